"""DPO and its family: the trainer's loss on a fixed batch against the formulas computed by hand (value
and gradient, one case per option), the references (LoRA base with adapters off, precomputed) against
a frozen copy, conversational and implicit-prompt data, resume and micro-batches, bad configs, and the
learning test: from an SFT model on the embedded preference task the hidden score rises, KL bounded.

The fixed batch ('|' is the prompt / response boundary; every response ends with EOS):

    pair 0   "1+2="    | chosen "3"      rejected "45678"     responses of different lengths
    pair 1   "10+20="  | chosen "abc"    rejected "x"         a longer prompt (left padding for the others)
    pair 2   "7*8="    | chosen "56"     rejected "65"

The hand side runs the model on each row's real tokens alone (<bos> + prompt + response, no padding,
positions 0..n-1), takes a full log_softmax, sums the response tokens' log-probs, and writes each loss
out in plain Python; the trainer runs its padded 2B-row batch with each pair's prompt run once.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlalign.cli import main
from rlalign.config import ConfigError, load_config
from rlalign.lm.data import DataError, PreferenceExample, load_preferences
from rlalign.lm.encoding import collate_preference_completions, explicit_prompt
from rlalign.lm.models import apply_lora, load_policy, load_reference, load_tokenizer
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import dpo
from rlalign.train.metrics import read_metrics

torch.set_num_threads(1)

PAIRS = [("1+2=", "3", "45678"), ("10+20=", "abc", "x"), ("7*8=", "56", "65")]
TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "progress=false", "plots=false"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), spec, seed=0)


@pytest.fixture(scope="module")
def ref_path(tmp_path_factory):
    """Another tiny model: the frozen reference (its log-probs differ from the policy's)."""
    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ref"), spec, seed=1)


def examples() -> list[PreferenceExample]:
    return [PreferenceExample(p, c, r) for p, c, r in PAIRS]


def hand_logps(model, tokenizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
    """Per pair: summed log pi(chosen), summed log pi(rejected), |chosen|, |rejected| (EOS counted), each row run alone."""

    def ids(text: str) -> list[int]:
        return [tokenizer.convert_tokens_to_ids(c) for c in text]

    def row(prompt: list[int], response: list[int]) -> torch.Tensor:
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([prompt + response])).logits[0].float(), dim=-1)  # (n, V)
        return sum(log_probs[len(prompt) - 1 + t, token] for t, token in enumerate(response))  # position P - 1 + t predicts token t

    out = ([], [], [], [])
    for prompt, chosen, rejected in PAIRS:
        p = [tokenizer.bos_token_id] + ids(prompt)
        c, r = ids(chosen) + [tokenizer.eos_token_id], ids(rejected) + [tokenizer.eos_token_id]
        for values, value in zip(out, (row(p, c), row(p, r), len(c), len(r))):
            values.append(value)
    return out


def log_sigmoid(x):
    return -torch.log1p(torch.exp(-x))


def hand_loss(case: str, policy, reference, tokenizer) -> torch.Tensor:
    """The loss of ``case`` from its equation, pair by pair, then the mean over the 3 pairs."""
    pc, pr, lc, lr = hand_logps(policy, tokenizer)
    with torch.no_grad():
        rc, rr, _, _ = hand_logps(reference, tokenizer)
    beta = {"dpo": 0.3, "cdpo": 0.3, "ipo": 0.4, "simpo": 2.0}[case]
    losses = []
    for i in range(len(PAIRS)):
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        if case == "dpo":  # -log sigmoid(beta h)
            losses.append(-log_sigmoid(beta * h))
        elif case == "cdpo":  # eps = 0.2: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
            losses.append(-0.8 * log_sigmoid(beta * h) - 0.2 * log_sigmoid(-beta * h))
        elif case == "ipo":  # (rho_c / |y_c| - rho_r / |y_r| - 1 / (2 beta))^2
            losses.append(((pc[i] - rc[i]) / lc[i] - (pr[i] - rr[i]) / lr[i] - 1 / (2 * beta)) ** 2)
        else:  # simpo, gamma = 0.7: -log sigmoid(beta log pi(y_c) / |y_c| - beta log pi(y_r) / |y_r| - gamma)
            losses.append(-log_sigmoid(beta * pc[i] / lc[i] - beta * pr[i] / lr[i] - 0.7))
    return sum(losses) / len(losses)


