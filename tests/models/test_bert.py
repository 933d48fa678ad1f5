import pytest
import torch
import torch.nn.functional as F
import transformers

import flash_models as fm
from flash_models.models.bert import BertForQuestionAnswering, BertForSequenceClassification
from flash_models.testing import (
    assert_bf16_error_bounded, assert_meta_keys_match_hf, assert_round_trip_bit_identical,
    assert_saved_model_read_by_transformers, low_precision_bound_ok, max_rel_err, ours_from_hf, random_hf_model,
    random_input_ids,
)

VOCAB = 151
AUTO = {
    "BertModel": "AutoModel",
    "BertForPreTraining": "AutoModelForPreTraining",
    "BertForMaskedLM": "AutoModelForMaskedLM",
    "BertForSequenceClassification": "AutoModelForSequenceClassification",
    "BertForTokenClassification": "AutoModelForTokenClassification",
    "BertForQuestionAnswering": "AutoModelForQuestionAnswering",
}


def bert_config(architecture="BertModel", **overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=112,
                max_position_embeddings=40, type_vocab_size=3, hidden_act="gelu_new", layer_norm_eps=1e-6,
                architectures=[architecture], num_labels=2 if architecture == "BertForQuestionAnswering" else 3)
    return transformers.BertConfig(**{**base, **overrides})


def hf_bert(architecture="BertModel", seed=0, **overrides):
    return random_hf_model(bert_config(architecture, **overrides), seed=seed, auto_class=AUTO[architecture])


def padded_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 19), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding
    mask[2, :5] = 0  # left padding
    return ids, mask, torch.randint(0, 3, ids.shape, generator=gen)


def padded_inputs(seed=0):
    """padded_batch as forward keyword arguments."""
    return dict(zip(("input_ids", "attention_mask", "token_type_ids"), padded_batch(seed)))


