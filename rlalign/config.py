"""Typed configs: one pydantic class per command, loaded from YAML with dotted overrides.

    cfg = load_config(GRPOConfig, "configs/grpo_arithmetic.yaml", ["optim.lr=1e-4", "seed=3"])

Every config class derives from :class:`Config`, which forbids unknown keys and refuses a boolean
for a number. Errors are raised as :class:`ConfigError` naming the key, the value and what is
allowed; a config file must be UTF-8 YAML with each key once per mapping (a repeated key names its
lines).
"""

from __future__ import annotations

import codecs
import difflib
import io
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from rlalign.errors import RLAlignError
from rlalign.trl_names import trl_hint, trl_trainer

__all__ = ["Config", "ConfigError", "load_config", "read_yaml", "parse_overrides", "apply_overrides"]


class ConfigError(RLAlignError, ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


class Config(BaseModel):
    """Base of every command's config: unknown keys are errors; defaults and assignments are validated;
    floats must be finite (an infinite learning rate or KL coefficient would train NaN weights)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``batch_size: true`` is an error, not 1 (pydantic's lax mode would take a bool for an int or a float)."""
        if _bool_for_number(cls.model_fields[info.field_name].annotation, value):
            raise ValueError("a boolean where a number goes: write the number (e.g. 1 or 0.5)")
        return value


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """Whether ``value`` holds a bool where ``annotation`` wants an int or a float (and takes no bool), also inside
    lists, tuples and dict values."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _bool_for_number(typing.get_args(annotation)[0], value)
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    if isinstance(value, bool):
        return any(o in (int, float) for o in options) and not any(o in (bool, Any, object) for o in options)
    for option in options:
        origin, args = typing.get_origin(option), typing.get_args(option)
        if origin in (list, tuple, set, frozenset) and isinstance(value, (list, tuple)) and args:
            items = args if origin is tuple and Ellipsis not in args and len(args) == len(value) else [args[0]] * len(value)
            if any(_bool_for_number(a, v) for a, v in zip(items, value)):
                return True
        elif origin is dict and isinstance(value, dict) and len(args) == 2:
            if any(_bool_for_number(args[1], v) for v in value.values()):
                return True
    return False


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (YAML itself keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges; keys after it may override its keys
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the constructor below names it
                continue
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping."""

    def __init__(self, key: Any, first_line: int, mark: yaml.Mark):
        where = f"on line {first_line}" if first_line == mark.line + 1 else f"on lines {first_line} and {mark.line + 1}"
        super().__init__(f"key {key!r} is given twice ({where}); keep one")
        self.key, self.first_line, self.line = key, first_line, mark.line + 1


C = TypeVar("C", bound=Config)


def _parse_value(text: str) -> Any:
    """'3' -> 3, '1e-4' -> 0.0001, 'true' -> True, '[1, 2]' -> [1, 2], 'abc' -> 'abc' (YAML scalars)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except DuplicateKeyError as err:
        raise ConfigError(f"override value {text!r}: {err}") from None
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


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config classes an annotation names: itself, or those inside ``X | None``, ``list[X]``, ``dict[str, X]``, ``Annotated``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _allowed_fields(cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names allowed at ``loc`` (the parent of the offending key). A part of ``loc`` that names
    no field (an index of a list, a key of a mapping, a union member's tag) keeps the sections found so far."""
    annotation: Any = cls
    for part in loc:
        field = next((f for model in _models_in(annotation) for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is not None:
            annotation = field.annotation
    return sorted({f.alias or name for model in _models_in(annotation) for name, f in model.model_fields.items()})  # as a config writes them


def _format_error(cls: type[BaseModel], err: ValidationError, source: str) -> str:
    lines = [f"invalid {cls.__name__} config ({source}):"]
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(cls, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            name, colon, value = str(loc[-1]).partition(":")
            if colon and name in allowed:  # {function:arithmetic} is YAML for the key "function:arithmetic"
                hint = f" Did you mean {f'{name}: {value}'!r} (YAML needs a space after the colon)?"
            trl = trl_hint(trl_trainer(cls), str(loc[-1]), allowed=allowed)
            if trl is not None:  # TRL's name for a field called otherwise here: the spelling's neighbour would mislead
                hint = f" {trl}."
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
        loaded = read_yaml(path) or {}
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


def read_yaml(path: Path) -> Any:
    """The YAML document in the file ``path``: UTF-8 text, each key once per mapping.

    Raises:
        ConfigError: no such file, a directory, not UTF-8 (naming the line), a syntax error or a repeated key (naming the line).
    """
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the YAML file inside it")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    raw = path.read_bytes()
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise ConfigError(f"config file {str(path)!r} is UTF-16 text; rlalign reads UTF-8: save it as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: byte {raw[err.start]:#04x} on line {line}; save it as UTF-8") from None
    stream = io.StringIO(text)
    stream.name = str(path)  # named in a syntax error's message, with the line and column
    try:
        return yaml.load(stream, Loader=_UniqueKeyLoader)
    except DuplicateKeyError as err:
        raise ConfigError(f"config file {str(path)!r}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None


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
        dotted = f"{prefix}{info.alias or name}"  # what a user writes (environment.class)
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
            key = info.alias or name  # what a user writes (environment.class)
            if nested is not None and isinstance(value, dict):
                out.append(f"{indent}{key}:")
                out.extend(emit(nested, value, indent + "  "))
            else:
                out.append(f"{indent}{key}: {yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix(chr(10) + '...')}")
        return out

    return "\n".join(emit(cls, cls().model_dump(mode="json"), "")) + "\n"
