"""flash_models.backward_on_this_thread: autograd's multithreading is off inside (thread-locally) and restored
after; a training forward of our models on CUDA turns it off for the calling thread by itself. (That the Trainer's
backward runs under it is tested in tests/train/test_train_features.py.)"""

import threading

import pytest

import torch

import flash_models as fm


def test_switches_multithreading_off_and_restores_it():
    assert torch._C._is_multithreading_enabled()  # (conftest restores the default after each test)
    with fm.backward_on_this_thread():
        assert not torch._C._is_multithreading_enabled()
        seen_elsewhere = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(torch._C._is_multithreading_enabled()))
        thread.start()
        thread.join()
        assert seen_elsewhere == [True]  # thread-local: other threads keep the default
    assert torch._C._is_multithreading_enabled()


def _tiny_lm():
    return fm.create_model("llama-1b", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64)


def test_a_cuda_training_forward_moves_this_threads_later_backwards_here(monkeypatch):
    """Our forward recording gradients on a CUDA device turns multithreading off for the calling thread and
    leaves it off; without grad, off CUDA or as one rank of several it changes nothing. (The device is faked: the
    GPU test below runs a real one.)"""
    from flash_models import backward

    model, ids = _tiny_lm().train(), torch.randint(0, 64, (2, 5))
    model(ids, labels=ids)  # on the CPU: the default stays
    assert torch._C._is_multithreading_enabled()
    monkeypatch.setattr(backward, "_on_cuda", lambda module: True)
    with torch.no_grad():
        model(ids)
    assert torch._C._is_multithreading_enabled()
    monkeypatch.setattr(backward.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(backward.dist, "get_world_size", lambda: 2)
    model(ids, labels=ids)
    assert torch._C._is_multithreading_enabled()  # torchrun: DDP keeps the worker threads
    monkeypatch.setattr(backward.dist, "get_world_size", lambda: 1)
    model(ids, labels=ids).loss.backward()
    assert not torch._C._is_multithreading_enabled()
    seen_elsewhere = []
    thread = threading.Thread(target=lambda: seen_elsewhere.append(torch._C._is_multithreading_enabled()))
    thread.start()
    thread.join()
    assert seen_elsewhere == [True]


@pytest.mark.gpu
def test_gpu_a_plain_loops_backward_runs_on_the_calling_thread():
    """The README's plain loop, no wrapper: the backward of our model runs its Python nodes on this thread."""
    model = _tiny_lm().cuda().train()
    ids = torch.randint(0, 64, (2, 5), device="cuda")
    threads = []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    model.embed.tokens.weight.register_hook(lambda grad: threads.append(threading.get_ident()))
    loss.backward()
    assert threads == [threading.get_ident()]
