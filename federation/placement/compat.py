"""Software requirements against what a node has: versions, derived runtimes, frameworks.

A task says what it needs (``cuda: ">=12.1"``, ``torch: "2.4.*"``, ``arch: "x86_64"``); a node
says what it has in its labels (``driver``, ``cuda``, ``cann``, framework versions, ``arch``).
The adaptation table fills the gaps: the CUDA a driver supports, what a framework release needs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from federation.api.v1 import resources_pb2


class CompatError(ValueError):
    """A requirement or a table entry that cannot be read."""


@dataclass(frozen=True, slots=True)
class FrameworkRelease:
    version: Version
    needs: tuple[tuple[str, SpecifierSet], ...]


@dataclass(frozen=True, slots=True)
class CompatTable:
    cuda_min_driver: tuple[tuple[Version, Version], ...]
    """(CUDA release, minimum driver), ascending."""
    frameworks: Mapping[str, tuple[FrameworkRelease, ...]]

    def cuda_for_driver(self, driver: Version) -> Version | None:
        """The newest CUDA the driver runs, or None if it predates the table."""
        supported = [cuda for cuda, least in self.cuda_min_driver if driver >= least]
        return max(supported, default=None)


def parse_specifier(text: str, field: str = "requirement") -> SpecifierSet:
    """``"2.4.*"`` or ``">=12.1"``; a bare version means ``==`` it. Raises CompatError."""
    text = text.strip()
    if text and text[0].isdigit():
        text = "==" + text
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise CompatError(f"{field}: {text!r} is not a valid version range") from None


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def load_table(doc: Mapping[str, Any]) -> CompatTable:
    try:
        cuda = sorted(
            (Version(str(c)), Version(str(d))) for c, d in doc.get("cuda_min_driver", {}).items()
        )
        frameworks = {
            name: tuple(
                FrameworkRelease(
                    Version(str(entry["version"])),
                    tuple(
                        (key, parse_specifier(str(spec), f"{name}.needs.{key}"))
                        for key, spec in entry.get("needs", {}).items()
                    ),
                )
                for entry in entries
            )
            for name, entries in doc.get("frameworks", {}).items()
        }
    except (InvalidVersion, KeyError, TypeError, AttributeError) as err:
        raise CompatError(f"compatibility table: {err}") from None
    return CompatTable(tuple(cuda), frameworks)


@functools.lru_cache(maxsize=8)
def load_table_files(extra: tuple[Path, ...] = ()) -> CompatTable:
    """The shipped table, with operators' files merged over it key by key."""
    shipped = resources.files("federation.placement").joinpath("data/compat.yaml").read_text()
    doc: dict[str, Any] = yaml.safe_load(shipped)
    for path in extra:
        overlay = yaml.safe_load(path.read_text()) or {}
        for section, values in overlay.items():
            doc.setdefault(section, {}).update(values)
    return load_table(doc)


def _node_has(
    key: str, spec: SpecifierSet, labels: Mapping[str, str], table: CompatTable
) -> str | None:
    """None when the node meets ``key spec``, else why not (for people)."""
    if key == "cuda":
        have = _version(labels.get("cuda", ""))
        how = f"node has cuda {have}"
        if have is None and (driver := _version(labels.get("driver", ""))) is not None:
            have = table.cuda_for_driver(driver)
            how = (
                f"node driver {driver} supports cuda {have}"
                if have
                else (f"node driver {driver} predates every CUDA in the table")
            )
        if have is None:
            return (
                f"needs cuda{spec}, {how if 'driver' in how else 'node reports no cuda or driver'}"
            )
        # A driver runs every CUDA up to its newest: any such release in range will do.
        releases = [c for c, _ in table.cuda_min_driver if c <= have] + [have]
        if any(spec.contains(r, prereleases=True) for r in releases):
            return None
        return f"needs cuda{spec}, {how}"
    have_text = labels.get(key)
    if have_text is None:
        return f"needs {key}{spec}, node reports no {key}"
    have = _version(have_text)
    if have is None or not spec.contains(have, prereleases=True):
        return f"needs {key}{spec}, node has {key} {have_text}"
    return None


def node_labels(node: resources_pb2.Node) -> dict[str, str]:
    """What a node has, as requirements and node labels read it: its labels and its arch."""
    return {**node.labels, **({"arch": node.arch} if node.arch else {})}


def unmet(
    requires: tuple[tuple[str, str], ...], labels: Mapping[str, str], table: CompatTable
) -> str | None:
    """The first requirement the node does not meet, explained; None when all are met."""
    for key, text in requires:
        if key == "arch":
            allowed = {a.strip() for a in text.split("|")}
            if labels.get("arch") not in allowed:
                return f"needs arch {text}, node is {labels.get('arch') or 'unknown'}"
            continue
        spec = parse_specifier(text, key)
        releases = table.frameworks.get(key)
        if releases is None or key in labels:
            if (reason := _node_has(key, spec, labels, table)) is not None:
                return reason
            continue
        wanted = [r for r in releases if spec.contains(r.version, prereleases=True)]
        if not wanted:
            return f"needs {key}{spec}: no {key} release in the compatibility table matches"
        reasons = [
            next((w for k, s in r.needs if (w := _node_has(k, s, labels, table))), None)
            for r in wanted
        ]
        if all(reasons):
            return f"needs {key}{spec}: {key} {wanted[-1].version} {reasons[-1]}"
    return None


def validate_requires(requires: Mapping[str, str]) -> list[tuple[str, str]]:
    """(key, problem) for each unreadable requirement."""
    problems = []
    for key, text in requires.items():
        if key == "arch":
            if not text.strip():
                problems.append((key, "is empty"))
            continue
        try:
            parse_specifier(text, key)
        except CompatError as err:
            problems.append((key, str(err).split(": ", 1)[-1]))
    return problems
