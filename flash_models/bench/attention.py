"""`flash-models bench attention`: our Triton attention vs torch SDPA's backends, in one process.

Training grid: bf16, B*S fixed (16k tokens), H*D fixed (2048), head dim 64 and 128, S from 512 to 16k, causal
and not. Forward and forward+backward TFLOP/s (DESIGN.md: fwd = 4*B*S^2*H*D, half when causal; fwd+bwd =
3.5x fwd). Peers: SDPA FLASH_ATTENTION (FA2), CUDNN_ATTENTION, EFFICIENT_ATTENTION, each pinned with
``sdpa_kernel``, and the best of them. The sides of a shape are timed in interleaved rounds (``--rounds``),
each reporting its best round (``_time_in_rounds``). Calls are timed back to back by default, as they run in a
model (``--timing isolated``: each call on an idle GPU, its host launch latency included; ``time_cuda``).

Decode grid: one query token, KV length 2k..32k, batch 1..64; GB/s of K+V bytes read, ours vs SDPA, and as a
fraction of the measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from ..backward import backward_on_this_thread
from .harness import (BenchResult, add_rounds_argument, add_timing_argument, best_of_rounds, graph_replay,
                      measure_copy_bandwidth, time_cuda)

log = logging.getLogger(__name__)

PEERS = ("flash", "cudnn", "efficient")
TRAIN_COLUMNS = ["hdim", "S", "causal", "ours_fwd", "flash_fwd", "cudnn_fwd", "efficient_fwd", "x_fa2_fwd", "x_cudnn_fwd",
                 "ours_fwdbwd", "flash_fwdbwd", "cudnn_fwdbwd", "efficient_fwdbwd", "x_fa2_fwdbwd", "x_cudnn_fwdbwd"]
DECODE_COLUMNS = ["batch", "kv_len", "ours_us", "ours_graph_us", "ours_GBs", "flash_GBs", "cudnn_GBs", "efficient_GBs",
                  "x_best_sdpa", "frac_copy_bw", "frac_copy_bw_pdl"]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _sdpa_fn(backend_name, q, k, v, causal):
    """SDPA pinned to one backend, on the same (B, S, H, D) tensors as ours (viewed as (B, H, S, D))."""
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backends()[backend_name]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    return run


def _ours_fn(q, k, v, causal):
    from flash_kernels import flash_attn_func

    return lambda: flash_attn_func(q, k, v, causal=causal, backend="triton")


def _prepare(make_fn, q, k, v, graphs=False):
    """(forward call, forward+backward call, output) ready to time, or None when the backend rejects this
    input; ``make_fn(q, k, v)`` gives the call. ``graphs``: the calls replay a CUDA graph of the call instead of
    making it, the GPU work alone, without Python and launch costs."""
    try:
        fn = make_fn(q, k, v)
        out = fn()
        dout = torch.randn_like(out)

        def fwd_bwd():
            # Fresh leaves per call: a leaf's gradient accumulator remembers the stream it was made on, and one
            # made outside a graph capture would make the capture wait on another stream (an error).
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with backward_on_this_thread():  # every side alike, as the Trainer runs its backward
                torch.autograd.grad(make_fn(*leaves)(), leaves, dout)

        fwd_bwd()  # autotune outside any capture
        fwd_call, both_call = (graph_replay([fn]), graph_replay([fwd_bwd])) if graphs else (fn, fwd_bwd)
        return fwd_call, both_call, out
    except RuntimeError as err:  # e.g. a SDPA backend that does not support this shape on this GPU
        log.warning("backend failed: %s", str(err).splitlines()[0])
        return None


def _time_in_rounds(prepared: dict, repeats: int, rounds: int,
                    back_to_back: bool = True) -> dict[str, tuple[float | None, float | None]]:
    """Per side, (fwd ms, fwd+bwd ms): the best over ``rounds`` interleaved rounds (``harness.best_of_rounds``)
    of a median of ``repeats`` calls (``time_cuda``); Nones for a side that was rejected."""

    def timing(call):
        return lambda: time_cuda(call, repeats=repeats, back_to_back=back_to_back).median_ms

    measures = {}
    for name, calls in prepared.items():
        if calls is not None:
            fwd_call, both_call, _ = calls
            measures[name, "fwd"], measures[name, "both"] = timing(fwd_call), timing(both_call)
    best = best_of_rounds(measures, rounds)
    return {name: (best[name, "fwd"], best[name, "both"]) if calls is not None else (None, None)
            for name, calls in prepared.items()}


def _tflops(flops, ms):
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def bench_training(res, *, hdims, seqlens, causals, tokens, hidden, repeats, graphs=False, rounds=3,
                   back_to_back=True):
    for d in hdims:
        h = hidden // d
        for s in seqlens:
            b = max(1, tokens // s)
            for causal in causals:
                q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                row = {"hdim": d, "S": s, "B": b, "causal": causal}
                prepared = {"ours": _prepare(lambda *t: _ours_fn(*t, causal), q, k, v, graphs)}
                for peer in PEERS:
                    prepared[peer] = _prepare(lambda *t, peer=peer: _sdpa_fn(peer, *t, causal), q, k, v, graphs)
                times = _time_in_rounds(prepared, repeats, rounds, back_to_back)
                best_f, best_b = 0.0, 0.0
                for name, (fwd, both) in times.items():
                    row[f"{name}_fwd"], row[f"{name}_fwdbwd"] = _tflops(flops, fwd), _tflops(3.5 * flops, both)
                    if name != "ours":
                        best_f, best_b = max(best_f, row[f"{name}_fwd"] or 0.0), max(best_b, row[f"{name}_fwdbwd"] or 0.0)
                if prepared["ours"] is not None and prepared["flash"] is not None:
                    out, pout = prepared["ours"][2].float(), prepared["flash"][2].float()
                    row["err_vs_fa2"] = ((out - pout).norm() / pout.norm()).item()
                row["best_fwd"], row["best_fwdbwd"] = best_f, best_b
                row["x_fa2_fwd"] = _ratio(row["ours_fwd"], row["flash_fwd"])
                row["x_fa2_fwdbwd"] = _ratio(row["ours_fwdbwd"], row["flash_fwdbwd"])
                row["x_cudnn_fwd"] = _ratio(row["ours_fwd"], row["cudnn_fwd"])
                row["x_cudnn_fwdbwd"] = _ratio(row["ours_fwdbwd"], row["cudnn_fwdbwd"])
                res.add(**row)
                print(_short_row(row), flush=True)
                del q, k, v, prepared
                torch.cuda.empty_cache()


def _ratio(a, b):
    return None if a is None or not b else a / b


def _short_row(row):
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def _decode_inputs(b, kv, heads, kv_heads, d, copies):
    """``copies`` independent caches, so consecutive calls do not read K/V out of L2."""
    sets = []
    for _ in range(copies):
        q = torch.randn(b, 1, heads, d, dtype=torch.bfloat16, device="cuda")
        kc = torch.randn(b, kv, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        sets.append((q, kc, torch.randn_like(kc)))
    return sets


# A decode graph cycles through the cache copies until it holds this many calls (or GRAPH_MAX_MS of work). Each
# replay is one launch, and the GPU's gap between two replays (the next graph's first kernel cannot start early,
# as a kernel inside a graph can under PDL) would otherwise be charged to a handful of calls: with the 3-4 copies
# that fill L2 four times over at batch 1 / 8k keys, 1.3 us a call on an H100 (26.1 us a call in graphs of 64
# calls against 27.4 in graphs of 4, PDL: this area's decode rows with GRAPH_CALLS at each), 5% of the call. In generation the attention is
# one call among hundreds of kernels in one step's graph, so that gap is the step's, not the attention's.
GRAPH_CALLS = 32
GRAPH_MAX_MS = 20.0


def _graph_cycles(n_sets: int, call_ms: float) -> int:
    """How many times a decode graph runs through its ``n_sets`` calls: up to GRAPH_CALLS calls, fewer where
    that would pass GRAPH_MAX_MS. ``call_ms`` is an eager call's time, which bounds its GPU time from above."""
    return max(1, min(-(-GRAPH_CALLS // n_sets), int(GRAPH_MAX_MS / (call_ms * n_sets))))


def _time_decode(make_fn, sets, repeats, back_to_back=True):
    """(ms of one isolated eager call, Python included; graph-replayed ms per call, the graph cycling through
    ``sets`` up to GRAPH_CALLS calls)."""
    fns = [make_fn(*s) for s in sets]
    for fn in fns:
        fn()
    eager = time_cuda(fns[0], repeats=repeats).median_ms
    cycles = _graph_cycles(len(fns), eager)
    replay = graph_replay(fns * cycles)
    graphed = time_cuda(replay, repeats=repeats, back_to_back=back_to_back).median_ms / (len(fns) * cycles)
    return eager, graphed


def bench_decode(res, *, kv_lens, batches, heads, kv_heads, d, repeats, copy_bw, back_to_back=True):
    from torch.nn.attention import sdpa_kernel

    from flash_kernels import flash_attn_with_kvcache, programmatic_launch

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    for b in batches:
        for kv in kv_lens:
            nbytes = 2 * b * kv * kv_heads * d * 2  # K and V, bf16
            copies = max(1, min(8, -(-4 * l2 // nbytes)))
            if copies * nbytes > torch.cuda.mem_get_info()[0] * 0.7:
                continue
            sets = _decode_inputs(b, kv, heads, kv_heads, d, copies)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            row = {"batch": b, "kv_len": kv, "kv_MB": nbytes / 1e6}

            def ours(q, kc, vc):
                return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, backend="triton")

            eager, graphed = _time_decode(ours, sets, repeats, back_to_back)
            row["ours_us"], row["ours_graph_us"] = eager * 1e3, graphed * 1e3
            row["ours_GBs"] = nbytes / (graphed * 1e-3) / 1e9
            row["ours_eager_GBs"] = nbytes / (eager * 1e-3) / 1e9
            # As a decode step runs it on Hopper: with programmatic dependent launch (each call's split kernel
            # launching while the call before it finishes; the graphs are captured inside the context), with
            # the early trigger at batch 1 as generation uses it.
            with programmatic_launch(early_trigger=b == 1):
                _, pdl_graphed = _time_decode(ours, sets, repeats, back_to_back)
            row["ours_pdl_GBs"] = nbytes / (pdl_graphed * 1e-3) / 1e9
            best = 0.0
            for peer in PEERS:
                backend = _sdpa_backends()[peer]

                def sdpa(q, kc, vc, backend=backend):
                    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

                    def run():
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=heads != kv_heads)

                    return run

                try:
                    _, pg = _time_decode(sdpa, sets, repeats, back_to_back)
                    row[f"{peer}_GBs"] = nbytes / (pg * 1e-3) / 1e9
                    best = max(best, row[f"{peer}_GBs"])
                except RuntimeError as err:
                    log.warning("decode %s failed: %s", peer, str(err).splitlines()[0])
                    row[f"{peer}_GBs"] = None
            row["best_sdpa_GBs"] = best
            row["x_best_sdpa"] = _ratio(row["ours_GBs"], best)
            row["frac_copy_bw"] = row["ours_GBs"] * 1e9 / copy_bw
            row["frac_copy_bw_pdl"] = row["ours_pdl_GBs"] * 1e9 / copy_bw
            res.add(**row)
            print(_short_row(row), flush=True)
            del sets
            torch.cuda.empty_cache()


def decode_sweep(*, heads, kv_heads, d, repeats, copy_bw):
    """Tuning aid: graph-replayed decode bandwidth for split-KV schedules (programs per SM) x split tiles
    (BLOCK_N, warps, stages), plain and with programmatic dependent launch (the early trigger at batch 1, as
    generation runs it). The minimum chunk stays at its default (``DECODE_MIN_CHUNK``: its comment says why)."""
    from flash_kernels import attention_decode as dec
    from flash_kernels import flash_attn_with_kvcache, programmatic_launch

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    tiles = ((64, 4, 3), (64, 4, 4), (64, 8, 3), (32, 4, 4), (128, 4, 2), (128, 8, 2))
    for b, kv in ((1, 8192), (1, 32768), (16, 8192)):
        nbytes = 2 * b * kv * kv_heads * d * 2
        sets = _decode_inputs(b, kv, heads, kv_heads, d, max(1, min(8, -(-4 * l2 // nbytes))))
        seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
        defaults = dec.DECODE_PROGRAMS_PER_SM, dec.DECODE_TILE, dec.DECODE_TILE_WAIT_IN_LOOP
        for per_sm, tile, pdl in itertools.product((1, 2, 3, 4), tiles, (False, True)):
            # The tile of every chunk length (the early trigger's long chunks take their own otherwise).
            dec.DECODE_PROGRAMS_PER_SM, dec.DECODE_TILE, dec.DECODE_TILE_WAIT_IN_LOOP = per_sm, tile, tile
            with programmatic_launch(pdl, early_trigger=b == 1):
                _, graphed = _time_decode(
                    lambda q, kc, vc: lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                                                      backend="triton"),
                    sets, repeats)
            print(f"sweep B={b} kv={kv} per_sm={per_sm} tile={tile} pdl={pdl} "
                  f"{graphed * 1e3:.1f} us {nbytes / (graphed * 1e-3) / copy_bw:.3f} of copy bw", flush=True)
        dec.DECODE_PROGRAMS_PER_SM, dec.DECODE_TILE, dec.DECODE_TILE_WAIT_IN_LOOP = defaults


def _not_measured(ax, part):
    """An empty panel that says so (a run with --skip-decode), rather than bare axes and a legend warning."""
    ax.axis("off")
    ax.text(0.5, 0.5, f"{part}: not measured in this run", ha="center", va="center", transform=ax.transAxes)


def plot(train, decode, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no plot")
        return
    hdims = sorted({r["hdim"] for r in train.rows})
    fig, axes = plt.subplots(2, len(hdims) + 1, figsize=(6 * (len(hdims) + 1), 9), squeeze=False)
    for col, d in enumerate(hdims):
        for row_i, mode in enumerate(("fwd", "fwdbwd")):
            ax = axes[row_i][col]
            for name, style in (("ours", "k"), ("flash", "C0"), ("cudnn", "C1"), ("efficient", "C2")):
                for causal, ls in ((False, "-"), (True, "--")):
                    rows = [r for r in train.rows if r["hdim"] == d and r["causal"] == causal and r.get(f"{name}_{mode}")]
                    if rows:
                        ax.plot([r["S"] for r in rows], [r[f"{name}_{mode}"] for r in rows], style, ls=ls, marker="o",
                                label=f"{name}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"hdim {d}, {'forward' if mode == 'fwd' else 'forward+backward'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
    ax = axes[0][-1]
    if decode.rows:
        for i, b in enumerate(sorted({r["batch"] for r in decode.rows})):
            rows = [r for r in decode.rows if r["batch"] == b]
            ax.plot([r["kv_len"] for r in rows], [r["ours_GBs"] for r in rows], f"C{i}", marker="o",
                    label=f"ours B={b}")
            ax.plot([r["kv_len"] for r in rows], [r["best_sdpa_GBs"] for r in rows], f"C{i}", ls=":",
                    label=f"SDPA best B={b}")
        ax.set_xscale("log", base=2)
        ax.set_title("decode: KV bytes read, GB/s")
        ax.set_xlabel("KV length")
        ax.legend(fontsize=7)
    else:
        _not_measured(ax, "decode")
    axes[1][-1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(prog="flash-models bench attention", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results", help="directory for attention.json and attention.png")
    p.add_argument("--hdims", default="64,128")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="B * S of the training grid")
    p.add_argument("--hidden", type=int, default=2048, help="H * D of the training grid")
    p.add_argument("--decode-kv", default="2048,8192,32768")
    p.add_argument("--decode-batch", default="1,8,64")
    p.add_argument("--decode-heads", type=int, default=16)
    p.add_argument("--decode-kv-heads", type=int, default=16)
    p.add_argument("--decode-hdim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    add_rounds_argument(p, "training-grid shape")
    p.add_argument("--graphs", action="store_true",
                   help="training grid: time CUDA-graph replays (GPU work only) instead of eager calls, for every side")
    add_timing_argument(p)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--decode-sweep", action="store_true", help="also time a few split-KV schedules (tuning aid)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench attention needs a CUDA GPU")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    train = BenchResult(area="attention")
    back_to_back = args.timing == "back-to-back"
    train.env["timing"] = ("CUDA-graph replay" if args.graphs else "eager calls") + f", {args.timing}"
    if not args.skip_train:
        bench_training(train, hdims=_ints(args.hdims), seqlens=_ints(args.seqlens), causals=causals,
                       tokens=args.tokens, hidden=args.hidden, repeats=args.repeats, graphs=args.graphs,
                       rounds=args.rounds, back_to_back=back_to_back)
    decode = BenchResult(area="attention-decode")
    decode.env["timing"] = f"CUDA-graph replay, {args.timing}"
    if not args.skip_decode:
        copy_bw = measure_copy_bandwidth()
        decode.env["copy_bandwidth_GBs"] = copy_bw / 1e9
        if args.decode_sweep:
            decode_sweep(heads=args.decode_heads, kv_heads=args.decode_kv_heads, d=args.decode_hdim,
                         repeats=args.repeats, copy_bw=copy_bw)
        bench_decode(decode, kv_lens=_ints(args.decode_kv), batches=_ints(args.decode_batch), heads=args.decode_heads,
                     kv_heads=args.decode_kv_heads, d=args.decode_hdim, repeats=args.repeats, copy_bw=copy_bw,
                     back_to_back=back_to_back)
    # A skipped part writes nothing: an earlier run's file in the same folder stays as it was.
    if not args.skip_train:
        train.write_json(out_dir / "attention.json")
    if not args.skip_decode:
        decode.write_json(out_dir / "attention_decode.json")
    plot(train, decode, out_dir / "attention.png")
    print(f"\n{train.env}\n")
    if train.rows:
        print("### Training shapes, TFLOP/s (bf16)\n")
        print(train.markdown(TRAIN_COLUMNS))
    if decode.rows:
        print(f"\n### Decode, GB/s of KV read (copy bandwidth {decode.env['copy_bandwidth_GBs']:.0f} GB/s)\n")
        print("(GB/s from CUDA-graph replays over rotating caches; ours_us is one eager call, Python included)\n")
        print(decode.markdown(DECODE_COLUMNS))


if __name__ == "__main__":
    main()
