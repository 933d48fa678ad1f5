"""bench attention on the CPU: its timing rounds, with a scripted clock (every side is timed once per round before
the next round, each reports its best round, and a side the backend rejected reports nothing), and which json
files a run with a part skipped writes."""

from flash_models.bench import attention  # its timing helpers, under a scripted clock: main() needs a GPU
from flash_models.bench.harness import BenchResult, Timing


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
    forward_order = ["ours fwd", "ours f+b", "flash fwd", "flash f+b"]
    assert order == forward_order + forward_order[::-1]  # every other round reversed


def test_a_skipped_part_leaves_an_earlier_runs_file_alone(monkeypatch, tmp_path):
    """--skip-decode writes the training grid's json only: a decode json from an earlier run in the same folder
    is not replaced by an empty one (and the other way round)."""
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "plot", lambda *args: None)
    monkeypatch.setattr(attention, "BenchResult", lambda area: BenchResult(area=area, env={}))  # no device to name
    monkeypatch.setattr(attention, "bench_training", lambda result, **kwargs: result.add(hdim=64, S=1024))
    monkeypatch.setattr(attention, "measure_copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(attention, "bench_decode", lambda result, **kwargs: result.add(batch=1, kv_len=8192))
    earlier_decode = tmp_path / "attention_decode.json"
    earlier_decode.write_text('{"earlier": true}')

    attention.main(["--out", str(tmp_path), "--skip-decode"])
    assert '"S": 1024' in (tmp_path / "attention.json").read_text()
    assert earlier_decode.read_text() == '{"earlier": true}'

    attention.main(["--out", str(tmp_path), "--skip-train"])
    assert '"S": 1024' in (tmp_path / "attention.json").read_text()
    assert '"kv_len": 8192' in earlier_decode.read_text()


def test_decode_graph_cycles_the_copies_and_reports_per_call(monkeypatch):
    """The decode graph runs the cache copies in turn until it holds GRAPH_CALLS calls (fewer where an eager
    call is long), and the replay's time is divided by the calls it holds."""
    captured = []

    def fake_graphed(fns):
        captured.append(len(fns))
        return lambda: [fn() for fn in fns]

    calls = []

    def fake_time_cuda(fn, repeats, back_to_back=False):
        before = len(calls)
        fn()
        ran = len(calls) - before
        return Timing(median_ms=eager_ms if ran == 1 else 0.5 * ran, min_ms=0.0, repeats=repeats)

    monkeypatch.setattr(attention, "graph_replay", fake_graphed)
    monkeypatch.setattr(attention, "time_cuda", fake_time_cuda)
    make = lambda tag: (lambda: calls.append(tag))  # noqa: E731

    eager_ms = 0.08  # a batch-1 call: 4 copies, cycled to 32 calls
    calls.clear()
    eager, per_call = attention._time_decode(make, [("a",), ("b",), ("c",), ("d",)], repeats=3)
    assert (eager, per_call) == (0.08, 0.5)
    assert captured[-1] == attention.GRAPH_CALLS == 32
    assert calls[-8:] == ["a", "b", "c", "d"] * 2  # the copies in turn, so no call reads the last one's cache from L2

    eager_ms = 8.0  # a long call: one copy, capped by GRAPH_MAX_MS
    attention._time_decode(make, [("a",)], repeats=3)
    assert captured[-1] == int(attention.GRAPH_MAX_MS // 8.0) == 2
    assert attention._graph_cycles(1, 50.0) == 1  # never fewer than one pass over the copies
