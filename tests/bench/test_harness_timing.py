"""The benchmark harness's timing, on the CPU. time_cuda with fake CUDA events: isolated calls wait for the GPU
before the next call starts; back-to-back calls are queued and synchronized once, after the last; both report
the median of each call's own start-to-end event time. best_of_rounds with scripted measures: interleaved
rounds, each measure's lowest value, errors kept or raised."""

import gc
import weakref

import pytest
import torch

from flash_models.bench import harness


class _FakeEvents:
    """Stands in for torch.cuda's Event and synchronize, logging what the timer does in order."""

    def __init__(self, durations):
        self.log, self.durations = [], list(durations)

    def event(self, enable_timing):
        assert enable_timing
        fake = self

        class Event:
            def record(self):
                fake.log.append("record")

            def synchronize(self):
                fake.log.append("wait")

            def elapsed_time(self, end):
                return fake.durations.pop(0)

        return Event()

    def synchronize(self):
        self.log.append("sync")


@pytest.fixture
def fake_cuda(monkeypatch):
    events = _FakeEvents([5.0, 1.0, 3.0, 2.0, 4.0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", events.event)
    monkeypatch.setattr(torch.cuda, "synchronize", events.synchronize)
    return events


def _timed_call(events):
    return lambda: events.log.append("call")


@pytest.mark.parametrize("back_to_back", [False, True])
def test_time_cuda_waits_per_call_only_when_isolated(fake_cuda, back_to_back):
    timing = harness.time_cuda(_timed_call(fake_cuda), warmup=2, repeats=5, back_to_back=back_to_back)
    assert timing.median_ms == 3.0 and timing.min_ms == 1.0 and timing.repeats == 5
    per_call = ["record", "call", "record"] + ([] if back_to_back else ["wait"])
    assert fake_cuda.log == ["call", "call", "sync"] + per_call * 5 + ["sync"]


def test_copy_bandwidth_is_timed_back_to_back(monkeypatch):
    seen = {}

    def fake_time_cuda(fn, **kwargs):
        seen.update(kwargs)
        return harness.Timing(median_ms=1.0, min_ms=1.0, repeats=kwargs["repeats"])

    monkeypatch.setattr(harness, "time_cuda", fake_time_cuda)
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device: torch.zeros(n, dtype=dtype))
    bandwidth = harness.measure_copy_bandwidth(nbytes=2048)
    assert seen["back_to_back"] is True
    assert bandwidth == 2048 / 1e-3


def test_best_of_rounds_alternates_the_order_and_keeps_each_lowest():
    order, script = [], {"a": [3.0, 1.0, 2.0], "b": [2.0, 5.0, 4.0]}

    def measure(name):
        def run():
            order.append(name)
            return script[name].pop(0)
        return run

    best = harness.best_of_rounds({"a": measure("a"), "b": measure("b")}, rounds=3)
    assert best == {"a": 1.0, "b": 2.0}
    assert order == ["a", "b", "b", "a", "a", "b"]


def test_best_of_rounds_keeps_an_error_and_stops_measuring_it_or_raises():
    calls = []

    def broken():
        calls.append("broken")
        raise RuntimeError("this side rejects the input")

    best = harness.best_of_rounds({"ok": lambda: 1.5, "broken": broken}, rounds=3, keep_errors=True)
    assert best["ok"] == 1.5
    assert isinstance(best["broken"], RuntimeError) and calls == ["broken"]
    with pytest.raises(RuntimeError, match="rejects"):
        harness.best_of_rounds({"broken": broken}, rounds=2)


def test_a_kept_error_frees_what_the_failed_measurement_made():
    """The error is kept without its traceback, whose frames would keep the measurement's objects (a CUDA graph
    and its memory pool in ``bench ops --graphs``) alive for the rest of the run."""
    made = []

    class Pool:  # stands for what a measurement allocates
        pass

    def fails_after_making_something():
        pool = Pool()
        made.append(weakref.ref(pool))
        try:
            raise ValueError("operation not permitted when stream is capturing")
        except ValueError:  # raised while handling another error: the first one's frames count too
            raise RuntimeError("capture invalidated")

    best = harness.best_of_rounds({"side": fails_after_making_something}, rounds=2, keep_errors=True)
    assert isinstance(best["side"], RuntimeError) and best["side"].__traceback__ is None
    assert isinstance(best["side"].__context__, ValueError)
    gc.collect()
    assert made[0]() is None


@pytest.mark.gpu
def test_gpu_a_call_that_waits_for_the_gpu_fails_before_any_capture():
    """A call with a host synchronization (liger's cross-entropy calls ``.item()``) fails in graph_replay's
    warm-up with HostSyncError, before a capture begins: an invalidated capture keeps its memory pool reserved,
    and in ``bench ops --graphs`` every later case would then run out of memory."""
    x = torch.ones(1 << 20, device="cuda")
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(harness.HostSyncError, match="synchronizes with the host"):
        harness.graph_replay([lambda: x.mul(2), lambda: x.sum().item()])
    assert torch.cuda.get_sync_debug_mode() == 0  # the process's own mode is back
    x.sum().item()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved
    out = torch.zeros_like(x)
    replay = harness.graph_replay([lambda: out.copy_(x * 3)])  # capturing still works afterwards
    out.zero_()
    replay()
    torch.cuda.synchronize()
    assert bool((out == 3).all())


@pytest.mark.gpu
def test_gpu_a_first_call_may_synchronize_and_still_be_captured():
    """Only the warm-up after the first call refuses host synchronizations: a first call that compiles or
    autotunes waits for the GPU (as ``bench ops``' torch.compile cross-entropy peer can), and is still captured."""
    x, out, calls = torch.ones(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda"), []

    def syncs_on_its_first_call_only():
        if not calls:
            x.sum().item()
        calls.append(None)
        out.copy_(x * 3)

    replay = harness.graph_replay([syncs_on_its_first_call_only])
    out.zero_()
    replay()
    torch.cuda.synchronize()
    assert bool((out == 3).all()) and len(calls) == 3  # first call, warm-up, capture; replays run no Python
