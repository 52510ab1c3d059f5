"""The trainers, composed from :mod:`rlalign.core` and :mod:`rlalign.lm`:

- :mod:`rlalign.train.sft` and :mod:`rlalign.train.reward_model`, through :mod:`rlalign.train.supervised`;
- :mod:`rlalign.train.grpo` and :mod:`rlalign.train.ppo`, each one algorithm's config, loss and step,
  on the RL runtime they share: :mod:`~rlalign.train.rl_config` (config fields),
  :mod:`~rlalign.train.rollouts` (prompts, reward terms, sampling and scoring),
  :mod:`~rlalign.train.passes` (reference and pi_old log-prob passes);
- for all four: :mod:`~rlalign.train.updater` (model, AdamW, schedule, clipping), :mod:`~rlalign.train.loop`
  (start, ``--resume``, the step loop, ``final/``), :mod:`~rlalign.train.run_dir` (one run per output
  directory), :mod:`~rlalign.train.checkpoints` (the checkpoint format), :mod:`~rlalign.train.run_config`
  (model, optimiser and run configs), :mod:`~rlalign.train.seeding` (seeds, RNG states, data order),
  :mod:`~rlalign.train.metrics` (metrics.jsonl, trackers, curves), :mod:`~rlalign.train.common`
  (autocast, AdamW schedule, the starting model, generation evaluation), :mod:`~rlalign.train.distributed` (torchrun).
"""
