"""The command line's user mistakes, through the real entry point in a subprocess: each is a non-zero exit with
one or two lines on stderr, found before any model loads; and how positionals are read."""

import pytest

from cli_helpers import REPO, assert_short_error, run_cli
# _model_and_text: the positional grammar, case by case; through main() each case would load a model.
from flash_models.cli import UsageError, _model_and_text, build_parser


@pytest.mark.parametrize("args, needle", [
    (["chat", "./no-such-dir"], "no model folder there"),
    (["generate", "-m", "./no-such-dir", "Hello"], "no model folder there"),
    (["generate", "missing.gguf", "Hello"], "no GGUF file at missing.gguf"),
    (["chat", ""], "the model name is empty"),
    (["generate", ""], "PROMPT is empty"),
    (["chat", "-p", "  "], "MESSAGE is empty"),
    (["chat", "What is the capital of France?"], "flash-models chat -p"),
    (["generate", "a", "b", "c"], "too many arguments"),
    (["generate", "--max-new-tokens", "-5", "Hello"], "--max-new-tokens: must be at least 1"),
    (["generate", "--max-new-tokens", "ten", "Hello"], "--max-new-tokens"),
    (["generate", "--temperature", "0", "Hello"], "--temperature"),
    (["chat", "--top-p", "1.5", "-p", "Hello"], "--top-p"),
    (["chat", "--top-k", "-1"], "--top-k"),
    (["generate", "--dtype", "float8", "Hello"], "--dtype"),
    (["generate", "--device", "gpu", "Hello"], "--device"),
    (["generate", "Hello", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["compare", "./no-such-dir"], "no model folder there"),
    (["convert", "./no-such-dir", "out"], "no model folder there"),
    (["train", "no-such-config.yaml"], "config file no-such-config.yaml does not exist"),
    (["train", "configs/gpt2-small.yaml"], "data.train: no data at 'data/openwebtext:train'"),
    (["train", "configs/gpt2-small.yaml", "optim.lrr=1"], "'optim.lrr'"),
    (["bench"], "choose an AREA"),
    (["bench", "nonsense"], "invalid choice"),
    (["bench", "cpu", "--prompt", " "], "--prompt is empty"),
    (["bench", "cpu", "--out", "README.md/bench.json"], "README.md is a file, not a folder"),
    (["bench", "cpu", "--rounds", "0"], "--rounds at least 1"),
    (["bench", "cpu", "--out", "configs"], "--out configs: is a folder"),
    ([], "required: COMMAND"),
])
def test_user_mistakes_are_one_or_two_lines_before_any_load(args, needle):
    assert_short_error(run_cli(*args), needle)


def test_mistakes_found_without_a_model_do_not_import_torch(tmp_path):
    """A bad flag or path is reported by the command line alone: no torch, so no seconds of imports."""
    probe = tmp_path / "sitecustomize.py"
    probe.write_text("import sys\nsys.modules['torch'] = None  # importing torch would fail: this run must not\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}:{REPO / 'kernels'}"}
    for args, needle in [(["generate", "--max-new-tokens", "-5", "Hello"], "--max-new-tokens"),
                         (["chat", "./no-such-dir"], "no model folder there"),
                         (["generate", "gpt2", "Hello"], "HF cache"),
                         (["train", "configs/gpt2-small.yaml"], "data.train"),
                         (["convert", "smollm2", str(tmp_path / "out"), "--max-shard-size", "5 gigs"],
                          "--max-shard-size: max_shard_size '5 gigs' is not a size")]:
        assert_short_error(run_cli(*args, env=env), needle)
    assert run_cli("--help", env=env).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["generate", "--max-new-tokens", "ten", "Hi"], "argument --max-new-tokens: expected an integer, got 'ten'"),
    (["chat", "--top-p", "most", "-p", "Hi"], "argument --top-p: expected a number, got 'most'"),
    (["generate", "--seed", "x", "Hi"], "argument --seed: expected an integer, got 'x'"),
    (["generate", "--device", "gpu", "Hi"], "argument --device: 'gpu' is not a device: cpu, cuda, cuda:N or mps"),
    (["convert", "a", "b", "--max-shard-size", "-1"], "argument --max-shard-size: max_shard_size '-1' is not a size"),
    (["convert", "a", "b", "--max-shard-size", "0"], "argument --max-shard-size: max_shard_size must be at least 1"),
])
def test_bad_option_values_say_what_was_expected(args, message, capsys):
    """In process (argparse alone): the message names the option and what it takes, not a parser function."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "invalid" not in err, err


@pytest.mark.parametrize("args", [["generate", "minilm", "Hello"], ["compare", "minilm"]])  # chat loads as generate does
def test_a_model_that_does_not_generate_is_named_before_its_weights_load(args, tmp_path):
    """MiniLM is a BERT encoder: the message says so, from its config (its weights file is never read)."""
    import shutil

    import flash_models as fm

    folder = tmp_path / "minilm"
    shutil.copytree(fm.minilm_dir(), folder)
    (folder / "model.safetensors").write_bytes(b"not read")
    args = [str(folder) if a == "minilm" else a for a in args]
    assert_short_error(run_cli(*args), "is a BertModel (bert), not a causal LM")


def test_folder_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert_short_error(run_cli("generate", str(tmp_path), "Hello"), "no tokenizer in")


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    assert_short_error(run_cli("chat", str(tmp_path / "weights.bin")), "is a file")


def test_offline_hub_id_fails_at_once(tmp_path):
    """The README's hub example offline: one line naming the cache and the network, not a minute of retries."""
    run = run_cli("generate", "gpt2", "Hello", env={"HF_HUB_CACHE": str(tmp_path)})
    assert_short_error(run, "'gpt2'", "not in the local HF cache")
    assert run.seconds < 30  # transformers' own retries take about 50 s; the imports alone take a few


