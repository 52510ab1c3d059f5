"""The seeds' explorers as figures, each computed with :mod:`rlalign.core` on a small problem whose
answer is known. One module per explorer, each with a pure ``compute(...)`` returning a dataclass of
arrays and a ``plot(result, path)``; :mod:`rlalign.explore.registry` maps kebab-case names to them
and ``rlalign explore`` (:mod:`rlalign.explore.cli`) runs them. See docs/explorers.md.
"""

from rlalign.explore.registry import EXPLORERS, run_explorer

__all__ = ["EXPLORERS", "run_explorer"]
