"""GRPO and PPO pinned term by term: each trainer's own loss and step code against the seeds'
formulas written out here in plain loops, value and gradient, one case per option.

The "hand" side never calls the trainers' helpers nor rlalign.core: it runs the model on each row's
real tokens alone (no padding, positions 0..n-1), takes a full log_softmax, and loops over rows
and tokens. The trainers run their padded, shared-prompt batches. So these tests also pin the
alignment: the token at completion position t is predicted by the hidden state of position
P_i - 1 + t of row i, the critic's V(s_t) is read there too, for prompts of different lengths (left
padding), completions of different lengths (right padding), EOS inside the budget and at its end,
and a completion without EOS.

The fixed rollout (4 rows, 2 groups of G = 2; '|' is the prompt / completion boundary):

    row 0  p0 = "1+2="       | "3", "4", "5", EOS     EOS at the end of the budget (C = 4)
    row 1  p0                | "7", EOS, pad, pad     EOS inside
    row 2  p1 = "10+20="     | "a", "b", "c", "d"     truncated: no EOS
    row 3  p1                | "x", "y", EOS, pad

The sampler's log-probs (log pi_old) are the policy's own, shifted so that the ratios r = pi / pi_old
straddle both clip edges: with eps_low = 0.2 and eps_high = 0.28, the ratio 1.25 is inside
[0.8, 1.28] but outside [0.72, 1.2] (eps_low and eps_high swapped), and so on.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

from rlalign.config import load_config
from rlalign.core.kl import AdaptiveKLController, FixedKLController
from rlalign.lm.data import load_prompts
from rlalign.lm.heads import load_critic
from rlalign.lm.reward_calls import UNSCORED
from rlalign.lm.models import load_policy, load_tokenizer
from rlalign.lm.rollout import Rollout
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, ppo, sources
from rlalign.train.sources import make_source

torch.set_num_threads(1)

PROMPTS = ["1+2=", "1+2=", "10+20=", "10+20="]
COMPLETIONS = [["3", "4", "5", "EOS"], ["7", "EOS"], ["a", "b", "c", "d"], ["x", "y", "EOS"]]
C = 4  # completion length of the fixed rollout (its longest completion)
BUDGET = 6  # sampling.max_new_tokens in the loss tests: Dr.GRPO's fixed L, longer than this batch's C
# target ratios pi / pi_old per completion token (rows as above)
RATIOS = [[1.25, 1.35, 0.7, 1.0], [0.75, 0.85], [1.3, 0.78, 1.1, 0.95], [1.5, 0.6, 1.02]]
REF_SHIFTS = [[0.3, -0.4, 0.2, -0.1], [0.5, -0.2], [-0.3, 0.1, 0.4, -0.6], [0.2, 0.3, -0.5]]  # log pi_ref - log pi
TEMPERATURE = 0.9
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), spec, seed=0)


@pytest.fixture(scope="module")
def ref_path(tmp_path_factory):
    """Another tiny model: the frozen reference of the step tests (its log-probs differ from the policy's)."""
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ref"), spec, seed=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return load_tokenizer(tiny_path)


# ----------------------------------------------------------------------------------------------
# The fixed rollout and the hand side
# ----------------------------------------------------------------------------------------------


def token_ids(tokenizer, pieces: list[str]) -> list[int]:
    return [tokenizer.eos_token_id if p == "EOS" else tokenizer.convert_tokens_to_ids(p) for p in pieces]


def real_tokens(tokenizer, prompt_texts: list[str] = PROMPTS) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's real prompt ids and real completion ids (EOS included), unpadded."""
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt_texts]
    completions = [token_ids(tokenizer, c) for c in COMPLETIONS]
    assert all(tokenizer.unk_token_id not in ids for ids in prompts + completions)
    return prompts, completions


def build_rollout(tokenizer, sampler_logp: list[list[float]], prompt_texts: list[str] = PROMPTS, group_size: int = 2) -> Rollout:
    """The rows of the module docstring, left-padded prompts and right-padded completions; the
    sampler's log-probs are ``sampler_logp`` (0 on padding)."""
    prompts, completions = real_tokens(tokenizer, prompt_texts)
    pad = tokenizer.pad_token_id
    p = max(len(ids) for ids in prompts)
    prompt_ids = torch.tensor([[pad] * (p - len(ids)) + ids for ids in prompts])  # (B, P)
    prompt_mask = torch.tensor([[0] * (p - len(ids)) + [1] * len(ids) for ids in prompts])
    completion_ids = torch.tensor([ids + [pad] * (C - len(ids)) for ids in completions])  # (B, C)
    completion_mask = torch.tensor([[1] * len(ids) + [0] * (C - len(ids)) for ids in completions])
    logprobs = torch.tensor([row + [0.0] * (C - len(row)) for row in sampler_logp])  # (B, C)
    truncated = torch.tensor([tokenizer.eos_token_id not in ids for ids in completions])
    group_index = torch.arange(len(prompts)) // group_size  # (B,)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, group_index, truncated)


def hand_forward(model, tokenizer, temperature: float = TEMPERATURE, with_entropy: bool = False, prompt_texts: list[str] = PROMPTS):
    """log pi(o_t) (and H_t) of every real completion token, each row run alone: lists of 0-d tensors."""
    prompts, completions = real_tokens(tokenizer, prompt_texts)
    logp, entropy = [], []
    for prompt, completion in zip(prompts, completions):
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature  # (n, V)
        log_probs = torch.log_softmax(logits, dim=-1)
        rows_logp, rows_entropy = [], []
        for t, token in enumerate(completion):
            position = len(prompt) - 1 + t  # the hidden state that predicts completion token t
            rows_logp.append(log_probs[position, token])
            rows_entropy.append(-(log_probs[position].exp() * log_probs[position]).sum())
        logp.append(rows_logp)
        entropy.append(rows_entropy)
    return (logp, entropy) if with_entropy else logp


def hand_values(critic, tokenizer) -> list[list[torch.Tensor]]:
    """V(s_t) of every real completion token: the critic's scalar at position P_i - 1 + t of row i run alone."""
    prompts, completions = real_tokens(tokenizer)
    values = []
    for prompt, completion in zip(prompts, completions):
        hidden = critic.backbone(input_ids=torch.tensor([prompt + completion])).last_hidden_state[0]  # (n, H)
        scalars = critic.head(hidden.float())[:, 0]  # (n,)
        values.append([scalars[len(prompt) - 1 + t] for t in range(len(completion))])
    return values


