"""A task's data at its site: inputs staged in before it starts, outputs stored once it succeeds.

Inputs come from the commit (``StagedInput``: a URL the holding site signed, the size and the
SHA-256 it reported); each is downloaded once, checked, and put at its path in every replica's
work folder before any replica starts. Outputs are read from replica 0's folder, never through
a link, and uploaded to this site's store (``federation.agent.object_store``); a site without a
store keeps them in the task's folder and says so in the task's reason. Blocking work runs in
threads, off the agent's event loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from federation.agent.accounts import Account
from federation.agent.checkpoint_store import prune, replicate, restore_path
from federation.agent.dataset_replicas import DatasetReplicas
from federation.agent.object_store import (
    DataError,
    ObjectStoreSettings,
    SiteStore,
    Transfer,
    download,
)
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import DATASET, RunKey

log = structlog.get_logger()

PROGRESS_EVERY_S = 5.0
"""How often a long stage-in tells the coordinator how far it is."""


async def staging_problem(
    key: RunKey, staging: Awaitable[None], expected: tuple[type[Exception], ...] = (DataError,)
) -> str | None:
    """Awaits a task's ``staging`` (its folders, inputs and restore); why it failed, or None.
    ``expected`` failures are the task's (an input that cannot be had); any other is a bug,
    which must not leave the task DELEGATED for ever either."""
    try:
        await staging
    except expected as exc:
        log.warning("inputs_not_staged", job_id=key[0], task=key[1], error=str(exc))
        return str(exc)
    except OSError as exc:
        return f"cannot create working directory: {exc}"
    except Exception as exc:
        log.exception("staging_failed", job_id=key[0], task=key[1])
        return f"staging failed: {type(exc).__name__}"
    return None


class TaskData:
    """Stages inputs and stores outputs for one site; ``store`` None: the site has none."""

    def __init__(
        self,
        store: SiteStore | None,
        site: str,
        settings: ObjectStoreSettings | None = None,
        scratch: Path | None = None,
    ) -> None:
        self.store = store
        self._site = site
        self._settings = settings or (store.settings if store else ObjectStoreSettings())
        self._scratch = scratch or Path(tempfile.gettempdir())
        """An agent-only folder for checkpoints copied to other sites."""
        self.on_progress: Callable[[site_link_service_pb2.StageProgress], None] | None = None
        """Told each input's progress and, once in place, what it moved (the runtime sends
        it to the coordinator); None: nobody is told."""
        self.replicas = (
            DatasetReplicas(store, self._settings.replica_bytes, self._scratch / "replicas.json")
            if store is not None and self._settings.replica_bytes > 0
            else None
        )
        """The dataset copies this site keeps; None: it keeps none."""
        self.on_copy: Callable[[site_link_service_pb2.DatasetCopyReport], None] | None = None
        """Told each dataset copy kept or evicted (the runtime sends it to the coordinator)."""
        self._keeping: set[asyncio.Task[None]] = set()

    async def stage(
        self,
        inputs: Sequence[site_link_service_pb2.StagedInput],
        folders: Sequence[Path],
        account: Account | None,
        key: RunKey = ("", "", 0),
        tenant: str = "",
    ) -> None:
        """Put every input in every folder. Raises DataError naming the input. A registered
        dataset staged from another site is then kept as a copy in the background, when the
        site keeps copies (``replicas``)."""
        for item in inputs:
            if item.error:
                raise DataError(f"input {item.dataset}: {item.error}")
            first = folders[0] / item.path
            progress = _Progress(key, item, self.on_progress)
            try:
                moved = await asyncio.to_thread(
                    download,
                    item.url,
                    first,
                    item.bytes,
                    item.sha256,
                    folder=item.folder,
                    attempts=self._settings.download_attempts,
                    stall_s=self._settings.download_stall_s,
                    progress=progress.tick,
                )
                progress.done(moved)
                for folder in folders[1:]:
                    await asyncio.to_thread(_copy, first, folder / item.path)
                if account is not None:
                    for folder in folders:
                        await asyncio.to_thread(_give, folder, item.path, account)
            except DataError as err:
                raise DataError(f"input {item.dataset}: {err}") from None
            except OSError as err:
                raise DataError(f"input {item.dataset}: cannot write {item.path}: {err}") from None
            if self.replicas is not None and item.dataset.startswith(DATASET):
                if item.site != self._site:
                    self._keep(tenant, item, first)
                else:
                    self.replicas.touch(self.replicas.key(tenant, item.dataset[len(DATASET) :]))
            log.info(
                "input_staged",
                dataset=item.dataset,
                path=item.path,
                bytes=item.bytes,
                source=item.site,
                seconds=round(moved.seconds, 3),
                resumes=moved.resumes,
            )

    def _keep(self, tenant: str, item: site_link_service_pb2.StagedInput, source: Path) -> None:
        """Keep the dataset staged at ``source`` as a copy, in the background (the task starts
        meanwhile), and tell ``on_copy`` what changed."""
        replicas = self.replicas
        assert replicas is not None
        name = item.dataset[len(DATASET) :]

        async def keep() -> None:
            try:
                reports = await asyncio.to_thread(
                    replicas.keep, tenant, name, source, item.bytes, item.sha256, self._scratch
                )
            except Exception:
                log.exception("replica_failed", dataset=name, tenant=tenant)
                return
            for report in reports:
                if self.on_copy is not None:
                    self.on_copy(report)

        task = asyncio.create_task(keep())
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    async def publish(
        self,
        key: RunKey,
        tenant: str,
        outputs: Sequence[jobs_pb2.Output],
        folder: Path,
        scratch: Path,
    ) -> tuple[list[jobs_pb2.Artifact], str]:
        """Store each output; returns the artifacts and a note for the task's reason (empty
        when all went to the store). Raises DataError naming the output."""
        return await self._publish(key, tenant, outputs, folder, scratch, partial=False)

    async def keep_partial(
        self,
        key: RunKey,
        tenant: str,
        outputs: Sequence[jobs_pb2.Output],
        folder: Path,
        scratch: Path,
    ) -> list[jobs_pb2.Artifact]:
        """Store what a task that failed or was cancelled left of its ``keep_on_failure``
        outputs, marked partial (for debugging); one it did not write, or one that cannot be
        stored, is left out (logged): the task's end stays as it was."""
        kept = []
        for output in outputs:
            if not output.keep_on_failure:
                continue
            try:
                found, _ = await self._publish(key, tenant, [output], folder, scratch, partial=True)
            except DataError as err:
                log.info("partial_output_not_kept", job_id=key[0], task=key[1], error=str(err))
                continue
            kept.extend(found)
        return kept

    async def _publish(
        self,
        key: RunKey,
        tenant: str,
        outputs: Sequence[jobs_pb2.Output],
        folder: Path,
        scratch: Path,
        *,
        partial: bool,
    ) -> tuple[list[jobs_pb2.Artifact], str]:
        job_id, task, epoch = key
        if self.store is None:
            artifacts = []
            for output in outputs:
                size = await asyncio.to_thread(_local_size, folder / output.path, output.name)
                artifacts.append(
                    jobs_pb2.Artifact(
                        name=output.name, bytes=size, site=self._site, partial=partial
                    )
                )
            names = ", ".join(o.name for o in outputs)
            note = f"outputs {names} kept at site {self._site}: it has no object store"
            return artifacts, note
        store = self.store
        artifacts = []
        for output in outputs:
            object_key = store.key(tenant, job_id, task, epoch, output.name)
            try:
                source = await asyncio.to_thread(_inside, folder, output.path)
                stored = await asyncio.to_thread(store.upload, source, object_key, scratch)
            except DataError as err:
                raise DataError(f"output {output.name} ({output.path}): {err}") from None
            log.info(
                "output_stored", job_id=job_id, task=task, output=output.name, bytes=stored.bytes
            )
            artifacts.append(
                jobs_pb2.Artifact(
                    name=output.name,
                    bytes=stored.bytes,
                    sha256=stored.sha256,
                    site=self._site,
                    key=stored.key,
                    folder=stored.folder,
                    partial=partial,
                )
            )
        return artifacts, ""

    async def sign(
        self, request: site_link_service_pb2.PresignRequest
    ) -> site_link_service_pb2.PresignAnswer:
        """A read-only URL for one object of this site's store, for another site."""
        if self.store is None:
            return site_link_service_pb2.PresignAnswer(
                error=f"site {self._site} has no object store"
            )
        if request.method not in ("", "GET", "PUT"):
            return site_link_service_pb2.PresignAnswer(error="only GET and PUT URLs are signed")
        try:
            if request.method == "PUT":
                url, key = await asyncio.to_thread(self._sign_put, request)
            else:
                key = request.key
                url = await asyncio.to_thread(
                    self.store.sign_get, request.key, request.tenant, request.ttl_s
                )
                if self.replicas is not None:
                    self.replicas.touch(key)  # a copy kept here is used
        except DataError as err:
            log.warning("presign_refused", key=request.key, tenant=request.tenant, error=str(err))
            return site_link_service_pb2.PresignAnswer(error=str(err))
        log.info("presigned", key=key, method=request.method or "GET", ttl_s=request.ttl_s)
        return site_link_service_pb2.PresignAnswer(url=url, key=key)

    def _sign_put(self, request: site_link_service_pb2.PresignRequest) -> tuple[str, str]:
        """A PUT URL for a checkpoint copied in from another site, once the older copies of
        its folder beyond ``keep`` are deleted (the new one is the ``keep``-th)."""
        assert self.store is not None
        url, key = self.store.sign_put(request.key, request.tenant, request.ttl_s)
        if request.keep:
            prune(self.store, key.rsplit("/", 1)[0] + "/", max(0, request.keep - 1))
        return url, key

    async def replicate(
        self, request: site_link_service_pb2.ReplicateCheckpoint
    ) -> site_link_service_pb2.ReplicateAnswer:
        """Copy one of this site's checkpoints to another site's store through its URL."""
        if self.store is None:
            return site_link_service_pb2.ReplicateAnswer(error=f"site {self._site} has no store")
        try:
            await asyncio.to_thread(replicate, self.store, request, self._scratch)
        except DataError as err:
            log.warning("checkpoint_not_copied", key=request.key, error=str(err))
            return site_link_service_pb2.ReplicateAnswer(error=str(err))
        log.info("checkpoint_copied", key=request.key, bytes=request.bytes)
        return site_link_service_pb2.ReplicateAnswer()

    async def restore(
        self,
        key: RunKey,
        item: site_link_service_pb2.StagedInput,
        task_dir: Path,
        account: Account | None,
        of: jobs_pb2.CheckpointRecord | None,
    ) -> tuple[jobs_pb2.CheckpointRecord | None, str]:
        """Stages the uploaded checkpoint task ``key`` restores from in ``task_dir``: the
        record of it there (``of``, where it now lies), or, when it cannot be had, None and
        why the task starts fresh (no failure: its reason says so)."""
        dest = restore_path(task_dir, item)
        why = item.error
        if not why:
            try:
                await asyncio.to_thread(
                    download, item.url, dest, item.bytes, item.sha256, folder=item.folder
                )
                if account is not None:
                    await asyncio.to_thread(_give, dest.parent.parent, _relative(dest), account)
            except DataError as exc:
                why = str(exc)
            except OSError as exc:
                why = f"cannot write {dest.name}: {exc}"
        if why:
            job_id, task, _ = key
            log.warning("checkpoint_not_restored", job_id=job_id, task=task, error=why)
            return None, f"started fresh: checkpoint {item.dataset} not restored: {why}"
        log.info("checkpoint_staged", name=item.dataset, bytes=item.bytes)
        record = jobs_pb2.CheckpointRecord()
        if of is not None:
            record.CopyFrom(of)
        record.path = str(dest)
        return record, ""

    async def describe(
        self, request: site_link_service_pb2.DescribeRequest
    ) -> site_link_service_pb2.DescribeAnswer:
        """The size and digest of one object of this site's store, for a dataset being
        registered; only objects of the tenant's folder in this site's own bucket."""
        if self.store is None:
            return site_link_service_pb2.DescribeAnswer(
                error=f"site {self._site} has no object store"
            )
        if request.bucket != self.store.settings.bucket:
            return site_link_service_pb2.DescribeAnswer(
                error=f"site {self._site}'s store is bucket {self.store.settings.bucket}, "
                f"not {request.bucket}"
            )
        try:
            size, sha256 = await asyncio.to_thread(
                self.store.stat, request.key, request.tenant, request.bytes, request.sha256
            )
        except DataError as err:
            log.warning("describe_refused", key=request.key, tenant=request.tenant, error=str(err))
            return site_link_service_pb2.DescribeAnswer(error=str(err))
        log.info("described", key=request.key, bytes=size)
        return site_link_service_pb2.DescribeAnswer(bytes=size, sha256=sha256)


