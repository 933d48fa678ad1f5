"""transformers' generation settings beyond the sampling basics: each one gives HF's tokens, or is refused by name
(never silently ignored); HF's streamer protocol, assistant_model, and the checkpoint's generation_config.json."""

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import ours_from_hf
from tests.generation.test_generate import VOCAB, llama_hf

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models stepped one token at a time


@pytest.fixture(scope="module")
def pair():
    hf = llama_hf(seed=31)
    return hf, ours_from_hf(hf)


def prompt(batch=3, length=7, seed=0):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


LENGTH_SETTINGS = [
    dict(max_length=15),
    dict(max_length=15, max_new_tokens=3),  # max_new_tokens wins, as in HF
    dict(no_repeat_ngram_size=1, max_new_tokens=30),
    dict(no_repeat_ngram_size=2, max_new_tokens=30),
    dict(no_repeat_ngram_size=3, max_new_tokens=40, repetition_penalty=0.5),  # a penalty < 1 makes repeats likely
]


@pytest.mark.parametrize("as_config", [False, True], ids=["kwargs", "GenerationConfig"])
@pytest.mark.parametrize("settings", LENGTH_SETTINGS, ids=[repr(s) for s in LENGTH_SETTINGS])
def test_length_and_ngram_settings_give_hf_tokens(pair, settings, as_config):
    hf, ours = pair
    ids = prompt()
    ref = hf.generate(ids, do_sample=False, eos_token_id=None, pad_token_id=0, **settings)
    if as_config:
        out = ours.generate(ids, generation_config=transformers.GenerationConfig(**settings), eos_token_id=[], pad_token_id=0)
    else:
        out = ours.generate(ids, eos_token_id=[], pad_token_id=0, **settings)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("settings", [dict(min_length=14), dict(min_length=9, min_new_tokens=5)])
def test_min_length_counts_the_prompt_and_holds_eos_back_as_hf(pair, settings):
    hf, ours = pair
    ids = prompt()
    eos = int(ours.generate(ids, max_new_tokens=3, eos_token_id=[])[0, -1])  # row 0 would end at its 3rd token
    ref = hf.generate(ids, do_sample=False, eos_token_id=eos, pad_token_id=0, max_new_tokens=20, **settings)
    out = ours.generate(ids, eos_token_id=eos, pad_token_id=0, max_new_tokens=20, **settings)
    assert torch.equal(out, ref)
    assert int(out[0, 7 + 2]) != eos  # held back


