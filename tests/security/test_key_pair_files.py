"""Replacing a key pair on disk: whatever step a crash interrupts, the pair in place after
``finish_replacement`` matches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeAlias

import pytest

from federation.security.identity import Identity, Role
from federation.security.key_pair_files import finish_replacement, pending, replace_key_pair
from federation.security.pki import CertificateAuthority

Pairs: TypeAlias = tuple[Path, Path, tuple[bytes, bytes], tuple[bytes, bytes]]
"""The cert and key paths (holding the old pair), the old pair and a new one."""


@pytest.fixture
def pairs(tmp_path: Path) -> Pairs:
    ca = CertificateAuthority.create()
    old = ca.issue_client(Identity(Role.SITE, "s"))
    new = ca.issue_client(Identity(Role.SITE, "s"))
    cert, key = tmp_path / "site.pem", tmp_path / "site-key.pem"
    cert.write_bytes(old[0])
    key.write_bytes(old[1])
    return cert, key, old, new


def test_replace_writes_both_0600_and_leaves_nothing_pending(pairs: Pairs) -> None:
    """A replacement that runs through puts the new pair in place, both files 0600."""
    cert, key, _, (new_cert, new_key) = pairs
    replace_key_pair(cert, key, new_cert, new_key)
    assert (cert.read_bytes(), key.read_bytes()) == (new_cert, new_key)
    assert {os.stat(p).st_mode & 0o777 for p in (cert, key)} == {0o600}
    assert not pending(cert).exists()
    assert not pending(key).exists()
    assert not finish_replacement(cert, key)


def test_a_crash_between_the_renames_is_finished(pairs: Pairs) -> None:
    """New key in place beside the old certificate: the pending certificate completes it."""
    cert, key, _, (new_cert, new_key) = pairs
    key.write_bytes(new_key)
    pending(cert).write_bytes(new_cert)
    assert finish_replacement(cert, key)
    assert (cert.read_bytes(), key.read_bytes()) == (new_cert, new_key)


def test_a_crash_before_the_renames_promotes_the_new_pair(pairs: Pairs) -> None:
    """Both pending files written: the new pair (the only one a renewed site may use) wins."""
    cert, key, _, (new_cert, new_key) = pairs
    pending(key).write_bytes(new_key)
    pending(cert).write_bytes(new_cert)
    assert finish_replacement(cert, key)
    assert (cert.read_bytes(), key.read_bytes()) == (new_cert, new_key)


def test_a_crash_while_writing_keeps_the_old_pair(pairs: Pairs) -> None:
    """Only the pending key written (or a torn certificate): the old pair stays, the rest goes."""
    cert, key, (old_cert, old_key), (_, new_key) = pairs
    pending(key).write_bytes(new_key)
    pending(cert).write_bytes(b"-----BEGIN CERTIFICATE-----\ntorn")
    assert not finish_replacement(cert, key)
    assert (cert.read_bytes(), key.read_bytes()) == (old_cert, old_key)
    assert not pending(cert).exists()
    assert not pending(key).exists()
