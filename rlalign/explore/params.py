"""The parameters a reader may move in an explorer, with their ranges, and the check of a request's values.

Every explorer module declares ``PARAMS``: one :class:`Param` per keyword of its ``compute()`` that
the live page (``rlalign explore --serve``) shows as a slider (numbers) or a selector (choices), or,
with ``stage="figure"``, per keyword of its ``figure()`` and ``plot()`` (what is shown of a result,
such as the value-iteration sweep: moving it recomputes nothing). ``convert`` turns the control's
value into the keyword's (a single entropy coefficient into the tuple of those compared).
:func:`parse_params` turns a request's text values into ``compute()`` keywords, or raises
:class:`ParamError` naming the parameter and what is allowed: a value outside its range, of the
wrong type, not on its step grid, or a name the explorer does not have. A ``compute()`` called
directly from Python checks its own arguments with :func:`require` against what the maths allows
(wider than the page's ranges: ``gamma`` in [0, 1], a batch of at least two for a leave-one-out
baseline), with one message naming the explorer, the keyword and what it must be.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Param", "ParamError", "parse_params", "defaults", "keywords", "require", "whole", "number", "each"]


class ParamError(ValueError):
    """A request's parameter is unknown, malformed or out of range; the message says which and what is allowed."""


@dataclass(frozen=True)
class Param:
    name: str  # compute()'s keyword
    label: str  # what the page shows, with the seed's symbol
    default: float | int | str
    low: float = 0.0
    high: float = 1.0
    step: float = 0.01
    kind: str = "float"  # "float" | "int" (sliders) or "choice" (a selector over ``choices``)
    choices: tuple[str, ...] = ()
    help: str = ""
    stage: str = "compute"  # "compute": a keyword of compute(); "figure": of figure() and plot()
    convert: Callable[[Any], Any] | None = None  # control value -> the keyword's value
    size: bool = False  # a problem size (steps, samples): larger values cost proportionally more compute

    def __post_init__(self) -> None:
        if self.stage not in ("compute", "figure"):
            raise ValueError(f"{self.name}: stage must be compute or figure, got {self.stage!r}")
        if self.kind == "choice":
            if self.default not in self.choices:
                raise ValueError(f"{self.name}: default {self.default!r} is not one of {self.choices}")
            return
        if self.kind not in ("float", "int"):
            raise ValueError(f"{self.name}: kind must be float, int or choice, got {self.kind!r}")
        if not self.low <= self.default <= self.high:
            raise ValueError(f"{self.name}: default {self.default} is outside [{self.low}, {self.high}]")
        if self.kind == "int" and not all(float(v).is_integer() for v in (self.low, self.high, self.step, self.default)):
            raise ValueError(f"{self.name}: an int parameter needs whole bounds, step and default")
        if not self._on_grid(float(self.default)):
            raise ValueError(f"{self.name}: default {self.default} is not on the grid {self.low} + k * {self.step}")

    def _on_grid(self, value: float) -> bool:
        k = (value - self.low) / self.step
        return abs(k - round(k)) < 1e-6

    def allowed(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        kind = "a whole number" if self.kind == "int" else "a number"
        return f"{kind} from {self.low:g} to {self.high:g} in steps of {self.step:g}"

    def parse(self, text: str) -> float | int | str:
        """The value of ``text`` for this parameter, or :class:`ParamError`."""
        if self.kind == "choice":
            if text not in self.choices:
                raise ParamError(f"{self.name}={text[:40]!r} is not allowed; it must be {self.allowed()}")
            return text
        try:
            value = float(text)
        except ValueError:
            raise ParamError(f"{self.name}={text[:40]!r} is not a number; it must be {self.allowed()}") from None
        if not math.isfinite(value) or not self.low - 1e-9 <= value <= self.high + 1e-9 or not self._on_grid(value):
            raise ParamError(f"{self.name}={text[:40]!r} is out of range; it must be {self.allowed()}")
        # snap to the grid, so 0.30000000000000004 and 0.3 compute (and cache) the same thing
        snapped = self.low + round((value - self.low) / self.step) * self.step
        return int(round(snapped)) if self.kind == "int" else round(snapped, 10)

    def spec(self) -> dict[str, Any]:
        """The JSON the page builds its control from."""
        return {
            "name": self.name, "label": self.label, "kind": self.kind, "default": self.default, "low": self.low,
            "high": self.high, "step": self.step, "choices": list(self.choices), "help": self.help, "stage": self.stage,
            "size": self.size,
        }


def keywords(params: Sequence[Param], values: Mapping[str, Any], stage: str) -> dict[str, Any]:
    """The keywords of ``stage`` ("compute" or "figure") for parsed ``values``, each through its ``convert``."""
    return {p.name: (p.convert(values[p.name]) if p.convert else values[p.name]) for p in params if p.stage == stage}


def defaults(params: Sequence[Param]) -> dict[str, Any]:
    return {p.name: p.default for p in params}


def parse_params(params: Sequence[Param], query: Mapping[str, str]) -> dict[str, Any]:
    """``compute()`` keywords from a request's ``query``: every declared parameter, missing ones at their default.
    A name given twice (``?eps=0.1&eps=0.3``, in a multi-valued query such as Starlette's) is refused, not resolved
    by silently keeping one of the values."""
    by_name = {p.name: p for p in params}
    names = [name for name, _ in query.multi_items()] if hasattr(query, "multi_items") else list(query)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ParamError(f"parameter {repeated[0][:40]!r} is given {names.count(repeated[0])} times; give it once")
    unknown = sorted(set(query) - set(by_name))
    if unknown:
        allowed = ", ".join(by_name) or "none"
        raise ParamError(f"unknown parameter {unknown[0][:40]!r}; this explorer takes: {allowed}")
    values = defaults(params)
    for name, text in query.items():
        values[name] = by_name[name].parse(text)
    return values


def require(where: str, **checks: tuple[Any, Callable[[Any], bool], str]) -> None:
    """Check the arguments of a ``compute()`` called directly (the page's values are checked by
    :func:`parse_params`): each keyword is (value, test, what it must be); raises :class:`ParamError`
    "<where>: <name>=<value> must be <what>" for the first that fails its test (or cannot be tested)."""
    for name, (value, test, what) in checks.items():
        try:
            ok = bool(test(value))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ParamError(f"{where}: {name}={value!r:.60} must be {what}")


def whole(low: int) -> Callable[[Any], bool]:
    """The test of a whole number >= ``low`` (an int, a numpy integer; not a bool)."""
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low


def number(low: float = -math.inf, high: float = math.inf, above: bool = False) -> Callable[[Any], bool]:
    """The test of a finite real number in [low, high] (in (low, high] with ``above``)."""
    return lambda v: (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                      and (v > low if above else v >= low) and v <= high)


def each(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """The test of a non-empty sequence whose every item passes ``test``."""
    return lambda values: len(values) > 0 and all(test(v) for v in values)
