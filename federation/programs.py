"""The installed commands. fedctl and fed-coordinator need the ``coordinator`` extra, which
an agent host may lack: without it each says so in one line (exit 2) rather than fail on an
import deep inside."""

from __future__ import annotations

import importlib.util
import sys

COORDINATOR_EXTRA = ("numpy", "cel", "rich", "aetcd", "grpc_health", "grpc_reflection")
"""Modules the ``coordinator`` extra brings (``pyproject.toml``)."""


def missing(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _require_coordinator_extra(program: str) -> None:
    if lacking := missing(COORDINATOR_EXTRA):
        print(
            f"{program}: needs the coordinator extra, which is not installed here (no "
            f"{', '.join(lacking)}). To fix: pip install 'fedplane[coordinator]'",
            file=sys.stderr,
        )
        sys.exit(2)


def fedctl() -> None:
    _require_coordinator_extra("fedctl")
    from federation.cli.app import main

    main()


def coordinator() -> None:
    _require_coordinator_extra("fed-coordinator")
    from federation.coordinator.__main__ import main

    main()
