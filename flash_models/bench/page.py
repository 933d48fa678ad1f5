"""`python -m flash_models.bench.page`: docs/benchmarks.md, generated from the bench JSON results.

Every bench area writes its rows and the run's environment (device, date, versions, commit, command) as JSON.
The JSON of the run a number comes from is kept in docs/results/; this module renders the page from those
files alone, so the page shows current numbers only and each comes with the command that reproduces it. The
numbers' history is in git. Plots (PNG, beside the JSON) need matplotlib: ``pip install -e ".[bench]"``.

    python -m flash_models.bench.page              # docs/results/*.json -> docs/benchmarks.md and the plots
    python -m flash_models.bench.page --no-plots   # the page alone
    python -m flash_models.bench.page --merge docs/results/train.json run-a.json run-b.json
                                                   # one area's runs (one case per process) as one result file
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import attention, bert, cpu, generate, ops, overhead, train, train_hf, vit
from .harness import BenchResult

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
PAGE = REPO / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Section:
    """One area's part of the page: its JSON file, what it measures, which columns its table shows."""

    file: str
    title: str
    about: str
    columns: tuple[str, ...] | None = None  # None: every column of the first row
    plot: str | None = None  # the PNG (in docs/results) this section shows, drawn by PLOTS


SECTIONS = (
    Section("attention.json", "Attention: training shapes",
            "TFLOP/s of our `flash_attn_func` against torch SDPA pinned to each backend (FA2 = flash, cuDNN, "
            "efficient), bf16, B * S = 16k tokens, H * D = 2048; forward = 4 * B * S^2 * H * D FLOPs (half when "
            "causal), forward + backward = 3.5x that. `x_*` = our TFLOP/s over the peer's.",
            tuple(attention.TRAIN_COLUMNS), "attention.png"),
    Section("attention_decode.json", "Attention: decode",
            "One query token per row against a KV cache of `kv_len` keys (16 heads, head dim 128, bf16): GB/s of "
            "keys and values read, and that as a fraction of the measured device copy bandwidth "
            "(`frac_copy_bw`, `_pdl`: with programmatic dependent launch).",
            tuple(attention.DECODE_COLUMNS)),
    Section("ops.json", "Fused ops",
            "Forward and forward + backward of each fused op against torch eager, torch.compile and liger-kernel. "
            "`copy_frac`: the op's minimal bytes over the device copy bandwidth; `x_vs_*`: the peer's time over ours.",
            tuple(ops.COLUMNS)),
    Section("train.json", "Training",
            "Tokens/s of a training step, ours against HF transformers from the same random weights, bf16 autocast, "
            "fused AdamW; MFU against the measured bf16 matmul peak; peak memory. `eval:` rows time the evaluation "
            "forward (eval mode, no grad, logits and loss; MFU of forward FLOPs).",
            tuple(train.COLUMNS), "train.png"),
    Section("train_hf.json", "Training in transformers' Trainer",
            "Tokens/s of `transformers.Trainer` steps with the same `TrainingArguments` (bf16, fused AdamW, the same "
            "batch): our model, HF's model, HF's with liger-kernel (`use_liger_kernel=True`; Liger has no GPT-2 "
            "kernels, so no such row there), HF's with our attention (`attn_implementation=\"fm_attention\"`) and "
            "with `flash_models.hf.use_fused_ops` too.", tuple(train_hf.COLUMNS)),
    Section("generate.json", "Generation",
            "Greedy decoding, bf16: ms per step (one new token per row), ours against HF's generate; `bound_ms` is "
            "the weights' and cache's bytes over the copy bandwidth.",
            tuple(generate.COLUMNS)),
    Section("bert.json", "BERT",
            "Inference and training steps of BERT presets on padded batches, ours against HF (sdpa); `useful_tok_s` "
            "counts real tokens only.", tuple(bert.COLUMNS)),
    Section("vit.json", "ViT", "ViT image classification, ours against timm (eager and torch.compile).",
            tuple(vit.COLUMNS)),
    Section("cpu.json", "CPU generation",
            "The CPU main job (`flash-models bench cpu`): the embedded SmolLM2-135M-Instruct GGUF, fp32, greedy, the "
            "same chat prompt and number of new tokens on both sides, ours against transformers in one process, "
            "sides alternating: time to the first new token and the decode rate after it (median and range of the "
            "rounds); `same_tokens`: both generated the same tokens.", tuple(cpu.COLUMNS)),
    Section("overhead.json", "Host overhead",
            "Host time per call of our ops against torch's, calls queued back to back (launch-bound shapes).",
            tuple(overhead.COLUMNS)),
)


