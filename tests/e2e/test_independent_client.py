"""The refusal table, run by a client that shares no code with the federation.

The .proto files are compiled with ``grpc_tools.protoc`` into a temporary folder and a separate
process (``independent_client.py``) makes every call with plain ``grpc`` against a real
coordinator over mTLS on loopback. The project's own code only sets the stage: it starts the
federation and mints certificates and tokens. The table the test prints is the one in the
README's security section.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation
from federation.security.identity import Identity, Role
from federation.security.pki import init_pki, issue_client_files, load_issuer, make_csr
from federation.security.tls import TlsFiles

from .conftest import (
    admin,
    jobs,
    python_task,
    site_tls,
    spec,
    tenant_tls,
    until_past,
    wait_for_job,
)
from .test_refusals import enrol_ghost

pytestmark = pytest.mark.xdist_group("e2e-independent")

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("independent_client.py")
SLEEPER = python_task("sleep", "import time; time.sleep(300)", resources={"cpu": 1})
HANDSHAKE = "UNAVAILABLE"
"""gRPC Python can only require client certificates in the handshake: a refused certificate
ends the connection before any RPC, and the call fails UNAVAILABLE naming the handshake."""


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .proto files compiled by protoc alone into a folder of top-level modules.

    Copies import each other by bare file name, so nothing generated is named ``federation``;
    the protobuf package (and so every message and method name on the wire) is unchanged.
    """
    work = tmp_path_factory.mktemp("independent")
    sources, out = work / "proto", work / "generated"
    sources.mkdir()
    out.mkdir()
    for proto in sorted((ROOT / "proto" / "federation" / "api" / "v1").glob("*.proto")):
        text = proto.read_text().replace('import "federation/api/v1/', 'import "')
        (sources / proto.name).write_text(text)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    protoc = [sys.executable, "-m", "grpc_tools.protoc", f"-I{sources}", f"-I{include}"]
    names = sorted(p.name for p in sources.glob("*.proto"))
    subprocess.run(
        [*protoc, f"--python_out={out}", f"--grpc_python_out={out}", *names],
        cwd=sources,
        check=True,
    )
    return out


