"""`flash-models bench ops`: our fused memory-bound ops against torch eager, torch.compile of the same unfused
code, and liger-kernel where it is installed, in one process on one GPU.

Shapes (bf16): norms 16k x 4096; rotary on LLaMA-7B q and k (4 x 4096 tokens, 32 heads of 128); SwiGLU /
GeGLU / GELU on LLaMA-7B's MLP (8k tokens x 11008); cross-entropy 8k x 50304 and 8k x 128256; fused LM head +
CE at real checkpoints' heads (LINEAR_CE_HEADS: GPT-2's 50257, LLaMA's 32000, SmolLM2's 49152, Qwen2's 151936,
LLaMA-3's 128256, each at its hidden size); the cuBLASLt GELU MLP at GPT-2 sizes (16k tokens, 768 -> 3072 -> 768).
Memory-bound rows report GB/s from a minimal byte count (every tensor read or written once) and that as a
fraction of the measured device copy bandwidth; CE and linear+CE report peak memory. Every side's backward
runs on the calling thread, as the Trainer runs it. The sides of a case are timed in interleaved rounds
(``--rounds``), each reporting its best round: see ``_time_sides``. Calls are timed back to back by default
(``--timing``: see ``harness.time_cuda``); ``--graphs`` times CUDA-graph replays instead, the GPU's work alone:
an eager norm's forward + backward costs about as much host time as GPU time, so on a slow host its eager
wall time measures the host (``scripts/profile/op_kernels.py`` prints a case's kernel time against its wall time).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..backward import backward_on_this_thread
from .harness import (BenchResult, add_rounds_argument, add_timing_argument, best_of_rounds, graph_replay,
                      measure_copy_bandwidth, peak_memory_bytes, time_cuda, without_tracebacks)

log = logging.getLogger(__name__)

DTYPE = torch.bfloat16
DEVICE = "cuda"
COLUMNS = ["op", "shape", "impl", "fwd_ms", "fwd_bwd_ms", "GB/s", "copy_frac", "x_vs_eager", "x_vs_compile",
           "x_vs_liger", "peak_GiB"]


@dataclass
class Case:
    """One op at one shape: implementations returning the forward output(s), and the inputs to differentiate."""

    op: str
    shape: str
    impls: dict[str, Callable[[], object]]
    inputs: list[torch.Tensor]
    bytes_fwd_bwd: int | None = None
    side_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # a side differentiating other tensors
    memory: bool = False
    repeats: int = 20
    extra: dict = field(default_factory=dict)


def _liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _outputs(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def fwd_bwd_step(fn, inputs):
    """A closure running forward + backward of fn w.r.t. inputs with fixed random output gradients."""
    grads = [torch.randn_like(o) for o in _outputs(fn())]

    def step():
        with backward_on_this_thread():  # every side alike, as the Trainer runs its backward
            torch.autograd.grad(_outputs(fn()), inputs, grads)

    return step


def _time_sides(case: Case, rounds: int, back_to_back: bool = True, graphs: bool = False) -> dict[str, dict]:
    """Per side: fwd and fwd+bwd ms, each the best over ``rounds`` interleaved rounds (``harness.best_of_rounds``:
    these ops take 0.1-0.5 ms, about as much as their host work) of a median of ``case.repeats`` calls
    (``time_cuda``), and peak memory where the case asks; or the error of a side that failed. ``graphs``: the
    calls replay a CUDA graph of each side's forward and of its forward + backward (``harness.graph_replay``),
    so that what is timed is the GPU's work alone, whatever the host's speed."""
    steps, errors, peaks = {}, {}, {}
    for name, fn in case.impls.items():
        try:
            steps[name] = fwd_bwd_step(fn, case.side_inputs.get(name, case.inputs))
            if case.memory:  # eager, after a warm-up step, and before any graph's memory pool exists
                steps[name]()
                peaks[name] = peak_memory_bytes(steps[name]) / 2**30
        except Exception as err:  # a peer that rejects this input must not stop the other measurements
            steps.pop(name, None)
            errors[name] = without_tracebacks(err)

    def timing(fn, grad: bool):
        def measure():
            with torch.set_grad_enabled(grad):
                # A graph per measurement, dropped after it: one side's memory pool at a time (linear + CE's
                # unfused peers hold ~24 GB a step). A call that cannot be captured fails its side here.
                call = graph_replay([fn]) if graphs else fn
                return time_cuda(call, repeats=case.repeats, back_to_back=back_to_back).median_ms
        return measure

    measures = {}
    for name, step in steps.items():
        measures[name, "fwd"], measures[name, "both"] = timing(case.impls[name], grad=False), timing(step, grad=True)
    best = best_of_rounds(measures, rounds, keep_errors=True)
    results = {}
    for name in case.impls:
        if name in errors:
            results[name] = {"error": errors[name]}
            continue
        fwd, both = best[name, "fwd"], best[name, "both"]
        failed = next((t for t in (fwd, both) if isinstance(t, Exception)), None)
        results[name] = {"error": failed} if failed is not None else {"fwd_ms": fwd, "fwd_bwd_ms": both}
        if name in peaks:
            results[name]["peak_GiB"] = peaks[name]
    return results


def _add_rows(case: Case, results: dict[str, dict], result: BenchResult, copy_bw: float) -> None:
    for name, measured in results.items():
        row = {"op": case.op, "shape": case.shape, "impl": name}
        err = measured.get("error")
        if err is not None:
            log.warning("%s %s %s failed: %s", case.op, case.shape, name, err)
            row["fwd_bwd_ms"] = None
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        else:
            row.update(measured)
            if case.bytes_fwd_bwd:
                gbs = case.bytes_fwd_bwd / (row["fwd_bwd_ms"] * 1e-3) / 1e9
                row["GB/s"], row["copy_frac"] = gbs, gbs * 1e9 / copy_bw
        result.add(**row)
        print(_short(row), flush=True)


def _add_speedups(result: BenchResult, first_row: int) -> None:
    rows = result.rows[first_row:]
    times = {r["impl"]: r.get("fwd_bwd_ms") for r in rows}
    for r in rows:
        if not r["impl"].startswith("ours") or r.get("fwd_bwd_ms") is None:
            continue
        for peer, col in (("torch eager", "x_vs_eager"), ("torch.compile", "x_vs_compile"), ("liger", "x_vs_liger")):
            peer_ms = next((t for name, t in times.items() if name.startswith(peer) and t), None)
            if peer_ms:
                r[col] = peer_ms / r["fwd_bwd_ms"]


# ----------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------


def _param(*shape, scale=1.0, requires_grad=True):
    return (torch.randn(*shape, device=DEVICE, dtype=DTYPE) * scale).requires_grad_(requires_grad)


def _with_peers(eager, ours, *, compile_peer, liger=None, extra_ours=None):
    impls = {"ours": ours, **(extra_ours or {}), "torch eager": eager}
    if compile_peer:
        impls["torch.compile"] = torch.compile(eager)
    if liger is not None and _liger_available():
        impls["liger"] = liger()
    return impls


def norm_cases(compile_peer: bool) -> list[Case]:
    from flash_kernels import layer_norm, rms_norm
    from flash_kernels.layer_norm_ref import layer_norm_ref

    m, n = 16384, 4096
    x, r = _param(m, n), _param(m, n)
    w, b = _param(n), _param(n)
    el = 2  # bytes per bf16 element
    shape = f"{m}x{n}"

    def liger_rms():
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)

    def liger_add_rms():
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return lambda: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False)

    def liger_ln():
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda: LigerLayerNormFunction.apply(x, w, b, 1e-5)

    def eager_add_rms():
        h = x + r
        return layer_norm_ref(h, w, is_rms_norm=True, eps=1e-6, upcast=True), h

    return [
        # fwd reads x writes y; bwd reads x, dy writes dx: 5 passes.
        Case("rms_norm", shape, _with_peers(lambda: layer_norm_ref(x, w, eps=1e-6, is_rms_norm=True),
                                            lambda: rms_norm(x, w), compile_peer=compile_peer, liger=liger_rms),
             [x, w], bytes_fwd_bwd=5 * m * n * el),
        # fwd reads x, r writes y, h; bwd reads h, dy, dh writes dx (= d residual): 8 passes.
        Case("add+rms_norm prenorm", shape, _with_peers(eager_add_rms, lambda: rms_norm(x, w, residual=r, prenorm=True),
                                                        compile_peer=compile_peer, liger=liger_add_rms),
             [x, r, w], bytes_fwd_bwd=8 * m * n * el),
        Case("layer_norm", shape, _with_peers(lambda: F.layer_norm(x, (n,), w, b, 1e-5), lambda: layer_norm(x, w, b),
                                              compile_peer=compile_peer, liger=liger_ln),
             [x, w, b], bytes_fwd_bwd=5 * m * n * el),
    ]


def rotary_cases(compile_peer: bool) -> list[Case]:
    from flash_kernels import apply_rotary
    from flash_kernels.rotary import apply_rotary_ref

    b, s, h, d = 4, 4096, 32, 128
    q, k = _param(b, s, h, d), _param(b, s, h, d)
    angles = torch.rand(s, d // 2, device=DEVICE) * 6.28
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)

    def liger():
        from liger_kernel.ops.rope import LigerRopeFunction

        # Liger's layout: (B, H, S, D) tensors and full-width (1, S, D) tables.
        qt, kt = _param(b, h, s, d), _param(b, h, s, d)
        cos_full, sin_full = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
        return (lambda: LigerRopeFunction.apply(qt, kt, cos_full, sin_full)), [qt, kt]

    impls = _with_peers(lambda: (apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)),
                        lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)), compile_peer=compile_peer)
    cases = [Case("rotary q+k", f"{b}x{s}x{h}x{d}", impls, [q, k], bytes_fwd_bwd=8 * q.numel() * 2)]
    if _liger_available():
        fn, inputs = liger()
        cases.append(Case("rotary q+k", f"{b}x{s}x{h}x{d}", {"liger": fn}, inputs, bytes_fwd_bwd=8 * q.numel() * 2))
    return cases


def activation_cases(compile_peer: bool) -> list[Case]:
    from flash_kernels import geglu, gelu, swiglu
    from flash_kernels.activations import geglu_ref, gelu_ref, swiglu_ref

    m, f = 8192, 11008
    gate_up, x = _param(m, 2 * f), _param(m, f)
    shape = f"{m}x{f}"

    def liger(name):
        def make():
            module = importlib.import_module(f"liger_kernel.ops.{name}")
            cls = getattr(module, "LigerSiLUMulFunction" if name == "swiglu" else "LigerGELUMulFunction")
            # Sliced per call, as ours chunks gate_up per call: views kept across calls would hold gate_up's
            # gradient accumulator alive from outside any capture, tied to the stream it was made on, and every
            # side's CUDA-graph capture of a backward to gate_up would then wait on that stream and fail.
            return lambda: cls.apply(gate_up[:, :f], gate_up[:, f:])

        return make

    # fwd reads 2F writes F; bwd reads 2F + F writes 2F: 8F per row. GELU: 2 + 3 = 5 per element.
    return [
        Case("swiglu", shape, _with_peers(lambda: swiglu_ref(gate_up), lambda: swiglu(gate_up),
                                          compile_peer=compile_peer, liger=liger("swiglu")),
             [gate_up], bytes_fwd_bwd=8 * m * f * 2),
        Case("geglu tanh", shape, _with_peers(lambda: geglu_ref(gate_up), lambda: geglu(gate_up),
                                              compile_peer=compile_peer, liger=liger("geglu")),
             [gate_up], bytes_fwd_bwd=8 * m * f * 2),
        Case("gelu erf", shape, _with_peers(lambda: gelu_ref(x), lambda: gelu(x, backend="triton"), compile_peer=compile_peer),
             [x], bytes_fwd_bwd=5 * m * f * 2),
    ]


def cross_entropy_cases(compile_peer: bool) -> list[Case]:
    from flash_kernels import cross_entropy

    cases = []
    n = 8192
    for vocab in (50304, 128256):
        logits = _param(n, vocab)
        labels = torch.randint(0, vocab, (n,), device=DEVICE)

        def eager(logits=logits, labels=labels):  # the usual fp32-upcast loss
            return F.cross_entropy(logits.float(), labels)

        def liger(logits=logits, labels=labels):
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

            return lambda: LigerCrossEntropyFunction.apply(logits, labels, None)

        impls = _with_peers(
            eager, lambda logits=logits, labels=labels: cross_entropy(logits, labels), compile_peer=compile_peer,
            liger=liger,
            # The gradient overwrites the logits (a leaf here): later iterations time the same traffic.
            extra_ours={"ours inplace_backward": lambda logits=logits, labels=labels: cross_entropy(
                logits, labels, inplace_backward=True)},
        )
        # fwd reads the logits; bwd reads them again and writes the gradient.
        cases.append(Case("cross_entropy", f"{n}x{vocab}", impls, [logits], bytes_fwd_bwd=3 * n * vocab * 2,
                          memory=True))
    return cases


# (label, tokens, hidden size, vocabulary): real checkpoints' LM heads at a training step's token count.
LINEAR_CE_HEADS = (
    ("GPT-2", 16384, 768, 50257),
    ("LLaMA-1.1B", 8192, 2048, 32000),
    ("SmolLM2-135M", 16384, 576, 49152),
    ("Qwen2-0.5B", 8192, 896, 151936),
    ("LLaMA-3-8B", 16384, 4096, 128256),
)


def linear_cross_entropy_cases(compile_peer: bool) -> list[Case]:
    from flash_kernels import linear_cross_entropy

    cases = []
    for label, n, h, vocab in LINEAR_CE_HEADS:
        hidden, weight = _param(n, h), _param(vocab, h, scale=h ** -0.5)
        labels = torch.randint(0, vocab, (n,), device=DEVICE)

        def eager(hidden=hidden, weight=weight, labels=labels):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels)

        def liger(hidden=hidden, weight=weight, labels=labels):
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            return lambda: LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)

        extra, side_inputs = {}, {}
        if vocab % 128:  # what our models run: the head padded once, at construction (modules/vocab_padding.py)
            padded = F.pad(weight.detach(), (0, 0, 0, -vocab % 128)).requires_grad_()

            def padded_head(hidden=hidden, padded=padded, labels=labels, vocab=vocab):
                return linear_cross_entropy(hidden, padded, labels, vocab_size=vocab)

            extra["ours padded head"], side_inputs["ours padded head"] = padded_head, [hidden, padded]
        impls = _with_peers(eager, lambda hidden=hidden, weight=weight, labels=labels: linear_cross_entropy(
            hidden, weight, labels), compile_peer=compile_peer, liger=liger, extra_ours=extra)
        cases.append(Case("linear+cross_entropy", f"{label} {n}x{h}->V{vocab}", impls, [hidden, weight], memory=True,
                          repeats=5, side_inputs=side_inputs))
    return cases


def fused_dense_cases(compile_peer: bool) -> list[Case]:
    from flash_kernels import fused_dense, fused_dense_gelu_dense

    n, d, hidden = 16384, 768, 3072  # GPT-2 124M MLP, 16 x 1024 tokens
    x = _param(n, d)
    w1, b1, w2, b2 = _param(hidden, d, scale=d ** -0.5), _param(hidden), _param(d, hidden, scale=hidden ** -0.5), _param(d)

    def eager_mlp():
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def eager_linear_gelu():
        return F.gelu(F.linear(x, w1, b1), approximate="tanh")

    mlp = _with_peers(eager_mlp, lambda: fused_dense_gelu_dense(x, w1, b1, w2, b2, backend="triton"),
                      compile_peer=compile_peer)
    dense = _with_peers(lambda: F.linear(x, w1, b1), lambda: fused_dense(x, w1, b1, backend="triton"),
                        compile_peer=compile_peer)
    return [
        Case("MLP fc1+gelu(tanh)+fc2 (cuBLASLt)", f"{n}x{d}->{hidden}->{d}", mlp, [x, w1, b1, w2, b2]),
        Case("Linear+GELU (torch, reference)", f"{n}x{d}->{hidden}", {"torch eager": eager_linear_gelu}, [x, w1, b1]),
        Case("dense GEMM+bias (cuBLASLt)", f"{n}x{d}->{hidden}", dense, [x, w1, b1]),
    ]


GROUPS = {
    "norms": norm_cases,
    "rotary": rotary_cases,
    "activations": activation_cases,
    "cross_entropy": cross_entropy_cases,
    "linear_cross_entropy": linear_cross_entropy_cases,
    "fused_dense": fused_dense_cases,
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="flash-models bench ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(GROUPS), help="op groups to run (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (saves compile time)")
    parser.add_argument("--out", default="out/bench_ops.json", help="JSON output path")
    add_rounds_argument(parser, "case")
    add_timing_argument(parser)
    parser.add_argument("--graphs", action="store_true",
                        help="time CUDA-graph replays of each side's forward and forward + backward (the GPU's work "
                             "alone, no host or launch cost) instead of eager calls")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench ops measures GPU kernels and needs a CUDA GPU (on a CPU: flash-models bench cpu)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    result = BenchResult(area="ops")
    result.env["timing"] = ("CUDA-graph replays" if args.graphs else "eager calls") + f", {args.timing}"
    copy_bw = measure_copy_bandwidth()
    result.env["copy_bandwidth_GBs"] = copy_bw / 1e9
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    for group in args.only or list(GROUPS):
        cases = GROUPS[group](not args.no_compile)
        for case in cases:
            first = len(result.rows)
            _add_rows(case, _time_sides(case, args.rounds, args.timing == "back-to-back", args.graphs), result, copy_bw)
            _add_speedups(result, first)
        del cases
        torch.cuda.empty_cache()
    _merge_split_cases(result)
    print(result.markdown(COLUMNS))
    result.write_json(args.out)
    print(f"wrote {args.out}")
    return result


def _merge_split_cases(result: BenchResult) -> None:
    """Rotary's liger peer runs on its own layout (a separate Case): fill the speedup against it afterwards."""
    by_op: dict = {}
    for row in result.rows:
        by_op.setdefault((row["op"], row["shape"]), []).append(row)
    for rows in by_op.values():
        liger = next((r.get("fwd_bwd_ms") for r in rows if r["impl"] == "liger"), None)
        for r in rows:
            if r["impl"].startswith("ours") and liger and r.get("fwd_bwd_ms"):
                r["x_vs_liger"] = liger / r["fwd_bwd_ms"]


def _short(row: dict) -> str:
    parts = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()]
    return " ".join(parts)


if __name__ == "__main__":
    main()
