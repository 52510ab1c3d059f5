"""The runs of tests/train/test_distributed.py, through the real CLI.

    torchrun --standalone --nproc-per-node 2 tests/train/distributed_runs.py OUT TINY_MODEL   (DDP, then FSDP2)
    python tests/train/distributed_runs.py OUT TINY_MODEL          (the same runs in one process)

SFT and the reward model build the tiny recipe model themselves (rank 0 first under torchrun);
GRPO and PPO start from TINY_MODEL. Rewards are the preference task's hidden rule (the vowel share
of the completion), which varies between random completions, so every update carries signal.
"""

from __future__ import annotations

import os
import sys

import torch

from rlalign.cli import main
from rlalign.train.distributed import exit_process

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "progress=false", "num_threads=1"]


def commands(out: str, tiny: str, sharding: str = "ddp") -> list[list[str]]:
    """The runs, in output directories named ``<run>`` (DDP, or one process) or ``<run>_fsdp``."""
    tag = "" if sharding == "ddp" else f"_{sharding}"
    out_sft, out_rm, out_grpo, out_ppo = (f"{out}/{name}{tag}" for name in ("sft", "rm", "grpo", "ppo"))
    rl = [f"model.sharding={sharding}", f"model.path={tiny}", "data.task=arithmetic", "data.num_prompts=64", "rewards=[{function: preference}]", "sampling.max_new_tokens=6",
          "optim.lr=3e-3", "progress=false", "plots=false", "num_threads=1"]
    grpo = ["grpo", *rl, "steps=3", "prompts_per_step=4", "group_size=4", "beta=0.1", "mu=2", "num_minibatches=2", "advantage=batch",
            "aggregation=token-mean", "save_every=1", "keep_last=5",
            # more rows logged than rank 0 holds (8 of a step's 16; 2 or 3 of an evaluation batch's 5 prompts): every rank's are gathered
            "sample_every=1", "num_samples_logged=12", "eval.num_prompts=5", "eval.batch_size=2", "eval.num_samples_logged=5"]
    return [
        ["sft", *TINY, f"model.sharding={sharding}", f"output_dir={out_sft}", "data.task=arithmetic", "data.num_train=64", "data.num_eval=8", "batch_size=8", "max_steps=3",
         "eval_every=3", "optim.lr=3e-3"],
        ["rm", *TINY, f"model.sharding={sharding}", f"output_dir={out_rm}", "data.num_train=64", "data.num_eval=8", "batch_size=8", "max_steps=3", "eval_every=3", "center_coef=0.01"],
        [*grpo, f"output_dir={out_grpo}"],
        [*grpo, f"output_dir={out_grpo}_resumed", "--resume", f"{out_grpo}/checkpoints/step_00000002"],
        # micro-batches of one row: a rank's rows of a shuffled minibatch vary (0 to 2), and a rank with fewer runs a row weighted 0 to match
        ["ppo", *rl, f"output_dir={out_ppo}", "steps=2", "prompts_per_step=8", "ppo_epochs=2", "num_minibatches=4", "micro_batch_size=1", "critic.optim.lr=3e-3",
         "kl_coef=0.05", "kl_target=1.0", "kl_horizon=100", "aggregation=seq-mean-token-mean"],
    ]


if __name__ == "__main__":
    torch.set_num_threads(1)
    shardings = ("ddp", "fsdp") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ("ddp",)  # one process: sharding does nothing
    for sharding in shardings:
        for argv in commands(sys.argv[1], sys.argv[2], sharding):
            if main(argv) != 0:
                sys.exit(f"rlalign {' '.join(argv)} failed")
    exit_process(0)  # as the program ends a rank
