"""Selectors are bounded before they run: length, nesting and worst-case cost per device."""

from __future__ import annotations

import pytest

from federation.placement import selectors
from federation.placement.selector_cost import (
    MAX_SELECTOR_BYTES,
    MAX_SELECTOR_COST,
    SelectorCostError,
    check_selector_cost,
    selector_cost,
)
from federation.placement.selectors import SelectorError, check_selector, compile_selector

FORTY = "[" + ",".join(str(i) for i in range(40)) + "]"


def nested_all(depth: int, items: str = FORTY) -> str:
    """``depth`` nested ``.all()`` over ``items``: the body runs len(items)**depth times."""
    body = "true"
    for level in range(depth):
        body = f"{items}.all(v{level}, {body} && v{level} >= 0)"
    return body


PANICS = "device.memory_gib >= 1 && " * 2700 + "true &&& x"
"""Over 64 KiB with a syntax error past column 65,535: the CEL library panics on it."""

EVERYDAY = [
    'device.memory_gib >= 40 && device.attributes["cuda"] >= "12"',
    'device.vendor == "nvidia" && device.model in ["A100-80GB", "H100-80GB"]',
    '"cuda" in device.attributes && device.attributes["cuda"].startsWith("12.")',
    'has(device.attributes.cann) && device.kind == "NPU"',
    'device.model.matches("^(A|H)100") || device.tflops_fp16 > 300.0',
    'device.attributes.exists(k, k.startsWith("nv") && device.attributes[k] == "on")',
    "size(device.model) > 0 && !device.declared ? true : false",
    "[1, 2, 3].map(x, x * 2).filter(y, y > 2).size() == 2 && 0x10u == 16u && .5 < 1e3",
    "r'raw\\d' != '''triple''' && b\"bytes\" == b'bytes' // a comment",
    '{"a": 1, "b": 2}.a == 1 && [[1], [2, 3]].all(l, l.all(x, x > 0))',
]


@pytest.mark.parametrize("source", EVERYDAY)
def test_everyday_selectors_are_cheap_and_valid(source: str) -> None:
    """Selectors people write cost a small share of the limit and still compile (the most
    costly here reads ``device.attributes`` once per entry: 0.7 ms on the largest device)."""
    assert 0 < selector_cost(source) < MAX_SELECTOR_COST // 4
    check_selector(source)


def test_the_freezing_selector_is_refused_with_its_cost() -> None:
    """Five nested all() over 40 elements (636 characters, 85 s in the library) is refused."""
    source = nested_all(5)
    assert len(source) < 700
    with pytest.raises(SelectorError, match=r"up to [\d,]+ evaluation steps per device"):
        check_selector(source)
    assert selector_cost(source) > 40**5


def test_cost_grows_with_nesting_and_range() -> None:
    """Each nested comprehension multiplies by its range; two levels of 40 fit, three do not."""
    two, three = selector_cost(nested_all(2)), selector_cost(nested_all(3))
    assert 40**2 <= two <= MAX_SELECTOR_COST < three
    assert three >= 40**3
    check_selector_cost(nested_all(2))
    with pytest.raises(SelectorCostError):
        check_selector_cost(nested_all(3))


def test_attribute_maps_count_at_their_view_limit() -> None:
    """A comprehension over device.attributes costs its largest allowed size, squared nested."""
    once = selector_cost("device.attributes.all(k, k != '')")
    twice = selector_cost("device.attributes.all(a, device.attributes.all(b, a != b))")
    assert twice > 50 * once
    patterns = "device.attributes.all(a, device.attributes[a].matches('^[0-9]+(a|b)*c?d{2,5}$'))"
    assert selector_cost(patterns) > 64 * 30 * 20  # each call compiles its pattern again


def test_comprehension_variables_shadow_device() -> None:
    """A variable named device inside a comprehension is the element, not the device."""
    assert selector_cost("[[1, 2]].all(device, device.all(x, x > 0))") < 50


def test_strings_grown_by_doubling_are_refused() -> None:
    """Doubling a string in chained map() calls grows the cost as fast as the work."""
    chain = "['" + "x" * 64 + "']" + ".map(s, s + s + s + s)" * 12
    with pytest.raises(SelectorCostError):
        check_selector_cost(f"{chain}.size() > 0")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x" * (MAX_SELECTOR_BYTES + 1), f"at most {MAX_SELECTOR_BYTES} allowed"),
        ("(" * 40 + "true" + ")" * 40, "nested deeper than 32"),
        ("!" * 40 + "true", "nested deeper than 32"),
        ("device.vendor == ", "expected a value at the end"),
        ('device.model == "open', "unexpected character at column 17"),
        ("device.?model", "expected a field or method name"),
        ("[1].all(1, true)", "takes a variable name first"),
        ("[1].map(x, 1, 2, 3)", "wrong number of arguments to map()"),
    ],
)
def test_malformed_or_oversized_selectors_are_refused_by_the_bound(
    source: str, message: str
) -> None:
    """Text too long, too deep or not understood never reaches the CEL library."""
    with pytest.raises(SelectorCostError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_selector_cost(source)


def test_a_panicking_selector_is_a_plain_error() -> None:
    """The selector that panics the CEL library is refused as a SelectorError."""
    with pytest.raises(SelectorError, match="at most 2048 allowed"):
        compile_selector(PANICS)


def test_a_panic_in_the_library_becomes_a_selector_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even past the bound, the library's panic (a BaseException) is caught by name."""
    monkeypatch.setattr(selectors, "check_selector_cost", lambda source: None)
    compile_selector.cache_clear()
    with pytest.raises(SelectorError, match="cannot be parsed"):
        compile_selector(PANICS)
