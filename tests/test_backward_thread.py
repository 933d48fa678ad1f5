"""flash_models.backward_on_this_thread: autograd's multithreading is off inside (thread-locally), restored after,
and gradients are unchanged."""

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


def test_gradients_equal_the_default_backward():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(7, 3, requires_grad=True)
    (x @ w).tanh().sum().backward()
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with fm.backward_on_this_thread():
        (x @ w).tanh().sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])
