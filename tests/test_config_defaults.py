"""Every command's config contract, pinned: each field's dotted name, default and allowed range.

A default or a bound is behaviour (GRPO's beta 0.04, PPO's clip 0.2, a learning rate that must be
> 0), so changing one must be a deliberate, reviewed edit of ``tests/data/config_defaults.json``,
never a silent slip. After changing a field on purpose, regenerate the file with

    RLALIGN_UPDATE_CONFIG_SNAPSHOT=1 .venv/bin/python -m pytest tests/test_config_defaults.py

and read its diff. Descriptions are left out, so rewording a field's help changes nothing here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import annotated_types
import pytest
from pydantic import BaseModel

from rlalign.classic.dqn import DQNConfig
from rlalign.classic.ppo import PPOConfig as ClassicPPOConfig
from rlalign.classic.q_learning import QLearningConfig
from rlalign.classic.trpo import TRPOConfig
from rlalign.classic.value_iteration import ValueIterationConfig
from rlalign.classic.vpg import VPGConfig
from rlalign.config import ConfigError, load_config
from rlalign.demo import DemoConfig
from rlalign.train.distill import DistillConfig
from rlalign.train.dpo import DPOConfig
from rlalign.train.grpo import GRPOConfig
from rlalign.train.ppo import PPOConfig
from rlalign.train.reward_model import RMConfig
from rlalign.train.sft import SFTConfig

SNAPSHOT = Path(__file__).parent / "data" / "config_defaults.json"
COMMANDS = {
    "grpo": GRPOConfig, "ppo": PPOConfig, "distill": DistillConfig, "sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "demo": DemoConfig,
    "classic q_learning": QLearningConfig, "classic dqn": DQNConfig, "classic vpg": VPGConfig, "classic trpo": TRPOConfig,
    "classic ppo": ClassicPPOConfig, "classic value_iteration": ValueIterationConfig,
}
BOUNDS = {annotated_types.Gt: "gt", annotated_types.Ge: "ge", annotated_types.Lt: "lt", annotated_types.Le: "le"}


def _nested_config(annotation) -> type[BaseModel] | None:
    """The config class of a nested field (``ModelConfig``, ``ModelConfig | None``), else None."""
    candidates = getattr(annotation, "__args__", (annotation,))
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def contract(config_cls: type[BaseModel], prefix: str = "") -> dict[str, dict]:
    """{dotted field: {"default": ..., "bounds": {...}}} of ``config_cls`` and the config classes nested in it."""
    table: dict[str, dict] = {}
    for name, info in config_cls.model_fields.items():
        default = info.get_default(call_default_factory=True)
        bounds = {BOUNDS[type(m)]: getattr(m, BOUNDS[type(m)]) for m in info.metadata if type(m) in BOUNDS}
        dumped = default.model_dump(mode="json") if isinstance(default, BaseModel) else default
        if isinstance(dumped, list):
            dumped = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in dumped]
        table[prefix + name] = {"default": dumped, "bounds": bounds}
        nested = _nested_config(info.annotation)
        if nested is not None:
            table.update(contract(nested, prefix + name + "."))
    return table


def snapshot_text(table: dict[str, dict]) -> str:
    """JSON with one line per field, so a changed default is a one-line diff."""
    commands = []
    for command in sorted(table):
        fields = ",\n".join(f"  {json.dumps(key)}: {json.dumps(table[command][key], sort_keys=True)}" for key in sorted(table[command]))
        commands.append(f"{json.dumps(command)}: {{\n{fields}\n}}")
    return "{\n" + ",\n".join(commands) + "\n}\n"


def current() -> dict[str, dict]:
    return {command: contract(cls) for command, cls in COMMANDS.items()}


def test_defaults_and_bounds_match_the_snapshot():
    table = json.loads(json.dumps(current()))  # JSON round trip: tuples as lists, as in the file
    if os.environ.get("RLALIGN_UPDATE_CONFIG_SNAPSHOT"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(snapshot_text(table))
    expected = json.loads(SNAPSHOT.read_text())
    assert table.keys() == expected.keys()
    for command in expected:
        changed = {
            key: (expected[command].get(key), table[command].get(key))
            for key in expected[command].keys() | table[command].keys()
            if expected[command].get(key) != table[command].get(key)
        }
        assert not changed, f"rlalign {command}: fields changed (snapshot, now): {changed}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_default_is_valid_and_every_bound_is_enforced(command):
    # the defaults validate (Config sets validate_default), and one step past each bound is refused
    config_cls = COMMANDS[command]
    config_cls()
    for field, entry in contract(config_cls).items():
        if "." in field or not entry["bounds"] or isinstance(entry["default"], bool):
            continue
        for kind, bound in entry["bounds"].items():
            step = 1 if isinstance(entry["default"], int) and isinstance(bound, int) else 1e-9
            outside = {"gt": bound, "ge": bound - step, "lt": bound, "le": bound + step}[kind]
            with pytest.raises(ConfigError, match=field):
                load_config(config_cls, None, {field: outside})
