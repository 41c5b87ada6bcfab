"""How every core reports back to the session layer: a task's report, and that its view changed.

A callback that fails is logged, never raised into the core: the core must go on tracking its
tasks whatever the session layer does with what it hears.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from federation.agent.core import ChangeCallback, StatusCallback
from federation.api.v1 import resources_pb2, site_link_service_pb2

log = structlog.get_logger()


class Reports:
    """A core's callbacks to the session layer.

    Args:
        on_status: Called with a task's report each time its state changes.
        on_change: Called whenever the core's nodes or queue change.
    """

    def __init__(self, on_status: StatusCallback, on_change: ChangeCallback) -> None:
        self._on_status, self._on_change = on_status, on_change
        self._published = b""

    def status(self, report: site_link_service_pb2.TaskReport) -> None:
        """Reports a task's state."""
        try:
            self._on_status(report)
        except Exception:
            log.exception("status_callback_failed")

    def changed(self) -> None:
        """Says the core's view may have changed."""
        try:
            self._on_change()
        except Exception:
            log.exception("change_callback_failed")

    def view(self, nodes: Iterable[resources_pb2.Node], queue: resources_pb2.QueueState) -> None:
        """Says the view changed, when it differs from the one last said (a core that reads
        its scheduler often publishes only what moved)."""
        encoded = b"".join(n.SerializeToString(deterministic=True) for n in nodes)
        encoded += queue.SerializeToString(deterministic=True)
        if encoded != self._published:
            self._published = encoded
            self.changed()
