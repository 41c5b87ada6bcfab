"""A worst-case cost for a CEL selector, computed from its text before it ever runs.

The CEL library has no cost limit, and one short selector can take minutes: five nested
``.all()`` over a 40-element list evaluate their body 40^5 times. So every selector is parsed
here first (CEL's grammar, cel-spec ``langdef.md``) and its cost bounded the way cel-go's
estimator does it: every node costs one step, a comprehension costs its range's largest size
times its body, and sizes come from literals, from the limits a site view is held to
(``device.attributes``) or, failing both, from a generous default. A selector over the limit, or
one this parser does not understand, is refused before the library sees it, which also keeps
the library's own parser (which panics on some large inputs) away from hostile text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_SELECTOR_BYTES = 2048
"""Longest selector accepted; real ones are a line or two."""
MAX_SELECTOR_COST = 100_000
"""Worst-case evaluation steps per device: about 5 ms of the CEL library's time (a step of a
comprehension measured 45 ns on the 2-core development machine)."""
MAX_DEPTH = 32
"""Deepest nesting of brackets and operators accepted."""
MAX_DEVICE_ATTRIBUTES = 64
"""Most attributes a device may carry in a site view (the coordinator checks views)."""
MAX_ATTRIBUTE_CHARS = 256
"""Longest attribute value (and model, vendor) a site view may carry."""
_UNKNOWN_SIZE = MAX_DEVICE_ATTRIBUTES
"""Size assumed for a value nothing else bounds."""
_TEXT_STEP = 0.1
"""Steps per character that a string scan or comparison costs (cel-go's traversal factor)."""
_PATTERN_STEP = 0.25
"""Steps per pattern character per text step of ``matches`` (cel-go's regex factor)."""
_PATTERN_COMPILE = 30
"""Steps per pattern character to compile it: ``matches`` compiles its pattern at every call
(a 30-character pattern took 40 us, about 900 steps)."""
_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_TEXT_SCANS = frozenset({"contains", "startsWith", "endsWith", "matches", "size"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|//[^\n]*)
  | (?P<string>(?:[rR][bB]?|[bB][rR]?|[bB])?(?:'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"
        |'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"))
  | (?P<number>0[xX][0-9a-fA-F]+[uU]?|(?:\d*\.\d+|\d+)(?:[eE][+-]?\d+)?[uU]?)
  | (?P<ident>[_a-zA-Z][_a-zA-Z0-9]*)
  | (?P<op>\|\||&&|==|!=|<=|>=|[-+*/%!<>?:.,()\[\]{}])
    """,
    re.VERBOSE | re.DOTALL,
)
_RELATIONS = frozenset({"<", "<=", ">", ">=", "==", "!=", "in"})


class SelectorCostError(ValueError):
    """A selector too long, too deep, too costly, or written in syntax not understood here."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """Worst case of one expression: steps to evaluate it, and the size of its value."""

    cost: int
    size: int = 1
    """Entries of a list or map, characters of a string; 1 for other values."""
    element: Estimate | None = None
    """The largest element of a list or map (its values), when known."""
    is_map: bool = False
    """A map: the library copies its entries far more slowly than a list's."""


_SCALAR = Estimate(0)
_TEXT = Estimate(0, MAX_ATTRIBUTE_CHARS)
_DEVICE = Estimate(0, 11, _TEXT, is_map=True)
_ATTRIBUTES = Estimate(0, MAX_DEVICE_ATTRIBUTES, _TEXT, is_map=True)
_DEVICE_FIELDS: Mapping[str, Estimate] = {
    "kind": _TEXT,
    "vendor": _TEXT,
    "model": _TEXT,
    "attributes": _ATTRIBUTES,
}
_ATTRIBUTES_READ = 5 * MAX_DEVICE_ATTRIBUTES
"""Steps to read ``device.attributes``: the library converts the whole map at every read
(11 us for 64 entries of 256 characters)."""
_MAP_ENTRY_UNITS = 13
"""Steps to copy one entry of a map (590 ns per entry of ``device.attributes``, where a list's
element takes about 45 ns)."""


def _join(a: Estimate | None, b: Estimate | None) -> Estimate | None:
    """An estimate at least as large as both (for branches and list elements)."""
    if a is None or b is None:
        return a or b
    return Estimate(
        max(a.cost, b.cost),
        max(a.size, b.size),
        _join(a.element, b.element),
        a.is_map or b.is_map,
    )


def _with_cost(estimate: Estimate | None, cost: int) -> Estimate:
    base = estimate or _SCALAR
    return Estimate(cost, base.size, base.element, base.is_map)


def _units(estimate: Estimate) -> int:
    """Steps to copy a value deeply: 1, or 1 plus its elements' (a map's entries cost more)."""
    if estimate.element is None:
        return 2 if estimate.size > 1 else 1  # a string copies at about twice a number
    entry = _units(estimate.element) + (_MAP_ENTRY_UNITS if estimate.is_map else 0)
    return 1 + estimate.size * entry


def _scan(characters: int) -> int:
    return math.ceil(_TEXT_STEP * characters)


# The parser builds no tree: each rule returns its estimate, and comprehension variables are
# bound in ``scope`` while their body is parsed.


class _Parser:
    def __init__(self, source: str) -> None:
        self._tokens: list[tuple[str, str, int]] = []
        position = 0
        while position < len(source):
            match = _TOKEN.match(source, position)
            if match is None:
                raise SelectorCostError(f"unexpected character at column {position + 1}")
            kind = match.lastgroup or ""
            if kind != "space":
                self._tokens.append((kind, match.group(), position))
            position = match.end()
        self._at = 0
        self._depth = 0
        self._scope: dict[str, Estimate] = {}

    # Tokens ------------------------------------------------------------------------------

    def _peek(self, offset: int = 0) -> tuple[str, str, int]:
        at = self._at + offset
        return self._tokens[at] if at < len(self._tokens) else ("end", "", -1)

    def _is(self, text: str) -> bool:
        kind, value, _ = self._peek()
        return value == text and kind in ("op", "ident")

    def _take(self, text: str) -> None:
        if not self._is(text):
            self._fail(f"expected {text!r}")
        self._at += 1

    def _fail(self, what: str) -> None:
        _, value, position = self._peek()
        where = f"column {position + 1}" if position >= 0 else "the end"
        found = f" ({value!r})" if value else ""
        raise SelectorCostError(f"{what} at {where}{found}")

    def parse(self) -> Estimate:
        estimate = self._expr()
        if self._peek()[0] != "end":
            self._fail("unexpected text")
        return estimate

    # Grammar -----------------------------------------------------------------------------

    def _expr(self) -> Estimate:
        self._depth += 1
        if self._depth > MAX_DEPTH:
            self._fail(f"nested deeper than {MAX_DEPTH} levels")
        condition = self._binary(0)
        if self._is("?"):
            self._at += 1
            then = self._binary(0)
            self._take(":")
            other = self._expr()
            condition = _with_cost(
                _join(then, other), condition.cost + max(then.cost, other.cost) + 1
            )
        self._depth -= 1
        return condition

    _LEVELS: tuple[frozenset[str], ...] = (
        frozenset({"||"}),
        frozenset({"&&"}),
        _RELATIONS,
        frozenset({"+", "-"}),
        frozenset({"*", "/", "%"}),
    )

    def _binary(self, level: int) -> Estimate:
        if level == len(self._LEVELS):
            return self._unary()
        left = self._binary(level + 1)
        while self._peek()[1] in self._LEVELS[level] and self._peek()[0] in ("op", "ident"):
            operator = self._peek()[1]
            self._at += 1
            right = self._binary(level + 1)
            cost = left.cost + right.cost + 1
            if operator == "in":
                left = Estimate(cost + right.size)  # a scan of the list or map
            elif operator in _RELATIONS:
                left = Estimate(cost + _scan(min(left.size, right.size)))
            elif operator == "+":  # numbers, or strings and lists joined (and copied)
                left = Estimate(
                    cost + _scan(left.size + right.size) + _units(left) + _units(right),
                    left.size + right.size,
                    _join(left.element, right.element),
                )
            else:
                left = Estimate(cost)
        return left

    def _unary(self) -> Estimate:
        if self._is("!") or self._is("-"):
            self._at += 1
            self._depth += 1
            if self._depth > MAX_DEPTH:
                self._fail(f"nested deeper than {MAX_DEPTH} levels")
            operand = self._unary()
            self._depth -= 1
            return _with_cost(operand, operand.cost + 1)
        return self._member()

    def _member(self) -> Estimate:
        value, name = self._primary()
        while True:
            if self._is("."):
                self._at += 1
                kind, field, _ = self._peek()
                if kind != "ident":
                    self._fail("expected a field or method name")
                self._at += 1
                if self._is("("):
                    value = self._method(value, field)
                else:
                    value = self._field(value, name, field)
                name = f"{name}.{field}" if name else ""
            elif self._is("["):
                self._at += 1
                index = self._expr()
                self._take("]")
                value = _with_cost(value.element, value.cost + index.cost + 1)
                name = ""
            else:
                return value

    def _field(self, value: Estimate, name: str, field: str) -> Estimate:
        if name == "device" and "device" not in self._scope:
            found = _DEVICE_FIELDS.get(field, _SCALAR)
            if found is _ATTRIBUTES:
                return _with_cost(found, value.cost + 1 + _ATTRIBUTES_READ)
        else:
            found = value.element or Estimate(0, _UNKNOWN_SIZE)
        return _with_cost(found, value.cost + 1)

    def _method(self, target: Estimate, name: str) -> Estimate:
        self._take("(")
        if name in _MACROS:
            return self._comprehension(target, name)
        args = self._arguments(")")
        cost = target.cost + sum(a.cost for a in args) + 1
        if name == "matches":  # the pattern is compiled, then run over the text
            pattern = sum(a.size for a in args)
            run = _scan(target.size) * math.ceil(_PATTERN_STEP * pattern)
            return Estimate(cost + run + _PATTERN_COMPILE * pattern)
        if name in _TEXT_SCANS:
            return Estimate(cost + _scan(target.size + sum(a.size for a in args)))
        return Estimate(cost, max([target.size, *(a.size for a in args)]))

    def _comprehension(self, target: Estimate, name: str) -> Estimate:
        kind, variable, _ = self._peek()
        if kind != "ident":
            self._fail(f"{name}() takes a variable name first")
        self._at += 1
        self._take(",")
        outer = self._scope.get(variable)
        self._scope[variable] = target.element or Estimate(0, _UNKNOWN_SIZE)
        try:
            body = self._arguments(")")
        finally:
            if outer is None:
                del self._scope[variable]
            else:
                self._scope[variable] = outer
        if not 1 <= len(body) <= (2 if name == "map" else 1):
            self._fail(f"wrong number of arguments to {name}()")
        steps = sum(b.cost + 1 for b in body)
        cost = target.cost + 1 + target.size * steps
        if name == "map":
            element = _with_cost(body[-1], 0)
        elif name == "filter":
            element = target.element or _SCALAR
        else:
            return Estimate(cost)
        # The library copies the list it builds at every step, elements and all: n steps
        # copy n(n+1)/2 elements (900 lists of 100 took 9 s, estimated as 92,796 steps).
        copied = target.size * (target.size + 1) // 2 * _units(element)
        return Estimate(cost + copied, target.size, element)

    def _arguments(self, closing: str) -> list[Estimate]:
        args: list[Estimate] = []
        while not self._is(closing):
            args.append(self._expr())
            if not self._is(closing):
                self._take(",")
        self._take(closing)
        return args

    def _primary(self) -> tuple[Estimate, str]:
        kind, text, _ = self._peek()
        self._at += 1
        if kind == "string":
            return Estimate(1, len(text)), ""
        if kind == "number":
            return Estimate(1), ""
        if text == "(":
            inner = self._expr()
            self._take(")")
            return inner, ""
        if text == "[":
            items = self._arguments("]")
            element = None
            for item in items:
                element = _join(element, item)
            built = sum(i.cost + _units(i) for i in items)  # each item copied in
            return Estimate(1 + built, len(items), element), ""
        if text == "{":
            return self._map(), ""
        if text == "." and self._peek()[0] == "ident":
            kind, text, _ = self._peek()  # a name from the root namespace: ".device"
            self._at += 1
        if kind != "ident":
            self._at -= 1
            self._fail("expected a value")
        if self._is("("):
            self._at += 1
            if text == "has":
                probe = self._arguments(")")
                return Estimate(1 + sum(p.cost for p in probe)), ""
            args = self._arguments(")")
            size = max([1, *(a.size for a in args)])
            return Estimate(1 + sum(a.cost + _scan(a.size) for a in args), size), ""
        if text in ("true", "false", "null"):
            return Estimate(1), ""
        if text in self._scope:
            return _with_cost(self._scope[text], 1), text
        if text == "device":
            return _with_cost(_DEVICE, 1), text
        return Estimate(1, _UNKNOWN_SIZE), text

    def _map(self) -> Estimate:
        cost, entries, element = 1, 0, None
        while not self._is("}"):
            key = self._expr()
            self._take(":")
            value = self._expr()
            cost += key.cost + value.cost
            entries += 1
            element = _join(element, value)
            if not self._is("}"):
                self._take(",")
        self._take("}")
        return Estimate(cost, entries, element, is_map=True)


def selector_cost(source: str) -> int:
    """Worst-case evaluation steps of ``source`` on one device.

    Raises:
        SelectorCostError: The selector is longer or deeper than allowed, or its syntax is
            not understood here.
    """
    size = len(source.encode())
    if size > MAX_SELECTOR_BYTES:
        raise SelectorCostError(f"is {size} bytes long; at most {MAX_SELECTOR_BYTES} allowed")
    return _Parser(source).parse().cost


def check_selector_cost(source: str, limit: int = MAX_SELECTOR_COST) -> None:
    """Refuse a selector whose worst case exceeds ``limit`` steps (``SelectorCostError``)."""
    cost = selector_cost(source)
    if cost > limit:
        raise SelectorCostError(
            f"may take up to {cost:,} evaluation steps per device; at most {limit:,} allowed. "
            "To fix: iterate over fewer or smaller lists (nested all/exists/map/filter multiply)"
        )
