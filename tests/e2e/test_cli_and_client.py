"""One suite, two front ends: every scenario runs through ``fedctl`` (a process of its own,
``-o json`` where it prints data, its exit status where it reports an outcome) and through
``federation.client``, against the same federation as the same operator, and asserts the same
outcome of both: submit and wait (succeeded, failed, cancelled), get, list, cancel, watch,
logs, explain, and a refusal.

Each front end gives back plain data: messages as ``fedctl -o json`` prints them
(``message_data``), final states by name (fedctl's exit status read by its documented meaning:
0 succeeded, 3 failed, 4 cancelled).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import pytest

from federation.api.v1 import jobs_pb2
from federation.cli.follow import EXIT_CANCELLED, EXIT_FAILED
from federation.cli.output import message_data
from federation.client import CallError, Client
from federation.local import LocalFederation

from .conftest import fedctl, until

pytestmark = pytest.mark.xdist_group("e2e-front-ends")

ENDED_BY_EXIT = {
    0: "JOB_STATE_SUCCEEDED",
    EXIT_FAILED: "JOB_STATE_FAILED",
    EXIT_CANCELLED: "JOB_STATE_CANCELLED",
}
"""What fedctl's exit status after ``--wait`` says of how the job ended (``cli.follow``)."""

Data = dict[str, Any]


class Refused(Exception):
    """A front end's refusal, as the words it gives a person."""


class FrontEnd(Protocol):
    name: str

    async def submit(self, spec: Data, *, wait: bool) -> tuple[str, str]:
        """The job's id, and with ``wait`` the state it ended in ("" without)."""
        ...

    async def get(self, job_id: str) -> Data: ...

    async def list_ids(self) -> list[str]: ...

    async def cancel(self, job_id: str) -> Data: ...

    async def wait(self, job_id: str) -> str: ...

    async def watch(self, job_id: str) -> list[Data]:
        """The job's events, its current state first, until it ends."""
        ...

    async def logs(self, job_id: str) -> list[str]: ...

    async def explain(self, job_id: str) -> list[Data]: ...


class Fedctl:
    """``fedctl`` as a process, as a script or a person runs it."""

    name = "fedctl"

    def __init__(self, fed: LocalFederation, folder: Path) -> None:
        self._fed = fed
        self._folder = folder
        self._files = 0

    async def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(fedctl, self._fed, *args)

    async def _data(self, *args: str) -> Any:
        done = await self._run("-o", "json", *args)
        refuse_on_error(done)
        return json.loads(done.stdout)

    def _file(self, spec: Data) -> str:
        self._files += 1
        path = self._folder / f"job-{self._files}.json"
        path.write_text(json.dumps(spec))
        return str(path)

    async def submit(self, spec: Data, *, wait: bool) -> tuple[str, str]:
        if not wait:
            (job,) = await self._data("jobs", "submit", self._file(spec))
            return str(job["id"]), ""
        done = await self._run("jobs", "submit", self._file(spec), "--wait")
        job_id = done.stdout.split()[1]  # "submitted <id> (<name>)", then its events
        return job_id, ENDED_BY_EXIT[done.returncode]

    async def get(self, job_id: str) -> Data:
        reply: Data = await self._data("jobs", "get", job_id)
        return reply["job"]  # type: ignore[no-any-return]

    async def list_ids(self) -> list[str]:
        return [j["id"] for j in await self._data("jobs", "list", "--limit", "1000")]

    async def cancel(self, job_id: str) -> Data:
        job: Data = await self._data("jobs", "cancel", job_id)
        return job

    async def wait(self, job_id: str) -> str:
        return ENDED_BY_EXIT[(await self._run("jobs", "wait", job_id)).returncode]

    async def watch(self, job_id: str) -> list[Data]:
        done = await self._run("-o", "json", "jobs", "watch", job_id)
        assert done.returncode == 0, done.stderr
        return documents(done.stdout)

    async def logs(self, job_id: str) -> list[str]:
        done = await self._run("-o", "json", "jobs", "logs", job_id)
        refuse_on_error(done)
        return [json.loads(line)["text"] for line in done.stdout.splitlines()]

    async def explain(self, job_id: str) -> list[Data]:
        reply: Data = await self._data("jobs", "explain", job_id)
        return reply["tasks"]  # type: ignore[no-any-return]


class Python:
    """``federation.client``, as a script uses it."""

    name = "client"

    def __init__(self, client: Client) -> None:
        self._client = client

    async def submit(self, spec: Data, *, wait: bool) -> tuple[str, str]:
        job = await self._client.submit(spec)
        if not wait:
            return job.id, ""
        return job.id, await self.wait(job.id)

    async def get(self, job_id: str) -> Data:
        return data(await refused_as_words(self._client.get(job_id)))

    async def list_ids(self) -> list[str]:
        return [j.id for j in await self._client.list_jobs()]

    async def cancel(self, job_id: str) -> Data:
        return data(await refused_as_words(self._client.cancel(job_id)))

    async def wait(self, job_id: str) -> str:
        (state,) = (await self._client.wait([job_id])).values()
        return jobs_pb2.JobState.Name(state)

    async def watch(self, job_id: str) -> list[Data]:
        events = []
        async for event in self._client.watch([job_id]):
            events.append(data(event))
            if event.job_id == job_id and is_ended(data(event)["job_state"]):
                return events
        raise AssertionError("the watch ended before the job")

    async def logs(self, job_id: str) -> list[str]:
        lines = self._client.logs(job_id)
        try:
            return [line.text async for line in lines]
        except CallError as err:
            raise Refused(err.message) from None

    async def explain(self, job_id: str) -> list[Data]:
        return [data(task) for task in await self._client.explain(job_id)]


