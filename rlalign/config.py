"""Typed configs: one pydantic class per command, loaded from YAML with dotted overrides.

    cfg = load_config(GRPOConfig, "configs/grpo_arithmetic.yaml", ["optim.lr=1e-4", "seed=3"])

Every config class derives from :class:`Config`, which forbids unknown keys. Errors are raised as
:class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from rlalign.errors import RLAlignError

__all__ = ["Config", "ConfigError", "load_config", "parse_overrides", "apply_overrides"]


class ConfigError(RLAlignError, ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


class Config(BaseModel):
    """Base of every command's config: unknown keys are errors; defaults and assignments are validated;
    floats must be finite (an infinite learning rate or KL coefficient would train NaN weights)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)


C = TypeVar("C", bound=Config)


def _parse_value(text: str) -> Any:
    """'3' -> 3, '1e-4' -> 0.0001, 'true' -> True, '[1, 2]' -> [1, 2], 'abc' -> 'abc' (YAML scalars)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ['a.b=1', 'c=x'] into {'a': {'b': 1}, 'c': 'x'}."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.lr=1e-4)")
        key, text = item.split("=", 1)
        apply_overrides(tree, {key.strip(): _parse_value(text)})
    return tree


def apply_overrides(tree: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys of ``flat`` inside the nested dict ``tree`` (in place) and return it."""
    for dotted, value in flat.items():
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return tree


def _allowed_fields(cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names allowed at ``loc`` (the parent of the offending key)."""
    model: Any = cls
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return []
        model = fields[part].annotation
    fields = getattr(model, "model_fields", None)
    return sorted(fields) if fields else []


def _format_error(cls: type[BaseModel], err: ValidationError, source: str) -> str:
    lines = [f"invalid {cls.__name__} config ({source}):"]
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(cls, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            lines.append(f"  unknown key {key!r}.{hint} Allowed here: {', '.join(allowed)}")
        elif not loc:  # a check across fields: its message says which
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key} = {e.get('input')!r}: {e['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | dict | None = None) -> C:
    """Load ``cls`` from an optional YAML file, then apply dotted overrides, then validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            with path.open() as f:
                loaded = yaml.safe_load(f) or {}  # a syntax error's message names the file, line and column
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level, got {type(loaded).__name__}")
        data = loaded
        source = str(path)
    if overrides:
        flat = overrides if isinstance(overrides, dict) else None
        if flat is None:
            data = _merge(data, parse_overrides(list(overrides)))
        else:
            data = apply_overrides(data, dict(flat))
        source += " + overrides"
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(cls, err, source)) from None


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------------------------
# Self-documentation: every field of a config class, as a table and as a commented YAML file
# ----------------------------------------------------------------------------------------------


def _config_class(annotation: Any) -> type[Config] | None:
    """The Config class inside ``annotation`` (``X``, ``X | None``, ``list[X]``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, Config):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _config_class(arg)
        if found is not None:
            return found
    return None


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    for noise in ("typing.", "rlalign.", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return re.sub(r"Literal\[(.*?)\]", lambda m: m.group(1).replace(", ", " | ").replace("'", ""), text)


def describe_fields(cls: type[Config], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) of every field of ``cls``, nested configs walked
    (``model.lora.r``; ``rewards[].function`` for a list of configs)."""
    rows = []
    for name, info in cls.model_fields.items():
        dotted = f"{prefix}{name}"
        nested = _config_class(info.annotation)
        default = info.get_default(call_default_factory=True)
        if nested is not None and (isinstance(default, (Config, list)) or default is None):
            is_list = getattr(info.annotation, "__origin__", None) is list
            shown = "[...]" if is_list else ("null" if default is None else "")
            rows.append((dotted, nested.__name__ + ("[]" if is_list else ""), shown, info.description or ""))
            rows.extend(describe_fields(nested, f"{dotted}[]." if is_list else f"{dotted}."))
            continue
        value = default.model_dump(mode="json") if isinstance(default, BaseModel) else default
        rows.append((dotted, _type_name(info.annotation), yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n..."), info.description or ""))
    return rows


def fields_help(cls: type[Config]) -> str:
    """Every field of ``cls`` for ``--help``: dotted name, type and default, then its description."""
    lines = []
    for dotted, type_name, default, description in describe_fields(cls):
        lines.append(f"  {dotted}  ({type_name}, default {default})" if default else f"  {dotted}  ({type_name})")
        if description:
            lines.append(f"      {description}")
    return "\n".join(lines)


def default_yaml(cls: type[Config]) -> str:
    """``cls``'s defaults as a YAML file, each field preceded by its description as a comment;
    loading it back with :func:`load_config` gives the defaults."""

    def emit(model: type[Config], values: dict[str, Any], indent: str) -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            if info.description:
                out.append(f"{indent}# {info.description}")
            value = values[name]
            nested = _config_class(info.annotation)
            if nested is not None and isinstance(value, dict):
                out.append(f"{indent}{name}:")
                out.extend(emit(nested, value, indent + "  "))
            else:
                out.append(f"{indent}{name}: {yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix(chr(10) + '...')}")
        return out

    return "\n".join(emit(cls, cls().model_dump(mode="json"), "")) + "\n"
