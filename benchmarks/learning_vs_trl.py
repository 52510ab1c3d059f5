"""Learning curves of rlalign's GRPO and TRL's GRPOTrainer on three offline tasks, over seeds.

    .venv/bin/python benchmarks/learning_vs_trl.py --config tiny --tasks quickstart --seeds 0 --steps 2      # the pipeline, < 1 min
    .venv/bin/python benchmarks/learning_vs_trl.py --tasks quickstart wordproblems choice --seeds 0 1 2 --steps 40 \
        --out runs/bench/learning_vs_trl.json --figures docs/img/
    .venv/bin/python benchmarks/learning_vs_trl.py --tasks quickstart --seeds 0 --sides rlalign-bf16-fast --out fast0.json  # a variant alone
    .venv/bin/python benchmarks/learning_vs_trl.py --merge a.json b.json fast0.json --out runs/bench/learning_vs_trl.json  # run apart

Model (``--config``): ``smollm2`` is SmolLM2-135M-Instruct, converted once to float32 safetensors by
``_lm_bench.smollm2_checkpoint`` (both sides load that directory); ``tiny`` is the recipe's tiny Llama
with random weights (``_lm_bench.tiny_checkpoint``), which checks the pipeline, not learning.

Tasks, every prompt a chat message built here from fixed word lists (nothing is downloaded):

    quickstart    "Summarise in one sentence: <two generated sentences>"; reward TRL's quick-start
                  ``-abs(20 - len(completion))`` (characters of the reply text); held-out success: a
                  greedy reply of 15 to 25 characters (SmolLM2-135M starts at 0/32, 74 characters on average)
    wordproblems  one- or two-step arithmetic word problems ("Maya has 7 shells. ..."); reward 1.0 when
                  ``math_verify`` finds the answer as the reply's final number, else 0.0; success = reward 1
                  (SmolLM2-135M starts at 10/32 greedy, 64 new tokens)
    choice        "Which is larger, 47 or 52? Reply with the larger number only."; reward 1.0 when the
                  first number in the reply is the larger one, else 0.0; success = reward 1 (SmolLM2-135M
                  starts at 4/32 greedy; graded as the exact reply it would be 0/32, by the last number
                  9/32, but that passes "25 is larger than 65")

How it is run. Per task and seed, one worker subprocess per side loads its model once and waits; the
parent hands out blocks of ``--block`` steps in turn (``grpo_vs_trl.run_blocks``), so one side
computes at a time and drift of the machine's load hits both alike. Both sides get the same settings
as in ``grpo_vs_trl.py`` (``rlalign_config`` / ``trl_config``: float32, G, prompts per step, max new
tokens, temperature 0.7, top-p 1, beta with a reference model, loss_type grpo = seq-mean-token-mean,
group-scaled advantages, AdamW (0.9, 0.95) at a constant lr, clipping at 1.0, one update per rollout,
the same seed, the same prompts at every step). The rlalign side is ``rlalign.train.grpo``'s own setup
and ``grpo_step`` (``_lm_bench.GRPOSetup``). SmolLM2 defaults: 2 prompts x G = 8, lr 1e-5, beta 0.04, 40
steps; both workers stay alive through a pair, and with ``--prompts-per-step 4`` TRL's worker alone
peaked at 10.6 GB RSS on quickstart (rlalign's at 5.7 GB).

Variants (``--sides``): rlalign with other settings, each its own worker: ``-eager`` trains with eager
attention; ``-fast`` adds SDPA in the decode loop and a packed bfloat16 sampling copy; ``-bf16`` runs the
forwards under bfloat16 autocast; ``-async`` samples in a producer process one step ahead (k = 1, TIS cap
2); ``-tis`` sets that TIS cap without a producer. An asynchronous side should run alone: between its
blocks its producer keeps sampling.

Held-out success. A fixed set of ``--eval-prompts`` prompts (the same for every seed, none of them a
training prompt) is answered greedily (temperature 0: one deterministic answer a prompt, so the curve
moves only when the policy does) by plain ``transformers`` ``model.generate`` on the side's current
model, the same function on both sides, before the first step and every ``--eval-every`` steps and
after the last; its time is not counted in the side's wall time.

Logged per step and side: rollout reward mean, KL to the reference (as each side logs it), mean
completion length in tokens, step time, cumulative wall time (training steps only), the worker's peak
RSS (``VmHWM``), rlalign's ``logprob_mismatch`` (sampler against training log-probs), and at
evaluation steps the held-out success, mean reward and reply length.

Table per task (mean +- standard deviation over seeds): rollout reward over the first and the last
``--window`` steps; held-out success at the start and the end; time to reach: the first step whose
trailing ``--window``-step mean reward reaches ``--reach`` % of the way from the common start (both
sides' first-window mean) to TRL's final (last-window) mean in that seed, in steps and wall seconds
(X% of TRL's final mean for a reward that starts at 0; the quick-start reward is negative, hence the
distance); median seconds per step (the first left out); peak RSS. Figure per task: reward (trailing
mean) and held-out success against step and wall time, mean and +-1 std band over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402
import grpo_vs_trl as gv  # noqa: E402

SIDES = ("rlalign", "trl")  # the default pair; the start reward and the figures' colours follow this order
VARIANTS = ("rlalign-eager", "rlalign-fast", "rlalign-fast-tis", "rlalign-bf16-fast", "rlalign-bf16-fast-tis", "rlalign-async",
            "rlalign-bf16-fast-async")  # --sides may add these
ASYNC = dict(enabled=True, max_staleness=1)  # "-async": a producer process samples step s + 1 while the learner learns step s
TIS_CAP = 2.0  # "-tis", and "-async" (which needs it): the sampler's importance weight pi_old / pi_sampler, truncated at this
CONFIGS = {  # per-model defaults; every one can be overridden on the command line
    "smollm2": dict(steps=40, prompts_per_step=2, group_size=8, temperature=0.7, beta=0.04, lr=1e-5, eval_prompts=32, num_prompts=512, max_new_tokens=None),
    "tiny": dict(steps=2, prompts_per_step=2, group_size=4, temperature=0.7, beta=0.04, lr=1e-4, eval_prompts=8, num_prompts=64, max_new_tokens=8),
}

# ---- Tasks: prompts built from word lists, reward functions in TRL's signature ---------------

NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kemal", "Lena", "Maya", "Noah", "Omar", "Priya"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "coins"]
SUBJECTS = ["The town council", "A small bakery", "Our neighbour", "The new library", "A group of students", "The football club",
            "The museum", "A local farmer", "The school choir", "The city zoo", "An old fisherman", "The hospital"]
VERBS = ["announced", "opened", "repaired", "celebrated", "cancelled", "planned", "finished", "started", "welcomed", "painted"]
OBJECTS = ["a summer festival", "the main bridge", "a reading club", "the north gate", "a charity market", "the old clock tower",
           "a cycling race", "the community garden", "a night concert", "the harbour wall"]
TAILS = ["after a long winter", "on Tuesday morning", "despite the heavy rain", "with help from volunteers", "for the first time in years",
         "before the holidays", "to the surprise of many", "at very short notice"]
DETAILS = ["Hundreds of people came to watch.", "The work took three weeks.", "Tickets sold out in an hour.", "Local shops stayed open late.",
           "The mayor gave a short speech.", "Children painted banners for it.", "It will happen again next year.", "The costs were shared."]


_reply = lb._text  # a completion's text: a string as is, chat messages (TRL's conversational rows) as the last one's content


def quickstart_record(rng: random.Random) -> dict:
    news = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}. {rng.choice(DETAILS)}"
    return {"prompt": [{"role": "user", "content": f"Summarise in one sentence: {news}"}]}


def quickstart_reward(completions, **_) -> list[float]:
    """TRL's quick-start reward: -|20 - characters of the reply|."""
    return [-abs(20 - len(_reply(c))) for c in completions]