def _relative(dest: Path) -> str:
    """``dest`` below its grandparent (the task's folder): the parts ``_give`` hands over."""
    return str(Path(dest.parent.name) / dest.name)


class _Progress:
    """One input's stage-in as the coordinator hears of it: a report each ``PROGRESS_EVERY_S``
    while the download runs (none for a short one), and one when it is in place. ``tick`` is
    called from the download's thread: each report is handed to the event loop."""

    def __init__(
        self,
        key: RunKey,
        item: site_link_service_pb2.StagedInput,
        tell: Callable[[site_link_service_pb2.StageProgress], None] | None,
    ) -> None:
        self._key, self._item, self._tell = key, item, tell
        self._loop = asyncio.get_running_loop()
        self._next = PROGRESS_EVERY_S

    def _report(self, **fields: Any) -> site_link_service_pb2.StageProgress:
        job_id, task, epoch = self._key
        return site_link_service_pb2.StageProgress(
            job_id=job_id,
            task=task,
            epoch=epoch,
            dataset=self._item.dataset,
            source_site=self._item.site,
            bytes_total=self._item.bytes,
            **fields,
        )

    def tick(self, held: int, seconds: float) -> None:
        if self._tell is None or seconds < self._next or held >= self._item.bytes:
            return
        self._next = seconds + PROGRESS_EVERY_S
        report = self._report(bytes_done=held, seconds=seconds)
        self._loop.call_soon_threadsafe(self._tell, report)

    def done(self, moved: Transfer) -> None:
        if self._tell is None:
            return
        self._tell(
            self._report(
                bytes_done=self._item.bytes,
                seconds=moved.seconds,
                done=True,
                bytes_moved=moved.bytes,
                active_s=moved.active_s,
                resumes=moved.resumes,
            )
        )


def _inside(folder: Path, relative: str) -> Path:
    """``folder/relative``, refused if a link on the way leads out of ``folder``."""
    path = folder / relative
    if not path.parent.resolve().is_relative_to(folder.resolve()):
        raise DataError("its path leads out of the work folder through a link")
    return path


def _local_size(path: Path, name: str) -> int:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise DataError(f"output {name} ({path.name}): the task did not write it") from None
    if os.path.isdir(path) and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())
    return st.st_size


def _copy(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True)
    else:
        shutil.copy2(source, dest)


def _give(folder: Path, relative: str, account: Account) -> None:
    """Make a staged input (and the folders made for it) the account's."""
    path = folder
    for part in Path(relative).parts:
        path = path / part
        os.chown(path, account.uid, account.gid, follow_symlinks=False)
    if path.is_dir() and not path.is_symlink():
        for inner in path.rglob("*"):
            os.chown(inner, account.uid, account.gid, follow_symlinks=False)
