"""Reading TOML config files into frozen dataclasses, with flags layered on top.

``build`` checks every value against its field's type (a TOML string is no number, and
``"no"`` is no boolean) and against the rule declared next to the field, if any::

    offer_timeout_s: float = field(default=5.0, metadata=positive())

Each refusal is a ``ConfigError`` naming the file and the full key path, e.g.
``agent.toml: slurm.gres.a100.memory_mib must be 0 or more, not -1``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

Rule = Callable[[Any], str | None]
"""What is wrong with a value of the right type (``"must be positive"``), or None."""


class ConfigError(ValueError):
    """A config file or flag is wrong; the message names the file and key."""


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


# Rules, declared as field metadata. In a list or table they apply to each number in it.


def _rule(rule: Rule) -> dict[str, Rule]:
    return {"rule": rule}


def positive() -> dict[str, Rule]:
    """A number above 0: timeouts and intervals, where 0 would mean at once or never."""
    return _rule(lambda v: None if v > 0 else "must be positive")


def at_least(low: int) -> dict[str, Rule]:
    """A number of at least ``low``: 0 for counts and limits where 0 turns the thing off."""
    wanted = "0 or more" if low == 0 else f"at least {low}"
    return _rule(lambda v: None if v >= low else f"must be {wanted}")


def within(low: float, high: float) -> dict[str, Rule]:
    """A number from ``low`` to ``high``, both included (a fraction: 0 and 1)."""
    return _rule(lambda v: None if low <= v <= high else f"must be in {low}..{high}")


def one_of(*choices: str) -> dict[str, Rule]:
    return _rule(lambda v: None if v in choices else f"must be one of {', '.join(choices)}")


def address(*, lowest_port: int = 0, empty: bool = False) -> dict[str, Rule]:
    """A ``host:port`` (``[v6]:port``; the host may be left out). ``lowest_port`` 0 for
    addresses to listen on (0 picks a free port), 1 for addresses others dial; ``empty``
    where the field's docstring gives "" a meaning."""

    def rule(value: str) -> str | None:
        if empty and not value:
            return None
        _, sep, port = value.rpartition(":")
        if sep and port.isdigit() and lowest_port <= int(port) <= 65535:
            return None
        return f"must be host:port with a port in {lowest_port}..65535"

    return _rule(rule)


def url(*schemes: str, empty: bool = False) -> dict[str, Rule]:
    """A ``scheme://host:port`` with one of ``schemes``; ``empty`` as for ``address``."""

    def rule(value: str) -> str | None:
        if empty and not value:
            return None
        scheme, sep, rest = value.partition("://")
        if sep and scheme in schemes and rest and address(lowest_port=1)["rule"](rest) is None:
            return None
        return f"must be {' or '.join(f'{s}://host:port' for s in schemes)}"

    return _rule(rule)


# Building a dataclass from a table.


def build(
    cls: type[T],
    values: Mapping[str, Any],
    *,
    source: str,
    folder: Path | None = None,
    path: str = "",
) -> T:
    """Instantiate dataclass ``cls`` from ``values``, each checked against its field.

    Args:
        source: The config file (or "flags"), named first in every error.
        folder: Where relative paths from the file lie; default the folder of ``source``
            when it is a ``.toml`` file, else the working directory.
        path: The key path of ``values`` within the file, e.g. ``slurm`` (empty: the top).

    Raises:
        ConfigError: An unknown key, a missing one, or a value of the wrong type or range.
    """
    if folder is None:
        folder = Path(source).parent if source.endswith(".toml") else Path.cwd()
    return _Reader(source, _absolute(folder)).table(cls, values, path)


def _absolute(path: Path) -> Path:
    # Lexically, so that messages show /etc/x rather than /home/me/../../etc/x; symlinks
    # are left alone, as the folder a config names may be one on purpose.
    return Path(os.path.abspath(path.expanduser()))


class _Reader:
    def __init__(self, source: str, folder: Path) -> None:
        self.source = source
        self.folder = folder

    def fail(self, where: str, problem: str, value: Any = dataclasses.MISSING) -> ConfigError:
        shown = "" if value is dataclasses.MISSING else f", not {value!r}"
        return ConfigError(f"{self.source}: {where} {problem}{shown}")

    def table(self, cls: type[T], values: Mapping[str, Any], path: str) -> T:
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        hints = typing.get_type_hints(cls)  # the annotations are strings (``from __future__``)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            where = f"{path}.{key}" if path else key
            field = fields.get(key)
            if field is None:
                raise ConfigError(
                    f"{self.source}: unknown setting {where}; known: {', '.join(fields)}"
                )
            if value is not None:  # a flag that was not given
                kwargs[key] = self.value(value, hints[key], where, field.metadata.get("rule"))
        for name, field in fields.items():
            required = field.default is field.default_factory is dataclasses.MISSING
            if required and name not in kwargs:
                where = f"{path}.{name}" if path else name
                raise ConfigError(f"{self.source}: {where} is missing")
        return cls(**kwargs)

    def value(self, value: Any, kind: Any, where: str, rule: Rule | None) -> Any:
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin in (types.UnionType, typing.Union):  # ``X | None``: TOML has no null
            (kind,) = [a for a in args if a is not type(None)]
            return self.value(value, kind, where, rule)
        if kind is Any or kind is object:
            return value  # checked where it is read (e.g. priority classes, links)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            if isinstance(value, kind):
                return value  # built already, by the caller
            if not isinstance(value, Mapping):
                raise self.fail(where, "must be a table", value)
            return self.table(kind, value, where)
        if origin is list:
            if not isinstance(value, list):
                raise self.fail(where, "must be an array", value)
            return [self.value(v, args[0], f"{where}[{i}]", rule) for i, v in enumerate(value)]
        if origin is dict:
            if not isinstance(value, Mapping):
                raise self.fail(where, "must be a table", value)
            return {k: self.value(v, args[1], f"{where}.{k}", rule) for k, v in value.items()}
        value = self.scalar(value, kind, where)
        problem = rule(value) if rule else None
        if problem:
            raise self.fail(where, problem, value)
        return value

    def scalar(self, value: Any, kind: Any, where: str) -> Any:
        # bool is an int to Python: look for it first, and refuse it as a number.
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and is_number and isinstance(value, int):
            return value
        if kind is float and is_number:
            if not math.isfinite(value):
                raise self.fail(where, "must be a finite number", value)
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if kind is Path and isinstance(value, Path):
            return _absolute(value)  # a flag: relative to the working directory
        if kind is Path and isinstance(value, str) and value:
            return _absolute(self.folder / Path(value).expanduser())  # from a file: beside it
        what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        raise self.fail(where, f"must be {what.get(kind, 'a path')}", value)