def load(path: Path) -> BenchResult:
    """A BenchResult from a bench area's JSON file; a file that is not one says so, naming it."""
    try:
        data = json.loads(path.read_text())
        return BenchResult(area=data["area"], rows=list(data["rows"]), env=dict(data["env"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a bench result (JSON with area, rows and env): {err}") from None


# Facts of a run that every merged run must share: numbers measured apart are only shown together when they
# come from the same machine and software.
_SHARED_FACTS = ("device", "torch", "triton", "transformers")


def merge(paths: list[Path]) -> BenchResult:
    """Several runs of one area as one result: the rows in the order given, the shared environment once, and
    each run's command and commit (a page section shows one provenance, so it lists every run's). Runs of
    different areas, devices or versions are refused, naming the first difference."""
    if not paths:
        raise ValueError("merge needs at least one bench result")
    runs = [load(path) for path in paths]
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:]):
        if run.area != first.area:
            raise ValueError(f"{path} is a {run.area!r} result, {paths[0]} a {first.area!r} one: merge one area at a time")
        for fact in _SHARED_FACTS:
            if run.env.get(fact) != first.env.get(fact):
                raise ValueError(f"{path} ran with {fact} {run.env.get(fact)!r}, {paths[0]} with "
                                 f"{first.env.get(fact)!r}: only runs on one machine and software merge")
    env = dict(first.env)
    env["date"] = max(str(run.env.get("date", "")) for run in runs)
    env["commit"] = ", ".join(dict.fromkeys(str(run.env.get("commit")) for run in runs if run.env.get("commit")))
    env["command"] = "\n".join(dict.fromkeys(str(run.env.get("command")) for run in runs if run.env.get("command")))
    return BenchResult(area=first.area, rows=[row for run in runs for row in run.rows], env=env)


def _blank(value) -> bool:
    """No measurement: None, or NaN (a ratio against a peer that did not run)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(value) -> str:
    if _blank(value):
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def table(rows: list[dict], columns: tuple[str, ...] | None) -> str:
    columns = columns or tuple(rows[0])
    columns = tuple(c for c in columns if not all(_blank(row.get(c)) for row in rows))  # no all-blank columns
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def provenance(env: dict) -> str:
    """Where and how the numbers were measured: device, date, versions, commit, command."""
    versions = ", ".join(f"{name} {env[name]}" for name in ("torch", "triton", "transformers") if env.get(name))
    device = env.get("device", "unknown device")
    if env.get("cpu") and env.get("threads"):  # a CPU run: which processor, how many threads
        device = f"{env['cpu']} CPU, {env['threads']} threads"
    facts = [device, env.get("date", "undated"), versions]
    if env.get("commit"):
        facts.append(f"commit {env['commit']}")
    if env.get("timing"):
        facts.append(f"timing: {env['timing']}")
    bandwidth = env.get("copy_bandwidth_GBs") or env.get("copy_bandwidth_GBps")
    if bandwidth:
        facts.append(f"measured copy bandwidth {bandwidth:.0f} GB/s")
    text = "; ".join(f for f in facts if f) + "."
    if env.get("command"):
        text += f"\n\n```\n{env['command']}\n```"
    return text


def render(results: Path = RESULTS) -> str:
    """The whole page from the JSON files in ``results``. A JSON file no section names is an error, so a result
    is never silently left off the page."""
    known = {s.file for s in SECTIONS}
    unknown = sorted(p.name for p in results.glob("*.json") if p.name not in known)
    if unknown:
        raise ValueError(f"{results} holds results no page section shows: {unknown}; add a Section for them")
    parts = [
        "# Benchmarks",
        "",
        "Current numbers only, generated by `python -m flash_models.bench.page` from the bench JSON in "
        "[docs/results](results). Every ratio is against a peer measured in the same process on the same device; "
        "never compare numbers across devices. The history of these numbers is in git.",
    ]
    missing = []
    for section in SECTIONS:
        path = results / section.file
        if not path.exists():
            missing.append(section.title)
            continue
        result = load(path)
        parts += ["", f"## {section.title}", "", section.about, "", provenance(result.env), ""]
        if section.plot and (results / section.plot).exists():
            parts += [f"![{section.title}](results/{section.plot})", ""]
        parts.append(table(result.rows, section.columns) if result.rows else "(no rows)")
    if missing:
        parts += ["", "## Not measured on the current code", "", "No results are kept for: " + ", ".join(missing) + "."]
    return "\n".join(parts) + "\n"


def _plot_attention(results: Path) -> None:
    train_rows, decode_rows = (results / "attention.json"), (results / "attention_decode.json")
    empty = BenchResult(area="none", env={})
    attention.plot(load(train_rows) if train_rows.exists() else empty,
                   load(decode_rows) if decode_rows.exists() else empty, results / "attention.png")


def _plot_train(results: Path) -> None:
    import matplotlib.pyplot as plt

    result = load(results / "train.json")
    cases = list(dict.fromkeys(r["case"] for r in result.rows))
    sides = list(dict.fromkeys(r["side"] for r in result.rows))
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(cases), 4))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        xs = [c + i * width for c, case in enumerate(cases)]
        ys = [next((r["tokens_per_s"] / 1e3 for r in result.rows if r["case"] == case and r["side"] == side), 0.0)
              for case in cases]
        ax.bar(xs, ys, width, label=side)
    ax.set_xticks([c + width * (len(sides) - 1) / 2 for c in range(len(cases))], cases)
    ax.set_ylabel("thousand tokens/s")
    ax.set_title(f"training throughput, {result.env.get('device', '')}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results / "train.png", dpi=90)
    plt.close(fig)


# The plots each section shows, by PNG name, drawn from the JSON in the results folder.
PLOTS: dict[str, tuple[tuple[str, ...], Callable[[Path], None]]] = {
    "attention.png": (("attention.json", "attention_decode.json"), _plot_attention),
    "train.png": (("train.json",), _plot_train),
}


def draw_plots(results: Path = RESULTS) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('the plots need matplotlib: pip install -e ".[bench]" (or pass --no-plots)') from None
    matplotlib.use("Agg")
    for name, (sources, draw) in PLOTS.items():
        if any((results / s).exists() for s in sources):
            draw(results)
            log.info("drew %s", results / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flash_models.bench.page", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of bench JSON results (default: %(default)s)")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="write the page without drawing the plots")
    parser.add_argument("--merge", nargs="+", type=Path, metavar=("OUT", "RUN"),
                        help="only merge the runs (JSON of one area) into OUT; render the page after")
    args = parser.parse_args(argv)
    if args.merge:
        if len(args.merge) < 2:
            parser.error("--merge takes the output file, then one or more runs")
        out, *runs = args.merge
        try:
            merged = merge(runs)
        except ValueError as err:
            parser.error(str(err))
        merged.write_json(out)
        print(f"wrote {out} ({len(merged.rows)} rows from {len(runs)} runs)")
        return
    if not args.no_plots:
        draw_plots(args.results)
    args.page.write_text(render(args.results))
    print(f"wrote {args.page}")


if __name__ == "__main__":
    main()
