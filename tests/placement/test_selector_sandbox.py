"""Selectors run in a child process under a time budget; their verdicts are remembered; and
every selector the static check accepts runs within that budget."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from federation.placement.selector_cost import SelectorCostError, check_selector_cost
from federation.placement.selector_sandbox import (
    EVALUATION_BUDGET_S,
    SelectorBudgetError,
    SelectorSandbox,
)
from federation.placement.selectors import (
    SAMPLE_DEVICE,
    WORST_CASE_DEVICE,
    SelectorError,
    _Verdicts,
    check_selector,
)


def zeros(n: int) -> str:
    return "[" + ",".join(["0"] * n) + "]"


# Found from outside: each passed the old estimate (at most 100,000 steps) and ran for seconds.
OUTSIDE_SELECTORS = (
    f"size({zeros(900)}.map(x, {zeros(100)})) > 0",
    f"size({zeros(900)}.filter(x, true)) > 0",
    f"size({zeros(30)}.map(x, {zeros(30)}.map(y, {zeros(30)}))) > 0",
    f"size({zeros(600)}.map(x, device.model + device.vendor)) > 0",
)


@pytest.fixture
def sandbox() -> Iterator[SelectorSandbox]:
    box = SelectorSandbox()
    try:
        yield box
    finally:
        box.close()


def test_outcomes_are_reported_per_device(sandbox: SelectorSandbox) -> None:
    outcomes = sandbox.evaluate(
        "device.memory_gib >= 40 && device.attributes['cuda'] == '12'",
        [{**SAMPLE_DEVICE, "attributes": {"cuda": "12"}}, {**SAMPLE_DEVICE, "memory_gib": 8.0}],
    )
    assert [o.is_true for o in outcomes] == [True, False]
    (missing,) = sandbox.evaluate("device.attributes['cuda'] == '12'", [SAMPLE_DEVICE])
    assert (missing.kind, missing.detail) == ("missing", "cuda")
    (text,) = sandbox.evaluate("device.model", [SAMPLE_DEVICE])
    assert (text.kind, text.detail, text.is_true) == ("value", "str", False)


def test_a_runaway_is_stopped_and_the_next_evaluation_works(sandbox: SelectorSandbox) -> None:
    """The first outside selector runs for seconds when nothing stops it."""
    sandbox.evaluate("true", [SAMPLE_DEVICE])
    child = sandbox._child
    assert child is not None
    started = time.monotonic()
    with pytest.raises(SelectorBudgetError, match="takes more than 10 ms"):
        sandbox.evaluate(OUTSIDE_SELECTORS[0], [SAMPLE_DEVICE])
    assert time.monotonic() - started < 1.0 + EVALUATION_BUDGET_S
    assert child.poll() is not None, "the runaway child was left running"
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    (outcome,) = sandbox.evaluate("device.memory_gib >= 40", [SAMPLE_DEVICE])
    assert outcome.is_true


def test_cpu_time_over_budget_is_refused_though_it_answered() -> None:
    box = SelectorSandbox(budget_s=0.001, grace_s=30.0)  # the wall clock never stops it
    try:
        with pytest.raises(SelectorBudgetError, match=r"takes more than 1 ms.*\(took \d+ ms\)"):
            box.evaluate(f"size({zeros(300)}.map(x, x)) > 0", [SAMPLE_DEVICE, SAMPLE_DEVICE])
    finally:
        box.close()


def test_verdicts_are_found_once_per_device_class() -> None:
    verdicts = _Verdicts()
    calls: list[int] = []
    evaluate = verdicts.sandbox.evaluate

    def counted(source: str, attribute_sets: list[dict[str, object]]) -> object:
        calls.append(len(attribute_sets))
        return evaluate(source, attribute_sets)

    verdicts.sandbox.evaluate = counted  # type: ignore[method-assign,assignment]
    small = {**SAMPLE_DEVICE, "memory_gib": 8.0}
    try:
        source = "device.memory_gib >= 40"
        assert verdicts.missing(source, [SAMPLE_DEVICE, small])
        assert verdicts.matches(source, [SAMPLE_DEVICE, small, dict(small)]) == [
            True,
            False,
            False,
        ]
        assert calls == [2], "equal devices are one class"
        assert not verdicts.missing(source, [small, SAMPLE_DEVICE])
        for _ in range(100):
            assert verdicts.matches(source, [small, SAMPLE_DEVICE]) == [False, True]
        assert calls == [2], "a waiting job's selector ran again"
    finally:
        verdicts.sandbox.close()


def test_a_selector_over_budget_matches_nothing_and_is_not_run_again() -> None:
    """One the static check would refuse reaches placement only from an older coordinator's
    store; it must cost its budget once, then nothing."""
    verdicts = _Verdicts()
    try:
        source = f"size({zeros(300)}.map(x, x)) > 0"
        verdicts.sandbox.budget_s = 0.0005
        check = "federation.placement.selectors.compile_selector"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(check, lambda source: None)
            assert verdicts.matches(source, [SAMPLE_DEVICE]) == [False]
            assert "takes more than" in verdicts.over_budget(source)
            assert not verdicts.missing(source, [WORST_CASE_DEVICE])
            verdicts.sandbox.close()
            assert verdicts.matches(source, [WORST_CASE_DEVICE]) == [False]
            assert verdicts.sandbox._child is None, "the over-budget selector ran again"
    finally:
        verdicts.sandbox.close()


@pytest.mark.parametrize("source", OUTSIDE_SELECTORS)
def test_outside_selectors_are_refused_at_once(source: str) -> None:
    started = time.monotonic()
    with pytest.raises(SelectorError, match="evaluation steps per device"):
        check_selector(source)
    assert time.monotonic() - started < 1.0


def test_ordinary_selectors_pass_the_trial() -> None:
    check_selector('device.memory_gib >= 40 && device.attributes["cuda"].startsWith("12")')
    check_selector('device.attributes.exists(k, k.startsWith("nv") && device.attributes[k] != "")')
    with pytest.raises(SelectorError, match=r"unknown attribute device\.colour"):
        check_selector('device.colour == "red"')


# Expressions of the kinds that cost more than they look: lists of lists, nested macros,
# strings built up, over literals and over the largest device a view may hold.
_LEAVES = st.sampled_from(
    ["0", "'ab'", "device.model", "device.vendor", "device.attributes", "x", "y"]
)


def _lists(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda item, n: "[" + ",".join([item] * n) + "]", inner, st.integers(0, 400))


def _grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    target = st.one_of(_lists(inner), st.sampled_from(["device.attributes"]), inner)
    macro = st.sampled_from(["map", "filter", "all", "exists"])
    variable = st.sampled_from(["x", "y"])
    return st.one_of(
        _lists(inner),
        st.builds(lambda t, m, v, b: f"{t}.{m}({v}, {b})", target, macro, variable, inner),
        st.builds(lambda a, b: f"({a} + {b})", inner, inner),
        st.builds(lambda a: f"[{a}, {a}]", inner),
    )


EXPENSIVE_SHAPES = st.recursive(_LEAVES, _grow, max_leaves=6).map(lambda e: f"size({e}) >= 0")


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(source=EXPENSIVE_SHAPES)
def test_whatever_the_static_check_accepts_runs_within_the_budget(source: str) -> None:
    try:
        check_selector_cost(source)
    except SelectorCostError:
        return  # refused before it runs: fine
    box = _TIMING
    outcomes = box.evaluate(source, [WORST_CASE_DEVICE, SAMPLE_DEVICE])
    slowest = max(o.cpu_s for o in outcomes)
    assert slowest <= EVALUATION_BUDGET_S, f"{slowest * 1e3:.1f} ms: {source[:300]}"


_TIMING = SelectorSandbox(budget_s=60.0)
"""Measures without stopping anything, so a miss shows by how much."""
