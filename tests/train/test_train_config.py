from pathlib import Path

import pytest

from flash_models.train import ConfigError, load_config
from flash_models.train.build import check_overrides

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_unknown_key_is_named_with_its_section_and_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.max_step'.*did you mean 'train\.max_steps'"):
        load_config({"train": {"max_step": 10}})


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="unknown config key 'trainer'"):
        load_config({"trainer": {}})


@pytest.mark.parametrize("section,key,value,expected", [
    ("train", "max_steps", "ten", "train.max_steps='ten' has type str, expected int"),
    ("train", "max_steps", 1.5, "expected int"),
    ("train", "max_steps", "1e3", "train.max_steps='1e3' has type str, expected int (YAML reads 1e3 as a string"),
    ("train", "compile", "yes", "train.compile='yes' has type str, expected bool"),
    ("optim", "lr", "fast", "optim.lr='fast' has type str, expected float"),
    ("optim", "betas", [0.9], "optim.betas"),
    ("model", "overrides", [1, 2], "model.overrides"),
])
def test_wrong_type_is_named(section, key, value, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        load_config({section: {key: value}})


def test_bad_choice_and_range_are_named():
    with pytest.raises(ConfigError, match=r"train\.precision='fp8'"):
        load_config({"train": {"precision": "fp8"}})
    with pytest.raises(ConfigError, match=r"train\.ema_decay"):
        load_config({"train": {"ema_decay": 1.5}})


def test_overrides_are_parsed_as_yaml_and_validated():
    cfg = load_config({"data": {"format": "synthetic"}},
                      ["train.max_steps=7", "optim.lr=1e-4", "optim.betas=[0.8, 0.9]", "model.overrides={n_layer: 2}",
                       "train.resume=null"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-4 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.model.overrides == {"n_layer": 2} and cfg.train.resume is None
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.learning_rate'"):
        load_config({}, ["optim.learning_rate=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config({}, ["max_steps"])


def test_int_is_accepted_for_float_but_not_bool_for_int():
    assert load_config({"optim": {"lr": 1}}).optim.lr == 1.0
    with pytest.raises(ConfigError, match="expected int"):
        load_config({"train": {"max_steps": True}})


def test_yaml_base_inheritance(tmp_path):
    (tmp_path / "base.yaml").write_text("train:\n  max_steps: 5\n  seed: 3\ndata:\n  format: synthetic\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain:\n  max_steps: 9\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.train.max_steps, cfg.train.seed) == (9, 3)


def test_a_base_that_leads_back_or_is_no_path_is_named(tmp_path):
    """A cycle recursed until Python gave up (RecursionError); a list failed on Path / list (TypeError)."""
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: ./a.yaml\n")
    with pytest.raises(ConfigError, match=r"base './a.yaml' leads back to itself \(a.yaml -> b.yaml\)"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="must be the path of one YAML file"):
        load_config(tmp_path / "c.yaml")


def test_presets_exist():
    names = {p.stem for p in CONFIGS}
    assert {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "smollm2-sft", "minilm-classification",
            "vit-finetune"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_preset_validates(path):
    cfg = load_config(path)
    assert cfg.train.max_steps > 0
    if not cfg.model.pretrained:  # a registered preset, with overrides its HF config knows
        check_overrides(cfg.model.name, cfg.model.overrides)


def test_model_override_typo_is_named():
    with pytest.raises(ValueError, match="model.overrides.n_layers is not a field of GPT2Config; did you mean 'n_layer'"):
        check_overrides("gpt2", {"n_layers": 2})


def test_yaml_mistakes_are_named_with_their_line(tmp_path):
    """A key given twice kept the last silently; a syntax error came out as PyYAML's multi-line traceback."""
    (tmp_path / "twice.yaml").write_text("train:\n  max_steps: 3\ndata:\n  format: synthetic\ntrain:\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:5: key 'train' is given twice"):
        load_config(tmp_path / "twice.yaml")
    (tmp_path / "broken.yaml").write_text("train:\n  max_steps: [3\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:3:1: not valid YAML \(while parsing a flow sequence"):
        load_config(tmp_path / "broken.yaml")
    with pytest.raises(ConfigError, match=r"override 'train.max_steps=\[3': the value is not valid YAML"):
        load_config({}, ["train.max_steps=[3"])