def wordproblem_record(rng: random.Random) -> dict:
    n, i = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9)
    text, answer = [
        (f"{n} has {a} {i}. {n} buys {b} more {i}. How many {i} does {n} have now?", a + b),
        (f"{n} had {a + b} {i} and gave {b} of them to a friend. How many {i} does {n} have left?", a),
        (f"{n} has {c} boxes with {b} {i} in each box. How many {i} are there in total?", b * c),
        (f"{n} shares {b * c} {i} equally among {c} friends. How many {i} does each friend get?", b),
        (f"{n} has {a + c} {i}, gets {b} more and then loses {c}. How many {i} does {n} have now?", a + b),
    ][rng.randrange(5)]
    return {"prompt": [{"role": "user", "content": f"{text} Give the final answer as a number."}], "answer": str(answer)}


def wordproblem_reward(completions, answer, **_) -> list[float]:
    """1.0 when math_verify's parse of the reply (its last number) equals the answer, else 0.0."""
    from math_verify import parse, verify

    out = []
    for c, a in zip(completions, answer, strict=True):
        try:
            out.append(float(verify(parse(a), parse(_reply(c)))))
        except Exception:  # math_verify's own time limit or a sympy failure: not a right answer
            out.append(0.0)
    return out


def choice_record(rng: random.Random) -> dict:
    a, b = rng.sample(range(10, 100), 2)
    return {"prompt": [{"role": "user", "content": f"Which is larger, {a} or {b}? Reply with the larger number only."}], "answer": str(max(a, b))}


