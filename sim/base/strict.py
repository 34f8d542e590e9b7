"""A strict builder of frozen dataclasses from YAML mappings.

Unknown keys are rejected with the list of allowed ones; values are checked
against the field's type hint; ``null`` means "the default". Every error is a
``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """Bad user input. The message is one line: file, field, expected, fix."""


# The ranges a run can mean, for every field alike: a count (tokens, blocks, requests in a step)
# fits the int32 columns of the requests table and every server's own limits; a time, span or
# duration within 1e9 s (31 years) keeps float64 seconds to a tenth of a microsecond (the ulp of
# 1e9 is 1.2e-7 s), finer than any step: beyond it, 1e300 ms gave 0 ms latencies.
MAX_COUNT = 2**31 - 1
MAX_SPAN_S = 1e9


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two YAML 1.2 habits users expect: ``1e3`` and ``2.5E-6`` are
    numbers (YAML 1.1 wants a dot, ``1.0e3``, and reads ``1e3`` as a string), and a key given
    twice in one mapping is an error at its line instead of the last one silently winning."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"duplicate key {key!r} (each field once)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse YAML text with ``StrictLoader`` (a ``yaml.YAMLError`` on bad input, nesting deep
    enough to exhaust Python's stack included)."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply to be a batchsim file") from None


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Check (and gently coerce int -> float, and a whole float such as ``1e6`` -> int) a YAML
    value against a type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is Any:
        return True, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return True, float(value)
        return False, value
    if hint is str:
        return isinstance(value, str), value
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    if origin is list:                    # list[int]: a YAML list whose items all pass
        if not isinstance(value, list):
            return False, value
        (item,) = typing.get_args(hint)
        checked = [_type_ok(v, item) for v in value]
        return all(ok for ok, _ in checked), [v for _, v in checked]
    return isinstance(value, hint), value


def _describe(hint: Any) -> str:
    if isinstance(hint, type):
        return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                "dict": "a mapping"}.get(hint.__name__, hint.__name__)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and any(typing.get_origin(h) is list for h in args):
        return " or ".join(_describe(h) for h in args if h is not type(None))     # int | list[int]: in words
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s"
    return str(hint).replace("typing.", "").replace("NoneType", "null")


def build(cls: type, data: Any, where: str, source: str, **extra: Any) -> Any:
    """Build frozen dataclass ``cls`` from a mapping, rejecting unknown keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: field '{where}' must be a mapping, got {type(data).__name__} "
                          f"({data!r})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in ("source", "base_dir", "raw")]
    kwargs: dict[str, Any] = dict(extra)
    for key, value in data.items():
        if value is None and key in names and not _type_ok(None, hints[key])[0]:
            continue                      # null means "the default"
        if key not in names:
            allowed = [n for n in names if n not in extra]
            raise ConfigError(f"{source}: unknown field '{where}.{key}'".replace("'.", "'")
                              + did_you_mean(key, allowed) + f"; allowed: {', '.join(allowed)}")
        ok, value = _type_ok(value, hints[key])
        if not ok and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: field '{where}.{key}'".replace("'.", "'")
                              + f" must be a finite number, got {value}")
        if not ok:
            raise ConfigError(f"{source}: field '{where}.{key}'".replace("'.", "'")
                              + f" expected {_describe(hints[key])}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def did_you_mean(word: Any, choices: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest of ``choices``, or ''."""
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _positive(source: str, name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        raise ConfigError(f"{source}: field '{name}' must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{source}: field '{name}' must be {'>= 0' if allow_zero else '> 0'}, "
                          f"got {value}")


def _require(source: str, name: str, value: Any, why: str) -> None:
    if value is None:
        raise ConfigError(f"{source}: field '{name}' is required {why}")


