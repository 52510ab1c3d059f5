import pytest
from pydantic import Field

from rlalign.config import Config, ConfigError, load_config, parse_overrides


class Optim(Config):
    lr: float = Field(1e-3, gt=0, description="learning rate")
    betas: tuple[float, float] = (0.9, 0.999)


class Recipe(Config):
    seed: int = 0
    group_size: int = Field(8, ge=2, description="completions per prompt")
    optim: Optim = Optim()


def test_yaml_then_dotted_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("seed: 3\noptim:\n  lr: 0.01\n")
    cfg = load_config(Recipe, path, ["optim.lr=1e-4", "group_size=4"])
    assert cfg.seed == 3 and cfg.optim.lr == 1e-4 and cfg.group_size == 4


def test_parse_overrides_types():
    assert parse_overrides(["a.b=1", "c=x", "d=true", "e=[1, 2]"]) == {"a": {"b": 1}, "c": "x", "d": True, "e": [1, 2]}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["novalue"])


def test_typo_names_the_key_a_suggestion_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        load_config(Recipe, None, ["optim.lrr=0.1"])
    message = str(err.value)
    assert "'optim.lrr'" in message and "Did you mean 'lr'" in message and "betas, lr" in message


def test_out_of_range_value_names_key_value_and_bound():
    with pytest.raises(ConfigError) as err:
        load_config(Recipe, None, ["group_size=1"])
    assert "group_size = 1" in str(err.value) and "greater than or equal to 2" in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Recipe, tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Recipe, bad)


def test_adam_betas_and_the_tiny_models_heads_are_checked_with_the_config():
    # both surfaced mid-start as tracebacks from torch and transformers (after the tiny model's directory was made)
    from rlalign.train.reward_model import RMConfig

    with pytest.raises(ConfigError, match=r"optim.betas.1 = 1.5: Input should be less than 1"):
        load_config(RMConfig, None, ["optim.betas=[0.9, 1.5]"])
    with pytest.raises(ConfigError, match=r"hidden_size=30 must be divisible by num_heads=4"):
        load_config(RMConfig, None, ["model.tiny.hidden_size=30"])
    assert load_config(RMConfig, None, ["optim.betas=[0.0, 0.999]", "model.tiny.hidden_size=32"]).optim.betas == (0.0, 0.999)
