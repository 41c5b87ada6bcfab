"""Datasets tenants register, kept in the store under ``/datasets/<tenant>/<name>``.

A dataset is one object in a site's store (``s3://BUCKET/KEY``); the coordinator records where
it is, its size and its SHA-256, never its bytes. At registration the holding site reads the
size and digest from its own store (``DescribeRequest``) and refuses a key outside the tenant's
folder of its prefix, as it does when it signs. A task reads a dataset as the input
``dataset:NAME`` (or by its ``s3://`` location): at submission the input gets the holder and
size, which placement weighs, and at commit the holder signs a URL for it like for an output.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping

import structlog

from federation.api.v1 import data_service_pb2, jobs_pb2, site_link_service_pb2
from federation.common.keys import DATASET
from federation.coordinator import audit
from federation.coordinator.data.outputs import S3, names_dataset
from federation.coordinator.jobs.records import now_timestamp
from federation.coordinator.jobs.validation import name_problem
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry
from federation.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from federation.security.identity import Identity, Role
from federation.store import CasConflictError, Delete, Put, Store

log = structlog.get_logger()

DATASETS = "/datasets/"
PROTOCOL = 6
"""The site-link protocol whose agents describe objects of their store."""
DEFAULT_TENANT = "default"
"""Operators' own datasets, as their own jobs' tenant."""
MAX_DATASETS = 100_000
MAX_LOCATION = 1024
DESCRIBE_TIMEOUT_S = 120.0
"""How long the holding site may take to read an object whose digest was not given."""
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class DatasetNotFoundError(NotFoundError):
    reason = "DATASET_NOT_FOUND"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"no dataset {name[:64]!r}. To fix: list datasets with 'fedctl data list'",
            dataset=name[:64],
        )


def dataset_key(tenant: str, name: str) -> str:
    return f"{DATASETS}{tenant}/{name}"


def split_location(location: str) -> tuple[str, str] | None:
    """``(bucket, key)`` of ``s3://BUCKET/KEY``, or None when it is not one."""
    if not location.startswith(S3):
        return None
    bucket, _, key = location.removeprefix(S3).partition("/")
    if not bucket or not key or key.endswith("/") or ".." in key.split("/"):
        return None
    return bucket, key


def dataset_violations(dataset: data_service_pb2.Dataset, path: str) -> list[FieldViolation]:
    """What is wrong with a dataset to register, field by field."""
    out = []
    if problem := name_problem(dataset.name):
        out.append(FieldViolation(f"{path}.name", problem))
    if len(dataset.location) > MAX_LOCATION:
        out.append(FieldViolation(f"{path}.location", f"at most {MAX_LOCATION} characters"))
    elif split_location(dataset.location) is None:
        out.append(
            FieldViolation(
                f"{path}.location",
                f"{dataset.location[:64]!r} is not an object's location: s3://BUCKET/KEY",
            )
        )
    if not dataset.site:
        out.append(FieldViolation(f"{path}.site", "is required: the site whose store holds it"))
    elif problem := name_problem(dataset.site):
        out.append(FieldViolation(f"{path}.site", problem))
    if dataset.tenant and (problem := name_problem(dataset.tenant)):
        out.append(FieldViolation(f"{path}.tenant", problem))
    if dataset.sha256 and not SHA256_RE.fullmatch(dataset.sha256):
        out.append(FieldViolation(f"{path}.sha256", "must be 64 lower-case hex digits"))
    return out


