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


class Term(Config):
    function: str = "length"
    weight: float = 1.0


class Aliased(Config):
    cls: str = Field("x", alias="class")


class Sections(Config):
    terms: list[Term] = []
    aliased: Aliased | None = None
    named: dict[str, Term] = {}
    maybe: Optim | None = None


@pytest.mark.parametrize("override, where", [
    ("terms=[{functon: arithmetic}]", "terms.0.functon"),  # an item of a list of sections
    ("named={a: {wieght: 2}}", "named.a.wieght"),  # a value of a mapping of sections
    ("maybe={lrr: 0.1}", "maybe.lrr"),  # an optional section
    ("aliased={clas: y}", "aliased.clas"),  # a field under its alias, as a config writes it
])
def test_a_typo_inside_a_list_mapping_or_optional_section_lists_that_sections_keys(override, where):
    with pytest.raises(ConfigError) as err:
        load_config(Sections, None, [override])
    message = str(err.value)
    allowed = {"maybe": "betas, lr", "aliased": "class"}.get(where.split(".")[0], "function, weight")
    assert f"unknown key {where!r}" in message and f"Allowed here: {allowed}" in message and "Did you mean" in message


def test_a_yaml_key_with_no_space_after_its_colon_is_explained():
    # {function:arithmetic} is YAML for the key "function:arithmetic" with no value
    with pytest.raises(ConfigError) as err:
        load_config(Sections, None, ["terms=[{function:arithmetic}]"])
    assert "'function: arithmetic' (YAML needs a space after the colon)" in str(err.value)


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


class Numbers(Config):
    steps: int = 1
    limit: int | None = None
    scale: float = 1.0
    weights: dict[str, float] = {}
    flag: bool = False
    choice: bool | int = 0


def test_a_boolean_for_a_number_is_an_error_and_numbers_still_parse(tmp_path):
    # pydantic's lax mode took `steps: true` as 1 and `scale: false` as 0.0, silently
    for override in ("steps=true", "limit=false", "scale=true", "weights={a: true}", "optim.betas=[true, 0.9]"):
        cls = Recipe if override.startswith("optim") else Numbers
        with pytest.raises(ConfigError, match=r"= (True|False|\[True, 0.9\]|\{'a': True\}): a boolean where a number goes"):
            load_config(cls, None, [override])
    path = tmp_path / "r.yaml"
    path.write_text("steps: true\n")
    with pytest.raises(ConfigError, match=rf"\({path}\):\n  steps = True: a boolean where a number goes"):
        load_config(Numbers, path)
    cfg = load_config(Numbers, None, ["steps=4.0", "limit=3", "scale=2", "weights={a: 1}", "flag=true", "choice=true"])
    assert (cfg.steps, cfg.limit, cfg.scale, cfg.weights, cfg.flag, cfg.choice) == (4, 3, 2.0, {"a": 1.0}, True, True)
    assert type(cfg.steps) is int and type(cfg.scale) is float
    with pytest.raises(ConfigError, match="fractional part"):
        load_config(Numbers, None, ["steps=4.5"])
    with pytest.raises(ValueError, match="a boolean where a number goes"):
        cfg.steps = True  # assignments are validated too


def test_a_key_given_twice_is_an_error_naming_the_key_and_its_lines(tmp_path):
    # YAML keeps the last of two equal keys silently: max_steps 2 then 3 ran 3 steps
    path = tmp_path / "r.yaml"
    path.write_text("seed: 1\ngroup_size: 2\nseed: 3\n")
    with pytest.raises(ConfigError, match=rf"config file '{path}': key 'seed' is given twice \(on lines 1 and 3\); keep one"):
        load_config(Recipe, path)
    path.write_text("optim: {lr: 0.1, lr: 0.2}\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice \(on line 1\)"):
        load_config(Recipe, path)
    with pytest.raises(ConfigError, match=r"override value '\{a: 1, a: 2\}': key 'a' is given twice"):
        parse_overrides(["weights={a: 1, a: 2}"])
    path.write_text("base: &base {lr: 0.1, betas: [0.5, 0.5]}\noptim:\n  <<: *base\n  lr: 0.2\n")  # a merge, then a key of it overridden: fine
    from rlalign.config import read_yaml

    assert read_yaml(path)["optim"] == {"lr": 0.2, "betas": [0.5, 0.5]}


def test_config_files_that_are_not_utf8_or_are_directories_are_named(tmp_path):
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_bytes("seed: 1\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=rf"config file '{utf16}' is UTF-16 text; rlalign reads UTF-8: save it as UTF-8"):
        load_config(Recipe, utf16)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("seed: 1\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file '{latin1}' is not UTF-8 text: byte 0xe9 on line 2; save it as UTF-8"):
        load_config(Recipe, latin1)
    with pytest.raises(ConfigError, match=rf"config file '{tmp_path}' is a directory; give the YAML file inside it"):
        load_config(Recipe, tmp_path)
    bom = tmp_path / "bom.yaml"
    bom.write_bytes("seed: 2\n".encode("utf-8-sig"))  # UTF-8 with a byte-order mark: fine
    assert load_config(Recipe, bom).seed == 2