def test_no_repeat_ngram_size_in_a_padded_batch_acts_on_each_row_alone(pair):
    _, ours = pair
    ids = prompt(length=9, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    settings = dict(no_repeat_ngram_size=2, max_new_tokens=25, eos_token_id=[], repetition_penalty=0.5)
    batched = ours.generate(ids, attention_mask=mask, **settings)
    alone = ours.generate(ids[1:2, 4:], **settings)
    assert torch.equal(batched[1, 9:], alone[0, 5:])
    new = batched[1, 9:].tolist()
    row = ids[1, 4:].tolist() + new
    bigrams = list(zip(row, row[1:]))
    assert len(bigrams) == len(set(bigrams))


def test_num_return_sequences_samples_what_hf_samples_from_one_seed(pair):
    hf, ours = pair
    ids = prompt(batch=2)
    settings = dict(do_sample=True, num_return_sequences=3, top_k=20, temperature=0.7, max_new_tokens=10, pad_token_id=0)
    torch.manual_seed(3)
    ref = hf.generate(ids, eos_token_id=None, **settings)
    torch.manual_seed(3)
    out = ours.generate(ids, eos_token_id=[], **settings)
    assert out.shape == (6, 17) and torch.equal(out, ref)


def test_output_logits_are_the_raw_logits_hf_returns(pair):
    hf, ours = pair
    ids = prompt()
    settings = dict(max_new_tokens=5, output_logits=True, output_scores=True, return_dict_in_generate=True,
                    repetition_penalty=1.5, pad_token_id=0)
    ref = hf.generate(ids, do_sample=False, eos_token_id=None, **settings)
    out = ours.generate(ids, eos_token_id=[], **settings)
    assert len(out.logits) == len(ref.logits) == 5
    for ours_step, hf_step in zip(out.logits, ref.logits):
        torch.testing.assert_close(ours_step, hf_step, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.logits[1], out.scores[1])  # raw, not the penalized scores
    assert out["sequences"] is out[0] is out.sequences and torch.equal(out.sequences, ref.sequences)  # read as HF's


@pytest.mark.parametrize("settings,message", [
    (dict(typical_p=0.5), r"GenerationConfig\.typical_p=0\.5 is not supported .* only typical_p=1\.0"),
    (dict(suppress_tokens=[5]), r"suppress_tokens=\[5\] is not supported .* drop suppress_tokens"),
    (dict(bad_words_ids=[[5]]), "bad_words_ids"),
    (dict(num_beams=2), "num_beams=2 is not supported"),
    (dict(max_time=1.0), "max_time"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(forced_eos_token_id=3), "forced_eos_token_id"),
])
@pytest.mark.parametrize("as_config", [False, True], ids=["kwargs", "GenerationConfig"])
def test_an_hf_setting_that_would_change_the_tokens_is_refused_by_name(pair, settings, message, as_config):
    _, ours = pair
    with pytest.raises(ValueError, match=message if as_config else message.replace(r"GenerationConfig\.", "")):
        if as_config:
            ours.generate(prompt(), generation_config=transformers.GenerationConfig(**settings))
        else:
            ours.generate(prompt(), **settings)


def test_hf_settings_that_change_no_token_are_accepted(pair):
    _, ours = pair
    ids = prompt()
    ref = ours.generate(ids, max_new_tokens=6, eos_token_id=[])
    neutral = dict(num_beams=1, typical_p=1.0, length_penalty=2.0, early_stopping=True, use_cache=False, bos_token_id=0,
                   output_attentions=False)
    assert torch.equal(ours.generate(ids, max_new_tokens=6, eos_token_id=[], **neutral), ref)
    config = transformers.GenerationConfig(max_new_tokens=6, **neutral)
    assert torch.equal(ours.generate(ids, generation_config=config, eos_token_id=[]), ref)


@pytest.mark.parametrize("settings,message", [
    (dict(max_length=7), r"max_length=7 leaves no room after the prompt's 7 columns"),
    (dict(num_return_sequences=2), "num_return_sequences=2 needs do_sample=True"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be >= 0"),
    (dict(min_length=2.5), "min_length must be an int"),
    (dict(output_logits="yes"), "output_logits must be True or False"),
    (dict(not_a_setting=1), r"unknown generation argument\(s\) \['not_a_setting'\]"),
])
def test_a_bad_hf_setting_is_named(pair, settings, message):
    _, ours = pair
    with pytest.raises(ValueError, match=message):
        ours.generate(prompt(), **settings)


def test_eos_and_pad_ids_as_tensors_as_hf_takes_them(pair):
    _, ours = pair
    ids = prompt()
    plain = ours.generate(ids, max_new_tokens=8, eos_token_id=[])
    eos = [int(plain[0, 9]), int(plain[1, 8])]
    ref = ours.generate(ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=4)
    out = ours.generate(ids, max_new_tokens=8, eos_token_id=torch.tensor(eos), pad_token_id=torch.tensor(4))
    assert torch.equal(out, ref) and int(out[0, -1]) == 4


class RecordingStreamer:
    """transformers' streamer protocol (what TextStreamer implements): put(ids) then end()."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


def test_a_streamer_gets_what_hf_gives_it(pair):
    hf, ours = pair
    ids = prompt(batch=1)
    eos = int(ours.generate(ids, max_new_tokens=5, eos_token_id=[])[0, -1])  # ends at step 5, before max_new_tokens
    theirs, mine = RecordingStreamer(), RecordingStreamer()
    ref = hf.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, streamer=theirs)
    out = ours.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, streamer=mine)
    assert torch.equal(out, ref) and out.shape[1] == 7 + 5
    assert mine.calls == theirs.calls


def test_a_text_streamer_prints_the_continuation(pair, capsys):
    from tests.generation.test_generate import CharTokenizer

    _, ours = pair
    tok = CharTokenizer()
    ids = prompt(batch=1)
    out = ours.generate(ids, max_new_tokens=6, eos_token_id=[], streamer=transformers.TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == tok.decode(out[0, 7:].tolist()) + "\n"


def test_a_streamer_without_put_and_end_is_refused(pair):
    with pytest.raises(ValueError, match="streamer must have put"):
        pair[1].generate(prompt(batch=1), streamer=print)


def test_assistant_model_is_the_draft_model(pair):
    _, ours = pair
    draft = ours_from_hf(llama_hf(seed=32, num_hidden_layers=1))
    ids = prompt()
    ref = ours.generate(ids, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(ours.generate(ids, assistant_model=draft, max_new_tokens=10, eos_token_id=[]), ref)
    with pytest.raises(ValueError, match="draft_model or assistant_model"):
        ours.generate(ids, assistant_model=draft, draft_model=draft)
    with pytest.raises(ValueError, match="no_repeat_ngram_size is not supported with draft_model"):
        ours.generate(ids, assistant_model=draft, no_repeat_ngram_size=2)


def test_the_checkpoints_generation_config_gives_the_default_eos_ids(tmp_path):
    """An instruct checkpoint's end-of-turn id is often in generation_config.json only (Llama-3): generate stops
    there, as transformers' does."""
    hf = llama_hf(seed=33)
    ids = prompt()
    plain = hf.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    turn_end = int(plain[0, 7 + 3])
    hf.generation_config = transformers.GenerationConfig(eos_token_id=[1, turn_end], pad_token_id=0, bos_token_id=0)
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ref = loaded.generate(ids, do_sample=False, max_new_tokens=12)
    ours = fm.from_pretrained(tmp_path)
    assert ours.generation_config.eos_token_id == [1, turn_end]
    out = ours.generate(ids, max_new_tokens=12)
    assert torch.equal(out, ref) and int(out[0, -1]) == 0  # row 0 ended at turn_end and was padded


def test_fm_generate_is_model_generate(pair):
    _, ours = pair
    ids = prompt()
    assert torch.equal(fm.generate(ours, ids, max_new_tokens=5, eos_token_id=[]),
                       ours.generate(ids, max_new_tokens=5, eos_token_id=[]))


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_a_padded_batch_without_its_mask_is_read_through_the_pad_id_as_hf_does(draft):
    """A tokenizer's padded batch passed without attention_mask: the pad id (set, and not an EOS id) marks the padding."""
    hf = llama_hf(seed=34, pad_token_id=2)
    ours = ours_from_hf(hf)
    ids = prompt(seed=3).clamp(min=3)
    ids[1, :3], ids[2, :5] = 2, 2
    ref = hf.generate(ids, do_sample=False, max_new_tokens=8)
    extra = dict(draft_model=ours_from_hf(llama_hf(seed=35, num_hidden_layers=1))) if draft else {}
    assert torch.equal(ours.generate(ids, max_new_tokens=8, **extra), ref)
    mask = (ids != 2).long()
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=8, **extra), ref)
    # the pad id doubling as EOS marks nothing: the prompt is read whole, as in HF
    assert torch.equal(ours.generate(ids, max_new_tokens=8, pad_token_id=1, eos_token_id=1),
                       hf.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=1, eos_token_id=1))


