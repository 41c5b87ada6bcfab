"""Lists that the coordinator answers page by page, read to their end."""

from __future__ import annotations

from federation.api.v1 import admin_service_pb2, admin_service_pb2_grpc


async def list_sites(
    admin: admin_service_pb2_grpc.AdminServiceAsyncStub, *, timeout_s: float | None = None
) -> list[admin_service_pb2.Site]:
    """Every site in name order, following ``ListSites``' pages; ``timeout_s`` per page."""
    sites: list[admin_service_pb2.Site] = []
    token = ""
    while True:
        reply = await admin.ListSites(
            admin_service_pb2.ListSitesRequest(page_token=token), timeout=timeout_s
        )
        sites.extend(reply.sites)
        token = reply.next_page_token
        if not token:
            return sites
