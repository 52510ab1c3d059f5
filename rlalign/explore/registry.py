"""The explorers by name: kebab-case name -> module with ``SUMMARY``, ``compute()`` and ``plot(result, path)``,
and for the live page (``rlalign explore --serve``) ``PARAMS`` (what the reader may move, with ranges),
``EQUATIONS`` ((caption, mathtext) pairs) and ``figure(result)`` (a plotly figure as plain dicts).

Running one writes ``<out>/<name>.png`` (the figure) and ``<out>/<name>.json`` (every array behind it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from rlalign.explore._common import write_json
from rlalign.explore.params import Param

__all__ = ["EXPLORERS", "Explorer", "get", "run_explorer"]


@dataclass(frozen=True)
class Explorer:
    name: str
    module: str  # dotted module path; imported only when the explorer runs
    seed_name: str  # the name the seed documents give it

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def summary(self) -> str:
        return self.load().SUMMARY

    @property
    def params(self) -> tuple[Param, ...]:
        return self.load().PARAMS

    @property
    def equations(self) -> tuple[tuple[str, str], ...]:
        return self.load().EQUATIONS


EXPLORERS: dict[str, Explorer] = {
    e.name: e
    for e in (
        Explorer("per-token-ratio", "rlalign.explore.per_token_ratio", "PerTokenRatioExplorer"),
        Explorer("ppo-loss-decomposition", "rlalign.explore.ppo_loss", "PPOLossDecomposition"),
        Explorer("ppo-surrogates", "rlalign.explore.ppo_surrogates", "PPO surrogate objectives along the update (PPO paper, fig. 2)"),
        Explorer("baseline-variance", "rlalign.explore.baseline_variance", "BaselineVarianceReduction"),
        Explorer("gae-lambda-sweep", "rlalign.explore.gae_sweep", "GAELambdaSweep / GAEExplorer"),
        Explorer("entropy-collapse", "rlalign.explore.entropy_collapse", "EntropyCollapseDemo"),
        Explorer("grpo-advantage", "rlalign.explore.grpo_advantage", "GRPOAdvantageExplorer"),
        Explorer("kl-penalty-tradeoff", "rlalign.explore.kl_penalty", "KLPenaltyTradeoff"),
        Explorer("kl-divergence", "rlalign.explore.kl_divergence", "KLDivergenceExplorer"),
        Explorer("maze-values", "rlalign.explore.maze_values", "MazeValueIteration"),
    )
}


def get(name: str) -> Explorer:
    if name not in EXPLORERS:
        raise KeyError(f"unknown explorer {name!r}; choose one of {', '.join(EXPLORERS)}")
    return EXPLORERS[name]


def run_explorer(name: str, out_dir: str | Path) -> tuple[Path, Path]:
    """Compute explorer ``name``, write its figure and data into ``out_dir``; return (png, json) paths."""
    module = get(name).load()
    out_dir = Path(out_dir)
    result = module.compute()
    png = module.plot(result, out_dir / f"{name}.png")
    data = write_json(result, out_dir / f"{name}.json")
    return Path(png), data
