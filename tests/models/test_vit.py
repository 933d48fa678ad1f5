import pytest
import torch
import transformers
from timm.models.vision_transformer import VisionTransformer as TimmViT

import flash_models as fm
from flash_models.testing import (
    assert_checkpoint_file_loads, assert_meta_keys_match_hf, assert_round_trip_bit_identical,
    assert_saved_model_read_by_transformers, low_precision_bound_ok, max_rel_err, ours_from_hf, random_hf_model,
    randomize_,
)

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=1.75, num_classes=7)
TIMM_OPTIONS = {
    "cls_token_pool": dict(),
    "avg_pool_fc_norm_no_qkv_bias": dict(global_pool="avg", class_token=False, qkv_bias=False),
    "registers_no_embed_class_pre_norm": dict(reg_tokens=2, no_embed_class=True, pre_norm=True, global_pool="avg", fc_norm=False),
    "max_pool_token_head_less": dict(global_pool="max", num_classes=0),
    "avgmax_no_final_norm": dict(global_pool="avgmax", final_norm=False),
}


def timm_vit(seed=0, **options):
    torch.manual_seed(seed)
    return randomize_(TimmViT(**{**TINY, **options}), seed=seed).eval()


def images(batch=2, seed=0):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", TIMM_OPTIONS)
def test_from_timm_matches_timm_fp32(name, attn_impl):
    source = timm_vit(seed=1, **TIMM_OPTIONS[name])
    ours = fm.from_timm(source, attn_impl=attn_impl)
    x = images(seed=1)
    with torch.no_grad():
        ref, out = source(x), ours(x)
    got = out.logits if out.logits is not None else out.pooler_output
    assert got.shape == ref.shape
    assert max_rel_err(got, ref) < 1e-5
    with torch.no_grad():
        features = source.forward_features(x)
    assert max_rel_err(out.last_hidden_state, features) < 1e-5


def test_from_timm_by_name_builds_the_registered_model():
    ours = fm.from_timm("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=5)
    c = ours.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.patch_size, c.image_size, c.num_classes) == (192, 12, 3, 16, 32, 5)
    assert ours(images(1)).logits.shape == (1, 5)


def test_bf16_error_bounded_by_timm_own_bf16_error():
    source = timm_vit(seed=2)
    source16 = timm_vit(seed=2).to(torch.bfloat16)
    ours16 = fm.from_timm(source, dtype=torch.bfloat16)
    x = images(4, seed=2)
    with torch.no_grad():
        ok, ours_err, timm_err = low_precision_bound_ok(ours16(x).logits.float(), source16(x.bfloat16()).float(), source(x))
    assert ok, f"ours bf16 error {ours_err:.3g} vs timm's own bf16 error {timm_err:.3g}"


def test_our_kernels_stay_within_timm_bf16_error():
    """attn_impl='flash' and kernel_backend='triton' (on a CPU through Triton's interpreter)."""
    source = timm_vit(seed=9, num_heads=2)  # head dim 32 for the kernels
    source16 = timm_vit(seed=9, num_heads=2).to(torch.bfloat16)
    ours = fm.from_timm(source, attn_impl="flash", kernel_backend="triton", dtype=torch.bfloat16)
    x = images(2, seed=9)
    with torch.no_grad():
        ok, ours_err, timm_err = low_precision_bound_ok(ours(x).logits.float(), source16(x.bfloat16()).float(), source(x))
    assert ok, f"ours bf16 error {ours_err:.3g} vs timm's own bf16 error {timm_err:.3g}"


def test_training_step_matches_timm_gradients():
    source = timm_vit(seed=3, global_pool="avg", class_token=False).train()
    ours = fm.from_timm(source).train()  # no dropout anywhere: both training steps are deterministic
    x, labels = images(3, seed=3), torch.tensor([0, 6, 2])
    torch.nn.functional.cross_entropy(source(x), labels).backward()
    ours(x, labels=labels).loss.backward()
    assert max_rel_err(ours.blocks[1].attn.qkv.weight.grad, source.blocks[1].attn.qkv.weight.grad) < 1e-4
    assert max_rel_err(ours.patch_embed.weight.grad, source.patch_embed.proj.weight.grad) < 1e-4


