"""flash_models.backward_on_this_thread: autograd's multithreading is off inside (thread-locally) and restored
after. (That the Trainer's backward runs under it is tested in tests/train/test_train_features.py.)"""

import threading

import torch

import flash_models as fm


def test_switches_multithreading_off_and_restores_it():
    assert torch._C._is_multithreading_enabled()
    with fm.backward_on_this_thread():
        assert not torch._C._is_multithreading_enabled()
        seen_elsewhere = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(torch._C._is_multithreading_enabled()))
        thread.start()
        thread.join()
        assert seen_elsewhere == [True]  # thread-local: other threads keep the default
    assert torch._C._is_multithreading_enabled()
