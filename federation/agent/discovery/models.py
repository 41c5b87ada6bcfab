"""Canonical model names: what vendor tools print, in the words placement's tables use.

NVML says ``NVIDIA H100 80GB HBM3`` where the speed table, inventories and jobs say
``H100-80GB``. The shipped table (``data/model_names.yaml``) maps one to the other; a site adds
or overrides entries with the agent's ``model_names`` setting.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

import yaml


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The shipped table of canonical names."""

    strip_prefixes: tuple[str, ...]
    """Vendor prefixes that do not tell models apart ("NVIDIA ", "Tesla "), first match wins."""
    names: Mapping[str, str]
    """Lookup key (see ``_key``) of a tool's name → canonical name."""


@functools.cache
def shipped_model_names() -> ModelNames:
    """The table in ``data/model_names.yaml``."""
    data = resources.files("federation.agent.discovery").joinpath("data")
    doc = yaml.safe_load(data.joinpath("model_names.yaml").read_text())
    prefixes = tuple(str(p) for p in doc["strip_prefixes"])
    names = {_key(str(raw), prefixes): str(name) for raw, name in doc["names"].items()}
    return ModelNames(prefixes, names)


def _bare(raw: str, prefixes: tuple[str, ...]) -> str:
    """The name with single spaces and without its vendor prefix."""
    name = " ".join(raw.split())
    for prefix in prefixes:
        if name.casefold().startswith(prefix.casefold()) and len(name) > len(prefix):
            return name[len(prefix) :]
    return name


def _key(raw: str, prefixes: tuple[str, ...]) -> str:
    return _bare(raw, prefixes).casefold()


def canonical_model(raw: str, extra: Mapping[str, str] | None = None) -> str:
    """The canonical model name for a name a vendor tool printed.

    Args:
        raw: The tool's name, e.g. ``"NVIDIA A100-SXM4-40GB"``.
        extra: The site's own entries (tool name → canonical name), tried first.

    Returns:
        The table's name (``"A100-40GB"``), or for a name the tables lack the name without its
        vendor prefix and with dashes for spaces (``"NVIDIA B200"`` → ``"B200"``).
    """
    table = shipped_model_names()
    key = _key(raw, table.strip_prefixes)
    if extra:
        site = {_key(name, table.strip_prefixes): value for name, value in extra.items()}
        if key in site:
            return site[key]
    return table.names.get(key) or _bare(raw, table.strip_prefixes).replace(" ", "-")
