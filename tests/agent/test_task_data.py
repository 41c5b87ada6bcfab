"""The embedded core stages a task's inputs before it starts and keeps its outputs: served by a
real HTTP server on loopback (the URL a holding site would sign), no store needed."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.agent.task_data import TaskData
from federation.api.v1 import jobs_pb2, site_link_service_pb2

from .cores import CANCELLED, FAILED, RUNNING, SUCCEEDED, Recorder, commit_for, node, offer

DATA = b"frames " * 50_000

READ = (
    "import hashlib, pathlib; "
    "print(hashlib.sha256(pathlib.Path('in/frames.bin').read_bytes()).hexdigest())"
)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """An HTTP server on loopback that serves DATA at /frames."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the standard library names it so
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/frames"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent() -> Iterator[str]:
    """A URL whose server takes the connection and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/frames"
    listener.close()


def staged(url: str, *, sha256: str = "", error: str = "") -> site_link_service_pb2.StagedInput:
    return site_link_service_pb2.StagedInput(
        dataset="task:prep.frames",
        path="in/frames.bin",
        bytes=len(DATA),
        sha256=sha256 or hashlib.sha256(DATA).hexdigest(),
        url=url,
        error=error,
    )


async def commit_with(
    core: EmbeddedCore, inputs: list[site_link_service_pb2.StagedInput], **task: object
) -> None:
    o = offer(**task)  # type: ignore[arg-type]
    answer = await core.offer(o)
    assert answer.accepted, answer.reason
    commit = commit_for(o, answer)
    commit.inputs.extend(inputs)
    started = await core.commit(commit)
    assert started.started, started.reason


async def test_each_replica_finds_its_inputs_in_place_when_it_starts(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, served: str
) -> None:
    core = make_core([node("n")])
    await commit_with(core, [staged(served)], code=READ, replicas=2)
    final = await recorder.final()
    assert final.state == SUCCEEDED, final.reason
    assert hashlib.sha256(DATA).hexdigest() in final.output_tail
    assert [r.state for r in recorder.reports] == [RUNNING, SUCCEEDED]


async def test_a_digest_that_does_not_match_fails_the_task_before_it_runs(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, served: str, tmp_path: Path
) -> None:
    core = make_core([node("n")])
    marker = tmp_path / "ran"
    await commit_with(core, [staged(served, sha256="0" * 64)], code=f"open({str(marker)!r}, 'w')")
    final = await recorder.final()
    assert final.state == FAILED
    assert final.reason.startswith("input task:prep.frames: digest mismatch: sha256 ")
    assert not marker.exists()
    assert RUNNING not in [r.state for r in recorder.reports]


async def test_an_input_that_cannot_be_had_fails_the_task_with_the_reason(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    core = make_core([node("n")])
    why = "output frames of task prep stayed at site edge-a, which has no object store"
    await commit_with(core, [staged("", error=why)])
    final = await recorder.final()
    assert (final.state, final.reason) == (FAILED, f"input task:prep.frames: {why}")


async def test_a_task_cancelled_while_staging_ends_cancelled_without_running(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, silent: str, tmp_path: Path
) -> None:
    """The commit is answered at once; the task holds its room, is not RUNNING, and a cancel
    ends it."""
    core = make_core([node("n")])
    marker = tmp_path / "ran"
    await commit_with(core, [staged(silent)], code=f"open({str(marker)!r}, 'w')")
    assert core.queue().running_tasks == 1  # its room is held while it stages
    await core.cancel("job-1", "train", 1, "cancelled by its owner")
    final = await recorder.final()
    assert (final.state, final.reason) == (CANCELLED, "cancelled by its owner")
    assert not marker.exists()
    assert RUNNING not in [r.state for r in recorder.reports]


async def test_outputs_stay_at_a_site_without_a_store_and_the_reason_says_so(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    core = make_core([node("n")])
    o = offer(code="open('out.bin', 'wb').write(b'x' * 10)")
    o.spec.outputs.append(jobs_pb2.Output(name="frames", path="out.bin"))
    answer = await core.offer(o)
    await core.commit(commit_for(o, answer))
    final = await recorder.final()
    assert final.state == SUCCEEDED
    assert final.reason == "outputs frames kept at site site-a: it has no object store"
    assert [(a.name, a.bytes, a.site, a.key) for a in final.artifacts] == [
        ("frames", 10, "site-a", "")
    ]


async def test_a_missing_output_fails_the_task(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    core = make_core([node("n")])
    o = offer(code="pass")
    o.spec.outputs.append(jobs_pb2.Output(name="frames", path="out.bin"))
    answer = await core.offer(o)
    await core.commit(commit_for(o, answer))
    final = await recorder.final()
    assert (final.state, final.reason) == (
        FAILED,
        "output frames (out.bin): the task did not write it",
    )


async def test_a_stored_checkpoint_is_staged_with_its_record_or_the_task_starts_fresh(
    served: str, tmp_path: Path
) -> None:
    """``TaskData.restore`` puts a stored checkpoint in the task's folder and gives its record
    pointing there; one that cannot be had gives no record and says why the task starts
    fresh."""
    data = TaskData(None, "edge-a", scratch=tmp_path / "scratch")
    key = ("job-1", "train", 2)
    of = jobs_pb2.CheckpointRecord(epoch=1, progress_s=30.0, path="/elsewhere/ckpt-30")
    record, why = await data.restore(key, staged(served), tmp_path / "task", None, of)
    assert why == ""
    assert record is not None
    assert (record.epoch, record.progress_s) == (1, 30.0)
    assert Path(record.path).is_relative_to(tmp_path / "task")
    assert await asyncio.to_thread(Path(record.path).read_bytes) == DATA
    reasons = []
    for bad in (staged(served, error="no copy reached this site"), staged(served, sha256="0" * 64)):
        record, why = await data.restore(key, bad, tmp_path / "other", None, of)
        assert record is None
        reasons.append(why)
    start = "started fresh: checkpoint task:prep.frames not restored: "
    assert reasons[0] == start + "no copy reached this site"
    assert reasons[1].startswith(start)
    assert "sha256" in reasons[1] or "digest" in reasons[1], reasons[1]