_NUMBER = re.compile(r"\d+")


def choice_reward(completions, answer, **_) -> list[float]:
    """1.0 when the first number in the reply is the answer ("57", "The answer is 57."), else 0.0."""
    return [float(next(iter(_NUMBER.findall(_reply(c))), None) == a) for c, a in zip(completions, answer, strict=True)]


@dataclass(frozen=True)
class Task:
    record: Callable[[random.Random], dict]  # one {"prompt": [messages], ...columns}
    reward: Callable[..., list[float]]  # TRL's signature: reward(completions=..., **columns)
    success: Callable[[float], bool]  # of one reply's reward
    max_new_tokens: int  # the smollm2 default


TASKS = {
    "quickstart": Task(quickstart_record, quickstart_reward, lambda r: r >= -5, 32),
    "wordproblems": Task(wordproblem_record, wordproblem_reward, lambda r: r == 1.0, 64),
    "choice": Task(choice_record, choice_reward, lambda r: r == 1.0, 16),
}
HELD_OUT_SEED = 12345  # the held-out prompts are the same for every training seed


def make_spec(config: str, task: str, model_path, seed: int, threads: int = 1, eval_every: int = 10, **overrides) -> dict:
    """The settings both sides of one task and seed share: ``CONFIGS[config]``, then ``overrides`` that are not None."""
    spec = {**CONFIGS[config], "config": config, "task": task, "model_path": str(model_path), "seed": seed, "threads": threads,
            "device": "cpu", "eval_every": eval_every}
    spec.update({k: v for k, v in overrides.items() if v is not None})
    spec["max_new_tokens"] = spec["max_new_tokens"] or TASKS[task].max_new_tokens
    return spec