def refuse_on_error(done: subprocess.CompletedProcess[str]) -> None:
    """fedctl's error, exit 1 and one line on stderr after its name, as ``Refused``."""
    if done.returncode != 0:
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("fedctl: ")
        raise Refused(line.removeprefix("fedctl: "))


def data(message: Any) -> Data:
    found: Data = message_data(message)  # type: ignore[assignment]
    return found


async def refused_as_words(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except CallError as err:
        raise Refused(err.message) from None


def is_ended(state: str) -> bool:
    return state in ENDED_BY_EXIT.values()


def documents(text: str) -> list[Data]:
    """The JSON documents ``fedctl -o json`` streams, one after another."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        while text[at].isspace():
            at += 1
        document, at = decoder.raw_decode(text, at)
        found.append(document)
    return found


@pytest.fixture(params=["fedctl", "client"])
async def front(
    request: pytest.FixtureRequest, federation: LocalFederation, tmp_path: Path
) -> AsyncIterator[FrontEnd]:
    if request.param == "fedctl":
        yield Fedctl(federation, tmp_path)
        return
    async with Client.from_pki(federation.pki.dir, federation.address) as client:
        yield Python(client)


def job(name: str, code: str) -> Data:
    return {"name": name, "tasks": [{"name": "t", "command": [sys.executable, "-c", code]}]}


SAYS = "print('first line'); print('second line')"


async def test_a_job_that_succeeds(front: FrontEnd) -> None:
    """submit --wait ends SUCCEEDED; get, list, wait, watch, logs and explain agree."""
    job_id, ended = await front.submit(job(f"ok-{front.name}", SAYS), wait=True)
    assert ended == "JOB_STATE_SUCCEEDED"
    got = await front.get(job_id)
    assert (got["id"], got["state"]) == (job_id, "JOB_STATE_SUCCEEDED")
    (task,) = got["tasks"]
    assert (task["name"], task["state"], task["exit_code"]) == ("t", "JOB_STATE_SUCCEEDED", 0)
    assert task["output_tail"].split() == ["first", "line", "second", "line"]
    assert job_id in await front.list_ids()
    assert await front.wait(job_id) == "JOB_STATE_SUCCEEDED"  # ended: at once
    events = await front.watch(job_id)
    assert events[-1]["job_id"] == job_id
    assert events[-1]["job_state"] == "JOB_STATE_SUCCEEDED"
    assert await front.logs(job_id) == ["first line", "second line"]
    (explained,) = await front.explain(job_id)
    assert (explained["task"], explained["site"]) == ("t", task["site"])
    assert task["site"] in [s["site"] for s in explained["sites"] if s["feasible"]]


async def test_a_job_that_fails(front: FrontEnd) -> None:
    job_id, ended = await front.submit(job(f"fails-{front.name}", "raise SystemExit(5)"), wait=True)
    assert ended == "JOB_STATE_FAILED"
    (task,) = (await front.get(job_id))["tasks"]
    assert (task["state"], task["exit_code"]) == ("JOB_STATE_FAILED", 5)
    assert await front.wait(job_id) == "JOB_STATE_FAILED"


async def test_a_job_cancelled_while_waited_for(front: FrontEnd, tmp_path: Path) -> None:
    """A wait already under way ends CANCELLED (fedctl: exit 4) once the job is cancelled
    through the same front end."""
    marker = tmp_path / f"running-{front.name}"
    code = f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    job_id, _ = await front.submit(job(f"cancelled-{front.name}", code), wait=False)
    waiting = asyncio.create_task(front.wait(job_id))

    async def running() -> bool:
        return marker.exists()

    await until(running, "the job to run")
    cancelled = await front.cancel(job_id)
    assert cancelled["id"] == job_id
    assert cancelled["cancel_requested"] or cancelled["state"] == "JOB_STATE_CANCELLED"
    assert await asyncio.wait_for(waiting, 60) == "JOB_STATE_CANCELLED"
    assert (await front.get(job_id))["state"] == "JOB_STATE_CANCELLED"


async def test_a_submit_wait_ends_cancelled_when_another_cancels(
    front: FrontEnd, federation: LocalFederation, tmp_path: Path
) -> None:
    """``submit --wait`` itself (fedctl's process, the client's submit and wait) ends
    CANCELLED when the operator cancels the job from elsewhere."""
    marker = tmp_path / f"submitted-{front.name}"
    code = f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    name = f"submit-cancelled-{front.name}"
    submitting = asyncio.create_task(front.submit(job(name, code), wait=True))

    async def running() -> bool:
        return marker.exists()

    await until(running, "the job to run")
    async with Client.from_pki(federation.pki.dir, federation.address) as other:
        (mine,) = [j for j in await other.list_jobs() if j.spec.name == name]
        await other.cancel(mine.id)
    job_id, ended = await asyncio.wait_for(submitting, 60)
    assert (job_id, ended) == (mine.id, "JOB_STATE_CANCELLED")


async def test_an_unknown_job_is_refused_naming_it(front: FrontEnd) -> None:
    """get, cancel and logs of a job that is not there: each refused in the coordinator's words
    (fedctl prints them after its name, exit 1; the client raises them), never a traceback."""
    missing = "j-0000000000-000000"
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: front.get(missing),
        lambda: front.cancel(missing),
        lambda: front.logs(missing),
    ]
    for call in calls:
        with pytest.raises(Refused) as refused:
            await call()
        words = str(refused.value)
        assert f"no job {missing!r}" in words
        assert "Traceback" not in words