def expired_tls(fed: LocalFederation, folder: Path, identity: Identity) -> TlsFiles:
    """A certificate the federation CA signed for ``identity`` that expired yesterday."""
    ca = load_issuer(fed.pki.ca_cert, fed.pki.ca_key, None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity))]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=2))
        .not_valid_after(now - dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), False
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .sign(ca.key, hashes.SHA256())
    )
    (folder / "expired.pem").write_bytes(ca.with_chain(cert))  # as the issuing CA hands out
    (folder / "expired-key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TlsFiles(ca=fed.pki.ca_cert, cert=folder / "expired.pem", key=folder / "expired-key.pem")


def files(tls: TlsFiles) -> dict[str, str]:
    return {"ca": str(tls.ca), "cert": str(tls.cert), "key": str(tls.key)}


def hello(site: str, **extra: Any) -> dict[str, Any]:
    """A Connect write holding one hello for ``site`` (protobuf JSON)."""
    return {"messages": [{"hello": {"view": {"site": site}, "generation": "1", **extra}}]}


def report(job: jobs_pb2.Job, state: str) -> dict[str, Any]:
    """A report on the job's first task, at the epoch it holds now, as its site would send."""
    task = job.tasks[0]
    return {"jobId": job.id, "task": task.name, "epoch": str(task.epoch), "state": state}


@pytest.fixture(scope="module")
def stage(federation: LocalFederation, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Certificates, tokens and a job running at dc-a, made with the project's own code."""
    folder = tmp_path_factory.mktemp("stage")
    (folder / "ghost").mkdir()
    other = init_pki(folder / "other-pki", server_sans=["localhost"])
    foreign_cert, foreign_key = issue_client_files(other, Identity(Role.OPERATOR, "admin"))

    async def prepare() -> dict[str, Any]:
        ghost = await enrol_ghost(federation, "indep-ghost", folder / "ghost")
        async with federation.operator().channel() as channel:
            running = await jobs(channel).SubmitJob(
                job_service_pb2.SubmitJobRequest(
                    spec=spec("indep-running", [SLEEPER], constraints={"sites": ["dc-a"]})
                )
            )
            job = await wait_for_job(
                channel, running.job.id, until=frozenset({jobs_pb2.JOB_STATE_RUNNING})
            )
            short = await admin(channel).CreateJoinToken(
                admin_service_pb2.CreateJoinTokenRequest(site="indep-late", domain=1, ttl_s=0.001)
            )
        used = await federation.create_token("indep-once", "edge")
        await until_past(short.expires_at.seconds, "the short token's expiry")
        return {"ghost": ghost, "job": job, "used": used, "expired": short.token}

    made = asyncio.run(prepare())
    return {
        **made,
        "foreign": TlsFiles(ca=federation.pki.ca_cert, cert=foreign_cert, key=foreign_key),
        "expired_cert": expired_tls(federation, folder, Identity(Role.TENANT, "indep-old")),
        "csr": make_csr("indep-once")[1].decode(),
        "other_csr": make_csr("indep-once")[1].decode(),
    }


def rows(fed: LocalFederation, stage: dict[str, Any]) -> list[dict[str, Any]]:
    """Every call the independent client makes, in order, with the status each must get."""
    ca = str(fed.pki.ca_cert)
    operator = files(fed.operator().tls)
    team_a = files(tenant_tls(fed, "indep-a"))
    team_b = files(tenant_tls(fed, "indep-b"))
    revoked = files(tenant_tls(fed, "indep-revoked"))
    ghost = files(stage["ghost"])
    job: jobs_pb2.Job = stage["job"]
    list_jobs = {"service": "JobService", "method": "ListJobs", "request": {}}
    b_job = {"id": "indep-b-job", "name": "b", "tasks": [python_task("t", "")]}
    join = {"service": "SiteLinkService", "method": "Join", "target": f"127.0.0.1:{fed.join_port}"}
    connect = {"service": "SiteLinkService", "method": "Connect", "read_s": 3.0}
    calls = [
        {
            "row": "no client certificate",
            "sent": "JobService.ListJobs with the CA bundle only",
            **list_jobs,
            "tls": {"ca": ca},
            "expect": HANDSHAKE,
        },
        {
            "row": "certificate from another CA",
            "sent": "JobService.ListJobs as operator:admin of a fresh self-signed CA",
            **list_jobs,
            "tls": files(stage["foreign"]),
            "expect": HANDSHAKE,
        },
        {
            "row": "expired certificate",
            "sent": "JobService.ListJobs, federation CA, notAfter yesterday",
            **list_jobs,
            "tls": files(stage["expired_cert"]),
            "expect": HANDSHAKE,
        },
        {
            "row": "(setup) revoke tenant:indep-revoked",
            "sent": "CertificateService.RevokeCertificates as operator",
            "service": "CertificateService",
            "method": "RevokeCertificates",
            "request": {"identity": "tenant:indep-revoked", "reason": "refusal table"},
            "tls": operator,
            "expect": "OK",
        },
        {
            "row": "revoked certificate",
            "sent": "JobService.ListJobs as the revoked tenant",
            **list_jobs,
            "tls": revoked,
            "expect": "UNAUTHENTICATED",
            "says": "was revoked at",
        },
        {
            "row": "wrong role: tenant on AdminService",
            "sent": "AdminService.ListSites as tenant:indep-a",
            "service": "AdminService",
            "method": "ListSites",
            "request": {},
            "tls": team_a,
            "expect": "PERMISSION_DENIED",
            "says": "may not call ListSites",
        },
        {
            "row": "wrong role: site on JobService",
            "sent": "JobService.ListJobs as site:dc-a",
            **list_jobs,
            "tls": files(site_tls(fed, "dc-a")),
            "expect": "PERMISSION_DENIED",
            "says": "may not call ListJobs",
        },
        {
            "row": "wrong role: operator on SiteLinkService.Connect",
            "sent": "Connect with a hello for dc-a as operator:admin",
            **connect,
            "stream": [hello("dc-a")],
            "tls": operator,
            "expect": "PERMISSION_DENIED",
            "says": "may not call Connect",
        },
        {
            "row": "(setup) tenant B submits a job",
            "sent": "JobService.SubmitJob id indep-b-job as tenant:indep-b",
            "service": "JobService",
            "method": "SubmitJob",
            "request": {"spec": b_job},
            "tls": team_b,
            "expect": "OK",
        },
        {
            "row": "tenant A reads tenant B's job",
            "sent": "JobService.GetJob indep-b:indep-b-job as tenant:indep-a",
            "service": "JobService",
            "method": "GetJob",
            "request": {"jobId": "indep-b:indep-b-job"},
            "tls": team_a,
            "expect": "NOT_FOUND",
            "same_as": "tenant A reads a job that does not exist",
        },
        {
            "row": "tenant A reads a job that does not exist",
            "sent": "JobService.GetJob indep-b:no-such-job as tenant:indep-a",
            "service": "JobService",
            "method": "GetJob",
            "request": {"jobId": "indep-b:no-such-job"},
            "tls": team_a,
            "expect": "NOT_FOUND",
        },
        {
            "row": "tenant A cancels tenant B's job",
            "sent": "JobService.CancelJob indep-b:indep-b-job as tenant:indep-a",
            "service": "JobService",
            "method": "CancelJob",
            "request": {"jobId": "indep-b:indep-b-job"},
            "tls": team_a,
            "expect": "NOT_FOUND",
        },
        {
            "row": "site speaks for another: hello",
            "sent": "Connect as site:indep-ghost, hello naming dc-a",
            **connect,
            "stream": [hello("dc-a")],
            "tls": ghost,
            "expect": "PERMISSION_DENIED",
            "says": "may speak only for itself",
        },
        {
            "row": "site speaks for another: full view",
            "sent": "Connect as site:indep-ghost, own hello, then a full view naming dc-a",
            **connect,
            "stream": [
                hello("indep-ghost"),
                {"messages": [{"view": {"generation": "2", "full": {"site": "dc-a"}}}]},
            ],
            "tls": ghost,
            "expect": "PERMISSION_DENIED",
            "says": "may speak only for itself",
        },
        {
            "row": "site speaks for another: task report",
            "sent": "Connect as site:indep-ghost, own hello, then SUCCEEDED for dc-a's task",
            **connect,
            "stream": [
                hello("indep-ghost"),
                {"messages": [{"taskStatus": report(job, "JOB_STATE_SUCCEEDED")}]},
            ],
            "tls": ghost,
            "expect": "OK",
            "fenced": "ack",
        },
        {
            "row": "site speaks for another: task in hello",
            "sent": "Connect as site:indep-ghost, hello claiming dc-a's task RUNNING",
            **connect,
            "stream": [hello("indep-ghost", tasks=[report(job, "JOB_STATE_RUNNING")])],
            "tls": ghost,
            "expect": "OK",
            "fenced": "cancel",
        },
        {
            "row": "(check) dc-a's job after the ghost's reports",
            "sent": "JobService.GetJob as operator",
            "service": "JobService",
            "method": "GetJob",
            "request": {"jobId": job.id},
            "tls": operator,
            "expect": "OK",
        },
        {
            "row": "(setup) join with a fresh token",
            "sent": "SiteLinkService.Join, token for indep-once",
            **join,
            "request": {"token": stage["used"], "csrPem": _b64(stage["csr"])},
            "tls": {"ca": ca},
            "expect": "OK",
        },
        {
            "row": "join token used twice",
            "sent": "SiteLinkService.Join, the same token again with another CSR",
            **join,
            "request": {"token": stage["used"], "csrPem": _b64(stage["other_csr"])},
            "tls": {"ca": ca},
            "expect": "UNAUTHENTICATED",
        },
        {
            "row": "expired join token",
            "sent": "SiteLinkService.Join, token past its ttl",
            **join,
            "request": {"token": stage["expired"], "csrPem": _b64(stage["csr"])},
            "tls": {"ca": ca},
            "expect": "UNAUTHENTICATED",
        },
    ]
    return [{"target": fed.address, **call} for call in calls]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def run_client(generated: Path, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(
        [sys.executable, str(CLIENT), str(generated)],
        input=json.dumps(calls),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def table(calls: list[dict[str, Any]], results: list[dict[str, Any]]) -> str:
    lines = ["| Row | Sent | Status | Message |", "|---|---|---|---|"]
    for call, result in zip(calls, results, strict=True):
        if call["row"].startswith("("):
            continue
        message = result.get("message") or ""
        if call.get("fenced"):
            kinds = [k for k in result["received"] if not k.startswith("(")]
            message = f"stream stays open; coordinator answers {', '.join(kinds)}; not applied"
        if result["code"] == HANDSHAKE:
            message = "TLS handshake refused: " + message
        message = message.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {call['row']} | {call['sent']} | {result['code']} | {message} |")
    return "\n".join(lines)


def test_refusal_table(federation: LocalFederation, generated: Path, stage: dict[str, Any]) -> None:
    """Every row of the refusal table gets exactly its status from an independent client."""
    calls = rows(federation, stage)
    results = run_client(generated, calls)
    print("\n" + table(calls, results))
    by_row = {r["row"]: r for r in results}
    for call, result in zip(calls, results, strict=True):
        assert result["code"] == call["expect"], (call["row"], result)
        message = result.get("message") or ""
        assert "Traceback" not in message
        assert 'File "' not in message
        if "says" in call:
            assert call["says"] in message, (call["row"], message)
        if call["expect"] == HANDSHAKE:
            assert "failed to connect" in message, (call["row"], result)
            assert "handshake" in message.lower() or "Socket closed" in message, result
        if "same_as" in call:
            other = by_row[call["same_as"]]["message"]
            assert message.replace("indep-b-job", "no-such-job") == other, (message, other)
        if "fenced" in call:
            assert call["fenced"] in result["received"], (call["row"], result)
            assert "welcome" in result["received"]
    job = by_row["(check) dc-a's job after the ghost's reports"]["reply"]["job"]
    assert job["state"] == "JOB_STATE_RUNNING"
    assert job["tasks"][0]["site"] == "dc-a"
    assert job["tasks"][0]["state"] == "JOB_STATE_RUNNING"


def test_the_client_is_independent(generated: Path) -> None:
    """The generated modules sit in a folder of their own, none under a ``federation`` name."""
    made = sorted(p.name for p in generated.iterdir() if p.suffix == ".py")
    assert "job_service_pb2_grpc.py" in made
    assert not (generated / "federation").exists()
    for path in generated.glob("*.py"):
        assert "from federation" not in path.read_text()
    assert grpc.__name__ == "grpc"