class DatasetBook:
    """Every registered dataset, cached from the store; writes go to the store first."""

    def __init__(self, store: Store, sites: SiteRegistry) -> None:
        self._store = store
        self._sites = sites
        self._datasets: dict[tuple[str, str], data_service_pb2.Dataset] = {}
        self._revisions: dict[tuple[str, str], int] = {}
        self._writing = asyncio.Lock()

    async def load(self) -> None:
        for kv in await self._store.range(DATASETS, limit=MAX_DATASETS):
            dataset = data_service_pb2.Dataset.FromString(kv.value)
            self._datasets[dataset.tenant, dataset.name] = dataset
            self._revisions[dataset.tenant, dataset.name] = kv.mod_revision

    async def register(
        self, caller: Identity, dataset: data_service_pb2.Dataset
    ) -> data_service_pb2.Dataset:
        """Record ``dataset`` once its site has read the object's size and digest."""
        if violations := dataset_violations(dataset, "dataset"):
            raise InvalidArgumentError(violations)
        tenant = _tenant(caller, dataset.tenant)
        if (tenant, dataset.name) in self._datasets:
            raise AlreadyExistsError(
                f"dataset {dataset.name!r} already exists. To fix: remove it first, or choose "
                "another name",
                dataset=dataset.name,
            )
        if len(self._datasets) >= MAX_DATASETS:
            raise FailedPreconditionError(f"at most {MAX_DATASETS} datasets")
        self._sites.get(dataset.site)  # SiteNotFoundError names it
        bucket, key = split_location(dataset.location) or ("", "")
        answer = await self._describe(dataset.site, bucket, key, tenant, dataset)
        stored = data_service_pb2.Dataset(
            name=dataset.name,
            tenant=tenant,
            location=dataset.location,
            site=dataset.site,
            bytes=answer.bytes,
            sha256=answer.sha256,
            registered_by=str(caller),
            registered_at=now_timestamp(),
        )
        async with self._writing:
            put = Put(
                dataset_key(tenant, dataset.name), stored.SerializeToString(), expect_revision=0
            )
            entry = audit.entry(str(caller), "dataset.register", f"{tenant}/{dataset.name}")
            try:
                revision = await self._store.commit([put, entry])
            except CasConflictError:
                raise AlreadyExistsError(
                    f"dataset {dataset.name!r} already exists", dataset=dataset.name
                ) from None
            self._datasets[tenant, dataset.name] = stored
            self._revisions[tenant, dataset.name] = revision
        log.info("dataset_registered", tenant=tenant, dataset=dataset.name, site=dataset.site)
        return stored

    async def add_copy(
        self, caller: Identity, copy: data_service_pb2.Dataset
    ) -> data_service_pb2.Dataset:
        """Record ``copy.location`` at ``copy.site`` as another holder of the caller's dataset
        ``copy.name``, once that site has read the object and found the dataset's size and
        digest."""
        if violations := dataset_violations(copy, "dataset"):
            raise InvalidArgumentError(violations)
        tenant = _tenant(caller, copy.tenant)
        found = self._datasets.get((tenant, copy.name))
        if found is None:
            raise DatasetNotFoundError(copy.name)
        held = {found.site, *(c.site for c in found.copies)}
        if copy.site in held:
            raise AlreadyExistsError(
                f"dataset {copy.name!r} is already held at site {copy.site}",
                dataset=copy.name,
            )
        self._sites.get(copy.site)  # SiteNotFoundError names it
        bucket, key = split_location(copy.location) or ("", "")
        given = data_service_pb2.Dataset(bytes=found.bytes, sha256=found.sha256)
        await self._describe(copy.site, bucket, key, tenant, given)  # refuses another object
        async with self._writing:
            current = self._datasets.get((tenant, copy.name))
            if current is None:
                raise DatasetNotFoundError(copy.name)
            stored = data_service_pb2.Dataset()
            stored.CopyFrom(current)
            stored.copies.add(site=copy.site, location=copy.location, added_at=now_timestamp())
            put = Put(
                dataset_key(tenant, copy.name),
                stored.SerializeToString(),
                expect_revision=self._revisions[tenant, copy.name],
            )
            entry = audit.entry(str(caller), "dataset.copy", f"{tenant}/{copy.name}@{copy.site}")
            try:
                revision = await self._store.commit([put, entry])
            except CasConflictError:
                raise FailedPreconditionError(
                    f"dataset {copy.name!r} changed meanwhile; try again", dataset=copy.name
                ) from None
            self._datasets[tenant, copy.name] = stored
            self._revisions[tenant, copy.name] = revision
        log.info("dataset_copy_added", tenant=tenant, dataset=copy.name, site=copy.site)
        return stored

    async def site_copy(self, site: str, report: site_link_service_pb2.DatasetCopyReport) -> None:
        """A copy ``site`` kept of a dataset after staging it for a task, or evicted: record
        it as a copy of the dataset, or drop it. A report that does not match the dataset (its
        size or digest, a bucket that is not the site's) is logged and ignored: the site
        checked the bytes against this digest when it kept them."""
        key = (report.tenant, report.dataset)
        async with self._writing:
            current = self._datasets.get(key)
            if current is None:
                return  # removed meanwhile: nothing to record
            stored = data_service_pb2.Dataset()
            stored.CopyFrom(current)
            kept = [c for c in stored.copies if c.site == site]
            if report.removed:
                if not kept or not kept[0].kept:
                    return  # a copy an operator registered stays until removed with the dataset
                stored.ClearField("copies")
                stored.copies.extend(c for c in current.copies if c.site != site)
                action = "dataset.copy_evicted"
            else:
                matches = (report.bytes, report.sha256) == (current.bytes, current.sha256)
                bucket, object_key = split_location(report.location) or ("", "")
                folder = f"{report.tenant}/replicas/"
                if not matches or f"/{folder}" not in f"/{object_key}" or site == current.site:
                    log.warning(
                        "dataset_copy_refused", site=site, dataset=report.dataset, bucket=bucket
                    )
                    return
                if kept:
                    return  # held there already
                stored.copies.add(
                    site=site, location=report.location, added_at=now_timestamp(), kept=True
                )
                action = "dataset.copy_kept"
            put = Put(
                dataset_key(*key), stored.SerializeToString(), expect_revision=self._revisions[key]
            )
            try:
                revision = await self._store.commit(
                    [put, audit.entry(f"site:{site}", action, "/".join(key))]
                )
            except CasConflictError:
                log.warning("dataset_copy_conflict", site=site, dataset=report.dataset)
                return
            self._datasets[key] = stored
            self._revisions[key] = revision
        log.info(action.replace(".", "_"), site=site, tenant=report.tenant, dataset=report.dataset)

    async def _describe(
        self,
        site: str,
        bucket: str,
        key: str,
        tenant: str,
        given: data_service_pb2.Dataset,
    ) -> site_link_service_pb2.DescribeAnswer:
        session = self._sites.session(site)
        if session is None:
            raise UnavailableError(
                f"site {site} is not connected: it reads the dataset's size and digest from "
                "its store. To fix: try again once it is connected",
                site=site,
            )
        if session.protocol < PROTOCOL:
            raise FailedPreconditionError(
                f"site {site}'s agent speaks site-link protocol {session.protocol}; describing "
                f"an object of its store needs {PROTOCOL}. To fix: upgrade its agent",
                site=site,
            )
        request = site_link_service_pb2.DescribeRequest(
            bucket=bucket, key=key, tenant=tenant, bytes=given.bytes, sha256=given.sha256
        )
        (answer,) = await session.request_many(
            [site_link_service_pb2.CoordinatorMessage(describe=request)], DESCRIBE_TIMEOUT_S
        )
        if isinstance(answer, SessionClosedError | TimeoutError):
            raise UnavailableError(f"site {site} did not describe the object; try again", site=site)
        if error := answer.describe_answer.error:
            violation = FieldViolation("dataset.location", f"site {site}: {error}")
            raise InvalidArgumentError([violation])
        return answer.describe_answer

    def get(self, caller: Identity, name: str, tenant: str = "") -> data_service_pb2.Dataset:
        """A dataset the caller may see; another tenant's is as unknown as a missing one."""
        found = self._datasets.get((_scope(caller, tenant), name))
        if found is None:
            raise DatasetNotFoundError(name)
        return found

    def visible(self, caller: Identity, tenant: str = "") -> list[data_service_pb2.Dataset]:
        if caller.role is Role.TENANT:
            tenant = caller.name  # a tenant's own only, whatever it asks
        return [
            d for (owner, _), d in sorted(self._datasets.items()) if not tenant or owner == tenant
        ]

    async def remove(self, caller: Identity, name: str, tenant: str = "") -> None:
        dataset = self.get(caller, name, tenant)
        where = (dataset.tenant, dataset.name)
        async with self._writing:
            entry = audit.entry(str(caller), "dataset.remove", f"{dataset.tenant}/{name}")
            delete = Delete(dataset_key(*where), expect_revision=self._revisions[where])
            try:
                await self._store.commit([delete, entry])
            except CasConflictError:
                raise FailedPreconditionError(
                    f"dataset {name} changed meanwhile; try again"
                ) from None
            del self._datasets[where], self._revisions[where]
        log.info("dataset_removed", tenant=dataset.tenant, dataset=name)

    def lookup(self, tenant: str, reference: str) -> data_service_pb2.Dataset | None:
        """The tenant's dataset an input names (``dataset:NAME`` or its location), or None."""
        if reference.startswith(DATASET):
            return self._datasets.get((tenant, reference.removeprefix(DATASET)))
        return next(
            (
                d
                for (owner, _), d in sorted(self._datasets.items())
                if owner == tenant and d.location == reference
            ),
            None,
        )

    def resolve_inputs(
        self, specs: Iterable[tuple[str, str, jobs_pb2.JobSpec]]
    ) -> list[FieldViolation]:
        """Point each input naming a dataset at the tenant's registered one: ``dataset:NAME``
        with its holder and size (placement weighs them; the commit asks the holder to sign).
        ``specs``: (field path, tenant, spec). An unknown dataset, or another tenant's, is a
        violation at the input's field path."""
        out = []
        for path, tenant, spec in specs:
            for t, task in enumerate(spec.tasks):
                for n, item in enumerate(task.inputs):
                    if not names_dataset(item.dataset):
                        continue
                    where = f"{path}.tasks[{t}].inputs[{n}]"
                    found = self.lookup(tenant, item.dataset)
                    if found is None:
                        out.append(
                            FieldViolation(
                                f"{where}.dataset",
                                f"no dataset {item.dataset[:80]!r} registered for tenant "
                                f"{tenant}. To fix: register it with 'fedctl data register'",
                            )
                        )
                        continue
                    if item.site and item.site != found.site:
                        out.append(
                            FieldViolation(
                                f"{where}.site",
                                f"dataset {found.name} is held at site {found.site}; leave "
                                "site empty",
                            )
                        )
                        continue
                    item.dataset = DATASET + found.name
                    item.site, item.bytes = found.site, found.bytes
                    item.path = item.path or found.name
        return out

    @property
    def datasets(self) -> Mapping[tuple[str, str], data_service_pb2.Dataset]:
        """The datasets by (tenant, name) (read them, never change them)."""
        return self._datasets


def _tenant(caller: Identity, asked: str) -> str:
    """The tenant a dataset is registered for: a tenant's own; an operator's choice."""
    if caller.role is Role.TENANT:
        if asked not in ("", caller.name):
            raise PermissionDeniedError(f"{caller} may not register datasets for tenant {asked!r}")
        return caller.name
    return asked or DEFAULT_TENANT


def _scope(caller: Identity, asked: str) -> str:
    """The tenant whose datasets a read names: a tenant's own (asking for another's finds
    nothing); an operator's choice, or the default tenant's."""
    if caller.role is Role.TENANT:
        return caller.name if asked in ("", caller.name) else "\0"
    return asked or DEFAULT_TENANT
