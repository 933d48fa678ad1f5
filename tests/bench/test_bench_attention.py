"""bench attention's timing rounds, on the CPU with a scripted clock: every side is timed once per round before
the next round, each reports its best round, and a side the backend rejected reports nothing."""

from flash_models.bench import attention
from flash_models.bench.harness import Timing


def test_training_sides_are_timed_in_interleaved_rounds(monkeypatch):
    order = []
    clock = {"ours fwd": [2.0, 1.0], "ours f+b": [5.0, 6.0], "flash fwd": [3.0, 3.5], "flash f+b": [9.0, 7.0]}

    def call(name):
        return lambda: order.append(name)

    def fake_time_cuda(fn, repeats, back_to_back):
        assert back_to_back is False  # passed through from the caller
        fn()
        return Timing(median_ms=clock[order[-1]].pop(0), min_ms=0.0, repeats=repeats)

    monkeypatch.setattr(attention, "time_cuda", fake_time_cuda)
    prepared = {"ours": (call("ours fwd"), call("ours f+b"), None), "flash": (call("flash fwd"), call("flash f+b"), None),
                "cudnn": None}
    times = attention._time_in_rounds(prepared, repeats=20, rounds=2, back_to_back=False)
    assert times == {"ours": (1.0, 5.0), "flash": (3.0, 7.0), "cudnn": (None, None)}
    assert order == ["ours fwd", "ours f+b", "flash fwd", "flash f+b"] * 2
