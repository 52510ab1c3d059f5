"""benchmarks/mfu.py: the FLOP count by hand, against the matmuls a tiny GRPO step executes, and --beta 0."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mfu  # noqa: E402

# N_body 10, N_head 4, one layer, d 2: attn(t, c) = 4 x 1 x 2 x t x c = 8 t c
DIMS = {"n_body": 10, "n_head": 4, "layers": 1, "d_attn": 2}


def test_step_flops_by_hand_with_ragged_rows():
    # B 2 rows of one prompt (U 1), P 3, completions of C_i = 2 and 1 (max 2).
    # generate: prefill 2 x 10 x 3 + 2 x 4 + attn(3, 3) = 60 + 8 + 72 = 140; decode step 1 runs only the row
    #   with C_i > 1: 2 x 14 + attn(1, 4) = 28 + 32 = 60 -> 200
    # shared forward: prompt but its last token 2 x 10 x 2 + 2 x 4 + attn(2, 2) = 40 + 8 + 32 = 80;
    #   row C=2: 2 x 14 x 2 + attn(2, 4) = 56 + 64 = 120; row C=1: 28 + attn(1, 3) = 28 + 24 = 52 -> 252
    f = mfu.step_flops(DIMS, 2, 3, 2, 2, groups=1, prefill_rows=1, completion_lens=[2, 1])
    assert f == {"generate": 200, "reference": 252, "policy_fwd_bwd": 756}
    # every row its own prompt: row C=2: 2 x 10 x 5 + 2 x 4 x 2 + attn(5, 5) = 100 + 16 + 200 = 316;
    #   row C=1: 2 x 10 x 4 + 2 x 4 + attn(4, 4) = 80 + 8 + 128 = 216 -> 532
    assert mfu.step_flops(DIMS, 2, 3, 2, 2, completion_lens=[2, 1])["reference"] == 532
    # no lengths given: every row runs C = 2 (decode step 1: 2 rows, 56 + 64 = 120; the second row 120 as the first)
    assert mfu.step_flops(DIMS, 2, 3, 2, 2, groups=1, prefill_rows=1) == {"generate": 260, "reference": 320, "policy_fwd_bwd": 960}


def test_counted_flops_bound_the_matmuls_a_tiny_step_executes():
    """Eager attention, so every matmul is an mm or bmm FlopCounterMode counts. The count of each row's
    own tokens is at most what the reference pass executes (packed rows keep some padding), and
    B x max C (padding counted) at least; equal when no row stops early (so at this seed, where every
    row runs all 24 tokens, the count must match the executed matmuls exactly)."""
    from torch.utils.flop_counter import FlopCounterMode

    import _lm_bench as lb
    from rlalign.lm.encoding import encode_prompts
    from rlalign.tasks import TASKS
    from rlalign.train import grpo
    from rlalign.train.passes import share_prompts
    from rlalign.train.rollouts import prompt_batch

    torch.manual_seed(0)
    cfg = grpo.GRPOConfig.model_validate(dict(
        output_dir=tempfile.mkdtemp(), seed=0, num_threads=1, model=dict(path=str(lb.tiny_checkpoint()), attn_implementation="eager"),
        sampling=dict(max_new_tokens=24, temperature=0.7), optim=dict(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0),
        steps=1, prompts_per_step=2, group_size=4, beta=0.04, progress=False, plots=False))
    setup = lb.GRPOSetup(cfg, TASKS["arithmetic"].prompt_records("train", 64, 0), lb.arithmetic_reward)
    lengths = mfu.capture_completion_lengths()
    batch = [ex.prompt for ex in prompt_batch(setup.run.prompts, 0, cfg.prompts_per_step, cfg.seed)]
    prompt_len = max(len(ids) for ids in encode_prompts(setup.run.tokenizer, batch))
    counter, executed = FlopCounterMode(display=False), {}
    inner = grpo.reference_logprobs

    def reference_logprobs(*args, **kwargs):
        before = counter.get_total_flops()
        out = inner(*args, **kwargs)
        executed["reference"] = counter.get_total_flops() - before
        return out

    grpo.reference_logprobs = reference_logprobs
    try:
        with counter:
            metrics = setup.step()
    finally:
        grpo.reference_logprobs = inner
    lens, groups = lengths[-1], cfg.prompts_per_step if share_prompts(setup.updater.model) else None
    c = int(metrics["completion_len/max"])
    assert len(lens) == 8 and max(lens) == c and sum(lens) == metrics["tokens"]
    useful = mfu.step_flops(mfu.model_dims(setup.policy.config), 8, prompt_len, c, c, groups, cfg.prompts_per_step, lens)["reference"]
    padded = mfu.step_flops(mfu.model_dims(setup.policy.config), 8, prompt_len, c, c, groups, cfg.prompts_per_step)["reference"]
    assert useful <= executed["reference"] <= padded, (useful, executed, padded, lens)
    if len(set(lens)) == 1:
        assert useful == executed["reference"] == padded


def test_beta_zero_counts_no_reference_pass(tmp_path, capsys):
    out = tmp_path / "mfu.json"
    argv = ["--shape", "tiny", "--steps", "2", "--prompts", "1", "--group-size", "2", "--new-tokens", "3", "--beta", "0",
            "--n", "64", "--repeats", "1", "--out", str(out)]
    assert mfu.main(argv) == 0
    r = json.loads(out.read_text())
    assert all("reference" not in s["flops"] for s in r["steps"])
    assert r["flops_ref_train"] == r["flops_update"]  # the update is all of the train phase's FLOPs