CASES = {
    "dpo": ["loss=dpo", "beta=0.3"],
    "cdpo": ["loss=dpo", "beta=0.3", "label_smoothing=0.2"],
    "ipo": ["loss=ipo", "beta=0.4"],
    "simpo": ["loss=simpo", "beta=2.0", "gamma=0.7"],
}


@pytest.mark.parametrize("case", CASES)
def test_trainer_loss_and_gradient_equal_the_hand_formula(case, tiny_path, ref_path):
    tokenizer = load_tokenizer(tiny_path)
    cfg = load_config(dpo.DPOConfig, None, CASES[case])
    policy, reference = load_policy(tiny_path), load_reference(ref_path)
    logps, lengths, ref = dpo.pair_logps(cfg, tokenizer, policy, reference, [dpo.Pair(ex) for ex in examples()])
    assert (ref is None) == (case == "simpo")
    loss, _ = dpo.preference_loss(cfg, logps, lengths, ref)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
    policy.zero_grad()
    expected = hand_loss(case, policy, reference, tokenizer)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().max() > 1e-4 for g in grads.values())


def test_cases_differ(tiny_path, ref_path):
    # each option changes the number: a trainer that ignored one would fail here, not pass every case
    tokenizer = load_tokenizer(tiny_path)
    policy, reference = load_policy(tiny_path), load_reference(ref_path)
    values = []
    for overrides in CASES.values():
        cfg = load_config(dpo.DPOConfig, None, overrides)
        with torch.no_grad():
            values.append(float(dpo.preference_loss(cfg, *dpo.pair_logps(cfg, tokenizer, policy, reference, [dpo.Pair(ex) for ex in examples()]))[0]))
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]) > 1e-3, values


def test_sequence_logps_without_sharing_prompts_are_the_same(tiny_path, monkeypatch):
    # one forward over the 2B full rows (as under torchrun) gives the shared-prompt numbers
    tokenizer, policy = load_tokenizer(tiny_path), load_policy(tiny_path)
    batch = collate_preference_completions(tokenizer, examples())
    shared, lengths = dpo.sequence_logps(policy, batch)
    monkeypatch.setattr(dpo, "share_prompts", lambda model: False)
    full, _ = dpo.sequence_logps(policy, batch)
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-5)
    assert lengths.tolist() == [2, 4, 3, 6, 2, 3]  # chosen "3", "abc", "56", then rejected "45678", "x", "65", each + EOS


