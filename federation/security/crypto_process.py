"""Cryptography in a short-lived child process, for a site agent.

An agent needs cryptography only at a few moments: making a key and a CSR (joining, renewing),
checking a trust bundle the coordinator sent before writing it, and checking a key pair a
crash left pending. Loaded once, cryptography's library stays in the process for good (about
10 MiB of an agent that otherwise idles near 60), so each of these runs here instead: the
agent starts ``python -m federation.security.crypto_process``, writes one request as JSON on
its stdin and reads one answer as JSON on its stdout; the child exits. Keys travel over the
pipes only, never on a command line. The child runs ``federation.security.pki``'s own code,
so what it accepts and refuses, and the errors it gives, are those of the functions named
here.

Each operation has a blocking form (start-up, the CLI) and an ``async`` one (a running agent,
whose event loop must not wait on a child).

Raises, besides each operation's own errors:
    CryptoProcessError: The child could not be started, timed out, or gave no answer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import federation
from federation.security.cert_info import CaCheckError

TIMEOUT_S = 60.0
"""Longest a child may take: starting Python and loading cryptography on a loaded edge box
takes about a second, making a P-256 key milliseconds."""


class CryptoProcessError(OSError):
    """The child process for a cryptographic operation failed; nothing was checked or made.

    An ``OSError``, as a failure to write the files would be: callers that retry those (the
    renewer) or keep what they have (the trust bundle) treat it alike."""


def make_csr(identity_hint: str) -> tuple[bytes, bytes]:
    """``pki.make_csr`` in a child: ``(key_pem, csr_pem)``."""
    return _csr(_run(_request("make_csr", identity_hint=identity_hint)))


async def make_csr_async(identity_hint: str) -> tuple[bytes, bytes]:
    """``make_csr`` without blocking the event loop."""
    return _csr(await _run_async(_request("make_csr", identity_hint=identity_hint)))


def check_bundle(pem: bytes) -> int:
    """``pki.load_bundle`` in a child: the number of certificates in the bundle.

    Raises:
        CaCheckError: The bundle holds no certificate or a malformed one (``load_bundle``'s
            error and message).
    """
    return int(_run(_request("check_bundle", pem=pem)))


async def check_bundle_async(pem: bytes) -> int:
    """``check_bundle`` without blocking the event loop."""
    return int(await _run_async(_request("check_bundle", pem=pem)))


def pair_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """Whether ``key_pem`` is the private key of the certificate ``cert_pem``; False for
    either malformed (torn or foreign)."""
    return bool(_run(_request("pair_matches", cert_pem=cert_pem, key_pem=key_pem)))


def _csr(answer: Any) -> tuple[bytes, bytes]:
    key_pem, csr_pem = answer
    return base64.b64decode(key_pem), base64.b64decode(csr_pem)


def _request(op: str, **fields: str | bytes) -> bytes:
    encoded = {
        k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in fields.items()
    }
    return json.dumps({"op": op, **encoded}).encode()


def _command() -> tuple[list[str], dict[str, str]]:
    """The child's command line and environment: this interpreter, running the federation
    package this process runs (first on its path, and not the working folder's, ``-P``)."""
    root = str(Path(federation.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-P", "-m", "federation.security.crypto_process"], env


def _run(request: bytes) -> Any:
    command, env = _command()
    try:
        done = subprocess.run(
            command, input=request, capture_output=True, env=env, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CryptoProcessError(f"the cryptography process failed: {err}") from None
    return _answer(done.returncode, done.stdout, done.stderr)


async def _run_async(request: bytes) -> Any:
    command, env = _command()
    try:
        child = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as err:
        raise CryptoProcessError(f"the cryptography process failed: {err}") from None
    try:
        out, err_out = await asyncio.wait_for(child.communicate(request), TIMEOUT_S)
    except TimeoutError:
        raise CryptoProcessError("the cryptography process timed out") from None
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode is not None
    return _answer(child.returncode, out, err_out)


def _answer(returncode: int, stdout: bytes, stderr: bytes) -> Any:
    """The child's result, or its operation's error raised again here."""
    try:
        answer = json.loads(stdout)
    except ValueError:
        last = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise CryptoProcessError(
            f"the cryptography process exited {returncode}: {last[0]}"
        ) from None
    if "error" in answer:
        raise _ERRORS.get(answer["error"], CryptoProcessError)(answer["message"])
    return answer["result"]


_ERRORS: dict[str, Callable[[str], Exception]] = {
    "CaCheckError": CaCheckError,
    "ValueError": ValueError,
}
"""Errors of the operations raised again as themselves; any other is a ``CryptoProcessError``."""


def _serve(request: dict[str, Any]) -> Any:
    """The child's side: one operation, with ``pki`` (and so cryptography) loaded."""
    from federation.security import pki

    def data(name: str) -> bytes:
        return base64.b64decode(request[name])

    op = request["op"]
    if op == "make_csr":
        key_pem, csr_pem = pki.make_csr(request["identity_hint"])
        return [base64.b64encode(key_pem).decode(), base64.b64encode(csr_pem).decode()]
    if op == "check_bundle":
        return len(pki.load_bundle(data("pem")))
    if op == "pair_matches":
        return pki.key_pair_matches(data("cert_pem"), data("key_pem"))
    raise ValueError(f"unknown operation {op!r}")


def main() -> None:
    """Answer the one request on stdin, on stdout."""
    try:
        answer = {"result": _serve(json.loads(sys.stdin.buffer.read()))}
    except Exception as err:  # reported to the parent, which raises it again
        answer = {"error": type(err).__name__, "message": str(err)}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