def main_output(out, architecture):
    if architecture == "BertModel":
        return out.last_hidden_state
    if architecture == "BertForQuestionAnswering":
        return torch.stack((out.start_logits, out.end_logits), -1)
    return out.prediction_logits if architecture == "BertForPreTraining" else out.logits


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("architecture", AUTO)
def test_fp32_outputs_match_hf_on_real_tokens(architecture, attn_impl):
    hf = hf_bert(architecture, seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert type(ours).__name__ == architecture
    ids, mask, types = padded_batch(1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out = ours(ids, attention_mask=mask, token_type_ids=types)
    expected, got = main_output(ref, architecture), main_output(out, architecture)
    if got.dim() == 3:  # per-token outputs: compare on real tokens
        expected, got = expected[mask.bool()], got[mask.bool()]
    assert max_rel_err(got, expected) < 1e-5
    if architecture == "BertModel":
        assert max_rel_err(out.pooler_output, ref.pooler_output) < 1e-5
    if architecture == "BertForPreTraining":
        assert max_rel_err(out.seq_relationship_logits, ref.seq_relationship_logits) < 1e-5


@pytest.mark.parametrize("architecture, overrides, make_labels", [
    ("BertForMaskedLM", {}, lambda ids: torch.where(torch.rand(ids.shape) < 0.3, ids, -100)),
    ("BertForTokenClassification", {}, lambda ids: torch.randint(0, 3, ids.shape)),
    ("BertForSequenceClassification", {}, lambda ids: torch.randint(0, 3, (ids.shape[0],))),
    ("BertForSequenceClassification", dict(num_labels=1), lambda ids: torch.randn(ids.shape[0])),
    ("BertForSequenceClassification", dict(problem_type="regression"), lambda ids: torch.randn(ids.shape[0], 3)),
    ("BertForSequenceClassification", dict(problem_type="multi_label_classification"), lambda ids: (torch.rand(ids.shape[0], 3) < 0.5).float()),
])
def test_losses_match_hf(architecture, overrides, make_labels):
    hf = hf_bert(architecture, seed=2, **overrides)
    ours = ours_from_hf(hf)
    ids, mask, types = padded_batch(2)
    labels = make_labels(ids)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
        out = ours(ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
    assert torch.allclose(out, ref, rtol=1e-5)


def test_pretraining_loss_matches_hf():
    hf = hf_bert("BertForPreTraining", seed=3)
    ours = ours_from_hf(hf)
    ids, mask, types = padded_batch(3)
    labels, nsp = torch.where(torch.rand(ids.shape) < 0.3, ids, -100), torch.randint(0, 2, (3,))
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp).loss
        out = ours(ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp).loss
    assert torch.allclose(out, ref, rtol=1e-5)


def test_bf16_error_bounded_by_hf_own_bf16_error():
    # compared on the real tokens of the padded batch, as hf_bert(seed=4) builds the model
    assert_bf16_error_bounded(bert_config(), padded_inputs(4), seed=4, output="last_hidden_state",
                              auto_class="AutoModel")


def test_flash_path_unpads_once_and_matches_hf():
    """attn_impl='flash' (our Triton kernels; on a CPU through Triton's interpreter): the layers see the
    packed real tokens only, and the re-padded output stays within HF's own bf16 error."""
    hf32 = hf_bert(seed=5, num_attention_heads=2)  # head dim 32, which the kernels support
    hf16 = hf_bert(seed=5, num_attention_heads=2).to(torch.bfloat16)
    ours = ours_from_hf(hf32, attn_impl="flash", dtype=torch.bfloat16)
    ids, mask, types = padded_batch(5)
    seen = []
    for block in ours.blocks:
        block.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        out = ours(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        ref = hf32(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        theirs = hf16(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert seen == [(1, int(mask.sum()), 64)] * 2
    real = mask.bool()
    assert (out[~real] == 0).all()
    ok, ours_err, hf_err = low_precision_bound_ok(out[real].float(), theirs[real].float(), ref[real])
    assert ok, f"ours bf16 error {ours_err:.3g} vs HF's own bf16 error {hf_err:.3g}"


def test_a_batch_without_padding_runs_as_without_a_mask():
    """An all-ones attention_mask (what a tokenizer gives an unpadded batch) is dropped: on the flash path the
    layers see the batch as it is, not unpadded, and the output is the maskless call's."""
    ours = ours_from_hf(hf_bert(seed=6, num_attention_heads=2), attn_impl="flash", dtype=torch.bfloat16)
    ids, _, types = padded_batch(6)
    seen = []
    for block in ours.blocks:
        block.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        out = ours(ids, attention_mask=torch.ones_like(ids), token_type_ids=types)
        plain = ours(ids, token_type_ids=types)
    assert seen == [(*ids.shape, 64)] * 4
    assert torch.equal(out.last_hidden_state, plain.last_hidden_state)
    assert torch.equal(out.pooler_output, plain.pooler_output)


@pytest.mark.gpu
def test_gpu_float32_weights_under_autocast_unpad_once():
    """Fine-tuning's usual setup (float32 weights, bf16 autocast: HF Trainer's bf16=True) takes the unpadded
    path: its layers compute in bf16, where our attention runs."""
    ours = ours_from_hf(hf_bert(seed=7, num_attention_heads=2)).cuda()
    assert ours.blocks[0].attn.backend_on(torch.device("cuda"), torch.bfloat16) == "flash"
    ids, mask, types = (t.cuda() for t in padded_batch(7))
    seen = []
    for block in ours.blocks:
        block.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours(ids, attention_mask=mask, token_type_ids=types).last_hidden_state.float().sum().backward()
    assert seen == [(1, int(mask.sum()), 64)] * 2


@pytest.mark.parametrize("architecture", AUTO)
def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match(architecture):
    assert_round_trip_bit_identical(hf_bert(architecture, seed=6))
    assert_meta_keys_match_hf(bert_config(architecture), auto_class=AUTO[architecture])


@pytest.mark.parametrize("architecture", ["BertForMaskedLM", "BertForPreTraining"])
def test_untied_mlm_decoder_matches_hf_and_round_trips(architecture, tmp_path):
    """Untied, transformers gives the decoder a bias of its own and leaves cls.predictions.bias unused: the
    logits and loss follow the decoder's weight and bias (the two biases differ here), every key round-trips."""
    hf = hf_bert(architecture, seed=7, tie_word_embeddings=False)
    assert_round_trip_bit_identical(hf)
    ours = ours_from_hf(hf)
    ids, mask, types = padded_batch(7)
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out = ours(ids, attention_mask=mask, token_type_ids=types)
        ref_loss = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
        out_loss = ours(ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
    real = mask.bool()
    assert max_rel_err(main_output(out, architecture)[real], main_output(ref, architecture)[real]) < 1e-5
    if architecture == "BertForMaskedLM":  # pretraining's loss needs next-sentence labels as well
        assert torch.allclose(out_loss, ref_loss, rtol=1e-5)
    output = "prediction_logits" if architecture == "BertForPreTraining" else "logits"
    assert_saved_model_read_by_transformers(hf, tmp_path, padded_inputs(7), auto_class=AUTO[architecture], output=output)


def test_old_checkpoint_names_and_pretraining_weights_load_as_masked_lm(tmp_path):
    """bert-base-uncased style: LayerNorm gamma/beta names, NSP head and pooler saved beside an MLM config."""
    source = hf_bert("BertForPreTraining", seed=8)
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in source.state_dict().items()}
    bert_config("BertForMaskedLM").save_pretrained(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = fm.from_pretrained(tmp_path)
    assert type(ours).__name__ == "BertForMaskedLM"
    ids, mask, types = padded_batch(8)
    with torch.no_grad():
        ref = source(input_ids=ids, attention_mask=mask, token_type_ids=types).prediction_logits
        out = ours(ids, attention_mask=mask, token_type_ids=types).logits
    assert max_rel_err(out[mask.bool()], ref[mask.bool()]) < 1e-5


@pytest.mark.parametrize("architecture", ["BertModel", "BertForMaskedLM", "BertForSequenceClassification",
                                          "BertForQuestionAnswering"])
def test_save_pretrained_is_read_by_transformers_with_same_outputs(architecture, tmp_path):
    hf = hf_bert(architecture, seed=9)
    assert type(hf).__name__ == architecture  # and the helper checks transformers reads back the same class
    output = {"BertModel": "last_hidden_state", "BertForQuestionAnswering": "start_logits"}.get(architecture, "logits")
    assert_saved_model_read_by_transformers(hf, tmp_path, padded_inputs(9), auto_class=AUTO[architecture],
                                            output=output, tol=1e-6)


def test_right_padded_rows_equal_each_sequence_alone():
    ours = ours_from_hf(hf_bert(seed=10))
    ids, mask, types = padded_batch(10)
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask, token_type_ids=types)
        alone = ours(ids[1:2, :11], token_type_ids=types[1:2, :11])
    assert max_rel_err(padded.last_hidden_state[1, :11], alone.last_hidden_state[0]) < 1e-5
    assert max_rel_err(padded.pooler_output[1], alone.pooler_output[0]) < 1e-5


def test_config_without_architectures_builds_bert_model():
    model = fm.checkpoint.build_model(bert_config(architectures=None), device="meta")
    assert type(model).__name__ == "BertModel" and model.pooler is not None


@pytest.mark.parametrize("overrides, match", [
    (dict(is_decoder=True), "decoder"),
    (dict(architectures=["BertForMultipleChoice"]), "BertForMultipleChoice"),
    (dict(architectures=["BertForQuestionAnswering"], num_labels=3), "num_labels must be 2"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type"),
])
def test_unsupported_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        fm.checkpoint.build_model(bert_config(**overrides))


# ---- the embedded real checkpoint: sentence-transformers all-MiniLM-L6-v2 ------------------------------------
SENTENCES = [
    "The capital of France is Paris.",
    "A man is playing a guitar on the street while people walk by.",
    "Hello!",
    "Flash attention skips the padding entirely.",
]


@pytest.fixture(scope="module")
def minilm():
    directory = fm.minilm_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    hf = transformers.AutoModel.from_pretrained(directory).eval()
    with torch.no_grad():
        ref = hf(**batch)
    return fm.from_pretrained(directory), batch, ref


def mean_pool(hidden, mask):
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def test_minilm_loads_as_bert_model_and_matches_hf(minilm):
    ours, batch, ref = minilm
    assert type(ours).__name__ == "BertModel"
    assert batch["attention_mask"].min() == 0, "the batch must contain padding"
    with torch.no_grad():
        out = ours(**batch)
    real = batch["attention_mask"].bool()
    assert (out.last_hidden_state[real] - ref.last_hidden_state[real]).abs().max() < 1e-4
    assert (out.pooler_output - ref.pooler_output).abs().max() < 1e-4


def test_minilm_sentence_embeddings_match_hf(minilm):
    ours, batch, ref = minilm
    with torch.no_grad():
        out = ours(**batch)
    mask = batch["attention_mask"]
    ours_emb = F.normalize(mean_pool(out.last_hidden_state, mask), dim=-1)
    ref_emb = F.normalize(mean_pool(ref.last_hidden_state, mask), dim=-1)
    cosine = (ours_emb * ref_emb).sum(-1)
    assert cosine.min() >= 0.99999, cosine
    # and the embeddings mean something: a sentence is closer to itself than to the others
    assert torch.equal((ours_emb @ ref_emb.T).argmax(-1), torch.arange(len(SENTENCES)))


def test_pad_token_id_outside_the_vocabulary_is_refused_naming_it():
    """HF builds word_embeddings with padding_idx=pad_token_id, which torch refuses with a bare assertion."""
    with pytest.raises(ValueError, match=f"pad_token_id {VOCAB} is outside the vocabulary of {VOCAB} tokens"):
        fm.checkpoint.build_model(bert_config(pad_token_id=VOCAB))


@pytest.mark.parametrize("labels", [torch.tensor([0, 2, 1], dtype=torch.int32), torch.tensor([[0], [2], [1]])],
                         ids=["int32", "column"])
def test_sequence_labels_of_another_int_dtype_or_a_column_give_hf_loss(labels):
    """HF flattens the labels (labels.view(-1)); int32 ids are class ids too."""
    hf = hf_bert("BertForSequenceClassification", seed=12)
    ours = ours_from_hf(hf)
    ids, mask, types = padded_batch(12)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels.long()).loss
        out = ours(ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
    assert torch.allclose(out, ref, rtol=1e-5)


@pytest.mark.parametrize("architecture, bad_labels", [
    ("BertForSequenceClassification", lambda ids: torch.tensor([0, 3, 1])),
    ("BertForTokenClassification", lambda ids: torch.full_like(ids, -1)),
    ("BertForMaskedLM", lambda ids: torch.full_like(ids, VOCAB)),
])
def test_labels_outside_the_classes_are_refused_naming_them(architecture, bad_labels):
    """torch's own error is an IndexError ('Target 3 is out of bounds'), a device assert on CUDA."""
    ours = ours_from_hf(hf_bert(architecture, seed=13))
    ids, mask, _ = padded_batch(13)
    with pytest.raises(ValueError, match=r"labels must be class ids in \[0, \d+\) .* or -100"):
        ours(ids, attention_mask=mask, labels=bad_labels(ids))


@pytest.mark.parametrize("packed", [False, True])
def test_position_ids_past_the_table_are_refused_naming_them(packed):
    ours = ours_from_hf(hf_bert(seed=14))
    ids = random_input_ids(VOCAB, (1, 6))
    positions = torch.arange(36, 42).unsqueeze(0)  # the table has 40 rows
    extra = dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)) if packed else {}
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 40\)"):
        ours(ids, position_ids=positions, **extra)


def test_question_answering_loss_matches_hf_with_positions_outside_the_window():
    """HF clamps a position outside the row to S and ignores it; a padded batch is scored over every position."""
    hf = hf_bert("BertForQuestionAnswering", seed=15)
    ours = ours_from_hf(hf)
    ids, mask, types = padded_batch(15)
    starts, ends = torch.tensor([[2], [40], [7]]), torch.tensor([5, 9, -3])  # (B, 1) as HF takes too
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, start_positions=starts, end_positions=ends)
        out = ours(ids, attention_mask=mask, token_type_ids=types, start_positions=starts, end_positions=ends)
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5)
    assert max_rel_err(out.start_logits, ref.start_logits) < 1e-5 and max_rel_err(out.end_logits, ref.end_logits) < 1e-5
    assert out[1] is out.start_logits and out[2] is out.end_logits  # HF's order: loss, start, end
    with pytest.raises(ValueError, match="start_positions must be integer token indices"):
        ours(ids, start_positions=starts.float(), end_positions=ends)


def test_question_answering_head_on_a_base_checkpoint_saves_for_transformers(tmp_path):
    """From a sequence classifier's checkpoint (3 labels): the QA head takes its two, as HF's does."""
    source = hf_bert("BertForSequenceClassification", seed=16)
    source.save_pretrained(tmp_path / "cls")
    qa = BertForQuestionAnswering.from_pretrained(tmp_path / "cls")
    assert qa.config.num_labels == 2 and qa.bert.pooler is None
    qa.save_pretrained(tmp_path / "qa")
    reread = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "qa").eval()
    ids, mask, types = padded_batch(16)
    with torch.no_grad():
        inputs = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out, ref = qa.eval()(**inputs), reread(**inputs)
    real = mask.bool()
    assert max_rel_err(out.end_logits[real], ref.end_logits[real]) < 1e-5


