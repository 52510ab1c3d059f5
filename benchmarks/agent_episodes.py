"""Episodes per second: batched multi-turn episodes with the KV cache carried across turns
(:func:`rlalign.agents.episodes.run_episodes`) against the tool rollout that prefills the whole
history again every turn (:func:`rlalign.train.tool_rollout.tool_rollout`), on the same task.

    .venv/bin/python benchmarks/agent_episodes.py                        # 8 prompts x G = 8, 4 turns of 24 tokens
    .venv/bin/python benchmarks/agent_episodes.py --prompts 4 --turns 6 --repeats 3

The task: look-up questions (:mod:`rlalign.tasks.lookup`) as text prompts, a randomly initialised
tiny Llama (hidden 128, 4 layers) sampling at temperature 1, and an environment that answers every
turn with a look-up result until ``--turns`` turns, and EOS made impossible (a hook on the logits),
so both paths take ``--turns`` turns of ``--max-new-tokens`` tokens (the tag path may cut a turn
after a closing tag, which random text hardly writes). Reported per path: the
median wall time of ``--repeats`` calls, episodes per second, sampled tokens per second, and the
mean turns and completion length (to show both did the same work). One torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlalign.agents.episodes import run_episodes
from rlalign.agents.tool_calls import CallFormat, ToolCall
from rlalign.lm.decode import SamplingParams
from rlalign.lm.tools import TAG
from rlalign.tasks import lookup as L
from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_llama
from rlalign.train.tool_rollout import tool_rollout

REPLY = L.lookup("brom")
EVERY_TURN_CALLS = CallFormat("every", "<tool>", "", "<result>", "</result>", lambda text: [ToolCall("lookup", {"name": "brom"})])


class Answering:
    """Today's environment protocol: a tool reply to every turn, done after ``turns`` turns."""

    def __init__(self, turns: int):
        self.turns, self.max_turns = 0, turns

    def reset(self, record):
        self.turns = 0
        return record["prompt"]

    def step(self, text):
        self.turns += 1
        return [{"role": "tool", "content": REPLY}], self.turns >= self.max_turns, None


class Replying:
    """The same environment in the agents' protocol."""

    tool_schemas: list = []

    def reset(self, record):
        return record["prompt"]

    def step(self, calls):
        return [{"role": "tool", "content": REPLY}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(tokenizer, TinyModelSpec(hidden_size=128, num_layers=4), seed=0).eval()
    eos = tokenizer.eos_token_id

    def no_eos(module, inputs, logits):  # every turn runs to max_new_tokens in both paths: the same work
        logits[..., eos] = -1e4
        return logits

    model.lm_head.register_forward_hook(no_eos)
    records = [{"prompt": r["prompt"][0]["content"]} for r in L.prompt_records("train", args.prompts)]
    params = SamplingParams(args.max_new_tokens, temperature=1.0)
    rows = args.prompts * args.group_size

    def before(seed):
        out = tool_rollout(model, tokenizer, records, lambda: Answering(args.turns), TAG, params, args.group_size, args.turns, torch.Generator().manual_seed(seed))
        return out.rollout, out.assistant_mask, out.turns

    def after(seed):
        out = run_episodes(model, tokenizer, records, Replying, params, group_size=args.group_size, max_turns=args.turns, fmt=EVERY_TURN_CALLS,
                           generator=torch.Generator().manual_seed(seed))
        return out.rollout, out.assistant_mask, out.turns

    print(f"{args.prompts} prompts x G = {args.group_size}, {args.turns} turns of <= {args.max_new_tokens} tokens, tiny Llama (hidden 128, 4 layers), 1 thread")
    results = {}
    for name, fn in (("tool_rollout (re-prefill each turn)", before), ("run_episodes (cache carried over)", after)):
        times, last = [], None
        for seed in range(args.repeats):
            t0 = time.perf_counter()
            last = fn(seed)
            times.append(time.perf_counter() - t0)
        rollout, sampled, turns = last
        wall = statistics.median(times)
        results[name] = wall
        print(f"{name:38s} {wall:7.3f} s  {rows / wall:7.1f} episodes/s  {sampled.sum().item() / wall:8.0f} sampled tokens/s  "
              f"turns {turns.float().mean():.2f}  completion {rollout.completion_mask.sum(1).float().mean():.1f} tokens")
    a, b = results.values()
    print(f"speed-up: {a / b:.2f}x")


if __name__ == "__main__":
    main()
