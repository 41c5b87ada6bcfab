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
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from federation.durable import sync_dir
from federation.security.pki import write_private_file

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
    try:
        certificate = x509.load_pem_x509_certificate(cert.read_bytes())
        private_key = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except ValueError:
        return False  # torn or foreign: not a pair to finish
    return bool(certificate.public_key() == private_key.public_key())
