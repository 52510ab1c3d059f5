"""configs/recipes/: every recipe loads with the config class of the command its header names, runs two
steps of that command through the real CLI on a tiny model (sizes shrunk, nothing else), keeps the
settings that make it its paper's algorithm in the config the run records, logs the metrics those
settings produce, and has a row in the README's Recipes table.

Tiny Llama (hidden 32, 2 layers, character tokenizer), one torch thread; about 10 s in all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from rlalign.cli import main
from rlalign.config import load_config
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import distill, grpo

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
CONFIG_CLASSES = {"grpo": grpo.GRPOConfig, "distill": distill.DistillConfig}
SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)

# What makes each recipe its paper's algorithm, as the file sets it (sizes, rates and lengths are left
# out: the test shrinks group_size and prompts_per_step, and those are scaled in the files anyway).
DISTINCTIVE = {
    "r1_zero_grpo": {"advantage": "group", "beta": 0.001, "kl_estimator": "k3", "kl_in": "loss", "eps_low": 0.999, "eps_high": 10.0,
                     "num_minibatches": 16, "mu": 1, "aggregation": "seq-mean-token-mean", "sampling.temperature": 1.0},
    "dr_grpo": {"advantage": "none", "aggregation": "seq-mean-token-sum-norm", "beta": 0.0, "eps_low": 0.2, "eps_high": 0.2, "mu": 1},
    "dapo": {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token-mean", "dynamic_sampling": True, "overlong_buffer": 2,
             "overlong_penalty": 1.0, "sampling.max_new_tokens": 10, "mask_truncated": True, "beta": 0.0, "num_minibatches": 16},
    "gspo": {"importance_sampling": "sequence", "eps_low": 3e-4, "eps_high": 4e-4, "num_minibatches": 4, "advantage": "group", "beta": 0.0},
    "cispo": {"loss_type": "cispo", "cispo_eps_low": None, "cispo_eps_high": 4.0, "aggregation": "token-mean", "advantage": "group", "beta": 0.0},
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "advantage": "group", "beta": 0.0},
    "reinforce_plus_plus": {"advantage": "reinforce_plus_plus", "kl_in": "reward", "kl_estimator": "k1", "beta": 0.01, "eps_low": 0.2},
    "reinforce_plus_plus_baseline": {"advantage": "reinforce_plus_plus_baseline", "kl_in": "loss", "kl_estimator": "k2", "beta": 1e-5},
    "on_policy_distillation": {"objective": "reverse_kl", "lmbda": 1.0, "sampling.temperature": 1.0},
}

# Metrics that only those settings produce: a recipe whose option were dropped on the way to the
# trainer would not log them.
EXPECTED_METRICS = {
    "r1_zero_grpo": ["reward/arithmetic/mean", "reward/format/mean"],
    "dapo": ["dynamic/draws", "dynamic/tied_groups", "reward/overlong/mean", "clip_frac/high"],
    "sapo": ["sapo/gate_mean"],
    "reinforce_plus_plus": ["reward/kl_penalty/mean"],
    "on_policy_distillation": ["kl/reverse", "loss/distill"],
}


def command_of(recipe: Path) -> str:
    """The command the recipe's header tells users to run it with: 'rlalign grpo --config configs/recipes/X.yaml'."""
    match = re.search(rf"^#\s+rlalign (\w+) +--config configs/recipes/{re.escape(recipe.name)}", recipe.read_text(), re.MULTILINE)
    assert match, f"{recipe.name}: the header names no 'rlalign COMMAND --config configs/recipes/{recipe.name}' line"
    return match.group(1)


def field(config: dict, dotted: str):
    for key in dotted.split("."):
        config = config[key]
    return config


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("student"), SPEC, seed=0)


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """Another tiny model of the same tokenizer, for the distillation recipe's teacher=."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("teacher"), SPEC, seed=1)


def test_every_recipe_is_pinned_and_documented():
    assert len(RECIPES) >= 9, RECIPES
    assert {r.stem for r in RECIPES} == set(DISTINCTIVE), "a recipe without its distinctive fields listed here, or a listed recipe gone"
    for recipe in RECIPES:
        header = recipe.read_text().split("\noutput_dir:")[0]
        assert re.search(r"arXiv:\d{4}\.\d{4,5}", header), f"{recipe.name}: the header cites no arXiv paper"
        assert "Scaled to the embedded task" in header, f"{recipe.name}: the header does not say what was scaled"
        assert command_of(recipe) in CONFIG_CLASSES


def test_readme_recipes_table_lists_every_recipe():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### Recipes\n", 1)
    assert len(section) == 2, "README.md has no '### Recipes' section"
    body = section[1].split("\n#", 1)[0]  # up to the next heading
    rows = [line for line in body.splitlines() if line.startswith("| [")]
    listed = {m.group(1) for line in rows for m in [re.search(r"\(configs/recipes/(\w+)\.yaml\)", line)] if m}
    assert listed == {r.stem for r in RECIPES}
    assert len(rows) == len(RECIPES)  # one row each


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_runs_two_steps_with_its_settings(recipe, tiny_path, teacher_path, tmp_path, capsys):
    command = command_of(recipe)
    written = load_config(CONFIG_CLASSES[command], recipe)  # loads as the file is, with the default paths
    out = tmp_path / "run"
    overrides = [f"model.path={tiny_path}", f"output_dir={out}", "steps=2", "data.num_prompts=64", "eval.num_prompts=4",
                 "progress=false", "plots=false"]
    if command == "grpo":  # shrink the rollout, keep the minibatch count: rows = 2 * prompts stays divisible by it
        overrides += ["group_size=2", f"prompts_per_step={max(2, written.num_minibatches)}"]
    else:
        overrides += [f"teacher={teacher_path}", "prompts_per_step=4"]
    assert main([command, "--config", str(recipe), *overrides]) == 0
    assert '"steps_run": 2' in capsys.readouterr().out

    used = yaml.safe_load((out / "checkpoints" / "step_00000002" / "config.yaml").read_text())  # the config the run recorded
    for name, value in DISTINCTIVE[recipe.stem].items():
        assert field(used, name) == value, f"{recipe.stem}: {name} = {field(used, name)!r}, the recipe's {value!r}"
        assert field(written.model_dump(mode="json"), name) == value

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] >= 0]
    assert len(steps) == 2
    for name in EXPECTED_METRICS.get(recipe.stem, []):
        assert all(name in s for s in steps), f"{recipe.stem}: {name} not logged"
    if command == "grpo":  # a KL coefficient of 0 loads no reference and logs no KL
        assert all(("kl" in s) == (written.beta > 0) for s in steps)