def test_head_from_pretrained_takes_hf_label_arguments(tmp_path):
    """AutoModelForSequenceClassification.from_pretrained(path, id2label=..., problem_type=...), as in HF; the
    names and the loss survive save_pretrained, and transformers reads them back."""
    hf_bert("BertModel", seed=17).save_pretrained(tmp_path / "base")
    Head = BertForSequenceClassification
    names = {0: "neg", 1: "neutral", 2: "pos", 3: "mixed"}
    model = Head.from_pretrained(tmp_path / "base", id2label=names, label2id={v: k for k, v in names.items()},
                                 problem_type="multi_label_classification")
    assert model.config.num_labels == 4 and model.config.problem_type == "multi_label_classification"
    ids, mask, _ = padded_batch(17)
    targets = (torch.rand(3, 4) < 0.5).float()
    expected = F.binary_cross_entropy_with_logits(model(ids, attention_mask=mask).logits, targets)
    assert torch.allclose(model(ids, attention_mask=mask, labels=targets).loss, expected)
    model.save_pretrained(tmp_path / "cls")
    reread = transformers.AutoConfig.from_pretrained(tmp_path / "cls")
    assert reread.id2label == names and reread.problem_type == "multi_label_classification"
    same = Head.from_pretrained(tmp_path / "cls", label2id={"a": 0, "b": 1, "c": 2, "d": 3})  # same count: renamed only
    assert same.config.typed.labels == ("a", "b", "c", "d")
    assert torch.equal(same.classifier.weight, model.classifier.weight)
    with pytest.raises(ValueError, match="num_labels=2 but 4 labels"):
        Head.from_pretrained(tmp_path / "cls", num_labels=2, id2label=names)


