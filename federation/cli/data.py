"""``fedctl data``: register, list, show and remove datasets that tasks read as inputs."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from rich.table import Table

from federation.api.v1 import data_service_pb2, data_service_pb2_grpc
from federation.cli.output import output_of, show
from federation.cli.render import text
from federation.connection import Connection


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser("data", help="datasets in sites' stores that tasks read as inputs")
    data.set_defaults(func=cmd_list)
    data_sub = data.add_subparsers(dest="data_command")
    listing = data_sub.add_parser("list", help="your datasets (operators: every tenant's)")
    listing.add_argument("--tenant", default="", help="only this tenant's (operators)")
    listing.set_defaults(func=cmd_list)
    register = data_sub.add_parser(
        "register", help="record an object of a site's store as a dataset"
    )
    register.add_argument("name")
    register.add_argument("location", help="s3://BUCKET/KEY in the store of --site")
    register.add_argument("--site", required=True, help="the site whose store holds the bucket")
    register.add_argument("--size", type=int, default=0, help="its size in bytes (checked)")
    register.add_argument(
        "--sha256",
        default="",
        help="its SHA-256; with it the site does not read the object (every staging checks it)",
    )
    register.add_argument("--tenant", default="", help="whose dataset (operators)")
    register.add_argument(
        "--copy",
        action="store_true",
        help="another copy of the existing dataset NAME, held at --site (same size and digest): "
        "tasks stage it from the holder nearest them",
    )
    register.set_defaults(func=cmd_register)
    for name, func, what in (
        ("show", cmd_show, "one dataset"),
        ("remove", cmd_remove, "forget a dataset (the object stays in its store)"),
    ):
        p = data_sub.add_parser(name, help=what)
        p.add_argument("name")
        p.add_argument("--tenant", default="", help="whose dataset (operators)")
        p.set_defaults(func=func)


async def cmd_register(args: argparse.Namespace, conn: Connection) -> int:
    dataset = data_service_pb2.Dataset(
        name=args.name,
        location=args.location,
        site=args.site,
        bytes=max(args.size, 0),
        sha256=args.sha256,
        tenant=args.tenant,
    )
    async with conn.channel() as channel:
        stub = data_service_pb2_grpc.DataServiceStub(channel)
        request = data_service_pb2.RegisterDatasetRequest(dataset=dataset, copy=args.copy)
        reply = await stub.RegisterDataset(request)
    out = output_of(args)
    if out.is_data:
        out.messages(reply.dataset)
    else:
        title = "Copy registered" if args.copy else "Dataset registered"
        show(datasets_table([reply.dataset], title=title))
    return 0


async def cmd_show(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = data_service_pb2_grpc.DataServiceStub(channel)
        request = data_service_pb2.GetDatasetRequest(name=args.name, tenant=args.tenant)
        reply = await stub.GetDataset(request)
    out = output_of(args)
    if out.is_data:
        out.messages(reply.dataset)
    else:
        show(datasets_table([reply.dataset], title="Dataset", whole_digest=True))
    return 0


async def cmd_list(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = data_service_pb2_grpc.DataServiceStub(channel)
        request = data_service_pb2.ListDatasetsRequest(tenant=getattr(args, "tenant", ""))
        reply = await stub.ListDatasets(request)
    out = output_of(args)
    if out.is_data:
        out.messages(list(reply.datasets))
    else:
        show(datasets_table(reply.datasets))
    return 0


async def cmd_remove(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = data_service_pb2_grpc.DataServiceStub(channel)
        request = data_service_pb2.RemoveDatasetRequest(name=args.name, tenant=args.tenant)
        await stub.RemoveDataset(request)
    out = output_of(args)
    if out.is_data:
        out.data({"removed": args.name})
    else:
        show(text(f"dataset {args.name} removed (its object stays in its store)"))
    return 0


def datasets_table(
    datasets: Iterable[data_service_pb2.Dataset],
    *,
    title: str = "Datasets",
    whole_digest: bool = False,
) -> Table:
    table = Table(title=title)
    for column in ("dataset", "tenant", "site", "location", "bytes", "sha256"):
        table.add_column(column)
    for d in datasets:
        digest = d.sha256 if whole_digest else d.sha256[:16] + "…"
        sites = "\n".join([d.site, *(f"{c.site} (copy)" for c in d.copies)])
        locations = "\n".join([d.location, *(c.location for c in d.copies)])
        cells = (d.name, d.tenant, sites, locations, str(d.bytes), digest)
        table.add_row(*map(text, cells))
    return table