def detached(rows: list[list[torch.Tensor]]) -> list[list[float]]:
    return [[float(x.detach()) for x in row] for row in rows]


def padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (C - len(row)) for row in rows])  # (B, C)


def hand_aggregate(token_values: list[list[torch.Tensor]], mode: str, max_len: int = C) -> torch.Tensor:
    """The four reductions written out: rows with no counted token do not count as sequences."""
    rows = [row for row in token_values if row]
    if mode == "token-mean":
        return sum(sum(row) for row in rows) / sum(len(row) for row in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in rows) / len(rows)
    assert mode == "seq-mean-token-sum-norm"
    return sum(sum(row) for row in rows) / (len(token_values) * max_len)  # every row of the batch, the fixed L


def clipped_term(ratio, advantage: float, eps_low: float, eps_high: float):
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), Schulman et al. 2017 eq. 7 (clip-higher: DAPO)."""
    clipped_ratio = torch.minimum(torch.maximum(ratio, torch.tensor(1.0 - eps_low)), torch.tensor(1.0 + eps_high))
    return -torch.minimum(ratio * advantage, clipped_ratio * advantage)


def k3(logp, ref_logp: float):
    """e^x - x - 1 with x = log pi_ref - log pi (Schulman's unbiased estimator; seed 002)."""
    x = ref_logp - logp
    return torch.exp(x) - x - 1.0


def hand_grpo_loss(logp, old_logp, ref_logp, advantages, counted, eps_low, eps_high, beta, mode, rows=None, max_len=C, weights=None):
    """aggregate(-min(r A, clip(r) A) * w) + beta * aggregate(k3) over the counted tokens (``counted``: a
    bool per token) of the minibatch's ``rows`` (default: every row); ``weights`` w per token (default 1)."""
    rows = range(len(logp)) if rows is None else rows
    w = weights or [[1.0] * len(row) for row in logp]
    surrogate = [
        [clipped_term(torch.exp(lp - old_logp[i][t]), advantages[i], eps_low, eps_high) * w[i][t] for t, lp in enumerate(logp[i]) if counted[i][t]]
        for i in rows
    ]
    loss = hand_aggregate(surrogate, mode, max_len)
    if beta > 0:
        kl = [[k3(lp, ref_logp[i][t]) for t, lp in enumerate(logp[i]) if counted[i][t]] for i in rows]
        loss = loss + beta * hand_aggregate(kl, mode, max_len)
    return loss


def all_counted(logp) -> list[list[bool]]:
    return [[True] * len(row) for row in logp]


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(trainer: dict[str, torch.Tensor], hand: dict[str, torch.Tensor], nonzero: bool = True) -> None:
    assert trainer.keys() == hand.keys()
    for name in hand:
        torch.testing.assert_close(trainer[name], hand[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")
    assert not nonzero or max(g.abs().max().item() for g in hand.values()) > 1e-3  # a real gradient


def sgd_updater(model, lr: float, grad_clip: float | None = None) -> grpo.Updater:
    """The trainers' Updater on plain SGD at a constant rate."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return grpo.Updater(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), grad_clip)


@dataclass
class Update:
    """One optimiser step of the trainer: the parameters it started from, its loss, its (clipped) gradient."""

    params: dict[str, torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def recording(updater: grpo.Updater) -> list[Update]:
    """Record every step of ``updater``. The hand side then recomputes each update at the very
    parameters the trainer had, so round-off cannot pile up over updates and flip a clip decision."""
    updates: list[Update] = []
    step = updater.step

    def step_and_record(loss: torch.Tensor) -> float:
        params = {name: p.detach().clone() for name, p in updater.model.named_parameters()}
        norm = step(loss)
        updates.append(Update(params, loss.detach(), grads(updater.model)))
        return norm

    updater.step = step_and_record
    return updates


def at_params(model, params: dict[str, torch.Tensor]):
    """``model`` with its parameters set to ``params`` and its gradients cleared."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    model.zero_grad()
    return model


def hand_grads(model, loss, grad_clip: float | None = None) -> dict[str, torch.Tensor]:
    """d loss / d params, scaled by clip / (||g|| + 1e-6) when the global norm exceeds ``grad_clip``."""
    loss.backward()
    hand = grads(model)
    norm = math.sqrt(sum(float((g**2).sum()) for g in hand.values()))
    factor = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip is not None else 1.0
    return {name: g * factor for name, g in hand.items()}


def assert_update(update: Update, model, loss, lr: float, grad_clip: float | None = None, next_params: dict[str, torch.Tensor] | None = None) -> None:
    """The recorded update has the hand loss and gradient, and SGD moved the parameters by -lr * gradient."""
    torch.testing.assert_close(update.loss, loss.detach(), rtol=1e-5, atol=1e-6)
    hand = hand_grads(model, loss, grad_clip)
    assert_same_grads(update.grads, hand, nonzero=False)  # an update whose tokens are all clipped has none
    if next_params is not None:
        for name, g in hand.items():
            torch.testing.assert_close(next_params[name], update.params[name] - lr * g, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def final_params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# GRPO: the loss of one minibatch (grpo_loss)
# ----------------------------------------------------------------------------------------------


def grpo_cfg(tiny_path, tmp_path, **overrides) -> grpo.GRPOConfig:
    base = {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic", "prompts_per_step": 2, "group_size": 2,
        "sampling.max_new_tokens": C, "sampling.temperature": TEMPERATURE, "progress": False, "plots": False,
    }
    return load_config(grpo.GRPOConfig, None, {**base, **overrides})


def shifted_rollout(policy, tokenizer, prompt_texts: list[str] = PROMPTS, group_size: int = 2):
    """The fixed rollout whose sampler log-probs make the ratios RATIOS, the hand log-probs, the
    sampler's (log pi_old) and the reference's (log pi + REF_SHIFTS)."""
    logp = hand_forward(policy, tokenizer, prompt_texts=prompt_texts)
    old = [[lp - math.log(RATIOS[i][t]) for t, lp in enumerate(row)] for i, row in enumerate(detached(logp))]
    ref = [[lp + REF_SHIFTS[i][t] for t, lp in enumerate(row)] for i, row in enumerate(detached(logp))]
    return build_rollout(tokenizer, old, prompt_texts, group_size), logp, old, ref


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.28), (0.2, 0.2)], ids=["clip-higher", "symmetric"])
def test_grpo_loss_is_clipped_surrogate_plus_beta_k3(tiny_path, tmp_path, tokenizer, mode, beta, eps_low, eps_high):
    cfg = grpo_cfg(tiny_path, tmp_path, aggregation=mode, beta=beta, eps_low=eps_low, eps_high=eps_high, **{"sampling.max_new_tokens": BUDGET})
    policy = load_policy(tiny_path)
    rollout, _, old, ref = shifted_rollout(policy, tokenizer)
    advantages = [1.0, -0.5, 0.8, -1.2]
    ref_logp = padded(ref) if beta > 0 else None  # the step passes none when beta = 0

    loss, stats = grpo.grpo_loss(policy, rollout, torch.tensor(advantages), rollout.completion_mask.float(), ref_logp, cfg)
    loss.backward()
    trainer_grads = grads(policy)

    policy.zero_grad()
    logp = hand_forward(policy, tokenizer)
    expected = hand_grpo_loss(logp, old, ref, advantages, all_counted(logp), eps_low, eps_high, beta, mode, max_len=BUDGET)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(trainer_grads, grads(policy))
    # the statistics: the policy term alone, the clip fractions by side, the mean k3
    surrogate = hand_grpo_loss(logp, old, ref, advantages, all_counted(logp), eps_low, eps_high, 0.0, mode, max_len=BUDGET)
    torch.testing.assert_close(stats["loss/policy"], surrogate.detach(), rtol=1e-5, atol=1e-6)
    ratios = [(r, advantages[i]) for i, row in enumerate(RATIOS) for r in row]
    low = sum(r < 1 - eps_low and a < 0 for r, a in ratios) / len(ratios)  # clipped below: 0.75 and 0.6 (A < 0), 0.78 too at eps_low 0.2
    high = sum(r > 1 + eps_high and a > 0 for r, a in ratios) / len(ratios)
    assert float(stats["clip_frac/low"]) == pytest.approx(low, abs=1e-6)
    assert float(stats["clip_frac/high"]) == pytest.approx(high, abs=1e-6)
    assert float(stats["clip_frac"]) == pytest.approx(low + high, abs=1e-6)
    if beta > 0:
        mean_k3 = sum(math.exp(s) - s - 1 for row in REF_SHIFTS for s in row) / len(ratios)
        assert float(stats["kl"]) == pytest.approx(mean_k3, rel=1e-5)
    else:
        assert "kl" not in stats


def test_clip_higher_cases_differ_from_swapped_eps():
    # the premise of the eps tests: each clip edge decides at least one token of the fixed rollout
    # A > 0, r = 1.25: inside 1 + 0.28, outside 1 + 0.2;  A < 0, r = 0.78: outside 1 - 0.2, inside 1 - 0.28
    assert 1.2 < RATIOS[0][0] < 1.28 and 0.72 < RATIOS[2][1] < 0.8
    for r, a in [(1.25, 1.0), (0.78, -1.0)]:
        assert float(clipped_term(torch.tensor(r), a, 0.2, 0.28)) != float(clipped_term(torch.tensor(r), a, 0.28, 0.2))


def test_grpo_loss_with_one_update_takes_pi_old_from_its_own_forward(tiny_path, tmp_path, tokenizer):
    # on_policy: log pi_old = logp.detach(), so r = 1 and L = -agg(A) + beta agg(k3); its gradient is
    # REINFORCE's -A grad log pi plus beta grad k3, whatever the sampler's log-probs were
    cfg = grpo_cfg(tiny_path, tmp_path, beta=0.05)
    policy = load_policy(tiny_path)
    rollout, _, old, ref = shifted_rollout(policy, tokenizer)
    advantages = [1.0, -0.5, 0.8, -1.2]
    loss, stats = grpo.grpo_loss(policy, rollout, torch.tensor(advantages), rollout.completion_mask.float(), padded(ref), cfg, on_policy=True)
    loss.backward()
    trainer_grads = grads(policy)
    policy.zero_grad()
    logp = hand_forward(policy, tokenizer)
    on_policy_old = detached(logp)
    expected = hand_grpo_loss(logp, on_policy_old, ref, advantages, all_counted(logp), 0.2, 0.2, 0.05, cfg.aggregation)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(trainer_grads, grads(policy))
    # the sampler's log-probs only feed the mismatch statistic: max |log r| over every sampled token
    assert float(stats["logprob_mismatch"]) == pytest.approx(max(abs(math.log(r)) for row in RATIOS for r in row), rel=1e-4)
    assert float(stats["ratio_dev"]) == 0.0


# ----------------------------------------------------------------------------------------------
# GRPO: the whole step (grpo_step) on the fixed rollout
# ----------------------------------------------------------------------------------------------

SCORES = [2.0, 0.5, -1.0, 3.0]  # rows 0-1 are group 0, rows 2-3 group 1


def fixed_sampler(monkeypatch, module, rollout: Rollout) -> None:
    """The step's sampler returns the fixed rollout (the rest of the step runs as in training)."""
    monkeypatch.setattr(sources, "sample_shard", lambda *args, **kwargs: rollout)


def fixed_scores(scores: list[float]) -> grpo.RewardTerm:
    return grpo.RewardTerm("fixed", 1.0, lambda prompts, completions: list(scores))


def prompt_examples():
    return load_prompts([{"prompt": p} for p in PROMPTS[::2]])


def hand_group_advantages(scores: list[float], group_size: int, estimator: str) -> list[float]:
    """group: (R - mean_g) / std_g;  batch: / std of all;  none: R - mean_g (Dr.GRPO);  rloo: R - mean of the others."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    std = lambda xs: math.sqrt(sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1))  # noqa: E731 (unbiased)
    out = []
    for g in range(0, len(scores), group_size):
        group = scores[g : g + group_size]
        for i, r in enumerate(group):
            if estimator == "group":
                out.append((r - mean(group)) / std(group))
            elif estimator == "batch":
                out.append((r - mean(group)) / std(scores))
            elif estimator == "none":
                out.append(r - mean(group))
            else:
                out.append(r - mean(group[:i] + group[i + 1 :]))
    return out


def step_against_hand(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, scores, prompts, group_size, **overrides):
    """One GRPO step on the fixed rollout of ``prompts`` scored ``scores`` (SGD at lr 0: its gradient stays
    in .grad): (cfg, its metrics, its gradients, the hand's log-probs with grad and the reference's)."""
    cfg = grpo_cfg(tiny_path, tmp_path, beta=0.1, group_size=group_size, prompts_per_step=4 // group_size, **overrides)
    policy, reference = load_policy(tiny_path), load_policy(ref_path)
    rollout, _, _, _ = shifted_rollout(policy, tokenizer, prompts, group_size)
    fixed_sampler(monkeypatch, grpo, rollout)
    updater = sgd_updater(policy, lr=0.0)
    state = grpo.TrainState(step=0, generator=torch.Generator().manual_seed(0))
    metrics, _ = grpo.grpo_step(updater, reference, make_source(cfg, updater, tokenizer, [fixed_scores(scores)], prompt_examples()), state, cfg)
    trainer_grads = grads(policy)
    policy.zero_grad()
    logp = hand_forward(policy, tokenizer, prompt_texts=prompts)
    return cfg, metrics, trainer_grads, policy, logp, detached(hand_forward(reference, tokenizer, prompt_texts=prompts))


@pytest.mark.parametrize("estimator", ["group", "batch", "none", "rloo"])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_grpo_step_gradient_by_hand(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, estimator, mask_truncated):
    # one update per rollout (mu = 1, one minibatch): the step's gradient (SGD at lr 0 leaves it in
    # .grad) is that of the hand loss with the hand advantages, pi_old = pi, the reference's own
    # log-probs (a second model, run alone on each row) and, with mask_truncated, row 2 (no EOS) left out
    group_size = 4 if estimator in ("batch", "rloo") else 2  # G = 4 separates batch from group std and RLOO from "none"
    scores = [2.0, 0.5, -1.0, 3.0]
    prompts = PROMPTS if group_size == 2 else [PROMPTS[2]] * 4  # one group of 4 shares one prompt
    cfg, metrics, trainer_grads, policy, logp, ref = step_against_hand(
        tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, scores, prompts, group_size, advantage=estimator, mask_truncated=mask_truncated
    )
    advantages = hand_group_advantages(scores, group_size, estimator)
    counted = [[not (mask_truncated and i == 2)] * len(row) for i, row in enumerate(logp)]
    expected = hand_grpo_loss(logp, detached(logp), ref, advantages, counted, cfg.eps_low, cfg.eps_high, cfg.beta, cfg.aggregation)
    expected.backward()
    assert_same_grads(trainer_grads, grads(policy))
    assert metrics["loss/policy"] == pytest.approx(-sum(a for i, a in enumerate(advantages) if any(counted[i])) / sum(any(c) for c in counted), abs=1e-5)
    assert metrics["adv/std"] == pytest.approx(float(torch.tensor(advantages).std()), rel=1e-5)


@pytest.mark.parametrize("estimator", ["group", "rloo"])
def test_grpo_step_leaves_out_a_row_no_reward_could_score(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, estimator):
    # one group of 4, row 1 unscored (a code run that never finished, a failed judge): the advantages are
    # over rows 0, 2, 3 alone (group: (R - mean) / std of [2, -1, 3]; rloo: R - mean of the two others)
    # and row 1 has no advantage and no token in the loss, whatever its (missing) score
    scores = [2.0, UNSCORED, -1.0, 3.0]
    cfg, metrics, trainer_grads, policy, logp, ref = step_against_hand(
        tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, scores, [PROMPTS[2]] * 4, 4, advantage=estimator
    )
    kept = [2.0, -1.0, 3.0]
    mean, std = sum(kept) / 3, math.sqrt(sum((x - sum(kept) / 3) ** 2 for x in kept) / 2)
    hand = {"group": [(r - mean) / std for r in kept], "rloo": [r - (sum(kept) - r) / 2 for r in kept]}[estimator]
    advantages = [hand[0], 0.0, hand[1], hand[2]]
    counted = [[i != 1] * len(row) for i, row in enumerate(logp)]
    expected = hand_grpo_loss(logp, detached(logp), ref, advantages, counted, cfg.eps_low, cfg.eps_high, cfg.beta, cfg.aggregation)
    expected.backward()
    assert_same_grads(trainer_grads, grads(policy))
    assert metrics["reward/fixed/failed"] == 1.0


@pytest.mark.parametrize(
    "mu, minibatches, sampling_dtype, grad_clip",
    [(2, 1, None, None), (1, 2, None, None), (2, 2, None, 0.05), (2, 2, "bfloat16", None)],
    ids=["mu2", "2-minibatches", "mu2-minibatches2-clipped", "recompute-pi-old"],
)
def test_grpo_step_with_several_updates_by_hand(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, mu, minibatches, sampling_dtype, grad_clip):
    # several updates per rollout: mu passes over the interleaved minibatches (rows k, k + m, ...),
    # one clipped SGD step each, all against one pi_old. It is the sampler's log-probs, unless the
    # sampler's numerics differ (sampling.dtype: bfloat16): then the training forward recomputes it
    # before the first update, and the sampler's shifted log-probs must not be used.
    cfg = grpo_cfg(
        tiny_path, tmp_path, mu=mu, num_minibatches=minibatches, beta=0.1, eps_high=0.28, aggregation="token-mean", **{"sampling.dtype": sampling_dtype}
    )
    policy, reference = load_policy(tiny_path), load_policy(ref_path)
    start = final_params(policy)
    rollout, logp0, sampler_logp, _ = shifted_rollout(policy, tokenizer)
    fixed_sampler(monkeypatch, grpo, rollout)
    lr = 0.5
    updater = sgd_updater(policy, lr, grad_clip)
    updates = recording(updater)
    state = grpo.TrainState(step=0, generator=torch.Generator().manual_seed(0))
    metrics, _ = grpo.grpo_step(updater, reference, make_source(cfg, updater, tokenizer, [fixed_scores(SCORES)], prompt_examples()), state, cfg)

    assert len(updates) == mu * minibatches
    ref = detached(hand_forward(reference, tokenizer))
    pi_old = detached(logp0) if sampling_dtype else sampler_logp
    advantages = hand_group_advantages(SCORES, 2, "group")
    assert updates[0].params.keys() == start.keys() and all(torch.equal(updates[0].params[n], start[n]) for n in start)
    for k, update in enumerate(updates):
        twin = at_params(copy.deepcopy(policy), update.params)
        logp = hand_forward(twin, tokenizer)
        rows = range(k % minibatches, len(logp), minibatches)
        loss = hand_grpo_loss(logp, pi_old, ref, advantages, all_counted(logp), cfg.eps_low, cfg.eps_high, cfg.beta, cfg.aggregation, rows)
        next_params = updates[k + 1].params if k + 1 < len(updates) else final_params(policy)
        assert_update(update, twin, loss, lr, grad_clip, next_params)
    assert any((final_params(policy)[n] - start[n]).abs().max() > 1e-3 for n in start)  # it moved
    if sampling_dtype:  # the recompute's gap to the sampler is logged: max |log r| of the shifted log-probs
        assert metrics["logprob_mismatch"] == pytest.approx(max(abs(math.log(r)) for row in RATIOS for r in row), rel=1e-4)
        assert metrics["ratio_dev/first"] < 1e-5
    else:
        first_rows = RATIOS[::minibatches]  # the first minibatch: rows 0, m, 2m, ...
        assert metrics["ratio_dev/first"] == pytest.approx(max(abs(r - 1) for row in first_rows for r in row), rel=1e-4)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("tis_mode", ["truncate", "mask"])
def test_grpo_step_on_a_stale_rollout_is_the_decoupled_objective_by_hand(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, k, tis_mode):
    # asynchronous rollouts, max_staleness k: the rollout was sampled by the policy of k updates ago, here
    # one whose log-probs are log pi - k log RATIOS (the drift compounds). The learner recomputes pi_old
    # as its own policy before the update (the proximal policy, log pi at the start), clips r = pi / pi_prox,
    # and weights each token by w = pi_prox / pi_behaviour = RATIOS^k, truncated at C (min(w, C)) or
    # masked above it (w 1[w <= C]); two updates (mu = 2), each against the same pi_prox.
    cap = 1.4
    cfg = grpo_cfg(
        tiny_path, tmp_path, mu=2, beta=0.1, tis_cap=cap, tis_mode=tis_mode, aggregation="token-mean",
        **{"async_rollouts.enabled": True, "async_rollouts.max_staleness": k},
    )
    assert cfg.recompute_old_logprobs  # a stale rollout: pi_old is the learner's, not the sampler's
    policy, reference = load_policy(tiny_path), load_policy(ref_path)
    logp0 = detached(hand_forward(policy, tokenizer))
    behaviour = [[lp - k * math.log(RATIOS[i][t]) for t, lp in enumerate(row)] for i, row in enumerate(logp0)]
    fixed_sampler(monkeypatch, grpo, build_rollout(tokenizer, behaviour, PROMPTS, 2))
    lr = 0.5
    updater = sgd_updater(policy, lr)
    updates = recording(updater)
    state = grpo.TrainState(step=0, generator=torch.Generator().manual_seed(0))
    metrics, _ = grpo.grpo_step(updater, reference, make_source(cfg, updater, tokenizer, [fixed_scores(SCORES)], prompt_examples()), state, cfg)

    ratios = [[r**k for r in row] for row in RATIOS]  # pi_prox / pi_behaviour per token
    weights = [[min(r, cap) if tis_mode == "truncate" else r * (r <= cap) for r in row] for row in ratios]  # mask: rho inside, 0 above C
    assert any(r > cap for row in ratios for r in row) and any(r <= cap for row in ratios for r in row)  # both sides of C occur
    ref = detached(hand_forward(reference, tokenizer))
    advantages = hand_group_advantages(SCORES, 2, "group")
    assert len(updates) == 2
    for n, update in enumerate(updates):
        twin = at_params(copy.deepcopy(policy), update.params)
        logp = hand_forward(twin, tokenizer)
        loss = hand_grpo_loss(logp, logp0, ref, advantages, all_counted(logp), cfg.eps_low, cfg.eps_high, cfg.beta, cfg.aggregation, weights=weights)
        assert_update(update, twin, loss, lr, None, updates[n + 1].params if n + 1 < len(updates) else final_params(policy))
    tokens = [w for row in weights for w in row]
    assert metrics["tis/weight_mean"] == pytest.approx(sum(tokens) / len(tokens), rel=1e-4)
    assert metrics["ratio_dev/first"] < 1e-5  # the first update's ratio is against the learner's own pi_prox: 1


# ----------------------------------------------------------------------------------------------
# PPO: the policy loss, the critic loss, the advantages and the whole step
# ----------------------------------------------------------------------------------------------


def ppo_cfg(tiny_path, tmp_path, **overrides) -> ppo.PPOConfig:
    base = {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic", "prompts_per_step": 4,
        "sampling.max_new_tokens": C, "sampling.temperature": TEMPERATURE, "progress": False, "plots": False,
    }
    return load_config(ppo.PPOConfig, None, {**base, **overrides})


def hand_ppo_policy_loss(logp, entropy, old, advantages, eps, entropy_coef, mode, rows=None, max_len=C):
    """aggregate(-min(r A, clip(r, 1 - eps, 1 + eps) A)) - c2 * aggregate(H) over the minibatch's ``rows``: the entropy is a bonus."""
    rows = range(len(logp)) if rows is None else rows
    surrogate = [[clipped_term(torch.exp(lp - old[i][t]), advantages[i][t], eps, eps) for t, lp in enumerate(logp[i])] for i in rows]
    bonus = [entropy[i] for i in rows]
    return hand_aggregate(surrogate, mode, max_len) - entropy_coef * hand_aggregate(bonus, mode, max_len)


def hand_value_loss(values, returns, old_values, clip, mode, rows=None, max_len=C):
    """1/2 aggregate(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)), or 1/2 aggregate((V - R)^2), over ``rows``."""
    errors = []
    for i in range(len(values)) if rows is None else rows:
        errors.append([])
        for t, v in enumerate(values[i]):
            error = (v - returns[i][t]) ** 2
            if clip is not None:
                moved = torch.minimum(torch.maximum(v - old_values[i][t], torch.tensor(-clip)), torch.tensor(clip))
                error = torch.maximum(error, (old_values[i][t] + moved - returns[i][t]) ** 2)
            errors[-1].append(error)
    return 0.5 * hand_aggregate(errors, mode, max_len)


TOKEN_ADVANTAGES = [[1.0, -0.4, 0.6, 0.3], [-1.0, 0.5], [0.9, -0.8, 0.2, -0.3], [1.5, -0.6, 0.7]]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_ppo_policy_loss_is_clipped_surrogate_minus_entropy_bonus(tiny_path, tmp_path, tokenizer, mode, entropy_coef):
    cfg = ppo_cfg(tiny_path, tmp_path, aggregation=mode, entropy_coef=entropy_coef, eps=0.2, **{"sampling.max_new_tokens": BUDGET})
    policy = load_policy(tiny_path)
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    loss, stats = ppo.policy_loss(policy, rollout, padded(TOKEN_ADVANTAGES), rollout.completion_mask.float(), cfg)
    loss.backward()
    trainer_grads = grads(policy)
    policy.zero_grad()
    logp, entropy = hand_forward(policy, tokenizer, with_entropy=True)
    expected = hand_ppo_policy_loss(logp, entropy, old, TOKEN_ADVANTAGES, 0.2, entropy_coef, mode, max_len=BUDGET)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(trainer_grads, grads(policy))
    mean_entropy = sum(float(h.detach()) for row in entropy for h in row) / sum(len(row) for row in entropy)
    assert float(stats["entropy"]) == pytest.approx(mean_entropy, rel=1e-5)


@pytest.mark.parametrize("value_clip", [None, 0.2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_ppo_critic_loss_reads_v_at_the_state_before_each_token(tiny_path, tmp_path, tokenizer, value_clip, mode):
    # V(s_t) is the critic's scalar where the policy's logits for token t are read (P_i - 1 + t of
    # row i): one position later (the state after token t) or earlier fails the comparison
    cfg = ppo_cfg(tiny_path, tmp_path, value_clip=value_clip, aggregation=mode, **{"sampling.max_new_tokens": BUDGET})
    torch.manual_seed(0)  # the critic's fresh value head
    critic = load_critic(tiny_path)
    rollout = build_rollout(tokenizer, [[0.0] * len(c) for c in COMPLETIONS])
    values = detached(hand_values(critic, tokenizer))
    # V_old = V + shifts: |shift| > 0.2 on some tokens so the clipped error decides there
    shifts = [[0.5, -0.1, 0.3, -0.35], [0.05, -0.6], [0.25, 0.0, -0.3, 0.1], [-0.45, 0.15, 0.4]]
    old_values = [[v + shifts[i][t] for t, v in enumerate(row)] for i, row in enumerate(values)]
    returns = [[v + 0.7 * (-1) ** t for t, v in enumerate(row)] for row in old_values]
    loss, stats = ppo.critic_loss(critic, rollout, padded(returns), padded(old_values), rollout.completion_mask.float(), cfg)
    loss.backward()
    trainer_grads = grads(critic)
    critic.zero_grad()
    expected = hand_value_loss(hand_values(critic, tokenizer), returns, old_values, value_clip, mode, max_len=BUDGET)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(trainer_grads, grads(critic))


def hand_ppo_advantages(scores, old, ref, values, beta, estimator, gamma, lam, whiten):
    """r_t = -beta KL_t (+ score at the last token); delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the
    last token); A_t = delta_t + gamma lam A_{t+1}; R_t = A_t + V_t; then A whitened over all tokens."""
    kl = [[(o - r) if estimator == "k1" else (math.exp(r - o) - (r - o) - 1) for o, r in zip(old[i], ref[i])] for i in range(len(old))]
    advantages, returns = [], []
    for i, row in enumerate(kl):
        rewards = [-beta * k for k in row]
        rewards[-1] += scores[i]
        adv = [0.0] * len(row)
        running = 0.0
        for t in reversed(range(len(row))):
            next_value = values[i][t + 1] if t + 1 < len(row) else 0.0
            running = rewards[t] + gamma * next_value - values[i][t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([a + v for a, v in zip(adv, values[i])])
    if whiten:
        flat = [a for row in advantages for a in row]
        mean = sum(flat) / len(flat)
        var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
        advantages = [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in advantages]
    return advantages, returns, kl


@pytest.mark.parametrize(
    "gamma, lam, whiten, estimator",
    [(1.0, 0.95, False, "k1"), (0.9, 0.5, False, "k3"), (0.8, 1.0, True, "k1"), (1.0, 0.0, True, "k3")],
)
def test_ppo_advantages_by_hand(gamma, lam, whiten, estimator):
    old = [[-1.0, -2.0, -0.5, -1.5], [-0.3, -0.9], [-2.0, -1.0, -0.2, -0.7], [-1.2, -0.4, -0.8]]
    ref = [[o + s for o, s in zip(row, shifts)] for row, shifts in zip(old, REF_SHIFTS)]
    values = [[0.5, 1.0, -0.5, 0.2], [0.3, -0.7], [1.2, 0.1, 0.4, -0.9], [-0.2, 0.6, 0.05]]
    scores = [2.0, -1.0, 0.5, 1.5]
    mask = padded([[1.0] * len(row) for row in old])
    _, adv, ret, kl = ppo.ppo_advantages(torch.tensor(scores), padded(old), padded(ref), padded(values), mask, 0.1, estimator, gamma, lam, whiten)
    hand_adv, hand_ret, hand_kl = hand_ppo_advantages(scores, old, ref, values, 0.1, estimator, gamma, lam, whiten)
    torch.testing.assert_close(adv, padded(hand_adv), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, padded(hand_ret), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl, padded(hand_kl), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the defaults: k1, gamma 1, lambda 0.95, whitening, value clip 0.2, fixed beta, 4 epochs x 2 minibatches
        {"kl_estimator": "k3", "gamma": 0.9, "lam": 0.5, "whiten_advantages": False, "value_clip": None, "entropy_coef": 0.05},
        # kl_target: "near" = 0.95 x the rollout's KL, so the controller's error 1/0.95 - 1 is inside its +-0.2 clip
        {"kl_target": "near", "kl_horizon": 20.0, "missing_eos_penalty": 1.5, "num_minibatches": 2, "ppo_epochs": 2, "aggregation": "seq-mean-token-sum-norm"},
        # a bfloat16 sampler: log pi_old is recomputed by the training forward before the rewards are shaped
        {"sampling.dtype": "bfloat16", "ppo_epochs": 1},
    ],
    ids=["defaults", "k3-gamma-lambda-unwhitened-unclipped-entropy", "adaptive-kl-eos-penalty-2-minibatches-sum-norm", "recompute-pi-old"],
)
def test_ppo_step_by_hand(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch, overrides):
    # the whole step: scores (minus the missing-EOS penalty), KL-shaped rewards at pi_old (the
    # sampler's log-probs, or the training forward's when the sampler is bfloat16) against the
    # reference, GAE on the critic's values before any update, then epochs x shuffled minibatches (the step's own permutations), a policy and a critic step each
    torch.manual_seed(0)  # the critic's fresh value head
    policy, reference, critic = load_policy(tiny_path), load_policy(ref_path), load_critic(tiny_path)
    old_values = detached(hand_values(critic, tokenizer))
    rollout, logp0, sampler_logp, _ = shifted_rollout(policy, tokenizer)
    old = detached(logp0) if overrides.get("sampling.dtype") else sampler_logp  # log pi_old
    ref = detached(hand_forward(reference, tokenizer))
    if overrides.get("kl_target") == "near":
        rollout_kl = sum(o - r for old_row, ref_row in zip(old, ref) for o, r in zip(old_row, ref_row)) / 4  # mean per-sequence k1
        overrides = {**overrides, "kl_target": 0.95 * rollout_kl}
    cfg = ppo_cfg(tiny_path, tmp_path, kl_coef=0.2, **{"optim.grad_clip": None, "critic.optim.grad_clip": None}, **overrides)
    fixed_sampler(monkeypatch, ppo, rollout)
    lr, critic_lr = 0.1, 0.02
    policy_updater, critic_updater = sgd_updater(policy, lr), sgd_updater(critic, critic_lr)
    policy_updates, critic_updates = recording(policy_updater), recording(critic_updater)
    kl_ctl = cfg.kl_controller()
    assert isinstance(kl_ctl, AdaptiveKLController if cfg.kl_target else FixedKLController)
    state = ppo.TrainState(step=0, generator=torch.Generator().manual_seed(3))
    prompts = load_prompts([{"prompt": p} for p in PROMPTS])
    metrics, _ = ppo.ppo_step(policy_updater, critic_updater, reference, kl_ctl, make_source(cfg, policy_updater, tokenizer, [fixed_scores(SCORES)], prompts), state, cfg)

    scores = [s - (cfg.missing_eos_penalty or 0.0) * (i == 2) for i, s in enumerate(SCORES)]  # row 2 has no EOS
    advantages, returns, kl = hand_ppo_advantages(scores, old, ref, old_values, 0.2, cfg.kl_estimator, cfg.gamma, cfg.lam, cfg.whiten_advantages)
    size = 4 // cfg.num_minibatches
    generator = torch.Generator().manual_seed(3)
    minibatches = [order[i : i + size] for order in (torch.randperm(4, generator=generator).tolist() for _ in range(cfg.ppo_epochs)) for i in range(0, 4, size)]
    assert len(policy_updates) == len(critic_updates) == len(minibatches)
    for k, rows in enumerate(minibatches):
        twin = at_params(copy.deepcopy(policy), policy_updates[k].params)
        logp, entropy = hand_forward(twin, tokenizer, with_entropy=True)
        loss_pi = hand_ppo_policy_loss(logp, entropy, old, advantages, cfg.eps, cfg.entropy_coef, cfg.aggregation, rows)
        assert_update(policy_updates[k], twin, loss_pi, lr, next_params=policy_updates[k + 1].params if k + 1 < len(minibatches) else final_params(policy))
        twin_critic = at_params(copy.deepcopy(critic), critic_updates[k].params)
        loss_v = hand_value_loss(hand_values(twin_critic, tokenizer), returns, old_values, cfg.value_clip, cfg.aggregation, rows)
        assert_update(critic_updates[k], twin_critic, loss_v, critic_lr, next_params=critic_updates[k + 1].params if k + 1 < len(minibatches) else final_params(critic))

    for updates in (policy_updates, critic_updates):  # real gradients, not all clipped away
        assert max(g.abs().max().item() for u in updates for g in u.grads.values()) > 1e-3

    # metrics and the KL coefficient for the next step: beta <- beta (1 + clip(KL / target - 1, +-0.2) B / horizon)
    seq_kl = sum(sum(row) for row in kl) / 4
    assert metrics["kl"] == pytest.approx(seq_kl, rel=1e-5, abs=1e-6)  # a difference of log-probs ~ -3: float32 cancellation
    assert metrics["score"] == pytest.approx(sum(scores) / 4, rel=1e-6)
    assert metrics["beta"] == 0.2
    assert metrics["non_score_reward"] == pytest.approx(-0.2 * seq_kl, rel=1e-5, abs=1e-6)
    if cfg.kl_target:
        error = min(max(seq_kl / cfg.kl_target - 1, -0.2), 0.2)
        assert error == pytest.approx(1 / 0.95 - 1, rel=1e-4)  # not clipped: the controller's size is pinned, not only its sign
        # the controller is fed the trainer's KL (float32; within 1e-5 of the hand value above), so pin its update on that
        trainer_error = min(max(metrics["kl"] / cfg.kl_target - 1, -0.2), 0.2)
        assert kl_ctl.value == pytest.approx(0.2 * (1 + trainer_error * 4 / cfg.kl_horizon), rel=1e-6)
        assert kl_ctl.value != 0.2
    else:
        assert kl_ctl.value == 0.2


def test_ppo_next_step_uses_the_updated_beta(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch):
    # the adaptive controller's new beta shapes the rewards of the next step: non_score_reward = -beta_2 * KL
    cfg = ppo_cfg(tiny_path, tmp_path, kl_coef=0.2, kl_target=0.5, kl_horizon=10.0, ppo_epochs=1, num_minibatches=1)
    policy, reference, critic = load_policy(tiny_path), load_policy(ref_path), load_critic(tiny_path)
    rollout, _, _, _ = shifted_rollout(policy, tokenizer)
    fixed_sampler(monkeypatch, ppo, rollout)
    kl_ctl = cfg.kl_controller()
    state = ppo.TrainState(step=0, generator=torch.Generator().manual_seed(0))
    prompts = load_prompts([{"prompt": p} for p in PROMPTS])
    policy_updater = sgd_updater(policy, 0.0)
    args = (policy_updater, sgd_updater(critic, 0.0), reference, kl_ctl, make_source(cfg, policy_updater, tokenizer, [fixed_scores(SCORES)], prompts), state, cfg)
    first, _ = ppo.ppo_step(*args)
    beta_2 = kl_ctl.value
    state.step = 1
    second, _ = ppo.ppo_step(*args)
    assert first["beta"] == 0.2 and second["beta"] == beta_2 != 0.2
    assert second["non_score_reward"] == pytest.approx(-beta_2 * second["kl"], rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Under torchrun: each rank's loss is multiplied by its share of the global normaliser
# ----------------------------------------------------------------------------------------------


def test_grpo_step_scales_each_update_by_the_distributed_loss_scale(tiny_path, tmp_path, tokenizer, monkeypatch):
    # loss_scale is 1 in one process; under torchrun rank r's minibatch loss is multiplied by
    # W n_r / sum_s n_s (rlalign.train.distributed.loss_scale, pinned in test_sft_rm_composed.py).
    # With a scale of 0.25 the optimiser must see 0.25 x the hand loss and its gradient.
    cfg = grpo_cfg(tiny_path, tmp_path, beta=0.0, mu=1, num_minibatches=2)
    policy = load_policy(tiny_path)
    rollout, _, sampler_logp, _ = shifted_rollout(policy, tokenizer)
    fixed_sampler(monkeypatch, grpo, rollout)
    monkeypatch.setattr(grpo.distributed, "loss_scale", lambda count, world: 0.25)
    updater = sgd_updater(policy, 0.0)
    updates = recording(updater)
    grpo.grpo_step(updater, None, make_source(cfg, updater, tokenizer, [fixed_scores(SCORES)], prompt_examples()), grpo.TrainState(0, torch.Generator().manual_seed(0)), cfg)
    advantages = hand_group_advantages(SCORES, 2, "group")
    for k, update in enumerate(updates):
        twin = at_params(copy.deepcopy(policy), update.params)
        logp = hand_forward(twin, tokenizer)
        loss = hand_grpo_loss(logp, sampler_logp, None, advantages, all_counted(logp), cfg.eps_low, cfg.eps_high, 0.0, cfg.aggregation, range(k, 4, 2))
        assert_update(update, twin, 0.25 * loss, 0.0)


def test_ppo_step_leaves_out_a_row_no_reward_could_score(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch):
    # row 1 unscored: its tokens enter neither the whitening, nor the policy loss, nor the value loss, so
    # moving its sampler log-probs (its KL-shaped rewards, its ratios) changes no update; scored, they do
    def first_updates(scores, shift):
        torch.manual_seed(0)  # the critic's fresh value head
        policy, reference, critic = load_policy(tiny_path), load_policy(ref_path), load_critic(tiny_path)
        rollout, _, _, _ = shifted_rollout(policy, tokenizer)
        rollout.logprobs[1] += shift * rollout.completion_mask[1]
        cfg = ppo_cfg(tiny_path, tmp_path, kl_coef=0.2, ppo_epochs=1, num_minibatches=1)
        fixed_sampler(monkeypatch, ppo, rollout)
        policy_updater, critic_updater = sgd_updater(policy, 0.0), sgd_updater(critic, 0.0)
        policy_updates, critic_updates = recording(policy_updater), recording(critic_updater)
        source = make_source(cfg, policy_updater, tokenizer, [fixed_scores(scores)], load_prompts([{"prompt": p} for p in PROMPTS]))
        metrics, _ = ppo.ppo_step(policy_updater, critic_updater, reference, cfg.kl_controller(), source, ppo.TrainState(step=0, generator=torch.Generator().manual_seed(0)), cfg)
        return policy_updates[0].grads, critic_updates[0].grads, metrics

    unscored = [SCORES[0], UNSCORED, *SCORES[2:]]
    (policy_a, critic_a, metrics), (policy_b, critic_b, _) = first_updates(unscored, 0.0), first_updates(unscored, 0.7)
    for a, b in ((policy_a, policy_b), (critic_a, critic_b)):
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    assert metrics["reward/fixed/failed"] == 1.0
    scored_a, _, _ = first_updates(SCORES, 0.0)
    scored_b, _, _ = first_updates(SCORES, 0.7)
    assert any(not torch.allclose(scored_a[k], scored_b[k], rtol=1e-5, atol=1e-7) for k in scored_a)  # the shift matters when the row trains


def test_ppo_step_scales_policy_and_critic_updates_by_the_distributed_loss_scale(tiny_path, ref_path, tmp_path, tokenizer, monkeypatch):
    cfg = ppo_cfg(tiny_path, tmp_path, kl_coef=0.2, ppo_epochs=1, num_minibatches=1, **{"optim.grad_clip": None, "critic.optim.grad_clip": None})
    torch.manual_seed(0)  # the critic's fresh value head
    policy, reference, critic = load_policy(tiny_path), load_policy(ref_path), load_critic(tiny_path)
    old_values = detached(hand_values(critic, tokenizer))
    rollout, _, old, _ = shifted_rollout(policy, tokenizer)
    ref = detached(hand_forward(reference, tokenizer))
    fixed_sampler(monkeypatch, ppo, rollout)
    monkeypatch.setattr(ppo.distributed, "loss_scale", lambda count, world: 0.25)
    policy_updater, critic_updater = sgd_updater(policy, 0.0), sgd_updater(critic, 0.0)
    policy_updates, critic_updates = recording(policy_updater), recording(critic_updater)
    prompts = load_prompts([{"prompt": p} for p in PROMPTS])
    state = ppo.TrainState(step=0, generator=torch.Generator().manual_seed(0))
    ppo.ppo_step(policy_updater, critic_updater, reference, cfg.kl_controller(), make_source(cfg, policy_updater, tokenizer, [fixed_scores(SCORES)], prompts), state, cfg)
    advantages, returns, _ = hand_ppo_advantages(SCORES, old, ref, old_values, 0.2, cfg.kl_estimator, cfg.gamma, cfg.lam, cfg.whiten_advantages)
    twin = at_params(copy.deepcopy(policy), policy_updates[0].params)
    logp, entropy = hand_forward(twin, tokenizer, with_entropy=True)
    assert_update(policy_updates[0], twin, 0.25 * hand_ppo_policy_loss(logp, entropy, old, advantages, cfg.eps, cfg.entropy_coef, cfg.aggregation), 0.0)
    twin_critic = at_params(copy.deepcopy(critic), critic_updates[0].params)
    loss_v = hand_value_loss(hand_values(twin_critic, tokenizer), returns, old_values, cfg.value_clip, cfg.aggregation)
    assert_update(critic_updates[0], twin_critic, 0.25 * loss_v, 0.0)