def test_stream_takes_a_tokenizers_output_and_a_generation_config(pair):
    from tests.generation.test_generate import CharTokenizer

    _, ours = pair
    tok = CharTokenizer()
    ids = torch.tensor([[0, 0, 40, 41, 42]])
    encoded = dict(input_ids=ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1]]))
    config = transformers.GenerationConfig(max_length=12, eos_token_id=[])
    pieces = list(fm.generation.stream(ours, tok, **encoded, generation_config=config))
    alone = ours.generate(ids[:, 2:], max_new_tokens=7, eos_token_id=[])
    assert "".join(pieces) == tok.decode(alone[0, 3:].tolist())


def test_sampling_from_one_seed_gives_hf_tokens_while_rows_finish_at_different_steps(pair):
    hf, ours = pair
    ids = prompt(seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eos = list(range(2, 30))  # likely enough that the rows finish early, at different steps
    settings = dict(attention_mask=mask, do_sample=True, top_k=0, top_p=0.95, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(3)
    ref = hf.generate(ids, **settings)
    torch.manual_seed(3)
    out = ours.generate(ids, **settings)
    ends = torch.isin(ref[:, 7:], torch.tensor(eos))
    finished_at = {int(row.nonzero()[0, 0]) if row.any() else None for row in ends}
    assert None not in finished_at and len(finished_at) == 3, f"setup: rows should end at different steps ({finished_at})"
    assert torch.equal(out, ref)


def test_save_pretrained_keeps_the_generation_config_it_was_loaded_with(tmp_path):
    hf = llama_hf(seed=36)
    hf.generation_config = transformers.GenerationConfig(eos_token_id=[1, 7], bos_token_id=0, do_sample=True, top_p=0.8)
    hf.save_pretrained(tmp_path / "source")
    fm.from_pretrained(tmp_path / "source").save_pretrained(tmp_path / "copy")
    again = fm.from_pretrained(tmp_path / "copy").generation_config
    assert again.eos_token_id == [1, 7] and again.do_sample is True and again.top_p == 0.8
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "copy").eos_token_id == [1, 7]
    # nothing beyond config.json's ids: no file, as before
    ours_from_hf(llama_hf(seed=36)).save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "generation_config.json").exists()


