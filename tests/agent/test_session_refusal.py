"""What the agent logs when the coordinator refuses what it sent on its Connect stream."""

from __future__ import annotations

from pathlib import Path

import grpc
from structlog.testing import capture_logs

from federation.agent.config import AgentConfig
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import resources_pb2
from federation.errors import FieldViolation, InvalidArgumentError
from federation.security.interceptors import to_status


async def test_refused_view_is_logged_with_every_bad_field(tmp_path: Path) -> None:
    """A stream ended INVALID_ARGUMENT is logged with each field the coordinator named, so the
    operator of a site sending a bad view can see which one."""
    config = AgentConfig(
        site="s",
        domain="edge",
        coordinator="127.0.0.1:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
    )
    core = EmbeddedCore(
        [resources_pb2.Node(name="n", cpu_cores=1, schedulable=True)],
        site="s",
        work_dir=tmp_path / "work",
        on_status=lambda report: None,
        on_change=lambda: None,
    )
    runtime = AgentRuntime(config, credential_paths(tmp_path), core)
    status = to_status(
        InvalidArgumentError(
            [
                FieldViolation(f"hello.view.nodes[{i}].cpu_free", "must be in [0, 1e12]")
                for i in range(7)
            ]
        )
    )

    async def refused(coordinator: str) -> None:
        runtime._leaving = True  # one session only
        raise grpc.aio.AioRpcError(
            status.code,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(*status.trailing_metadata),
            details=status.details,
        )

    runtime._session = refused  # type: ignore[method-assign]
    with capture_logs() as logs:
        await runtime.run()
    await core.close()
    (lost,) = [entry for entry in logs if entry["event"] == "session_lost"]
    assert lost["code"] == "INVALID_ARGUMENT"
    assert lost["violations"] == [
        f"hello.view.nodes[{i}].cpu_free: must be in [0, 1e12]" for i in range(7)
    ]
