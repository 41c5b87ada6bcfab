"""A core's way back to the session layer: a failing callback is logged, never raised into the
core; a view said again unchanged is not published twice."""

from __future__ import annotations

from structlog.testing import capture_logs

from federation.agent.reports import Reports
from federation.api.v1 import resources_pb2, site_link_service_pb2

from .cores import node


def test_a_failing_callback_is_logged_not_raised() -> None:
    def fail(*_: object) -> None:
        raise RuntimeError("session gone")

    reports = Reports(fail, fail)
    with capture_logs() as logs:
        reports.status(site_link_service_pb2.TaskReport(job_id="job-1"))
        reports.changed()
    assert [e["event"] for e in logs] == ["status_callback_failed", "change_callback_failed"]


def test_a_view_is_published_when_it_moved() -> None:
    changes: list[None] = []
    reports = Reports(lambda _: None, lambda: changes.append(None))
    nodes, queue = [node("n", devices=1)], resources_pb2.QueueState(pending_tasks=1)
    reports.view(nodes, queue)
    reports.view(nodes, queue)
    assert len(changes) == 1
    nodes[0].devices[0].allocated = True
    reports.view(nodes, queue)
    reports.view(nodes, resources_pb2.QueueState())
    assert len(changes) == 3
