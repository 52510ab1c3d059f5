"""``rlalign config COMMAND``: a command's full default config as a YAML file, every field with its
description as a comment (``rlalign config grpo > grpo.yaml``, edit, ``rlalign grpo --config grpo.yaml``)."""

from __future__ import annotations

import argparse
import importlib

from rlalign.config import default_yaml

# command -> "module:ConfigClass"
CONFIG_CLASSES = {
    "sft": "rlalign.train.sft:SFTConfig",
    "rm": "rlalign.train.reward_model:RMConfig",
    "dpo": "rlalign.train.dpo:DPOConfig",
    "grpo": "rlalign.train.grpo:GRPOConfig",
    "ppo": "rlalign.train.ppo:PPOConfig",
    "distill": "rlalign.train.distill:DistillConfig",
    "demo": "rlalign.demo:DemoConfig",
    "classic-q_learning": "rlalign.classic.q_learning:QLearningConfig",
    "classic-dqn": "rlalign.classic.dqn:DQNConfig",
    "classic-vpg": "rlalign.classic.vpg:VPGConfig",
    "classic-trpo": "rlalign.classic.trpo:TRPOConfig",
    "classic-ppo": "rlalign.classic.ppo:PPOConfig",
    "classic-value_iteration": "rlalign.classic.value_iteration:ValueIterationConfig",
}


def config_class(command: str) -> type:
    module_name, name = CONFIG_CLASSES[command].split(":")
    return getattr(importlib.import_module(module_name), name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(CONFIG_CLASSES), metavar="COMMAND", help=f"one of: {', '.join(CONFIG_CLASSES)}")


def run(args: argparse.Namespace) -> int:
    print(default_yaml(config_class(args.target)), end="")
    return 0
