"""The command line with models, through the real entry point in a subprocess: what generate and chat feed the
model (plain text, or the chat template), and convert's complete HF folder, GGUF included."""

import json
import shutil

import pytest
import torch
import transformers

import flash_models as fm
from cli_helpers import run_cli
from flash_models.checkpoint.tokenizer import load_tokenizer
from flash_models.testing import random_hf_model

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(fm.smollm2_gguf())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_tokenizer):
    """A tiny random LLaMA with SmolLM2's real tokenizer and chat template: quick to load, real text."""
    config = transformers.LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny-llama")
    random_hf_model(config, seed=3).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def _greedy_text(folder, tokenizer, ids) -> str:
    model = fm.from_pretrained(folder)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _chat_ids(tokenizer, message):
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def test_generate_continues_plain_text_and_chat_flag_uses_the_template(tiny_folder, smollm2_tokenizer):
    prompt = "The capital of France is"
    plain = run_cli("generate", str(tiny_folder), prompt, "--max-new-tokens", str(NEW_TOKENS))
    chat = run_cli("generate", "-m", str(tiny_folder), prompt, "--chat", "--max-new-tokens", str(NEW_TOKENS))
    assert plain.returncode == 0 and chat.returncode == 0, plain.stderr + chat.stderr
    expected_plain = _greedy_text(tiny_folder, smollm2_tokenizer, smollm2_tokenizer(prompt, return_tensors="pt").input_ids)
    expected_chat = _greedy_text(tiny_folder, smollm2_tokenizer, _chat_ids(smollm2_tokenizer, prompt))
    assert plain.stdout == expected_plain + "\n"
    assert chat.stdout == expected_chat + "\n"
    assert expected_plain != expected_chat  # the two paths feed the model different tokens


def test_chat_message_forms_agree(tiny_folder, smollm2_tokenizer):
    message = "Tell me a joke"
    expected = _greedy_text(tiny_folder, smollm2_tokenizer, _chat_ids(smollm2_tokenizer, message)) + "\n"
    for args in ([str(tiny_folder), message], ["-m", str(tiny_folder), "-p", message], [str(tiny_folder), "-p", message]):
        run = run_cli("chat", *args, "--max-new-tokens", str(NEW_TOKENS))
        assert run.returncode == 0 and run.stdout == expected, (args, run.stderr)


def test_chat_without_a_template_says_so(tmp_path, tiny_folder):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    tokenizer.chat_template = None
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_folder / name).read_bytes())
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    run = run_cli("chat", str(tmp_path), "-p", "Hello")
    assert run.returncode != 0 and "has no chat template" in run.stderr and len(run.stderr.strip().splitlines()) <= 2


@pytest.mark.slow
def test_convert_gguf_round_trip(tmp_path, smollm2_tokenizer):
    """GGUF -> HF folder -> AutoTokenizer + transformers' model: the same greedy tokens as our model on the
    GGUF, and our own command line chats from the folder as it does from the GGUF."""
    out = tmp_path / "smollm2"
    run = run_cli("convert", "smollm2", str(out))
    assert run.returncode == 0, run.stderr
    assert "tokenizer" in run.stdout and "chat template" in run.stdout and "generation config" in run.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == smollm2_tokenizer.eos_token_id

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    message = "What is the capital of France?"
    ids = _chat_ids(tokenizer, message)
    assert torch.equal(ids, _chat_ids(smollm2_tokenizer, message))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    ours = fm.from_pretrained(fm.smollm2_gguf()).generate(ids, max_new_tokens=NEW_TOKENS,
                                                         eos_token_id=smollm2_tokenizer.eos_token_id)
    assert torch.equal(ref, ours)

    from_folder = run_cli("chat", str(out), message, "--max-new-tokens", str(NEW_TOKENS))
    from_gguf = run_cli("chat", "-p", message, "--max-new-tokens", str(NEW_TOKENS))
    assert from_folder.returncode == 0 and from_gguf.returncode == 0, from_folder.stderr + from_gguf.stderr
    assert from_folder.stdout == from_gguf.stdout == tokenizer.decode(ours[0, ids.shape[1]:], skip_special_tokens=True) + "\n"


def test_sampling_flags_without_do_sample_are_said_to_be_ignored(tiny_folder):
    greedy = run_cli("generate", str(tiny_folder), "Hello", "--max-new-tokens", "3")
    flagged = run_cli("generate", str(tiny_folder), "Hello", "--max-new-tokens", "3", "--temperature", "0.7", "--top-k", "5")
    assert greedy.returncode == 0 and flagged.returncode == 0, greedy.stderr + flagged.stderr
    assert flagged.stdout == greedy.stdout
    assert "--temperature, --top-k without --do-sample: decoding greedily" in flagged.stderr
    assert "--do-sample" not in greedy.stderr


