"""Priority classes: named priorities operators configure, which jobs name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from federation.config import ConfigError

MAX_PRIORITY = 1000


@dataclass(frozen=True, slots=True)
class PriorityClass:
    name: str
    value: int
    """The job's priority: higher goes first in its queue's line."""
    preemptible: bool = True
    """Its tasks may be stopped to make room for work that may preempt."""
    may_preempt: bool = False
    """Its tasks may stop preemptible tasks of lower priority to start."""
    tenants: tuple[str, ...] = ()
    """Tenants that may name it when it may preempt or is not preemptible (operators always
    may); any tenant may name another class."""

    def allows(self, tenant: str | None) -> bool:
        """Whether ``tenant`` (None: an operator) may name this class."""
        privileged = self.may_preempt or not self.preemptible
        return tenant is None or not privileged or tenant in self.tenants


_FIELDS = {"value": int, "preemptible": bool, "may_preempt": bool, "tenants": list}


def parse_priority_classes(raw: Mapping[str, Any], *, source: str) -> dict[str, PriorityClass]:
    """``[priority_classes.NAME]`` tables of the coordinator's config.

    Raises:
        ConfigError: Naming the class and the setting.
    """
    out = {}
    for name, table in raw.items():
        where = f"{source}: priority_classes.{name}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} must be a table such as {{ value = 100 }}")
        unknown = set(table) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}")
        for key, kind in _FIELDS.items():
            value = table.get(key)
            if value is not None and (type(value) is not kind):
                what = {int: "an integer", bool: "true or false", list: "a list"}[kind]
                raise ConfigError(f"{where}.{key} must be {what}")
        if "value" not in table:
            raise ConfigError(f"{where}.value is required")
        if not -MAX_PRIORITY <= table["value"] <= MAX_PRIORITY:
            raise ConfigError(f"{where}.value must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        tenants = table.get("tenants", [])
        if not all(isinstance(t, str) for t in tenants):
            raise ConfigError(f"{where}.tenants must be a list of tenant names")
        out[name] = PriorityClass(name, **{**table, "tenants": tuple(tenants)})
    return out
