"""SFT and reward-model losses pinned term by term, value and gradient, against hand computations.

Each trainer's own per-batch loss (the ``batch_loss`` closure that ``train`` hands to
``supervised_loop``, captured by replacing the loop) runs on a tiny fixed batch with a tiny model of
fixed weights. The reference is written here from the seeds' formulas with plain loops: one
sequence at a time, no padding, no mask, token ids spelt out by hand, a full-vocabulary
log-softmax, the reward read at the sequence's last token:

    SFT:  L = sum_i sum_{t in completion_i (EOS included)} -log pi(y_t | y_<t) / sum_i |completion_i|
    RM:   L = 1/B sum_i -log sigmoid(r_c,i - r_r,i - m_i) + c * 1/B sum_i (r_c,i + r_r,i)^2

The token-mean of the SFT loss is TRL's completion-only loss (cross-entropy averaged over every
unmasked label of the batch); the centring term is TRL's ``center_rewards_coefficient`` term
(Eisenstein et al. 2023) and the margin is Llama 2's (Touvron et al. 2023, eq. 2).

Under torchrun each rank's loss is multiplied by ``distributed.loss_scale`` of its count; the
two-rank cases here run both shares in one process with the all-reduce replaced by the sum of the
shares' counts, and check that the average of the scaled losses (what DDP's gradient averaging
optimises) is the one-process loss of the global batch.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model, LlamaConfig, LlamaForCausalLM, LlamaModel

from rlalign.config import ConfigError, load_config
from rlalign.core.losses import AGGREGATION_MODES, aggregate
from rlalign.lm.data import PreferenceExample, SFTExample
from rlalign.lm.heads import ScalarHeadModel
from rlalign.lm.rewards import RewardModelReward
from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_checkpoint
from rlalign.train import distributed, reward_model, sft

torch.set_num_threads(1)

TOK = build_char_tokenizer()
PAD, BOS, EOS = 0, 1, 2
VOCAB = TOK.get_vocab()
assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id) == (PAD, BOS, EOS)


def ids_of(text: str) -> list[int]:
    """Token ids written out by hand: one id per character, the literal text "<eos>" is EOS."""
    out = []
    for piece in re.split(r"(<eos>)", text):
        out += [EOS] if piece == "<eos>" else [VOCAB[c] for c in piece]
    return out


# --- tiny models with fixed weights (float64 backbones; a ScalarHeadModel keeps its head in float32) ---


def _llama_config(**extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
                       pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, **extra)


def _gpt2_config() -> GPT2Config:
    # absolute position embeddings: a wrong position id changes the output (RoPE only sees offsets)
    return GPT2Config(vocab_size=len(TOK), n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2, tie_word_embeddings=False,
                      pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def make_lm(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()) if arch == "llama" else GPT2LMHeadModel(_gpt2_config())
    return model.double().eval()


def make_rm(arch: str) -> ScalarHeadModel:
    torch.manual_seed(1)
    backbone = LlamaModel(_llama_config()) if arch == "llama" else GPT2Model(_gpt2_config())
    return ScalarHeadModel(backbone.double().eval(), init_std=0.5)  # rewards of order 1


# --- the trainers' own batch losses, captured from train() ---


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("base"), spec)


def _captured_batch_loss(module, config_cls, overrides: list[str]):
    """The ``batch_loss`` closure ``module.train`` builds for ``overrides``, taken from its call to supervised_loop."""
    captured = {}

    def fake_loop(cfg, run, model, train_set, batch_loss, *rest):
        captured["batch_loss"] = batch_loss
        return {}

    cfg = load_config(config_cls, None, overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "supervised_loop", fake_loop)
        module.train(cfg)
    return captured["batch_loss"]


def _cached_batch_losses(module, config_cls, base_path, tmp_path_factory):
    """``get(**options)``: the trainer's batch loss under these config options, built once per options."""
    cache = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
            overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]
            cache[key] = _captured_batch_loss(module, config_cls, [
                f"output_dir={out}", f"model.path={base_path}", "data.num_train=2", "data.num_eval=1", "progress=false", *overrides])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def sft_batch_loss(base_path, tmp_path_factory):
    get = _cached_batch_losses(sft, sft.SFTConfig, base_path, tmp_path_factory)
    return lambda packing, max_length=20: get(**{"data.packing": packing, "data.max_length": max_length})


