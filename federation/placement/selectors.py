"""CEL device selectors: compiled once, evaluated once per device class (not per device)."""

from __future__ import annotations

import functools
import re
from typing import Any

import cel
import numpy as np

from federation.placement.snapshot import Bool, DeviceClass, Snapshot

# Every attribute a selector may read, with a value of the right type (for validation).
SAMPLE_DEVICE: dict[str, Any] = {
    "kind": "GPU",
    "vendor": "nvidia",
    "model": "A100-80GB",
    "memory_mib": 81920.0,
    "memory_gib": 80.0,
    "tflops_fp32": 19.5,
    "tflops_fp16": 312.0,
    "tflops_int8": 624.0,
    "power_tdp_watts": 400.0,
    "declared": False,
    "attributes": {},
}


class SelectorError(ValueError):
    """A selector that cannot be compiled, reads an unknown attribute, or is not boolean."""


@functools.lru_cache(maxsize=4096)
def compile_selector(source: str) -> Any:
    """The compiled program (cached: the same selector is compiled once per process)."""
    try:
        return cel.compile(source)
    except ValueError as err:
        raise SelectorError(str(err).splitlines()[0]) from None


def check_selector(source: str) -> None:
    """Compile and try ``source`` on a sample device; raise ``SelectorError`` saying why not."""
    program = compile_selector(source)
    try:
        result = program.execute({"device": SAMPLE_DEVICE})
    except KeyError as err:
        name = str(err.args[0]) if err.args else ""
        if re.search(rf"\bdevice\.{re.escape(name)}\b", source):
            known = ", ".join(sorted(SAMPLE_DEVICE))
            raise SelectorError(f"unknown attribute device.{name} (known: {known})") from None
        return  # a key looked up in device.attributes: absent on the sample, fine
    except Exception as err:
        raise SelectorError(f"cannot evaluate: {err}") from None
    if not isinstance(result, bool):
        raise SelectorError(f"must be true or false, got {type(result).__name__}")


def _matches(program: Any, device_class: DeviceClass) -> bool:
    try:
        return program.execute({"device": device_class.attributes}) is True
    except Exception:
        return False  # e.g. an attribute this class lacks: it does not match


def selector_class_mask(source: str, snap: Snapshot) -> Bool:
    """Mask over device classes: those the selector accepts (one evaluation per class)."""
    program = compile_selector(source)
    return np.array([_matches(program, c) for c in snap.classes], dtype=bool)