def test_chat_stops_at_an_end_id_listed_in_generation_config_only(tmp_path, tiny_folder, smollm2_tokenizer):
    """An instruct checkpoint may list its end-of-turn id in generation_config.json only (Llama-3's <|eot_id|>)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    ids = _chat_ids(smollm2_tokenizer, "Hello")
    plain = fm.from_pretrained(folder).generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=smollm2_tokenizer.eos_token_id)
    turn_end = int(plain[0, ids.shape[1]])  # the answer's first token: the turn ends right after it
    assert turn_end != smollm2_tokenizer.eos_token_id
    transformers.GenerationConfig(eos_token_id=[smollm2_tokenizer.eos_token_id, turn_end]).save_pretrained(folder)
    run = run_cli("chat", str(folder), "Hello", "--max-new-tokens", str(NEW_TOKENS))
    assert run.returncode == 0, run.stderr
    assert run.stdout == smollm2_tokenizer.decode([turn_end], skip_special_tokens=True) + "\n"


def test_convert_hf_folder_keeps_tokenizer_and_generation_config(tmp_path, tiny_folder):
    source = tmp_path / "source"
    shutil.copytree(tiny_folder, source)
    transformers.GenerationConfig(eos_token_id=2, bos_token_id=1, pad_token_id=2).save_pretrained(source)
    out = tmp_path / "out"
    run = run_cli("convert", str(source), str(out))
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template
    again = run_cli("generate", str(out), "Hello", "--max-new-tokens", "3")
    direct = run_cli("generate", str(source), "Hello", "--max-new-tokens", "3")
    assert again.returncode == 0 and again.stdout == direct.stdout


def test_bench_cpu_measures_both_sides_on_the_same_tokens(tmp_path, tiny_folder):
    out = tmp_path / "cpu.json"
    run = run_cli("bench", "cpu", "--model", str(tiny_folder), "--max-new-tokens", "4", "--rounds", "2",
                  "--threads", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert [row["side"] for row in result["rows"]] == ["ours", "hf"]
    assert all(row["same_tokens"] and row["decode_tok_s"] > 0 and row["first_token_s"] > 0 for row in result["rows"])
    assert result["env"]["threads"] == 1 and result["env"]["new_tokens"] == 4
    assert result["env"]["ours_path"] == "lean CPU step"  # the float32 LLaMA-style model takes runtime/cpu_decode.py


@pytest.mark.slow
def test_chat_answers_the_capital_question_offline():
    run = run_cli("chat", "-p", "What is the capital of France?", "--max-new-tokens", "24", "--stats")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "first token" in run.stderr and "tokens/s" in run.stderr


@pytest.mark.slow
def test_compare_reports_parity():
    run = run_cli("compare", "--max-new-tokens", "8")
    assert run.returncode == 0, run.stderr
    assert "identical: yes" in run.stdout
    assert float(run.stdout.split("max |logits ours - HF|:")[1].split()[0]) < 1e-3


def _files(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_convert_overwrite_keeps_nothing_of_the_old_folder(tmp_path, tiny_folder):
    from flash_models.convert import convert

    fresh, reused = tmp_path / "fresh", tmp_path / "reused"
    convert(tiny_folder, fresh)
    reused.mkdir()
    for stale in ("vocab.txt", "merges.txt", "model-00001-of-00002.safetensors", "notes.md"):
        (reused / stale).write_text("from an earlier conversion")
    convert(tiny_folder, reused)  # what `convert --overwrite` does
    assert _files(reused) == _files(fresh)
    assert transformers.AutoTokenizer.from_pretrained(reused).chat_template


def test_convert_failing_midway_leaves_the_destination_as_it_was(tmp_path, tiny_folder, monkeypatch):
    import flash_models.convert as convert_module

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "config.json").write_text('{"old": true}')

    def broken_copy(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(convert_module, "_copy_tokenizer_files", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        convert_module.convert(tiny_folder, dst)
    assert _files(dst) == {"config.json"} and json.loads((dst / "config.json").read_text()) == {"old": True}
    assert _files(tmp_path) == {"out"}  # no temporary folder left beside it


def test_new_tokens_past_the_context_are_cut_to_it(tiny_folder, smollm2_tokenizer):
    """tiny_folder's context is 256 positions: a larger --max-new-tokens generates what fits, and says so."""
    prompt_tokens = len(smollm2_tokenizer("Hello").input_ids)
    run = run_cli("generate", str(tiny_folder), "Hello", "--max-new-tokens", "100000", "--stats")
    assert run.returncode == 0, run.stderr
    assert f"[at most {256 - prompt_tokens} new tokens" in run.stderr
    assert int(run.stderr.split("tokens |")[0].rsplit("[", 1)[1]) <= 256 - prompt_tokens


def test_convert_keeps_the_source_dtype_unless_asked(tmp_path):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    random_hf_model(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    run = run_cli("convert", str(tmp_path / "bf16"), str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert fm.from_pretrained(tmp_path / "out", dtype="auto").dtype == torch.bfloat16


def test_interactive_chat_past_the_context_begins_a_new_chat(tiny_folder):
    """tiny_folder's context is 256 positions: a session whose history outgrows it goes on with a new chat (a
    note on stderr), and a message that alone fills it is named; neither ends the session."""
    typed = "\n".join(["Tell me a story."] * 4 + ["word " * 300, "Hello"]) + "\n"
    run = run_cli("chat", str(tiny_folder), "--max-new-tokens", "90", "--do-sample", stdin=typed)
    assert run.returncode == 0, run.stderr
    assert "[the chat filled the model's context of 256 tokens: a new chat begins with this message]" in run.stderr
    assert "this message alone fills it; try a shorter one]" in run.stderr
    assert run.stdout.endswith("> \n")  # the session ran to the end of the input
