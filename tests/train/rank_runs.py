"""The runs of tests/train/test_rank_producers.py, through the real CLI.

    torchrun --standalone --nproc-per-node 4 tests/train/rank_runs.py OUT TINY_MODEL RUN...   (2 learners + 2 producers)
    (RLALIGN_RANK_RUNS_PRODUCERS: producer ranks, default 2; RLALIGN_RANK_RUNS_DEVICE: model.device, default cpu)
    python tests/train/rank_runs.py OUT TINY_MODEL RUN...                                      (the same runs in one process)

RUN names a run of :func:`commands`; under torchrun the runs take ``async_rollouts.producers=2``.
The reward is the preference task's hidden rule, plus, for the fault runs, a term that raises or
kills its process at step 2 (on a producer rank under torchrun).
"""

from __future__ import annotations

import os
import sys

import torch

from rlalign.cli import main
from rlalign.train.distributed import exit_process


def raises_at_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 2:
        raise ValueError("the reward service is down")
    return [0.0] * len(completions)


def dies_at_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 2:
        os._exit(9)
    return [0.0] * len(completions)


def commands(out: str, tiny: str, producers: int, device: str = "cpu") -> dict[str, list[str]]:
    """The runs by name, each in ``<out>/<name>`` (on ``device``; tests/gpu runs one on a GPU)."""
    ranks = [f"async_rollouts.producers={producers}"] if producers else []
    grpo = ["grpo", f"model.path={tiny}", "data.task=arithmetic", "data.num_prompts=64", "sampling.max_new_tokens=6", "optim.lr=3e-3",
            "progress=false", "plots=false", "num_threads=1", "steps=3", "prompts_per_step=4", "group_size=4", "beta=0.1", "mu=2",
            "num_minibatches=2", "advantage=batch", "aggregation=token-mean", "save_every=1", "keep_last=5",
            f"async_rollouts.enabled={str(bool(producers) or device == 'cpu').lower()}",  # one process on a GPU: synchronous (= k 0)
            "async_rollouts.timeout_s=120", f"model.device={device}", *ranks]
    reward = "rewards=[{function: preference}]"
    ppo = ["ppo", *grpo[1:grpo.index("prompts_per_step=4")], "prompts_per_step=8", "ppo_epochs=2", "num_minibatches=4", "critic.optim.lr=3e-3",
           "kl_coef=0.05", "aggregation=seq-mean-token-mean", *grpo[grpo.index("save_every=1"):]]
    stale = ["async_rollouts.max_staleness=1", "tis_cap=2.0"]
    return {
        "k0": [*grpo, reward, "async_rollouts.max_staleness=0", f"output_dir={out}/k0"],
        "k0_broadcast": [*grpo, reward, "async_rollouts.max_staleness=0", f"output_dir={out}/k0_broadcast", *(["async_rollouts.weight_transport=broadcast"] if producers else [])],
        "k1_broadcast": [*grpo, reward, *stale, f"output_dir={out}/k1_broadcast", *(["async_rollouts.weight_transport=broadcast"] if producers else [])],
        "k0_fsdp": [*grpo, reward, "async_rollouts.max_staleness=0", "model.sharding=fsdp", f"output_dir={out}/k0_fsdp"],
        "k1": [*grpo, reward, *stale, f"output_dir={out}/k1"],
        "ppo_k1": [*ppo, reward, *stale, f"output_dir={out}/ppo_k1"],
        "k1_resumed": [*grpo, reward, *stale, f"output_dir={out}/k1_resumed", "--resume", f"{out}/k1/checkpoints/step_00000001"],
        "raises": [*grpo, "rewards=[{function: preference}, {function: 'tests.train.rank_runs:raises_at_step_2'}]", *stale,
                   f"output_dir={out}/raises"],
        "raises_broadcast": [*grpo, "rewards=[{function: preference}, {function: 'tests.train.rank_runs:raises_at_step_2'}]", *stale,
                             f"output_dir={out}/raises_broadcast", *(["async_rollouts.weight_transport=broadcast"] if producers else [])],
        "dies": [*grpo, "rewards=[{function: preference}, {function: 'tests.train.rank_runs:dies_at_step_2'}]", *stale, f"output_dir={out}/dies"],
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    producers = int(os.environ.get("RLALIGN_RANK_RUNS_PRODUCERS", "2")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    runs = commands(sys.argv[1], sys.argv[2], producers, os.environ.get("RLALIGN_RANK_RUNS_DEVICE", "cpu"))
    for name in sys.argv[3:]:
        if main(runs[name]) != 0:
            sys.exit(f"rlalign {' '.join(runs[name])} failed")
    exit_process(0)  # as the program ends a rank
