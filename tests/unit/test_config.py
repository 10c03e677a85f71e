"""The config tree: precedence, strictness, types, cross-field checks, round trip."""

import pytest
import yaml

from ntil_ds.config import (
    Config,
    ConfigError,
    flatten,
    gradient_accumulation_steps,
    load_config,
    save_config,
)

MINIMAL = {"model": {"name_or_path": "some/model"}, "data": {"train_file": "train.jsonl"}}


def write(tmp_path, content, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(content))
    return path


def test_precedence_defaults_yaml_cli(tmp_path):
    recipe = write(tmp_path, {**MINIMAL, "optim": {"lr": 2e-5}, "train": {"max_steps": 7}})
    cfg = load_config(recipe, ["train.max_steps=9", "loss.name=ce"])
    assert cfg.optim.lr == 2e-5  # from YAML
    assert cfg.train.max_steps == 9  # CLI beats YAML
    assert cfg.loss.name == "ce"  # CLI beats default
    assert cfg.loss.ntil_lambda == Config().loss.ntil_lambda  # default kept


def test_float_spellings_from_cli_and_yaml(tmp_path):
    # YAML 1.1 reads "1e-5" as a string; the loader must still give a float.
    recipe = write(tmp_path, MINIMAL)
    recipe.write_text(recipe.read_text() + "optim:\n  lr: 1e-5\n")
    cfg = load_config(recipe, ["loss.ntil_lambda=1", "optim.eps=1e-6"])
    assert cfg.optim.lr == pytest.approx(1e-5)
    assert isinstance(cfg.loss.ntil_lambda, float) and cfg.loss.ntil_lambda == 1.0
    assert cfg.optim.eps == pytest.approx(1e-6)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'"),
        ("trian.max_steps=3", "unknown config key 'trian'; did you mean 'train'"),
        ("train.max_steps=ten", "train.max_steps='ten' must be an integer"),
        ("train.max_steps=true", "must be an integer"),
        ("model.gradient_checkpointing=yes please", "must be true or false"),
        ("loss.name=mse", "loss.name='mse' is not one of 'ntil', 'ce', 'emd'"),
        ("optim.lr=fast", "optim.lr='fast' must be a number"),
        ("train.max_steps", "must look like key=value"),
        ("model=3", "model must be a mapping"),
        ("train.max_steps=0", "train.max_steps=0 must be > 0"),
        ("optim.warmup_steps=500", "exceeds train.max_steps"),
        ("train.eval_every=5", "needs data.eval_file"),
    ],
)
def test_bad_overrides_name_the_key(tmp_path, override, fragment):
    recipe = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [override])
    assert fragment in str(err.value)


def test_unknown_key_in_yaml_is_an_error(tmp_path):
    recipe = write(tmp_path, {**MINIMAL, "loss": {"ntil_lamda": 0.5}})
    with pytest.raises(ConfigError, match="loss.ntil_lamda.*did you mean 'loss.ntil_lambda'"):
        load_config(recipe)


def test_required_fields_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="model.name_or_path is required"):
        load_config(write(tmp_path, {"data": {"train_file": "x.jsonl"}}))
    with pytest.raises(ConfigError, match="data.train_file is required"):
        load_config(write(tmp_path, {"model": {"name_or_path": "m"}}))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_gradient_accumulation_must_divide(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["train.global_batch_size=12", "train.micro_batch_size=2"])
    assert gradient_accumulation_steps(cfg, data_parallel_size=2) == 3
    assert gradient_accumulation_steps(cfg, data_parallel_size=6) == 1
    with pytest.raises(ConfigError, match=r"not divisible by train.micro_batch_size=2 x 4 .* = 8"):
        gradient_accumulation_steps(cfg, data_parallel_size=4)


def test_saved_config_loads_back_equal(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["loss.abs_alpha=0.5", "tracking.run_name=abc"])
    saved = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(saved) == cfg


def test_flatten_has_every_leaf_once(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    flat = flatten(cfg)
    assert flat["model.name_or_path"] == "some/model"
    assert flat["loss.ntil_lambda"] == 0.3
    assert "model" not in flat and all(not isinstance(v, dict) for v in flat.values())
