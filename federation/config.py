"""Reading TOML config files into frozen dataclasses, with flags layered on top."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


def build(cls: type[T], values: Mapping[str, Any], *, source: str) -> T:
    """Instantiate dataclass ``cls`` from ``values``; unknown keys and wrong types raise.

    Paths are resolved relative to the config file's folder when ``source`` is a file.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    base = Path(source).parent if source.endswith(".toml") else Path.cwd()
    for key, value in values.items():
        if value is None:
            continue
        field = fields.get(key)
        if field is None:
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(fields)}")
        kind = str(field.type)
        if "Path" in kind:
            value = base / Path(str(value)).expanduser()
        elif "float" in kind and isinstance(value, int | float) and not isinstance(value, bool):
            value = float(value)
        elif kind.startswith("list") and not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be an array")
        elif kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{source}: {key} must be an integer")
        elif "dict" in kind and not kind.startswith("list") and not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a table")
        elif kind in ("str", "str | None") and not isinstance(value, str):
            raise ConfigError(f"{source}: {key} must be a string")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{source}: {err}") from None