@pytest.fixture(scope="module")
def rm_batch_loss(base_path, tmp_path_factory):
    get = _cached_batch_losses(reward_model, reward_model.RMConfig, base_path, tmp_path_factory)
    return lambda use_margin, center_coef: get(use_margin=use_margin, center_coef=center_coef)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(model, expected: dict[str, torch.Tensor]) -> None:
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert max(g.abs().max().item() for g in expected.values()) > 1e-2  # a real gradient, not zeros


def _two_ranks(monkeypatch, losses_and_counts) -> torch.Tensor:
    """DDP's objective for two ranks: 1/W sum_r loss_r * loss_scale(count_r), the all-reduce of the
    counts replaced by their sum."""
    total = sum(float(c) for _, c in losses_and_counts)
    monkeypatch.setattr(distributed, "all_sum", lambda x, world: torch.tensor(total, dtype=torch.float64))
    size = len(losses_and_counts)
    scaled = [loss * distributed.loss_scale(count, distributed.World(rank=r, size=size)) for r, (loss, count) in enumerate(losses_and_counts)]
    return sum(scaled) / size


# ============================== SFT ==============================

# prompts of 1, 4, 5 and 6 characters, completions of 1 to 3 characters, one with an EOS inside.
# Rows (BOS + prompt + completion + EOS): 7, 10, 6 and 9 tokens.
SFT_EXAMPLES = [SFTExample("1+2=", "3"), SFTExample("10+20=", "30"), SFTExample("x", "7<eos>y"), SFTExample("abc?", "yes")]


def hand_sft(model, examples: list[SFTExample], max_length: int = 10**9) -> tuple[torch.Tensor, int]:
    """(sum of completion-token NLLs, number of completion tokens), one unpadded sequence at a time."""
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for ex in examples:
        prompt = [BOS] + ids_of(ex.prompt)
        seq = (prompt + ids_of(ex.completion) + [EOS])[:max_length]
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()  # (T, V), positions 0..T-1
        logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # full log-softmax
        for t in range(len(prompt), len(seq)):  # token t is predicted at position t - 1
            nll = nll - logp[t - 1, seq[t]]
            count += 1
    return nll, count


def test_hand_sft_counts_the_completion_and_its_eos():
    # "3"+EOS, "30"+EOS, "7"+EOS+"y"+EOS, "yes"+EOS: 2 + 3 + 4 + 4 = 13 targets
    assert hand_sft(make_lm("llama"), SFT_EXAMPLES)[1] == 13


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("packing", [False, True])
def test_sft_loss_and_gradient_equal_the_hand_token_mean(sft_batch_loss, arch, packing):
    batch_loss = sft_batch_loss(packing)
    model = make_lm(arch)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append((kwargs["input_ids"].shape, kwargs["attention_mask"] is None)), with_kwargs=True)
    loss, stats, count = batch_loss(model, SFT_EXAMPLES)
    hook.remove()
    loss.backward()
    trainer_grads = _grads(model)

    # packing (max_length 20): rows [7 + 10 tokens], [6 + 9 tokens], no attention mask; else 4 right-padded rows
    assert seen == ([(torch.Size([2, 17]), True)] if packing else [(torch.Size([4, 10]), False)])
    model.zero_grad()
    nll, tokens = hand_sft(model, SFT_EXAMPLES)
    expected = nll / tokens  # a mean over the batch's 13 completion tokens, not a mean of per-example means
    expected.backward()
    assert count == tokens == 13
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-10)
    assert stats["loss/sft"] == pytest.approx(expected.item(), rel=1e-9)
    for name, grad in trainer_grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert max(g.abs().max().item() for g in trainer_grads.values()) > 1e-2


def test_sft_loss_is_not_a_mean_of_per_example_means(sft_batch_loss):
    # guards the test above: with completions of 2, 3, 4, 4 tokens the two normalisations differ
    model = make_lm("llama")
    loss, _, _ = sft_batch_loss(False)(model, SFT_EXAMPLES)
    per_example = [hand_sft(model, [ex]) for ex in SFT_EXAMPLES]
    seq_mean = sum(n / c for n, c in per_example) / len(per_example)
    assert abs(loss.item() - seq_mean.item()) > 1e-3


