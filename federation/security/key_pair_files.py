"""Replacing a certificate and its key on disk so that a crash never leaves a mismatched pair.

Two files cannot be renamed in one step. So the new pair is first written beside the old one
as ``<key>.next`` and then ``<cert>.next`` (each atomically, 0600, fsynced), and only then is
the key renamed over the old key and the certificate over the old certificate:

* a crash before the first rename leaves the old pair whole (and maybe the new one, pending);
* a crash between the two renames leaves the new key beside the old certificate, which no
  TLS handshake accepts, until ``finish_replacement`` (run before the pair is read) renames
  ``<cert>.next`` into place.

``finish_replacement`` completes a pending pair rather than dropping it: once the coordinator
has renewed a site's certificate it accepts only the new one, so the new pair is the one that
works. A pending file without its match (a crash while the pair was being written) is removed.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from federation.durable import sync_dir, write_private_file
from federation.security import crypto_process

log = structlog.get_logger()


def pending(path: Path) -> Path:
    """Where the next version of ``path`` is written before it replaces it."""
    return path.with_name(path.name + ".next")


def replace_key_pair(cert: Path, key: Path, cert_pem: bytes, key_pem: bytes) -> None:
    """Replace the pair at ``cert`` and ``key`` with a new one, both 0600 (see the module)."""
    write_private_file(pending(key), key_pem)
    write_private_file(pending(cert), cert_pem)
    os.replace(pending(key), key)
    os.replace(pending(cert), cert)
    sync_dir(cert.parent)


def finish_replacement(cert: Path, key: Path) -> bool:
    """Complete a replacement a crash interrupted; True if there was one to complete."""
    next_cert, next_key = pending(cert), pending(key)
    if next_key.exists():
        if next_cert.exists() and _pair_matches(next_cert, next_key):
            os.replace(next_key, key)
            os.replace(next_cert, cert)
            sync_dir(cert.parent)
            log.warning("key_pair_replacement_finished", cert=str(cert))
            return True
        next_key.unlink()
        next_cert.unlink(missing_ok=True)
        return False
    if next_cert.exists():
        if key.exists() and _pair_matches(next_cert, key):  # the key was renamed already
            os.replace(next_cert, cert)
            sync_dir(cert.parent)
            log.warning("key_pair_replacement_finished", cert=str(cert))
            return True
        next_cert.unlink()
    return False


def _pair_matches(cert: Path, key: Path) -> bool:
    """Whether the key is the certificate's; False for either torn or foreign. Checked in a
    child process: a site agent, which finishes its replacements, does not load cryptography.

    Raises:
        CryptoProcessError: The child failed (nothing is finished or removed then).
    """
    return crypto_process.pair_matches(cert.read_bytes(), key.read_bytes())