def task_records(name: str, num_prompts: int, eval_prompts: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training records of ``seed``, the fixed held-out records): distinct prompts, none in both."""
    seen: set[str] = set()

    def draw(rng: random.Random, n: int) -> list[dict]:
        out: list[dict] = []
        for _ in range(50 * n):  # stops short where the task has fewer distinct prompts
            if len(out) == n:
                break
            r = TASKS[name].record(rng)
            if (text := r["prompt"][0]["content"]) not in seen:
                seen.add(text)
                out.append(r)
        return out

    held_out = draw(random.Random(HELD_OUT_SEED), eval_prompts)
    return draw(random.Random(seed), num_prompts), held_out


# ---- Held-out evaluation: plain transformers generate, the same code on both sides -----------


class HeldOut:
    """Greedy replies of the held-out prompts with ``model.generate`` (no rlalign or TRL code), graded by the task."""

    def __init__(self, task: Task, records: list[dict], path: str, max_new_tokens: int):
        from transformers import AutoTokenizer, GenerationConfig

        self.task, self.records = task, records
        self.tokenizer = tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in records]
        self.batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def __call__(self, model) -> dict:
        import torch

        t0 = time.perf_counter()
        training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(**self.batch.to(model.device), generation_config=self.config)
        model.train(training)
        replies = self.tokenizer.batch_decode(out[:, self.batch["input_ids"].shape[1]:], skip_special_tokens=True)
        columns = {k: [r[k] for r in self.records] for k in self.records[0] if k != "prompt"}
        rewards = self.task.reward(completions=replies, **columns)
        return {"eval_success": statistics.mean(map(self.task.success, rewards)), "eval_reward": statistics.mean(rewards),
                "eval_chars": statistics.mean(len(r) for r in replies), "eval_time": time.perf_counter() - t0, "eval_sample": replies[0][:200]}


def _due(step: int, spec: dict) -> bool:
    """Evaluate after ``step`` optimiser steps (1-based)?"""
    return step % spec["eval_every"] == 0 or step == spec["steps"]


# ---- Workers ---------------------------------------------------------------------------------


def rlalign_config(spec: dict, side: str = "rlalign"):
    """``grpo_vs_trl.rlalign_config`` of the side's flags (``-eager``, ``-fast``, ``-bf16``: ``grpo_vs_trl.side_flags``);
    ``-tis`` corrects for the sampler's precision with a truncated importance weight (``tis_cap``: ``TIS_CAP``);
    ``-async`` adds an asynchronous producer (``ASYNC``, the learner's and the producer's threads ``spec["threads"]`` each)."""
    cfg = gv.rlalign_config({**spec, **gv.side_flags(side)}, Path(spec["model_path"]))
    extra: dict = {"tis_cap": TIS_CAP} if side.endswith(("-tis", "-async")) else {}
    if side.endswith("-async"):
        extra["async_rollouts"] = {**ASYNC, "learner_threads": spec["threads"], "producer_threads": spec["threads"]}
    return cfg.model_validate({**cfg.model_dump(), **extra}) if extra else cfg


def rlalign_setup(spec: dict, side: str = "rlalign") -> tuple[lb.GRPOSetup, HeldOut]:
    """rlalign's GRPO as ``grpo.train`` sets it up (:func:`rlalign_config`), and the held-out evaluator."""
    task = TASKS[spec["task"]]
    train, held_out = task_records(spec["task"], spec["num_prompts"], spec["eval_prompts"], spec["seed"])
    setup = lb.GRPOSetup(rlalign_config(spec, side), train, task.reward)
    return setup, HeldOut(task, held_out, spec["model_path"], spec["max_new_tokens"])


def rlalign_worker(spec: dict, chan: lb.Channel, side: str = "rlalign") -> None:
    setup, held_out = rlalign_setup(spec, side)
    chan.send({"ready": True, "eval0": held_out(setup.updater.module), "rss_loaded_mb": lb.current_rss_mb()})
    wall = 0.0
    while (cmd := chan.recv())["cmd"] == "run":
        block = []
        for _ in range(cmd["steps"]):
            t0 = time.perf_counter()
            m = setup.step()
            dt = time.perf_counter() - t0
            wall += dt
            step = setup.state.step
            rec = {"step": step, "time": dt, "wall": wall, "reward": m["reward/mean"], "kl": m.get("kl"),
                   "completion_len": m["completion_len/mean"], "logprob_mismatch": m.get("logprob_mismatch"), "peak_rss_mb": lb.peak_rss_mb()}
            if _due(step, spec):
                rec.update(held_out(setup.updater.module))
            block.append(rec)
        chan.send({"records": block})
    setup.source.close()  # an asynchronous producer stops here
    chan.send({"peak_rss_mb": lb.peak_rss_mb()})