@pytest.mark.parametrize("completion_only,tokens", [(True, 15), (False, 19)])
def test_packed_examples_never_predict_each_other(completion_only, tokens):
    # texts learn every token, and so do pairs without completion_only: end to end in a packed row, one example's last token
    # must not predict the next one's first (TRL masks position 0). Targets by hand: "abc" [BOS a b c EOS] 4, "hello" 6,
    # "xy" 3; "1+2=" -> "3": "3" and EOS, or all 6 tokens after BOS. Packed, those 4 examples are one row.
    examples = [SFTExample(None, "abc"), SFTExample(None, "hello"), SFT_EXAMPLES[0], SFTExample(None, "xy")]
    model = make_lm("llama")
    padded, padded_stats = sft._batch_loss(model, TOK, examples, 64, False, completion_only)
    packed, packed_stats = sft._batch_loss(model, TOK, examples, 64, True, completion_only)
    assert padded_stats.tokens == packed_stats.tokens == tokens
    torch.testing.assert_close(packed, padded, rtol=1e-6, atol=1e-7)


def test_packing_is_refused_for_a_model_that_would_let_packed_examples_attend_to_each_other(base_path, tmp_path, monkeypatch):
    # OPT and Bloom ignore the position restarts: their packed loss differed from the padded one (20.08 against 21.29)
    monkeypatch.setattr(sft, "packs_rows", lambda model: False)
    cfg = load_config(sft.SFTConfig, None, [f"output_dir={tmp_path}", f"model.path={base_path}", "data.num_train=2", "data.num_eval=1",
                                            "progress=false", "data.packing=true"])
    with pytest.raises(ConfigError, match=r"data.packing: true needs a model .*'llama' under 'sdpa'.*set data.packing=false"):
        sft.train(cfg)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_truncation_keeps_the_first_max_length_tokens(sft_batch_loss, packing):
    # BOS 1 + 2 = | 3 4 5 6 7 8 EOS: 12 tokens cut to 8 keeps 3 4 5 as targets and loses the EOS
    example = SFTExample("1+2=", "345678")
    model = make_lm("gpt2")
    loss, _, count = sft_batch_loss(packing, max_length=8)(model, [example, SFT_EXAMPLES[2]])  # the second (6 tokens) fits whole
    nll, tokens = hand_sft(model, [example, SFT_EXAMPLES[2]], max_length=8)
    assert count == tokens == 3 + 4
    torch.testing.assert_close(loss, nll / tokens, rtol=1e-9, atol=1e-10)


def test_sft_eval_loss_is_token_weighted_over_chunks(base_path, tmp_path):
    # eval batches of 3 then 1 pairs hold 2 + 3 + 4 = 9 and 4 tokens: the eval loss is sum nll / 13,
    # not the mean of the two chunk means
    cfg = load_config(sft.SFTConfig, None, [f"output_dir={tmp_path}", "eval_batch_size=3"])
    model = make_lm("llama")
    nll, tokens = hand_sft(model, SFT_EXAMPLES)
    assert sft._eval_loss(model, TOK, SFT_EXAMPLES, cfg) == pytest.approx((nll / tokens).item(), rel=1e-9)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_two_ranks_scaled_by_their_token_counts_give_the_global_loss(sft_batch_loss, monkeypatch, packing):
    # rank 0 holds 2 + 3 = 5 targets, rank 1 4 + 4 = 8: loss_scale = 2 * 5 / 13 and 2 * 8 / 13, so
    # 1/2 (S_0/5 * 10/13 + S_1/8 * 16/13) = (S_0 + S_1) / 13
    batch_loss = sft_batch_loss(packing)
    model = make_lm("llama")
    shares = [batch_loss(model, SFT_EXAMPLES[:2]), batch_loss(model, SFT_EXAMPLES[2:])]
    assert [c for _, _, c in shares] == [5, 8]
    combined = _two_ranks(monkeypatch, [(loss, count) for loss, _, count in shares])
    combined.backward()
    trainer_grads = _grads(model)
    model.zero_grad()
    nll, tokens = hand_sft(model, SFT_EXAMPLES)
    (nll / tokens).backward()
    torch.testing.assert_close(combined, nll / tokens, rtol=1e-9, atol=1e-10)
    _assert_same_grads(model, trainer_grads)


# ============================== reward model ==============================

