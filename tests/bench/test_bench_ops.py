"""bench ops' timing, on the CPU with a scripted clock: the sides of a case are timed in interleaved rounds, each
reports its best round, and a side that fails is reported without stopping the others; ``--graphs`` times
replays of captured calls. On a GPU: the graphs of the bench's own cases, every peer included."""

import pytest
import torch

from flash_models.bench import harness, ops  # ops._time_sides under a scripted clock: main() needs a GPU
from flash_models.bench.harness import Timing


def test_sides_are_timed_in_interleaved_rounds_and_report_their_best(monkeypatch):
    x = torch.randn(4, 8, requires_grad=True)
    order = []

    def side(name):
        def fn():
            order.append(name)
            return x * 2

        return fn

    def broken():
        raise RuntimeError("this peer rejects the input")

    # Per (side, forward or step): the medians the scripted clock gives, one per round; a stall hits a's round 1.
    script = {("a", "fwd"): [3.0, 1.0, 2.0], ("a", "step"): [9.0, 4.0, 5.0],
              ("b", "fwd"): [2.0, 2.5, 2.2], ("b", "step"): [6.0, 6.5, 7.0]}

    def fake_time_cuda(fn, repeats, back_to_back):
        assert back_to_back is True  # the default
        before = len(order)
        fn()
        name = order[before]
        kind = "step" if torch.is_grad_enabled() else "fwd"
        return Timing(median_ms=script[(name, kind)].pop(0), min_ms=0.0, repeats=repeats)

    monkeypatch.setattr(ops, "time_cuda", fake_time_cuda)
    case = ops.Case("op", "4x8", {"a": side("a"), "b": side("b"), "broken": broken}, [x])
    order.clear()
    results = ops._time_sides(case, rounds=3)
    assert results["a"] == {"fwd_ms": 1.0, "fwd_bwd_ms": 4.0}
    assert results["b"] == {"fwd_ms": 2.0, "fwd_bwd_ms": 6.0}
    assert "this peer rejects" in str(results["broken"]["error"])
    # After each side's one call that draws its output gradients, a round times every side (forward, then
    # forward + backward) before the next round starts, every other round in reverse order.
    assert order[2:] == ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]


def test_graphs_time_replays_of_each_sides_forward_and_step(monkeypatch):
    """``--graphs``: every measurement captures the side's forward (autograd off) or forward + backward and times
    the replays; a side whose call cannot be captured is reported with its error, the others still run."""
    x = torch.randn(4, 8, requires_grad=True)
    captured, replayed = [], []
    capturing = False

    def side(name):
        def fn():
            if name == "syncs" and capturing:
                raise RuntimeError("operation not permitted when stream is capturing")
            return x * 2

        return fn

    def fake_graph_replay(fns):
        nonlocal capturing
        (fn,) = fns
        capturing = True
        try:
            out = fn()
        finally:
            capturing = False
        kind = "step" if out is None else "fwd"  # the step returns nothing
        assert torch.is_grad_enabled() == (kind == "step")
        if kind == "fwd":
            assert not out.requires_grad, "the forward must be captured with autograd off"
        captured.append(kind)
        return lambda: replayed.append(kind)

    def fake_time_cuda(fn, repeats, back_to_back):
        before = len(replayed)
        fn()
        assert len(replayed) == before + 1, "a timed call must be a replay"
        return Timing(median_ms={"fwd": 1.0, "step": 3.0}[replayed[-1]], min_ms=0.0, repeats=repeats)

    monkeypatch.setattr(ops, "graph_replay", fake_graph_replay)
    monkeypatch.setattr(ops, "time_cuda", fake_time_cuda)
    case = ops.Case("op", "4x8", {"ours": side("ours"), "syncs": side("syncs")}, [x])
    results = ops._time_sides(case, rounds=2, graphs=True)
    assert results["ours"] == {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0}
    assert "not permitted when stream is capturing" in str(results["syncs"]["error"])
    assert captured == ["fwd", "step", "step", "fwd"]  # ours, once a round (the second reversed); the other side raised


def test_peak_memory_is_measured_eagerly_before_any_capture(monkeypatch):
    """A memory case's peak is each side's eager step, measured before the first graph is captured (a graph's
    pool would count, and crowd the step: the linear + CE case runs out of memory there); a side whose step
    fails there is reported with its error and not timed."""
    x = torch.randn(4, 8, requires_grad=True)
    events = []

    def fake_peak(step):
        step()
        if events[-1] == "ooms":
            raise torch.OutOfMemoryError("CUDA out of memory")
        events.append("peak")
        return 2**30

    def side(name):
        def fn():
            events.append(name)
            return x * 2
        return fn

    def fake_graph_replay(fns):
        events.append("capture")
        fns[0]()
        return lambda: None

    monkeypatch.setattr(ops, "peak_memory_bytes", fake_peak)
    monkeypatch.setattr(ops, "graph_replay", fake_graph_replay)
    monkeypatch.setattr(ops, "time_cuda", lambda fn, repeats, back_to_back: Timing(2.0, 1.0, repeats))
    case = ops.Case("op", "4x8", {"ours": side("ours"), "ooms": side("ooms")}, [x], memory=True)
    results = ops._time_sides(case, rounds=1, graphs=True)
    assert results["ours"] == {"fwd_ms": 2.0, "fwd_bwd_ms": 2.0, "peak_GiB": 1.0}
    assert "out of memory" in str(results["ooms"]["error"])
    first_capture = events.index("capture")
    assert "peak" in events[:first_capture] and "ooms" not in events[first_capture:]


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["norms", "activations", "cross_entropy"])
def test_gpu_graphs_capture_every_side_of_the_bench_cases(group):
    """``--graphs`` on the bench's own cases, every peer included (torch.compile; liger where installed): each
    side's forward and forward + backward is captured and replayed without error (liger's views of gate_up kept
    across calls would fail every side's capture in the SwiGLU and GeGLU cases: see ``ops.activation_cases``).
    The one failure allowed is a peer that synchronizes with the host (liger's cross-entropy), refused before
    its capture; the sides after it must still run (an invalidated capture would leave them no memory)."""
    for case in ops.GROUPS[group](True):
        case.repeats = 3
        results = ops._time_sides(case, rounds=1, graphs=True)
        failed = {name: str(r["error"])[:200] for name, r in results.items()
                  if "error" in r and not (name == "liger" and isinstance(r["error"], harness.HostSyncError))}
        assert not failed, f"{case.op}: {failed}"
        assert all(r["fwd_bwd_ms"] > 0 for r in results.values() if "error" not in r)  # every side but liger's