def test_a_stop_string_may_begin_in_the_prompt_as_in_hf():
    """transformers stops when a new token completes a stop string, wherever it begins (here: in the prompt);
    one lying wholly inside the prompt stops nothing."""
    from tests.generation.test_generate import CharTokenizer

    ours = ours_from_hf(llama_hf(seed=44, vocab_size=258))
    tok = CharTokenizer()
    ids = torch.tensor([[0, 0, ord("p") + 2, ord("q") + 2], [ord("r") + 2, ord("s") + 2, ord("t") + 2, ord("u") + 2]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    assert all(2 <= t < 2 + 128 for t in free[:, 4].tolist()), "setup: the first new tokens should be ASCII bytes"
    first = tok.decode(free[:, 4].tolist())  # one character a token
    stops = ["q" + first[0], "stu" + first[1]]
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], stop_strings=stops, tokenizer=tok,
                        pad_token_id=0)
    assert out.shape[1] == 5 and torch.equal(out, free[:, :5])
    inside = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], stop_strings=["pq", "rs"], tokenizer=tok)
    assert torch.equal(inside, free)


def test_the_models_generation_config_gives_ids_and_its_sampling_settings_only_when_passed():
    """model.generation_config's EOS/pad ids are the defaults; its other settings (sampling, lengths, settings we do
    not implement) apply only when it is passed as generation_config=, where they give transformers' tokens."""
    hf = llama_hf(seed=38)  # its own models: their generation configs are changed here
    ours = ours_from_hf(hf)
    ids = prompt()
    greedy = ours.generate(ids, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    recommended = dict(max_new_tokens=5, no_repeat_ngram_size=1, pad_token_id=0, eos_token_id=None)
    ours.generation_config = transformers.GenerationConfig(**recommended, do_sample=True, top_k=3, num_beams=4)
    assert torch.equal(ours.generate(ids, max_new_tokens=6, eos_token_id=[]), greedy)  # greedy: nothing applied
    with pytest.raises(ValueError, match=r"num_beams=4 is not supported"):
        ours.generate(ids, generation_config=ours.generation_config)
    for model in (hf, ours):
        model.generation_config = transformers.GenerationConfig(**recommended, do_sample=False)
    out = ours.generate(ids, generation_config=ours.generation_config)
    assert out.shape == (3, 12) and torch.equal(out, hf.generate(ids))
    # Another GenerationConfig argument: its fields, not the model's (transformers would merge the model's in)
    out = ours.generate(ids, generation_config=transformers.GenerationConfig(max_new_tokens=3), eos_token_id=[])
    assert torch.equal(out, greedy[:, :10])