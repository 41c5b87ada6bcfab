"""A real etcd for the coordinator tests that elect a leader."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from store.etcd_server import LocalEtcd, etcd_binary


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One etcd member for the session (tests keep apart by key prefix)."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = LocalEtcd.start(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()