def trl_worker(spec: dict, chan: lb.Channel) -> None:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    task = TASKS[spec["task"]]
    train, held_out_records = task_records(spec["task"], spec["num_prompts"], spec["eval_prompts"], spec["seed"])
    dataset = Dataset.from_list([train[i] for batch in spec["prompt_order"] for i in batch])  # rlalign's order, not shuffled
    held_out = HeldOut(task, held_out_records, spec["model_path"], spec["max_new_tokens"])

    class Pacer(TrainerCallback):
        """Times each optimiser step (end of the last log -> on_step_end), evaluates, pauses between blocks."""

        def __init__(self) -> None:
            self.want, self.block, self.wall, self.t_resume, self.dt, self.eval = 0, [], 0.0, 0.0, 0.0, {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.dt = time.perf_counter() - self.t_resume
            self.wall += self.dt
            self.eval = held_out(model) if _due(state.global_step, spec) else {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            self.block.append({"step": state.global_step, "time": self.dt, "wall": self.wall, "reward": logs["reward"], "kl": logs.get("kl"),
                               "completion_len": logs["completions/mean_length"], "peak_rss_mb": lb.peak_rss_mb(), **self.eval})
            if len(self.block) == self.want:
                chan.send({"records": self.block})
                self.block = []
                if state.global_step < args.max_steps:
                    self.start(chan.recv())
            self.t_resume = time.perf_counter()

        def start(self, cmd: dict) -> None:
            assert cmd["cmd"] == "run", cmd
            self.want, self.t_resume = cmd["steps"], time.perf_counter()

    pacer = Pacer()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    args = gv.trl_config({**spec, **gv.side_flags("trl")})
    trainer = trl.GRPOTrainer(model=spec["model_path"], reward_funcs=task.reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[pacer])
    chan.send({"ready": True, "eval0": held_out(trainer.model), "rss_loaded_mb": lb.current_rss_mb(), "trl": trl.__version__})
    pacer.start(chan.recv())
    trainer.train()
    assert chan.recv()["cmd"] == "stop"
    chan.send({"peak_rss_mb": lb.peak_rss_mb()})


def worker_main(side: str, spec: dict) -> None:
    import torch

    chan = lb.Channel()
    torch.set_num_threads(spec["threads"])
    if side == "trl":
        trl_worker(spec, chan)
    else:
        rlalign_worker(spec, chan, side)


# ---- Parent: runs, summary, table, figure ----------------------------------------------------


def run_pair(spec: dict, block: int, sides: tuple[str, ...] = SIDES) -> dict:
    """One task and seed: a worker per side, blocks of steps in turn. {side: {"records", "info"}}."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"learning_vs_trl_{spec['task']}_{spec['seed']}_"))
    print(f"{spec['task']} seed {spec['seed']}: worker logs in {log_dir}", file=sys.stderr)
    workers: list[gv.Worker] = []
    try:
        gv.run_blocks(workers, argparse.Namespace(sides=sides, steps=spec["steps"], block=block), spec, log_dir, script=__file__)
    except KeyboardInterrupt:
        for w in workers:
            w.proc.kill()
        raise
    return {w.side: {"records": w.records, "info": w.info} for w in workers}


def _stat(values: list[float]) -> tuple[float, float] | None:
    """(mean, standard deviation over seeds; 0 for one seed), None for no values."""
    values = [v for v in values if v is not None]
    return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0) if values else None


def _trailing(xs: list[float], w: int) -> list[float]:
    return [statistics.mean(xs[max(0, i + 1 - w): i + 1]) for i in range(len(xs))]


def eval_points(run: dict) -> list[tuple[int, float, float, float]]:
    """(step, wall s, held-out success, held-out reward) of a side's run, step 0 first."""
    e0 = run["info"].get("eval0")
    points = [(0, 0.0, e0["eval_success"], e0["eval_reward"])] if e0 else []
    return points + [(r["step"], r["wall"], r["eval_success"], r["eval_reward"]) for r in run["records"] if "eval_success" in r]


def sides_of(runs: dict) -> list[str]:
    """The sides in any of ``runs``' pairs, in ``SIDES + VARIANTS`` order."""
    present = {side for pair in runs.values() for side in pair}
    return [side for side in SIDES + VARIANTS if side in present]


def summarise(runs: dict, window: int, reach: float) -> dict:
    """Per side: start / end reward and success, time to reach, s per step, peak RSS (mean, std over seeds).

    The common start is the mean first-window reward of the ``SIDES`` in the pair (variants added with
    ``--sides`` leave it as it is); time to reach needs TRL's final reward, so a pair without TRL has none."""
    sides = sides_of(runs)
    per: dict = {side: {k: [] for k in ("start", "end", "s0", "s1", "reach_steps", "reach_s", "step_s", "rss")} for side in sides}
    for pair in runs.values():
        rewards = {s: [r["reward"] for r in run["records"]] for s, run in pair.items() if run["records"]}
        if not rewards:
            continue
        w = min(window, *(len(x) for x in rewards.values()))
        base = [s for s in SIDES if s in rewards] or list(rewards)
        start = statistics.mean(statistics.mean(rewards[s][:w]) for s in base)
        threshold = start + reach / 100 * (statistics.mean(rewards["trl"][-w:]) - start) if "trl" in rewards else None
        for side in rewards:
            recs, d = pair[side]["records"], per[side]
            d["start"].append(statistics.mean(rewards[side][:w]))
            d["end"].append(statistics.mean(rewards[side][-w:]))
            points = eval_points(pair[side])
            d["s0"].append(points[0][2] if points and points[0][0] == 0 else None)
            d["s1"].append(points[-1][2] if points else None)
            trailing = _trailing(rewards[side], w)
            hit = None if threshold is None else next((i for i, m in enumerate(trailing) if m >= threshold), None)
            d["reach_steps"].append(None if hit is None else recs[hit]["step"])
            d["reach_s"].append(None if hit is None else recs[hit]["wall"])
            d["step_s"].append(statistics.median(r["time"] for r in recs[1:]) if len(recs) > 1 else recs[0]["time"])
            d["rss"].append(pair[side]["info"].get("peak_rss_mb") or max(r["peak_rss_mb"] for r in recs))
    return {side: {**{k: _stat(v) for k, v in d.items()}, "reached": sum(v is not None for v in d["reach_steps"]), "seeds": len(d["start"])}
            for side, d in per.items()}


def markdown(task: str, summary: dict, window: int, reach: float) -> str:
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else f"{fmt.format(x[0])} ± {fmt.format(x[1])}"

    lines = [f"{task}: mean ± std over seeds; reward = rollout mean over the first / last {window} steps; time to reach {reach:.0f}% "
             "of the way from the common start to TRL's final reward", "",
             "| side | reward start | reward end | held-out success start | held-out success end | steps to reach | seconds to reach | s / step | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for side, s in summary.items():
        n = f" ({s['reached']}/{s['seeds']})"
        lines.append(f"| {side} | {f(s['start'])} | {f(s['end'])} | {f(s['s0'], '{:.2f}')} | {f(s['s1'], '{:.2f}')} | "
                     f"{f(s['reach_steps'], '{:.1f}')}{n} | {f(s['reach_s'], '{:.1f}')}{n} | {f(s['step_s'], '{:.2f}')} | {f(s['rss'], '{:.0f}')} |")
    return "\n".join(lines)


def figure(task: str, runs: dict, window: int, path: Path) -> None:
    """Reward (trailing mean) and held-out success against step and wall time; mean and +-1 std band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    for side, colour in zip(sides_of(runs), plt.get_cmap("tab10").colors):  # 10 colours for SIDES + VARIANTS
        pairs = [p[side] for p in runs.values() if side in p and p[side]["records"]]
        if not pairs:
            continue
        n = min(len(p["records"]) for p in pairs)
        steps = np.array([r["step"] for r in pairs[0]["records"][:n]])
        reward = np.array([_trailing([r["reward"] for r in p["records"][:n]], window) for p in pairs])  # (seeds, steps)
        wall = np.array([[r["wall"] for r in p["records"][:n]] for p in pairs]).mean(0)
        evals = [eval_points(p) for p in pairs]
        k = min(len(e) for e in evals)
        success = np.array([[e[2] for e in ev[:k]] for ev in evals])  # (seeds, evals)
        e_steps = np.array([e[0] for e in evals[0][:k]])
        e_wall = np.array([[e[1] for e in ev[:k]] for ev in evals]).mean(0)
        for ax, x, y in ((axes[0, 0], steps, reward), (axes[0, 1], wall, reward), (axes[1, 0], e_steps, success), (axes[1, 1], e_wall, success)):
            mean, std = y.mean(0), y.std(0)
            ax.plot(x, mean, color=colour, label=f"{side} ({len(pairs)} seeds)", marker="o" if y is success else None, ms=3)
            ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.2, lw=0)
    for ax, (xl, yl) in zip(axes.flat, [("step", f"rollout reward ({window}-step mean)"), ("wall time, s (training steps)", f"rollout reward ({window}-step mean)"),
                                        ("step", "held-out success (greedy)"), ("wall time, s (training steps)", "held-out success (greedy)")]):
        ax.set(xlabel=xl, ylabel=yl)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{task}: rlalign GRPO vs TRL GRPOTrainer, mean and ±1 std over seeds")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="smollm2", help="smollm2: SmolLM2-135M-Instruct; tiny: the tiny Llama, a pipeline check")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="optimiser steps per side (default: the config's)")
    parser.add_argument("--block", type=int, default=2, help="steps a side runs before the other side's turn")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps (and before the first, after the last)")
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts (default: the config's)")
    parser.add_argument("--prompts-per-step", type=int)
    parser.add_argument("--group-size", type=int, help="G completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, help="completion cap (default: the task's, tiny: 8)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--beta", type=float, help="KL coefficient (0: no reference model on either side)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--window", type=int, default=5, help="steps of the start / end reward and of the trailing mean")
    parser.add_argument("--reach", type=float, default=90.0, help="time to reach this %% of the way to TRL's final reward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--out", default="runs/bench/learning_vs_trl.json", help="the JSON of all records (tables next to it, .md)")
    parser.add_argument("--figures", default="docs/img/", help="directory of the figures, learning_vs_trl_<task>.png")
    parser.add_argument("--sides", nargs="+", choices=SIDES + VARIANTS, default=list(SIDES),
                        help="workers per task and seed: rlalign (defaults), trl, and rlalign variants: -eager (eager attention to train), "
                             "-fast (that, SDPA decoding and the packed bfloat16 sampling copy), -bf16 (autocast), -tis (tis_cap 2), -async (a producer, k = 1)")
    parser.add_argument("--worker", choices=SIDES + VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="write --out, its tables and the figures from these runs' JSON files instead of running")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args)
    if args.worker:
        worker_main(args.worker, json.loads(args.spec))
        return 0

    overrides = {k: getattr(args, k) for k in ("steps", "eval_prompts", "prompts_per_step", "group_size", "max_new_tokens", "lr", "beta", "temperature")}
    model_path = lb.tiny_checkpoint() if args.config == "tiny" else lb.smollm2_checkpoint()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"env": {"command": " ".join([Path(sys.executable).name, *sys.argv]), "python": platform.python_version(), "load_before": lb.machine_load(),
                      "rlalign_commit": lb.code_version(), "cores": os.cpu_count(), "threads": args.threads},
              "args": vars(args), "tasks": {}}
    tables = []
    started = time.time()
    for task in args.tasks:
        entry = result["tasks"][task] = {"spec": None, "runs": {}}
        for seed in args.seeds:
            spec = make_spec(args.config, task, model_path, seed, args.threads, args.eval_every, **overrides)
            entry["spec"] = {k: v for k, v in spec.items() if k != "seed"}
            num = len(task_records(task, spec["num_prompts"], spec["eval_prompts"], seed)[0])
            spec["prompt_order"] = gv.step_prompt_indices(num, spec["steps"], spec["prompts_per_step"], seed)  # rlalign's; TRL's dataset in this order
            entry["runs"][seed] = run_pair(spec, args.block, tuple(args.sides))
            result["env"].update(wall_s=round(time.time() - started, 1), load_after=lb.machine_load())
            out.write_text(json.dumps(result, indent=1))  # after every pair: a long run keeps what it has
        tables.append(finish_task(task, entry, args))
        out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text("\n\n".join(tables) + "\n")
    return 0


def finish_task(task: str, entry: dict, args: argparse.Namespace) -> str:
    """Summary, table and figure of one task's runs (written into ``entry``); returns the table."""
    entry["summary"] = summarise(entry["runs"], args.window, args.reach)
    entry["table"] = markdown(task, entry["summary"], args.window, args.reach)
    figure(task, entry["runs"], args.window, Path(args.figures) / f"learning_vs_trl_{task}.png")
    print("\n" + entry["table"] + "\n")
    return entry["table"]


def merge(paths: list[str], args: argparse.Namespace) -> int:
    """One result from several runs' JSON files (seeds, or variant sides, run as separate processes): their
    runs per task and seed joined, a side of a seed in two files is an error; summary, tables and figures as
    one run writes them."""
    result: dict = {"env": {"merged": []}, "tasks": {}}
    for path in paths:
        part = json.loads(Path(path).read_text())
        result["env"]["merged"].append({"file": str(path), **part["env"]})
        for task, entry in part["tasks"].items():
            into = result["tasks"].setdefault(task, {"spec": entry["spec"], "runs": {}})
            if into["spec"] != entry["spec"]:
                raise SystemExit(f"{path}: task {task} was run with other settings than in {paths[0]}: {entry['spec']} != {into['spec']}")
            for seed, pair in entry["runs"].items():  # a seed's sides may come from several files (variants run apart)
                have = into["runs"].setdefault(seed, {})
                if set(have) & set(pair):
                    raise SystemExit(f"{path}: task {task} seed {seed} side(s) {sorted(set(have) & set(pair))} already in an earlier file")
                have.update(pair)
    tables = [finish_task(task, entry, args) for task, entry in result["tasks"].items()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
