"""Logging set-up: the only ``structlog.configure`` call in the project."""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
"""What ``--log-level`` takes (any case)."""


def configure_logging(*, json: bool | None = None, level: str = "info") -> None:
    """Configure structlog: JSON for daemons, the console renderer on a terminal.

    Args:
        json: Force JSON (True) or console (False) output; None picks by whether stderr is a TTY.
        level: Minimum level name.
    """
    if json is None:
        json = not sys.stderr.isatty()
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    tail: list[structlog.typing.Processor] = (
        [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if json
        else [structlog.dev.ConsoleRenderer()]
    )
    structlog.configure(
        processors=[*shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