# prompts of 1 to 4 characters; responses of 1 to 5, one with an EOS inside; margins with one missing (0).
# Sequences (BOS + prompt + response + EOS): chosen 7, 9, 8, 6 tokens, rejected 10, 11, 4, 6.
RM_PAIRS = [
    PreferenceExample("1+2=", "3", "45<eos>6", 1.5),
    PreferenceExample("abcd", "xyz", "yy<eos>zz", None),
    PreferenceExample("q", "hello", "h", 0.5),
    PreferenceExample("zz", "ab", "ba", 2.0),
]


def hand_score(model: ScalarHeadModel, seq: list[int]) -> torch.Tensor:
    """The head at the last token of the sequence alone (no padding, no mask, default positions)."""
    hidden = model.backbone(input_ids=torch.tensor([seq])).last_hidden_state  # (1, T, H)
    return model.head(hidden[0, -1].float())[0]


def hand_pair_rewards(model, pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(hand_score(model, [BOS] + ids_of(p.prompt) + ids_of(p.chosen) + [EOS]),
             hand_score(model, [BOS] + ids_of(p.prompt) + ids_of(p.rejected) + [EOS])) for p in pairs]


def hand_bt(rewards, margins, use_margin: bool, center_coef: float) -> torch.Tensor:
    loss = 0.0
    for (r_c, r_r), m in zip(rewards, margins):
        x = r_c - r_r - ((m or 0.0) if use_margin else 0.0)
        loss = loss + torch.log(1 + torch.exp(-x))  # -log sigmoid(x)
        loss = loss + center_coef * (r_c + r_r) ** 2
    return loss / len(rewards)


@pytest.mark.parametrize("use_margin,center_coef", [(False, 0.0), (True, 0.0), (False, 0.3), (True, 0.3), ("null", 0.0)])
def test_rm_loss_and_gradient_equal_bradley_terry_by_hand(rm_batch_loss, use_margin, center_coef):
    # the data carry margins in every case: with use_margin=false they must be ignored; null (the default) uses them,
    # as TRL's RewardTrainer does whenever the data has a margin column
    model = make_rm("llama")
    loss, stats, count = rm_batch_loss(use_margin, center_coef)(model, RM_PAIRS)
    use_margin = use_margin is not False
    loss.backward()
    trainer_grads = _grads(model)

    model.zero_grad()
    rewards = hand_pair_rewards(model, RM_PAIRS)
    expected = hand_bt(rewards, [p.margin for p in RM_PAIRS], use_margin, center_coef)
    expected.backward()
    assert count == 4  # a mean over pairs
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    _assert_same_grads(model, trainer_grads)

    diffs = [(r_c - r_r).item() for r_c, r_r in rewards]
    assert stats["loss/rm"] == pytest.approx(expected.item(), rel=1e-5)
    assert stats["accuracy"] == sum(d > 0 for d in diffs) / 4
    assert stats["margin"] == pytest.approx(sum(diffs) / 4, rel=1e-5, abs=1e-6)  # r_c - r_r, without the pair margins
    assert stats["reward/mean"] == pytest.approx(sum(r.item() for pair in rewards for r in pair) / 8, rel=1e-5, abs=1e-6)


def test_rm_cases_differ(rm_batch_loss):
    # guards the test above: margin and centring each move the loss by more than its tolerance
    model = make_rm("llama")
    with torch.no_grad():
        values = {key: rm_batch_loss(*key)(model, RM_PAIRS)[0].item() for key in [(False, 0.0), (True, 0.0), (False, 0.3)]}
    assert abs(values[(True, 0.0)] - values[(False, 0.0)]) > 0.1 and abs(values[(False, 0.3)] - values[(False, 0.0)]) > 0.1