def test_lora_reference_with_adapters_off_equals_a_frozen_copy(tiny_path):
    from rlalign.lm.models import LoraConfig

    tokenizer = load_tokenizer(tiny_path)
    frozen = load_reference(tiny_path)
    policy = apply_lora(load_policy(tiny_path), LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the outputs
    batch = collate_preference_completions(tokenizer, examples())
    adapters_off = dpo.reference_logps(policy, None, batch)
    torch.testing.assert_close(adapters_off, dpo.reference_logps(frozen, frozen, batch), rtol=0, atol=1e-5)
    assert (dpo.sequence_logps(policy, batch)[0] - adapters_off).abs().max() > 1e-2  # with adapters on they differ
    assert policy.training  # the reference pass put it back in train mode


def test_precomputed_reference_equals_the_live_one(tiny_path, ref_path):
    tokenizer = load_tokenizer(tiny_path)
    policy, reference = load_policy(tiny_path), load_reference(ref_path)
    cfg = load_config(dpo.DPOConfig, None, ["precompute_ref_logprobs=true", "eval_batch_size=2"])  # precomputed in other batches than used
    pairs = dpo._precompute(policy, reference, tokenizer, examples(), cfg)
    _, _, precomputed = dpo.pair_logps(cfg, tokenizer, policy, None, pairs)
    _, _, live = dpo.pair_logps(cfg.model_copy(update={"precompute_ref_logprobs": False}), tokenizer, policy, reference, [dpo.Pair(ex) for ex in examples()])
    torch.testing.assert_close(precomputed, live, rtol=0, atol=1e-5)


def test_a_run_with_precomputed_reference_is_the_live_run(tmp_path):
    common = TINY + ["data.num_train=32", "data.num_eval=8", "batch_size=8", "max_steps=3", "eval_every=3", "optim.lr=1e-3"]
    live = dpo.train(load_config(dpo.DPOConfig, None, common + [f"output_dir={tmp_path / 'live'}"]))
    pre = dpo.train(load_config(dpo.DPOConfig, None, common + [f"output_dir={tmp_path / 'pre'}", "precompute_ref_logprobs=true"]))
    assert live.keys() == pre.keys()
    for key in live:
        if key != "time/total":
            assert pre[key] == pytest.approx(live[key], abs=1e-5), key
    history = [r["loss/dpo"] for r in read_metrics(tmp_path / "pre" / "metrics.jsonl") if "loss/dpo" in r]
    assert history[0] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the start: every h = 0 at step 0
    assert history[-1] < history[0] - 1e-3


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def test_implicit_prompts_are_the_shared_start():
    text = explicit_prompt(PreferenceExample(None, "Q: sky? It is blue.", "Q: sky? It is green."))
    assert (text.prompt, text.chosen, text.rejected) == ("Q: sky? It is", " blue.", " green.")  # the space goes with the responses (TRL)
    user = {"role": "user", "content": "word: cat"}
    chat = explicit_prompt(PreferenceExample(None, [user, {"role": "assistant", "content": "aeiou"}], [user, {"role": "assistant", "content": "xk"}]))
    assert chat.prompt == [user] and chat.chosen == [{"role": "assistant", "content": "aeiou"}]
    with pytest.raises(DataError, match="share no start"):
        explicit_prompt(PreferenceExample(None, "abc", "xyz"))


@pytest.mark.parametrize("chosen, rejected", [
    ("Q: sky? It is blue.", "Q: sky? It is green."),  # they differ after a space
    ("Q: 2+2=4", "Q: 2+2=5"),  # after no space
    ("ab", "abc"),  # one is the start of the other: TRL's prompt stops one short of it
    ("Q: yes", "Q: yes"),  # the same text
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]),
])
def test_implicit_prompts_split_as_trls_extract_prompt(chosen, rejected):
    from trl.data_utils import extract_prompt

    ours = explicit_prompt(PreferenceExample(None, chosen, rejected))
    assert {"prompt": ours.prompt, "chosen": ours.chosen, "rejected": ours.rejected} == extract_prompt({"chosen": chosen, "rejected": rejected})


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def conversational_rows(implicit: bool) -> list[dict]:
    rows = []
    for prompt, chosen, rejected in PAIRS:
        user = [{"role": "user", "content": prompt}]
        c, r = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
        rows.append({"chosen": user + c, "rejected": user + r} if implicit else {"prompt": user, "chosen": c, "rejected": r})
    return rows


def test_conversational_and_implicit_prompt_pairs_encode_like_explicit_ones(tiny_path, tmp_path):
    tokenizer = load_tokenizer(tiny_path)
    batches = {}
    for name, rows in {
        "chat": conversational_rows(False), "chat-implicit": conversational_rows(True),
        "text": [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS], "text-implicit": [{"chosen": p + c, "rejected": p + r} for p, c, r in PAIRS],
    }.items():
        batches[name] = collate_preference_completions(tokenizer, load_preferences(_rows(tmp_path / f"{name}.jsonl", rows)))
    for a, b in (("chat", "chat-implicit"), ("text", "text-implicit")):
        for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
            assert torch.equal(getattr(batches[a], field), getattr(batches[b], field)), (a, field)
    chat = batches["chat"]
    prompt = tokenizer.decode(chat.prompt_ids[0][chat.prompt_mask[0].bool()])
    assert prompt == "user: 1+2=\nassistant: "  # the chat template's rendering, then the assistant's reply
    assert tokenizer.decode(chat.completion_ids[0][chat.completion_mask[0].bool()]) == "3\n<eos>"


