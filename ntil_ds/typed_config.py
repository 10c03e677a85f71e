"""Strict typed trees of dataclasses from YAML and ``key=value`` overrides; no project knowledge.

Every key must be a field (an unknown key is an error with a "did you mean"), every value must have the
field's type (``Literal`` choices, bool, int, float, str, their unions and lists (of dataclasses too); YAML 1.1's "1e-5" read as a
number), and each error names the dotted key. ``ntil_ds.config`` is the schema built on it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the key and says how to fix it."""


def apply_override(raw: dict[str, Any], override: str) -> None:
    """``raw`` (the YAML mapping) with ``dotted.key=value`` set in place; the value is parsed as YAML."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like key=value, e.g. train.max_steps=10")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def build(cls: type, raw: Any, prefix: str = "") -> Any:
    """An instance of the dataclass ``cls`` from the mapping ``raw`` (fields absent from it keep their
    defaults); ``prefix``: the dotted path of ``raw`` in the tree, for error messages."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the recipe'} must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown config key '{prefix}{key}'{hint} (valid keys here: {', '.join(sorted(fields))})"
        )
    values: dict[str, Any] = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build(hint, value if value is not None else {}, prefix=f"{key}.")
        else:
            values[name] = _coerce(value, hint, key)
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:  # a list of one dataclass, each item built strictly like a section
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list (in YAML: one '- ...' entry per item)")
        if dataclasses.is_dataclass(item):
            return [build(item, entry, prefix=f"{key}[{i}].") for i, entry in enumerate(value)]
        return [_coerce(entry, item, f"{key}[{i}]") for i, entry in enumerate(value)]
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key} must not be empty")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be an integer")
    if hint is float:
        # YAML 1.1 reads "1e-5" (no dot) as a string: accept any numeric spelling.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} must be a string (quote it in YAML)")
    raise TypeError(f"config field {key} has an unsupported type {hint!r}")  # a bug in this file