def test_unreachable_hub_fails_at_once(tmp_path):
    """Not marked offline, but the endpoint refuses connections: one attempt, then the same one line."""
    run = run_cli("chat", "someone/some-model", env={"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path),
                                                      "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_short_error(run, "'someone/some-model'", "could not provide it")
    assert run.seconds < 30


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the child sees no GPU on any machine, so these run on GPU machines too


@pytest.mark.parametrize("args", [["generate", "--device", "cuda", "Hello"], ["chat", "--device", "cuda:1", "-p", "Hi"]])
def test_cuda_without_a_gpu_is_refused_before_loading(args):
    assert_short_error(run_cli(*args, env=NO_GPU), "no CUDA GPU is available")


def test_gpu_bench_on_a_cpu():
    assert_short_error(run_cli("bench", "ops", "--only", "norms", env=NO_GPU), "needs a CUDA GPU")


def test_missing_optional_dependency_names_the_pip_command(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['accelerate'] = None  # as if not installed\n")
    run = run_cli("compare", env={"PYTHONPATH": f"{tmp_path}:{REPO}:{REPO / 'kernels'}"})
    assert_short_error(run, "pip install accelerate")


def test_destination_under_a_file_is_refused_before_loading(tmp_path):
    (tmp_path / "a-file").write_text("x")
    assert_short_error(run_cli("convert", "smollm2", str(tmp_path / "a-file" / "out")), "a-file is a file, not a folder")


def test_os_errors_are_one_line_without_the_unexpected_hint(monkeypatch, capsys):
    import flash_models.cli as cli

    def denied(args):
        raise PermissionError(13, "Permission denied", "/models/out")

    monkeypatch.setattr(cli, "cmd_convert", denied)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", "a", "b"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert err.strip() == "flash-models convert: error: PermissionError: [Errno 13] Permission denied: '/models/out'"


def test_existing_destination_is_not_overwritten_unasked(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert_short_error(run_cli("convert", "smollm2", str(tmp_path)), "--overwrite")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_debug_shows_the_traceback():
    for run in (run_cli("--debug", "chat", "./no-such-dir"), run_cli("chat", "./no-such-dir", env={"FLASH_MODELS_DEBUG": "1"})):
        assert run.returncode != 0 and "Traceback" in run.stderr and "no model folder there" in run.stderr


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["generate", "--help"], ["chat", "--help"],
                                  ["compare", "--help"], ["convert", "--help"], ["train", "--help"]])
def test_help_works_and_shows_defaults(args):
    run = run_cli(*args)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    if args[0] in ("generate", "chat"):
        assert "(default: 128)" in run.stdout and "(default: 1.0)" in run.stdout
        assert "all) (default: 0)" in run.stdout and "sampling (default: 0)" in run.stdout  # --top-k, --seed
    if args[0] == "bench":
        assert "cpu" in run.stdout and "attention" in run.stdout


def test_version():
    import flash_models

    run = run_cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"flash-models {flash_models.__version__}", run


def test_bench_area_help_reaches_the_area():
    run = run_cli("bench", "cpu", "--help")
    assert run.returncode == 0 and "--threads" in run.stdout and "(default: 2)" in run.stdout


# ------------------------------------------------------------------------------------------------------------
# Positionals: their count decides, never their content
def _parse(*argv):
    args, rest = build_parser().parse_known_args(list(argv))
    assert not rest
    return args


@pytest.mark.parametrize("argv, expected", [
    (["generate", "The capital of France is"], ("smollm2", "The capital of France is")),
    (["generate", "gpt2", "Hello"], ("gpt2", "Hello")),
    (["generate", "-m", "gpt2", "Hello"], ("gpt2", "Hello")),
    (["generate", "gpt2"], ("smollm2", "gpt2")),  # one argument to generate is the prompt, whatever it says
])
def test_generate_positionals(argv, expected):
    assert _model_and_text(_parse(*argv), text_name="PROMPT", text_required=True) == expected


@pytest.mark.parametrize("argv, expected", [
    (["chat"], ("smollm2", None)),
    (["chat", "gpt2"], ("gpt2", None)),  # one argument to chat is the model, never a message
    (["chat", "What is it?"], ("What is it?", None)),
    (["chat", "gpt2", "Hi there"], ("gpt2", "Hi there")),
    (["chat", "-p", "Hi there"], ("smollm2", "Hi there")),
    (["chat", "gpt2", "-p", "Hi there"], ("gpt2", "Hi there")),
    (["chat", "-m", "gpt2", "Hi there"], ("gpt2", "Hi there")),
    (["chat", "-m", "gpt2", "-p", "Hi there"], ("gpt2", "Hi there")),
    (["chat", ""], ("", None)),  # an empty model name, refused by the loader, not the current folder
])
def test_chat_positionals(argv, expected):
    assert _model_and_text(_parse(*argv), text_name="MESSAGE", text_required=False) == expected


@pytest.mark.parametrize("argv", [["chat", "a", "b", "-p", "c"], ["chat", "-m", "x", "a", "b"], ["generate", "-m", "x", "a", "b"]])
def test_too_many_positionals(argv):
    with pytest.raises(UsageError, match="too many arguments"):
        _model_and_text(_parse(*argv), text_name="TEXT", text_required=argv[0] == "generate")


def test_generate_continues_text_unless_asked_for_chat():
    assert not _parse("generate", "Hello").chat and _parse("generate", "--chat", "Hello").chat
    assert _parse("chat").chat
