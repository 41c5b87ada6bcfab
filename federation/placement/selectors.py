"""CEL device selectors: compiled once, evaluated once per device class (not per device).

Every selector is bounded before the CEL library sees it (``selector_cost``): its length, its
nesting and its worst-case cost per device. The library's native code can panic; a panic is a
``BaseException``, so it is caught here by name and becomes a ``SelectorError`` like any other.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import cel
import numpy as np

from federation.placement.selector_cost import SelectorCostError, check_selector_cost
from federation.placement.snapshot import Bool, Snapshot

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


_MAX_MESSAGE = 200
"""Characters of the CEL library's own message kept in an error (it may quote the input)."""


def _is_panic(err: BaseException) -> bool:
    """A panic in the library's native code (pyo3's ``PanicException``, a ``BaseException``)."""
    return type(err).__name__ == "PanicException"


@functools.lru_cache(maxsize=4096)
def compile_selector(source: str) -> Any:
    """The compiled program of a selector within the bounds (cached: once per process).

    Raises:
        SelectorError: Too long, too deep, too costly, or not valid CEL.
    """
    try:
        check_selector_cost(source)
    except SelectorCostError as err:
        raise SelectorError(str(err)) from None
    try:
        return cel.compile(source)
    except ValueError as err:
        raise SelectorError(str(err).splitlines()[0][:_MAX_MESSAGE]) from None
    except BaseException as err:
        if _is_panic(err):
            raise SelectorError("cannot be parsed") from None
        raise


def accepts(program: Any, attributes: dict[str, Any]) -> bool:
    """Whether a compiled selector accepts a device with these attributes.

    An error (an attribute this device lacks) or a panic means it does not match.
    """
    try:
        return program.execute({"device": attributes}) is True
    except Exception:
        return False
    except BaseException as err:
        if _is_panic(err):
            return False
        raise


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
        raise SelectorError(f"cannot evaluate: {str(err)[:_MAX_MESSAGE]}") from None
    except BaseException as err:
        if _is_panic(err):
            raise SelectorError("cannot be evaluated") from None
        raise
    if not isinstance(result, bool):
        raise SelectorError(f"must be true or false, got {type(result).__name__}")


def selector_class_mask(source: str, snap: Snapshot) -> Bool:
    """Mask over device classes: those the selector accepts (one evaluation per class)."""
    program = compile_selector(source)
    return np.array([accepts(program, c.attributes) for c in snap.classes], dtype=bool)