def test_rm_two_ranks_give_the_global_loss(rm_batch_loss, monkeypatch):
    # two pairs a rank: loss_scale = 2 * 2 / 4 = 1 each, and 1/2 (mean_0 + mean_1) is the mean of 4
    batch_loss = rm_batch_loss(True, 0.3)
    model = make_rm("llama")
    shares = [batch_loss(model, RM_PAIRS[:2]), batch_loss(model, RM_PAIRS[2:])]
    combined = _two_ranks(monkeypatch, [(loss, count) for loss, _, count in shares])
    combined.backward()
    trainer_grads = _grads(model)
    model.zero_grad()
    expected = hand_bt(hand_pair_rewards(model, RM_PAIRS), [p.margin for p in RM_PAIRS], True, 0.3)
    expected.backward()
    torch.testing.assert_close(combined, expected, rtol=1e-5, atol=1e-6)
    _assert_same_grads(model, trainer_grads)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reward_is_read_at_the_last_real_token_under_any_padding(arch):
    # rows of a (B, T) batch and the position of their last real token:
    #   left-padded;  EOS inside, right-padded with EOS as filler;  padded on both sides;  no padding
    model = make_rm(arch)
    a, b, c, x, y = (VOCAB[ch] for ch in "abcxy")
    rows = [
        ([PAD, PAD, BOS, a, b, EOS], [0, 0, 1, 1, 1, 1]),
        ([BOS, a, EOS, c, EOS, EOS], [1, 1, 1, 1, 1, 0]),
        ([PAD, BOS, x, y, EOS, PAD], [0, 1, 1, 1, 1, 0]),
        ([BOS, x, a, b, c, EOS], [1, 1, 1, 1, 1, 1]),
    ]
    ids = torch.tensor([r for r, _ in rows])
    mask = torch.tensor([m for _, m in rows])
    with torch.no_grad():
        scores = model.sequence_scores(ids, mask)  # (4,)
        expected = torch.stack([hand_score(model, [t for t, m in zip(r, ms) if m]) for r, ms in rows])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert (expected[:, None] - expected[None, :]).abs().add(torch.eye(4)).min() > 1e-3  # four different scores


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pair_rewards_and_reward_function_read_each_sequence_at_its_eos(arch):
    # collate_preferences right-pads chosen then rejected to 11 tokens; each reward is the head at
    # the closing EOS of its own sequence (not at an EOS inside the response, not at padding)
    model = make_rm(arch)
    with torch.no_grad():
        r_c, r_r, margin = reward_model.pair_rewards(model, TOK, RM_PAIRS, max_length=64)
        expected = hand_pair_rewards(model, RM_PAIRS)
        torch.testing.assert_close(r_c, torch.stack([c for c, _ in expected]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r_r, torch.stack([r for _, r in expected]), rtol=1e-5, atol=1e-6)
        assert margin.tolist() == [1.5, 0.0, 0.5, 2.0]  # a missing margin is 0
        # the reward function PPO and GRPO call scores prompt + completion the same way, in the format rlalign rm trains (eos)
        scored = RewardModelReward(model, TOK, "eos", batch_size=3)([p.prompt for p in RM_PAIRS], [p.rejected for p in RM_PAIRS])
        assert scored == pytest.approx([r.item() for _, r in expected], rel=1e-5, abs=1e-6)


def test_pair_rewards_keep_the_end_of_long_sequences():
    # max_length 6: "<bos>1+2=3<eos>" (7 tokens) keeps its last 6, "1+2=3<eos>"; the rejected
    # "<bos>1+2=45<eos>6<eos>" (10) keeps "=45<eos>6<eos>": the closing EOS always survives
    model = make_rm("gpt2")
    with torch.no_grad():
        r_c, r_r, _ = reward_model.pair_rewards(model, TOK, RM_PAIRS[:1], max_length=6)
        torch.testing.assert_close(r_c[0], hand_score(model, ids_of("1+2=3<eos>")), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r_r[0], hand_score(model, ids_of("=45<eos>6<eos>")), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_margin,center_coef", [(False, 0.0), (True, 0.3)])
def test_rm_held_out_metrics_over_chunks(use_margin, center_coef):
    # chunks of 3 and 1 pairs; eval/loss is the training loss on the held-out pairs: with the margins (the second chunk's
    # pair has one, the first chunk's a missing one read as 0) and the centring term when the run trains with them
    model = make_rm("llama")
    metrics = reward_model.evaluate_pairs(model, TOK, RM_PAIRS, max_length=64, batch_size=3, use_margin=use_margin, center_coef=center_coef)
    with torch.no_grad():
        rewards = hand_pair_rewards(model, RM_PAIRS)
        loss = hand_bt(rewards, [p.margin for p in RM_PAIRS], use_margin, center_coef)
    diffs = [(c - r).item() for c, r in rewards]
    assert metrics["eval/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["eval/accuracy"] == sum(d > 0 for d in diffs) / 4
    assert metrics["eval/margin"] == pytest.approx(sum(diffs) / 4, rel=1e-5, abs=1e-6)
    assert metrics["eval/reward_mean"] == pytest.approx(sum(r.item() for p in rewards for r in p) / 8, rel=1e-5, abs=1e-6)


# ============================== distributed loss scale, every aggregation mode ==============================

# rank 0: 2 rows of width 3 with 3 and 1 tokens; rank 1: 2 rows of width 5 with 5 and 0 tokens; L = 6.
RANK_LENGTHS = [[3, 1], [5, 0]]
RANK_WIDTHS = [3, 5]
MAX_LEN = 6


def hand_global_loss(rows: list[list[torch.Tensor]], mode: str) -> torch.Tensor:
    """The one-process loss of the 4 rows (each a list of its counted token values), in loops."""
    with_tokens = [r for r in rows if r]
    if mode == "token-mean":  # 9 tokens
        return sum(v for r in rows for v in r) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":  # 3 rows with tokens
        return sum(sum(r) / len(r) for r in with_tokens) / len(with_tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in with_tokens) / len(with_tokens)
    return sum(sum(r) for r in with_tokens) / (len(rows) * MAX_LEN)  # Dr.GRPO: every row, fixed L: / 24


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_loss_scale_makes_two_ranks_compute_the_global_loss(monkeypatch, mode):
    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(2, w, generator=generator, dtype=torch.float64, requires_grad=True) for w in RANK_WIDTHS]
    masks = [torch.tensor([[1] * n + [0] * (w - n) for n in lengths]) for lengths, w in zip(RANK_LENGTHS, RANK_WIDTHS)]
    counts = [distributed.aggregation_count(m, mode) for m in masks]
    expected_counts = {"token-mean": [4, 5], "seq-mean-token-mean": [2, 1], "seq-mean-token-sum": [2, 1], "seq-mean-token-sum-norm": [2, 2]}
    assert [float(c) for c in counts] == expected_counts[mode]
    combined = _two_ranks(monkeypatch, [(aggregate(v, m, mode, max_len=MAX_LEN), c) for v, m, c in zip(values, masks, counts)])
    rows = [[values[r][i, t] for t in range(n)] for r, lengths in enumerate(RANK_LENGTHS) for i, n in enumerate(lengths)]
    expected = hand_global_loss(rows, mode)
    torch.testing.assert_close(combined, expected, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(combined, values)
    want = torch.autograd.grad(expected, values)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_loss_scale_is_zero_when_no_rank_has_anything_to_count(monkeypatch):
    # every rank's minibatch fully masked (e.g. mask_truncated with every completion truncated): the
    # global count is 0, so each rank's (zero) loss is scaled by 0, never by 0 / 0 = NaN
    monkeypatch.setattr(distributed, "all_sum", lambda x, world: torch.zeros((), dtype=torch.float64))
    assert distributed.loss_scale(0.0, distributed.World(rank=0, size=2)) == 0.0


def test_loss_share_is_the_same_on_every_rank_even_one_that_counts_nothing(monkeypatch):
    # counts 0 (a rank whose rows of a PPO minibatch are all elsewhere), 3 and 5 over 3 ranks: every rank's
    # accumulated gradient is multiplied by W / N = 3 / 8, the one factor that, after the ranks' gradients are
    # averaged, gives the gradient of the global loss; loss_scale's n W / N per rank would zero the first's
    monkeypatch.setattr(distributed, "all_sum", lambda x, world: torch.tensor(8.0, dtype=torch.float64))
    shares = [distributed.loss_share(n, distributed.World(rank=r, size=3)) for r, n in enumerate((0.0, 3.0, 5.0))]
    assert shares == [3 / 8, 3 / 8, 3 / 8]
    assert [distributed.loss_scale(n, distributed.World(rank=r, size=3)) for r, n in enumerate((0.0, 3.0, 5.0))] == [0.0, 9 / 8, 15 / 8]
    monkeypatch.setattr(distributed, "all_sum", lambda x, world: torch.zeros((), dtype=torch.float64))
    assert distributed.loss_share(0.0, distributed.World(rank=0, size=2)) == 0.0  # nothing counted anywhere: 0, not 2 / 0
    assert distributed.loss_share(4.0, distributed.World()) == 0.25 and distributed.loss_share(0.0, distributed.World()) == 0.0  # one process: 1 / n