@pytest.mark.parametrize("options, match", [
    (dict(init_values=1e-5), "LayerScale"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(global_pool="map"), "attention pooling"),
    (dict(drop_path_rate=0.1), "stochastic depth"),
])
def test_unsupported_timm_options_raise(options, match):
    with pytest.raises(ValueError, match=match):
        fm.from_timm(TimmViT(**{**TINY, **options}))


# ---- HF ViT ----------------------------------------------------------------------------------------------
def vit_config(architecture="ViTForImageClassification", **overrides):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=112, image_size=32,
                patch_size=8, num_labels=5, layer_norm_eps=1e-6, architectures=[architecture])
    return transformers.ViTConfig(**{**base, **overrides})


AUTO = {"ViTForImageClassification": "AutoModelForImageClassification", "ViTModel": "AutoModel"}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("architecture", AUTO)
def test_hf_vit_matches_fp32(architecture, attn_impl):
    hf = random_hf_model(vit_config(architecture, qkv_bias=architecture == "ViTModel"), seed=4, auto_class=AUTO[architecture])
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    x = images(seed=4)
    with torch.no_grad():
        ref, out = hf(pixel_values=x), ours(x)
    if architecture == "ViTModel":
        assert max_rel_err(out.pooler_output, ref.pooler_output) < 1e-5
        assert max_rel_err(out.last_hidden_state, ref.last_hidden_state) < 1e-5
    else:
        assert max_rel_err(out.logits, ref.logits) < 1e-5


@pytest.mark.parametrize("overrides, make_labels", [
    (dict(), lambda batch: torch.randint(0, 5, (batch,))),
    (dict(num_labels=1), lambda batch: torch.randn(batch)),
    (dict(problem_type="regression"), lambda batch: torch.randn(batch, 5)),
    (dict(), lambda batch: (torch.rand(batch, 5) < 0.5).float()),  # float labels: multi-label
    (dict(problem_type="multi_label_classification"), lambda batch: (torch.rand(batch, 5) < 0.5).float()),
], ids=["single_label", "regression", "regression_5_targets", "multi_label_inferred", "multi_label"])
def test_hf_vit_loss_follows_problem_type_as_hf(overrides, make_labels, tmp_path):
    """HF's image classifier picks its loss from problem_type (or the labels), as BERT's heads do; the config's
    choice survives save_pretrained (HF's forward also writes the inferred one into its config: we don't)."""
    hf = random_hf_model(vit_config(**overrides), seed=9, auto_class="AutoModelForImageClassification")
    ours = ours_from_hf(hf)
    x, labels = images(3, seed=9), make_labels(3)
    with torch.no_grad():
        assert torch.allclose(ours(x, labels=labels).loss, hf(pixel_values=x, labels=labels).loss, rtol=1e-5)
    ours.save_pretrained(tmp_path)
    assert fm.from_pretrained(tmp_path).config.problem_type == overrides.get("problem_type")


@pytest.mark.parametrize("architecture", AUTO)
def test_hf_round_trip_bit_identical_and_meta_keys_match(architecture):
    assert_round_trip_bit_identical(random_hf_model(vit_config(architecture), seed=5, auto_class=AUTO[architecture]))
    assert_meta_keys_match_hf(vit_config(architecture), auto_class=AUTO[architecture])


