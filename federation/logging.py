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
        [
            # Frames without their local variables, which may hold a secret.
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(),
        ]
        if json
        else [structlog.dev.ConsoleRenderer()]
    )
    structlog.configure(
        processors=[*shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries log through the standard library (OpenTelemetry's exporter when no collector
    # answers, asyncio, gRPC's Python side): render their records the same way, so a JSON log
    # stays one JSON object per line.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.getLevelName(level.upper()), logging.WARNING))