def test_long_pairs_lose_the_start_of_their_prompt_and_keep_one_prompt(tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    batch = collate_preference_completions(tokenizer, [PreferenceExample("0123456789", "ab", "abcdef")], max_length=10)
    # the longer response + EOS is 7 tokens: 3 prompt tokens are kept ("789"), the same for both responses
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[1])
    assert tokenizer.decode(batch.prompt_ids[0]) == "789"
    assert tokenizer.decode(batch.completion_ids[1]) == "abcdef<eos>"
    cut = collate_preference_completions(tokenizer, [PreferenceExample("0123456789", "ab", "abcdefghijklm")], max_length=10)
    assert tokenizer.decode(cut.prompt_ids[0]) == "9" and tokenizer.decode(cut.completion_ids[1]) == "abcdefghi"  # 1 prompt token, the rest cut


def test_trains_on_conversational_files_through_the_cli(tmp_path, capsys):
    data = _rows(tmp_path / "pairs.jsonl", conversational_rows(True) * 4)
    args = ["dpo", f"output_dir={tmp_path / 'run'}", *TINY, f"data.train_file={data}", f"data.eval_file={data}", "batch_size=4", "max_steps=2", "eval_every=1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])  # one summary line naming the output paths
    assert summary["final"] == str(tmp_path / "run" / "final") and "eval/rewards/accuracy_initial" in summary and "eval/reward" not in summary
    # a file's pairs are cut at TRL's 1024 tokens by default (64 cut long pairs unannounced), and the cut is reported
    assert "data: max_length=1024 cuts 0 of the 24 pairs checked" in out
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    keys = {"loss/dpo", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected"}
    assert keys <= set(records[-1]) and {"eval/loss"} | {f"eval/{k}" for k in keys - {"loss/dpo"}} <= set(records[-1])


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["precompute_ref_logprobs=true"], ["model.lora.r=4", "loss=ipo", "beta=0.5"]], ids=["dpo", "precomputed", "lora-ipo"])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, extra):
    common = TINY + ["data.num_train=64", "data.num_eval=4", "batch_size=8", "eval_every=100", "max_steps=4", "optim.warmup_steps=1",
                     "optim.lr=1e-2", "save_every=2", *extra]
    dpo.train(load_config(dpo.DPOConfig, None, common + [f"output_dir={tmp_path / 'full'}"]))
    step2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    dpo.train(load_config(dpo.DPOConfig, None, common + [f"output_dir={tmp_path / 'resumed'}"]), resume=step2)
    weights = next((tmp_path / "full" / "final").glob("*.safetensors")).name
    full, resumed = (load_file(str(tmp_path / run / "final" / weights)) for run in ("full", "resumed"))
    before = load_file(str(step2 / "model" / weights))
    assert max((full[k] - before[k]).abs().max() for k in full) > 1e-4  # steps 2-3 changed the weights
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=1e-6)
    full_log, resumed_log = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("full", "resumed"))
    assert [r["loss/dpo"] for r in full_log if r["step"] >= 2] == pytest.approx([r["loss/dpo"] for r in resumed_log if r["step"] >= 2], abs=1e-6)


@pytest.mark.parametrize("extra", [["micro_batch_size=3"], ["model.gradient_checkpointing=true"]], ids=["micro", "checkpointing"])
def test_micro_batches_or_checkpointing_are_the_same_run(tmp_path, extra):
    common = TINY + ["data.num_train=32", "data.num_eval=4", "batch_size=8", "eval_every=100", "max_steps=2", "optim.lr=1e-2"]
    for name, overrides in (("plain", []), ("other", extra)):
        dpo.train(load_config(dpo.DPOConfig, None, common + [f"output_dir={tmp_path / name}", *overrides]))
    plain, other = (load_file(str(tmp_path / name / "final" / "model.safetensors")) for name in ("plain", "other"))
    assert max((plain[k] - other[k]).abs().max() for k in plain) < 2e-5  # checkpointed: every row whole, not each prompt once
    assert max((plain[k] - load_file(str(tmp_path / "plain" / "base_model" / "model.safetensors"))[k]).abs().max() for k in plain) > 1e-3  # it trained


