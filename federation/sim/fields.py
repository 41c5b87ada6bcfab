"""Reading typed fields out of parsed YAML with errors that name the file and the field."""

from __future__ import annotations

import codecs
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class InputFileError(ValueError):
    """A simulator input (topology or trace) that cannot be used; the message says where."""


def read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark is dropped).

    Bytes that are not UTF-8 are refused with ``file:line:column`` (the column counts bytes).
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputFileError(f"{path}: cannot read: {err.strerror}") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise InputFileError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
            "save the file as UTF-8"
        ) from None


class Fields:
    """One mapping of a YAML document, read field by field.

    Every error names the file and the field path (``sites[2].nodes[0].cpu``), and ``done``
    refuses keys nobody read, so a typo is reported instead of silently ignored.
    """

    def __init__(self, source: str, path: str, value: object) -> None:
        if not isinstance(value, Mapping):
            raise InputFileError(f"{source}: {path or 'top level'}: expected a mapping")
        self.source = source
        self.path = path
        self._doc: Mapping[str, Any] = value
        self._read: set[str] = set()

    def where(self, key: str) -> str:
        """The path of ``key`` for messages."""
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, problem: str) -> InputFileError:
        """An error about ``key``."""
        return InputFileError(f"{self.source}: {self.where(key)}: {problem}")

    def names(self) -> list[str]:
        """Every key of the mapping, as text."""
        return [str(k) for k in self._doc]

    def has(self, key: str) -> bool:
        """Whether the mapping sets ``key`` (to anything but null)."""
        return self._doc.get(key) is not None

    def raw(self, key: str) -> Any:
        """The value as parsed, marked as read."""
        self._read.add(key)
        return self._doc.get(key)

    def string(self, key: str, default: str | None = None) -> str:
        """A non-empty string; required unless ``default`` is given."""
        value = self.raw(key)
        if value is None:
            if default is None:
                raise self.fail(key, "is required")
            return default
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise self.fail(key, f"expected text, got {type(value).__name__}")
        text = str(value).strip()
        if not text and default is None:
            raise self.fail(key, "is empty")
        return text

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        minimum: float = 0.0,
        maximum: float = math.inf,
    ) -> float:
        """A finite number in [minimum, maximum]; required unless ``default`` is given."""
        value = self.raw(key)
        if value is None:
            if default is None:
                raise self.fail(key, "is required")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number) or not minimum <= number <= maximum:
            bound = f"<= {maximum:g}" if math.isfinite(maximum) else ""
            raise self.fail(key, f"must be >= {minimum:g} {bound}".strip() + f", got {value!r}")
        return number

    def integer(self, key: str, default: int | None = None, *, minimum: int = 0) -> int:
        """A whole number >= minimum; required unless ``default`` is given."""
        value = self.raw(key)
        if value is None and default is not None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected a whole number, got {value!r}")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """A boolean."""
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def child(self, key: str) -> Fields | None:
        """A nested mapping, or None when absent."""
        value = self.raw(key)
        return None if value is None else Fields(self.source, self.where(key), value)

    def items(self, key: str, *, required: bool = False) -> list[Fields]:
        """A list of mappings."""
        value = self.raw(key)
        if value is None:
            if required:
                raise self.fail(key, "is required")
            return []
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise self.fail(key, "expected a list")
        if required and not value:
            raise self.fail(key, "is empty")
        return [Fields(self.source, f"{self.where(key)}[{i}]", v) for i, v in enumerate(value)]

    def done(self) -> None:
        """Refuse keys that were not read (typos, fields from another format)."""
        unknown = sorted(set(self._doc) - self._read)
        if unknown:
            raise InputFileError(
                f"{self.source}: {self.path or 'top level'}: unknown field(s) {', '.join(unknown)}"
            )