def test_transformers4_checkpoint_names_load(tmp_path):
    """Hub ViT checkpoints predate transformers 5: encoder.layer.N.attention.attention.query ... names."""
    hf = random_hf_model(vit_config(), seed=6, auto_class="AutoModelForImageClassification")
    renames = {"attention.q_proj": "attention.attention.query", "attention.k_proj": "attention.attention.key",
               "attention.v_proj": "attention.attention.value", "attention.o_proj": "attention.output.dense",
               "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
    state = {}
    for key, value in hf.state_dict().items():
        key = key.replace("vit.layers.", "vit.encoder.layer.")
        for new, old in renames.items():
            key = key.replace(new, old)
        state[key] = value
    assert any("attention.attention.query" in k for k in state)
    assert_checkpoint_file_loads(hf, state, tmp_path, dict(pixel_values=images(seed=6)), tol=1e-5)


@pytest.mark.parametrize("architecture", AUTO)
def test_save_pretrained_is_read_by_transformers_with_same_outputs(architecture, tmp_path):
    hf = random_hf_model(vit_config(architecture), seed=7, auto_class=AUTO[architecture])
    assert type(hf).__name__ == architecture  # and the helper checks transformers reads back the same class
    output = "last_hidden_state" if architecture == "ViTModel" else "logits"
    assert_saved_model_read_by_transformers(hf, tmp_path, dict(pixel_values=images(seed=7)),
                                            auto_class=AUTO[architecture], output=output, tol=1e-6)


def test_timm_model_in_hf_shape_saves_for_transformers_and_timm_only_options_refuse(tmp_path):
    source = timm_vit(seed=8)
    ours = fm.from_timm(source)
    ours.save_pretrained(tmp_path)
    reread = transformers.AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    x = images(seed=8)
    with torch.no_grad():
        assert max_rel_err(reread(pixel_values=x).logits, source(x)) < 1e-5
    with pytest.raises(ValueError, match="no HF ViT layout"):
        fm.from_timm(timm_vit(seed=8, global_pool="avg")).save_pretrained(tmp_path / "avg")


@pytest.mark.parametrize("patch_bias", [True, False])
def test_patch_embedding_gemm_equals_the_conv(patch_bias):
    """The patch embedding runs as a GEMM over flattened patches: the Conv2d's outputs and gradients, seen through
    the whole model against timm's, which runs the Conv2d."""
    source = timm_vit(seed=0, **({} if patch_bias else {"pre_norm": True}))
    model = fm.from_timm(source)
    x = images(batch=3).requires_grad_()
    ours, want = model(x).last_hidden_state, source.forward_features(x)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ours)
    params = [p for p in (model.patch_embed.weight, model.patch_embed.bias) if p is not None]
    conv = source.patch_embed.proj
    assert len(params) == (2 if patch_bias else 1) and (conv.bias is not None) == patch_bias
    got = torch.autograd.grad(ours, (x, *params), g)
    expected = torch.autograd.grad(want, (x, conv.weight, *([conv.bias] if patch_bias else [])), g)
    for got_grad, exp in zip(got, expected, strict=True):
        torch.testing.assert_close(got_grad, exp, rtol=1e-5, atol=1e-4)


def test_image_size_not_a_multiple_of_the_patch_size_leaves_out_the_remainder_as_hf(tmp_path):
    """HF's (and timm's) strided patch convolution takes the whole 7-px patches of a 32-px image, a 4 x 4 grid,
    and never reads the last 4 rows and columns: ours likewise, with HF's outputs, and it saves for HF."""
    hf = random_hf_model(vit_config("ViTModel", patch_size=7), seed=10, auto_class="AutoModel")
    ours = ours_from_hf(hf)
    assert ours.config.num_patches == 16
    x = images(seed=10)
    with torch.no_grad():
        ref, out = hf(pixel_values=x), ours(x)
    assert max_rel_err(out.last_hidden_state, ref.last_hidden_state) < 1e-5
    assert max_rel_err(out.pooler_output, ref.pooler_output) < 1e-5
    assert_saved_model_read_by_transformers(hf, tmp_path, dict(pixel_values=x), auto_class="AutoModel",
                                            output="last_hidden_state")


@pytest.mark.parametrize("overrides, match", [
    (dict(pooler_act="relu"), "pooler_act='relu'"),
    (dict(pooler_output_size=32), "pooler_output_size=32"),
])
def test_unsupported_hf_pooler_is_refused_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        fm.checkpoint.build_model(vit_config("ViTModel", **overrides))


