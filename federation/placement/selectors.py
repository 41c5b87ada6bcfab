"""CEL device selectors: compiled once, evaluated once per device class (not per device).

Every selector is bounded before the CEL library sees it (``selector_cost``): its length, its
nesting and its estimated worst-case cost per device. Estimates can be wrong, so selectors are
then only ever evaluated in a child process under a time budget (``selector_sandbox``): at
submission on a sample device and on the largest device a view may hold (``check_selector``,
off the event loop through ``try_selectors``), and in placement once per device class, the
verdicts remembered so that a waiting job costs nothing on later passes. The library's native
code can panic; a panic is a ``BaseException``, so it is caught by name and becomes a
``SelectorError`` like any other.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import cel
import numpy as np

from federation.placement.selector_cost import (
    MAX_ATTRIBUTE_CHARS,
    MAX_DEVICE_ATTRIBUTES,
    SelectorCostError,
    check_selector_cost,
)
from federation.placement.selector_sandbox import SelectorBudgetError, SelectorSandbox
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


_LONG = "x" * MAX_ATTRIBUTE_CHARS
WORST_CASE_DEVICE: dict[str, Any] = {
    **SAMPLE_DEVICE,
    **{k: _LONG for k in ("kind", "vendor", "model")},
    "attributes": {f"{i:0{MAX_ATTRIBUTE_CHARS}d}": _LONG for i in range(MAX_DEVICE_ATTRIBUTES)},
}
"""The largest device a checked view may carry: a selector is timed on it at submission."""


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


def attributes_key(attributes: dict[str, Any]) -> tuple[object, ...]:
    """A hashable key of what a selector sees of a device: equal keys, equal verdicts."""
    return tuple(
        (k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
        for k, v in sorted(attributes.items())
    )


class _Verdicts:
    """Every selector's verdict per device seen, and the selectors over budget; bounded."""

    def __init__(self) -> None:
        self.sandbox = SelectorSandbox()
        self._lock = threading.Lock()
        self._matches: dict[tuple[str, tuple[object, ...]], bool] = {}
        self._over_budget: dict[str, str] = {}
        self._trials: dict[str, str] = {}

    def missing(self, source: str, attribute_sets: Sequence[dict[str, Any]]) -> bool:
        """Whether some device's verdict is not known yet (it would be evaluated)."""
        if source in self._over_budget:
            return False
        return any((source, attributes_key(a)) not in self._matches for a in attribute_sets)

    def matches(self, source: str, attribute_sets: Sequence[dict[str, Any]]) -> list[bool]:
        keys = [attributes_key(a) for a in attribute_sets]
        if source in self._over_budget:
            return [False] * len(keys)
        todo = {k: a for k, a in zip(keys, attribute_sets, strict=True)}
        todo = {k: a for k, a in todo.items() if (source, k) not in self._matches}
        if todo:
            compile_selector(source)  # bounded statically before the sandbox sees it
            try:
                outcomes = self.sandbox.evaluate(source, list(todo.values()))
            except SelectorBudgetError as err:
                self._remember(self._over_budget, source, str(err))
                return [False] * len(keys)
            with self._lock:
                if len(self._matches) + len(todo) > MAX_VERDICTS_KEPT:
                    self._matches.clear()
                for key, outcome in zip(todo, outcomes, strict=True):
                    self._matches[(source, key)] = outcome.is_true
        return [self._matches.get((source, k), False) for k in keys]

    def over_budget(self, source: str) -> str:
        """Why ``source`` matches nothing though valid: it ran over budget ("" if not)."""
        return self._over_budget.get(source, "")

    def trial(self, source: str) -> str:
        """The problem found evaluating ``source`` on the sample and worst-case devices ("")."""
        problem = self._trials.get(source)
        if problem is None:
            problem = _trial_problem(self.sandbox, source)
            self._remember(self._trials, source, problem)
        return problem

    def is_tried(self, source: str) -> bool:
        return source in self._trials

    def _remember(self, kept: dict[str, str], source: str, value: str) -> None:
        with self._lock:
            if len(kept) >= MAX_SELECTORS_KEPT:
                kept.clear()
            kept[source] = value


MAX_VERDICTS_KEPT = 200_000
"""(selector, device class) verdicts kept per process before the cache starts afresh."""
MAX_SELECTORS_KEPT = 20_000
"""Selectors whose trial or over-budget verdict is kept per process."""

VERDICTS = _Verdicts()
"""The process's verdicts and its sandbox (one child process, started at first use)."""


def _trial_problem(sandbox: SelectorSandbox, source: str) -> str:
    try:
        compile_selector(source)
        sample, _worst = sandbox.evaluate(source, [SAMPLE_DEVICE, WORST_CASE_DEVICE])
    except (SelectorError, SelectorBudgetError) as err:
        return str(err)
    if sample.kind == "missing":
        if re.search(rf"\bdevice\.{re.escape(sample.detail)}\b", source):
            known = ", ".join(sorted(SAMPLE_DEVICE))
            return f"unknown attribute device.{sample.detail} (known: {known})"
        return ""  # a key looked up in device.attributes: absent on the sample, fine
    if sample.kind == "error":
        return f"cannot evaluate: {sample.detail}"
    if sample.kind == "panic":
        return "cannot be evaluated"
    if sample.detail not in ("true", "bool"):
        return f"must be true or false, got {sample.detail}"
    return ""


def check_selector(source: str) -> None:
    """Compile ``source`` and try it on a sample device and on the largest device a view may
    hold (in the sandbox, under its budget); raise ``SelectorError`` saying why not."""
    problem = VERDICTS.trial(source)
    if problem:
        raise SelectorError(problem)


async def try_selectors(sources: Iterable[str]) -> None:
    """Run the trials of ``sources`` not tried yet in a thread, so that ``check_selector``
    then answers from memory without blocking the event loop."""
    todo = [s for s in set(sources) if s and not VERDICTS.is_tried(s)]
    if todo:
        await asyncio.to_thread(lambda: [VERDICTS.trial(s) for s in todo])


def selector_matches(source: str, attribute_sets: Sequence[dict[str, Any]]) -> list[bool]:
    """Whether ``source`` accepts each device: remembered, or evaluated in the sandbox (a
    selector over budget, or one that fails on a device, accepts none)."""
    return VERDICTS.matches(source, attribute_sets)


def selector_class_mask(source: str, snap: Snapshot) -> Bool:
    """Mask over device classes: those the selector accepts (one evaluation per class, ever)."""
    return np.array(selector_matches(source, [c.attributes for c in snap.classes]), dtype=bool)
