"""``flash-models bench cpu``: the CPU main job, ours against transformers, in one process.

The embedded SmolLM2-135M-Instruct GGUF (or any MODEL), fp32, greedy, the same chat prompt and the same
number of new tokens on both sides (EOS off, so both generate exactly ``--max-new-tokens``), on
``--threads`` CPU threads. Sides alternate (ours, HF, HF, ours, ...) so a busy machine slows both alike; each
side reports the median and the range of its rounds: the time to the first new token (prefill plus one
sampling step, what a user waits for) and the decode rate after it (tokens/s over the remaining tokens).
The generated tokens must be identical; the table says whether they are.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ..checkpoint.atomic import why_unwritable
from .harness import BenchResult

DEFAULT_PROMPT = "What is the capital of France? Answer in one paragraph."
COLUMNS = ["side", "first_token_s", "first_token_range", "decode_tok_s", "decode_range", "x_decode_vs_hf", "same_tokens"]


class _Clock:
    """Token arrival times, for transformers' ``streamer`` protocol (its first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _run_ours(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[float], list[int]]:
    from ..generation.generate import Generation
    from ..generation.settings import resolve_settings

    settings = resolve_settings(model.config, model.decoder_config.vocab_size, max_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=[])
    times, tokens = [], []
    for token in Generation(model, ids, settings=settings):
        tokens.append(int(token[0]))
        times.append(time.perf_counter())
    return times, tokens


def _run_hf(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[float], list[int]]:
    clock = _Clock()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
    return clock.times, out[0, ids.shape[1]:].tolist()


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _summary(samples: list[tuple[float, float]]) -> dict:
    first = [f for f, _ in samples]
    rate = [r for _, r in samples]
    return {"first_token_s": statistics.median(first), "first_token_range": f"{min(first):.3f}-{max(first):.3f}",
            "decode_tok_s": statistics.median(rate), "decode_range": f"{min(rate):.1f}-{max(rate):.1f}"}


@torch.inference_mode()
def measure(model_name: str, *, prompt: str, new_tokens: int, rounds: int, threads: int) -> BenchResult:
    from ..checkpoint import from_pretrained
    from ..checkpoint.tokenizer import load_tokenizer
    from ..cli_source import locate_model
    from ..compare import load_hf
    from ..runtime.cpu_decode import lean_step_unsupported

    torch.set_num_threads(threads)
    source = str(locate_model(model_name, need_tokenizer=True).path)
    tokenizer = load_tokenizer(source)
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    sides = {"ours": (from_pretrained(source, dtype=torch.float32), _run_ours),
             "hf": (load_hf(source, dtype=torch.float32, device="cpu"), _run_hf)}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {}
    for name, (model, run) in sides.items():  # warm-up: first-call allocations, lazy imports
        run(model, ids, 4)
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            model, run = sides[name]
            start = time.perf_counter()
            times, tokens[name] = run(model, ids, new_tokens)
            rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
            samples[name].append((times[0] - start, rate))
    same = tokens["ours"] == tokens["hf"]
    result = BenchResult(area="cpu")
    ours = sides["ours"][0]
    why_not_lean = lean_step_unsupported(ours, ours.new_kv_cache(1, 1))  # the path our side took
    result.env.update(cpu=_cpu_name(), cpu_count=os.cpu_count(), threads=threads, model=source, prompt_tokens=int(ids.shape[1]), new_tokens=new_tokens,
                      rounds=rounds, dtype="float32", decoding="greedy",
                      ours_path="lean CPU step" if why_not_lean is None else f"plain forward ({why_not_lean})")
    hf_rate = _summary(samples["hf"])["decode_tok_s"]
    for name in sides:
        row = result.add(side=name, **_summary(samples[name]), same_tokens=same)
        row["x_decode_vs_hf"] = row["decode_tok_s"] / hf_rate
    return result


def _unwritable(out: Path) -> str | None:
    """Why the JSON file ``out`` could not be written (its folders are made as needed), or None."""
    if out.is_dir():
        return "is a folder; give the path of a .json file"
    return why_unwritable(out)


def main(argv: list[str] | None = None) -> BenchResult:
    from ..cli import _Parser  # the command line's two-line errors (mistake, where the usage is)

    parser = _Parser(prog="flash-models bench cpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="alias, .gguf file or HF folder (default: %(default)s)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message, through the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generation (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="generations per side, alternating (default: %(default)s)")
    parser.add_argument("--out", default="out/bench_cpu.json", help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2 or args.threads < 1 or args.rounds < 1:
        parser.error("--max-new-tokens must be at least 2, --threads and --rounds at least 1")
    if not args.prompt.strip():
        parser.error("--prompt is empty: give the user message to time")
    problem = _unwritable(Path(args.out))
    if problem:  # found now, not after minutes of measuring
        parser.error(f"--out {args.out}: {problem}")
    result = measure(args.model, prompt=args.prompt, new_tokens=args.max_new_tokens, rounds=args.rounds,
                     threads=args.threads)
    env = result.env
    print(f"{env['model']}: {env['prompt_tokens']} prompt tokens, {env['new_tokens']} new, fp32 greedy, "
          f"{env['threads']} threads, {env['rounds']} rounds per side (median, range); ours: {env['ours_path']}")
    print(result.markdown(COLUMNS))
    result.write_json(args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