@pytest.mark.parametrize("size", [(48, 40), (24, 24), (16, 56), (33, 33)], ids=str)
def test_other_image_sizes_with_interpolated_positions_match_hf(size):
    """HF's interpolate_pos_encoding=True: the position table resized to the image's grid of whole patches
    (non-square too); an image with the config's grid (33 px: 4 x 4 patches of 8) keeps the table as is."""
    hf = random_hf_model(vit_config("ViTForImageClassification"), seed=11, auto_class=AUTO["ViTForImageClassification"])
    ours = ours_from_hf(hf)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref, out = hf(pixel_values=x, interpolate_pos_encoding=True), ours(x, interpolate_pos_encoding=True)
    assert max_rel_err(out.logits, ref.logits) < 1e-5


def test_another_image_size_without_interpolation_is_refused_naming_the_argument():
    ours = ours_from_hf(random_hf_model(vit_config("ViTModel"), seed=12, auto_class="AutoModel"))
    with pytest.raises(ValueError, match=r"got \(1, 3, 48, 48\).*interpolate_pos_encoding=True"):
        ours(torch.randn(1, 3, 48, 48))
    with pytest.raises(ValueError, match=r"at least one 8-pixel patch"):
        ours(torch.randn(1, 3, 4, 32), interpolate_pos_encoding=True)


@pytest.mark.parametrize("shape", [(3, 32, 32), (2, 32, 32, 3), (2, 1, 32, 32)],
                         ids=["unbatched", "channels_last", "gray"])
def test_images_not_channels_first_batches_are_refused_naming_the_layout(shape):
    """Not a size problem: the message names the (B, C, H, W) layout, not interpolate_pos_encoding."""
    ours = fm.from_timm(timm_vit(seed=15))
    with pytest.raises(ValueError, match=r"channels-first images \(B, 3, H, W\)") as error:
        ours(torch.randn(shape))
    assert "interpolate_pos_encoding" not in str(error.value)


def test_hf_call_flags_are_taken_or_refused_as_bert_does():
    ours = fm.from_timm(timm_vit(seed=16))
    x = images(seed=16)
    with torch.no_grad():
        assert torch.equal(ours(x, output_hidden_states=None, return_dict=True).logits, ours(x).logits)
    with pytest.raises(ValueError, match="output_hidden_states=True is not supported"):
        ours(x, output_hidden_states=True)


@pytest.mark.parametrize("hf_head", [True, False], ids=["hf", "timm"])
def test_class_ids_outside_the_classes_are_refused_and_int32_ids_taken(hf_head):
    if hf_head:
        hf = random_hf_model(vit_config(), seed=17, auto_class="AutoModelForImageClassification")
        ours, classes = ours_from_hf(hf), 5
    else:
        ours, classes = fm.from_timm(timm_vit(seed=17)), TINY["num_classes"]
    x, labels = images(seed=17), torch.tensor([classes - 1, 0])
    with torch.no_grad():
        assert torch.equal(ours(x, labels=labels.int()).loss, ours(x, labels=labels).loss)
    with pytest.raises(ValueError, match=rf"labels must be class ids in \[0, {classes}\)"):
        ours(x, labels=torch.tensor([classes, 0]))


@pytest.mark.parametrize("name", ["cls_token_pool", "max_pool_token_head_less"])
def test_from_pretrained_reads_a_timm_folder(name, tmp_path):
    """timm's own Hub layout (save_for_hf: config.json with architecture and model_args, model.safetensors)."""
    import timm
    from timm.models import save_for_hf

    options = {**TINY, **TIMM_OPTIONS[name]}
    source = randomize_(timm.create_model("vit_base_patch16_224", pretrained=False, **options), seed=18).eval()
    save_for_hf(source, tmp_path, model_args=options, safe_serialization=True)
    ours = fm.from_pretrained(tmp_path, attn_impl="eager")
    assert type(ours).__name__ == "VisionTransformer" and not ours.training
    x = images(seed=18)
    with torch.no_grad():
        out, ref = ours(x), source(x)
    assert max_rel_err(out.logits if out.logits is not None else out.pooler_output, ref) < 1e-5
    assert fm.from_pretrained(tmp_path, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"timm checkpoint .*\['num_labels'\] are transformers config arguments"):
        fm.from_pretrained(tmp_path, num_labels=3)
