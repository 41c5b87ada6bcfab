"""Lists that the coordinator answers page by page, read to their end."""

from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from federation.api.v1 import admin_service_pb2, admin_service_pb2_grpc

MAX_WAITS = 30
"""Rate-limit refusals a listing waits out (each as long as the coordinator says) before it
gives up: pages of large sites count against the caller's bytes per second."""


async def list_sites(
    admin: admin_service_pb2_grpc.AdminServiceAsyncStub, *, timeout_s: float | None = None
) -> list[admin_service_pb2.Site]:
    """Every site in name order, following ``ListSites``' pages; ``timeout_s`` per page."""
    sites: list[admin_service_pb2.Site] = []
    token = ""
    waits = 0
    while True:
        request = admin_service_pb2.ListSitesRequest(page_token=token)
        try:
            reply = await admin.ListSites(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            delay_s = retry_delay_s(err)
            if delay_s is None or waits == MAX_WAITS:
                raise
            waits += 1
            await asyncio.sleep(delay_s)  # the coordinator's own hint: it refuses until then
            continue
        sites.extend(reply.sites)
        token = reply.next_page_token
        if not token:
            return sites


def retry_delay_s(err: grpc.aio.AioRpcError) -> float | None:
    """How long a rate-limit refusal (``RESOURCE_EXHAUSTED`` with ``RetryInfo``) asks the
    caller to wait; None for any other error."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            delay_s: float = info.retry_delay.ToTimedelta().total_seconds()
            return delay_s
    return None
