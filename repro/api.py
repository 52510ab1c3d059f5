"""Python-API driver: python api.py CASE  (chat prompts from the lookup task)."""
import sys, traceback, shutil
import envs
from rlalign.config import load_config
from rlalign.tasks import lookup as L
from rlalign.train import grpo

case = sys.argv[1]
out = f"/tmp/ab_api/{case}"
shutil.rmtree(out, ignore_errors=True)
fields = {"model.path": "/tmp/ab_tiny", "output_dir": out, "data.task": "arithmetic", "rewards": [], "steps": 2, "prompts_per_step": 2,
          "group_size": 2, "sampling.max_new_tokens": 8, "beta": 0.0, "progress": False, "plots": False, "eval.enabled": False,
          "environment.max_turns": 2, "save_every": 1}
records = L.prompt_records("train", 8)
kw = {}
if case.startswith("env:"):
    kw["environment"] = getattr(envs, case[4:])
elif case == "dict_missing":
    kw["environment"] = envs.DICT
elif case == "dict_unknown":
    kw["environment"] = envs.DICT
    records = [{**r, "environment": "nowhere"} for r in records]
elif case == "tools_lambda":
    kw["tools"] = [lambda x: x]
elif case == "tools_builtin":
    kw["tools"] = [len]
elif case == "tools_env_rlalign":
    kw["tools"] = [L.lookup]; kw["environment"] = L.LookupEnvironment
elif case == "envs_kw_no_env":
    fields.pop("environment.max_turns")
    seen = []
    def r(completions, environments=None, **k):
        seen.append(environments); return [0.0] * len(completions)
    kw["reward_functions"] = [r]
    kw["_seen"] = seen
elif case == "envs_kw_required_no_env":
    fields.pop("environment.max_turns")
    def r(completions, environments, **k):
        return [0.0] * len(completions)
    kw["reward_functions"] = [r]
seen = kw.pop("_seen", None)
cfg = load_config(grpo.GRPOConfig, None, fields)
try:
    res = grpo.train(cfg, prompts=records, **kw)
    print("OK", res.history[-1].get("reward/mean"))
except Exception as err:
    print("RAISED", type(err).__mro__[:3], err)
if seen is not None:
    print("environments seen:", seen)