@pytest.mark.parametrize("tied", [True, False])
def test_resize_token_embeddings_of_a_masked_lm_keeps_old_tokens_and_saves_for_transformers(tied, tmp_path):
    """HF's method: old ids' logits unchanged, new ids' rows at the old mean, the MLM bias grown with zeros (an
    untied decoder grown as the table); transformers reads the saved model with the same logits."""
    ours = ours_from_hf(hf_bert("BertForMaskedLM", seed=18, tie_word_embeddings=tied))
    ids, mask, types = padded_batch(18)
    with torch.no_grad():
        before = ours(ids, attention_mask=mask, token_type_ids=types).logits
    table = ours.resize_token_embeddings(VOCAB + 20)
    assert table.weight.shape[0] == VOCAB + 20 and ours.config.vocab_size == VOCAB + 20
    assert torch.allclose(table.weight[VOCAB + 7], table.weight[:VOCAB].mean(0))
    new_ids = torch.cat([ids, torch.full((3, 2), VOCAB + 19)], dim=1)
    new_mask = torch.cat([mask, torch.ones(3, 2, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        after = ours(ids, attention_mask=mask, token_type_ids=types).logits
        grown = ours(new_ids, attention_mask=new_mask).logits
    real = mask.bool()
    assert after.shape[-1] == VOCAB + 20 and torch.equal(after[..., :VOCAB][real], before[real])
    ours.save_pretrained(tmp_path)
    reread = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = reread(new_ids, attention_mask=new_mask).logits
    assert max_rel_err(grown[new_mask.bool()], ref[new_mask.bool()]) < 1e-5


def test_resize_token_embeddings_of_a_classifier_grows_the_encoder():
    ours = ours_from_hf(hf_bert("BertForTokenClassification", seed=19))
    ours.resize_token_embeddings(VOCAB + 1, pad_to_multiple_of=32)
    assert ours.config.vocab_size == ours.bert.config.vocab_size == 160
    ids = torch.tensor([[3, 159, 5]])
    assert ours(ids).logits.shape == (1, 3, 3)
    with pytest.raises(ValueError, match="input_ids must lie in \\[0, 160\\)"):
        ours(ids + 1)
