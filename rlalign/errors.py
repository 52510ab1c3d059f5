"""The one base class of the errors rlalign raises on bad input or a run it cannot continue.

The command line prints such an error as one message, without a traceback, and exits 2
(``rlalign --debug ...`` shows the traceback). Each subclass also derives from the built-in
exception it refines (``ValueError``, ``RuntimeError``, ...), so ``except ValueError`` still works.
"""

from __future__ import annotations

__all__ = ["RLAlignError", "NonFiniteError"]


class RLAlignError(Exception):
    """Bad input, or a run that cannot go on: the message says what and where."""


class NonFiniteError(RLAlignError, FloatingPointError):
    """A number a run cannot go on from: a loss, gradient norm, reward, parameter or network output that is NaN
    or infinite (or past float32's range). The run stops there and no weights of that step are saved."""