def test_bad_configs_are_errors():
    with pytest.raises(ConfigError, match="label_smoothing"):
        load_config(dpo.DPOConfig, None, ["loss=ipo", "label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="reference-free"):
        load_config(dpo.DPOConfig, None, ["loss=simpo", "reference=runs/x"])
    with pytest.raises(ConfigError, match="reference-free"):
        load_config(dpo.DPOConfig, None, ["loss=simpo", "precompute_ref_logprobs=true"])
    with pytest.raises(ConfigError, match="loss"):
        load_config(dpo.DPOConfig, None, ["loss=kto"])
    with pytest.raises(ConfigError, match="beta"):
        load_config(dpo.DPOConfig, None, ["beta=0"])
    with pytest.raises(ConfigError, match="label_smoothing"):
        load_config(dpo.DPOConfig, None, ["label_smoothing=0.5"])
    with pytest.raises(ConfigError, match="data.eval_file is required"):
        load_config(dpo.DPOConfig, None, ["data.train_file=x.jsonl"])
    assert main(["dpo", "beta=-1"]) == 2


# ----------------------------------------------------------------------------------------------
# Learning
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A tiny model SFT'd on the preference task's words (natural vowel share: hidden score ~0.18)."""
    from rlalign.train import sft

    out = tmp_path_factory.mktemp("sft")
    sft.train(load_config(sft.SFTConfig, None, [
        "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false", "plots=false",
        f"output_dir={out}", "data.task=preference", "max_steps=150", "eval_every=150", "data.num_eval=16", "optim.lr=3e-3", "optim.warmup_steps=20",
    ]))
    return out / "final"


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo"])
def test_preference_optimisation_raises_the_hidden_score_with_bounded_kl(sft_model, tmp_path, loss):
    """40 steps of 32 pairs ranked by the hidden rule (more vowels is better). Measured (seed 0): the
    held-out hidden score of sampled completions 0.18 -> 0.49 (dpo), 0.47 (ipo), 0.46 (simpo), with a
    KL to the SFT model of 2.1, 2.4 and 2.5 nats per completion. With chosen and rejected swapped the
    score falls to 0.05-0.06 instead."""
    from rlalign.demo import sequence_kl
    from rlalign.tasks import TASKS

    beta = {"dpo": "beta=0.1", "ipo": "beta=0.5", "simpo": "beta=2.0"}[loss]
    result = dpo.train(load_config(dpo.DPOConfig, None, [
        "progress=false", "plots=false", f"output_dir={tmp_path}", f"model.path={sft_model}", f"loss={loss}", beta, "max_steps=40",
        "eval_every=40", "batch_size=32", "optim.lr=5e-4", "data.num_train=1280", "data.num_eval=200",
    ]))
    assert result["eval/reward"] > result["eval/reward_initial"] + 0.15, result
    assert result["eval/rewards/accuracy"] > 0.9, result
    tokenizer, task = load_tokenizer(sft_model), TASKS["preference"]
    prompts = [r["prompt"] for r in task.prompt_records("eval", 200, 1)]
    kl = sequence_kl(load_policy(tmp_path / "final").eval(), load_reference(sft_model), tokenizer, prompts, task.max_new_tokens, seed=1)
    assert 0.2 < kl < 6.0, kl  # moved, and not far: nats per sampled completion of at most 12 tokens


def test_the_copy_of_a_policy_is_not_a_reference(tiny_path):
    # a full (non-LoRA) policy without a reference model has no reference: an error, never KL = 0 in disguise
    tokenizer = load_tokenizer(tiny_path)
    with pytest.raises(ValueError, match="no reference"):
        dpo.reference_logps(copy.deepcopy(load_policy(tiny_path)), None, collate_preference_completions(tokenizer, examples()))
