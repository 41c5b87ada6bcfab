"""A coordinator started before its etcd waits for it and comes up once it answers, rather
than exiting (a unit's restart policy may not start it again)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from federation.local import LocalFederation
from federation.testing.cluster import cpu_site, etcd_coordinator_args, until
from federation.testing.etcd import LocalEtcd, etcd_binary

pytestmark = [
    pytest.mark.xdist_group("store-wait"),
    pytest.mark.skipif(
        etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"
    ),
]


async def test_a_coordinator_started_before_etcd_comes_up_with_it(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    etcd.stop()
    args = etcd_coordinator_args(etcd.endpoint, "/wait", lease_s=2.0)
    fed = LocalFederation(tmp_path / "fed", [], coordinator_args=args)
    try:
        starting = asyncio.create_task(fed.start_coordinator())
        log = fed.log_path("coordinator")

        async def waiting() -> bool:
            return log.exists() and log.read_text().count("store_unreachable") >= 2

        await until(waiting, 20, "the coordinator's tries to reach etcd")
        assert not starting.done(), "the coordinator gave up or came up without its store"
        await asyncio.to_thread(etcd.restart)
        await starting
        await fed.start_site(cpu_site("edge-w"))
        await fed.wait_connected(["edge-w"])
    finally:
        fed.stop()
