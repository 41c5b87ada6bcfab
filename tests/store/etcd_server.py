"""A real single-member etcd on loopback for the etcd store tests (see ``federation.testing.etcd``).

It serves plaintext and mutual TLS on two client ports of one process, with certificates minted
by ``federation.security.pki``, and keeps its data in a temporary folder.
"""

from __future__ import annotations

import grpc.aio
from aetcd import rpc

from federation.testing.etcd import LocalEtcd, etcd_binary, free_ports, write_pki

__all__ = ["LocalEtcd", "compact", "etcd_binary", "free_ports", "write_pki"]


async def compact(endpoint: str, revision: int) -> None:
    """Compact etcd's history up to ``revision``, as an operator or auto-compaction would."""
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        await rpc.KVStub(channel).Compact(rpc.CompactionRequest(revision=revision, physical=True))
