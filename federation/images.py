"""OCI image references, as a task's ``image`` names them: ``registry/name[:tag][@digest]``.

The grammar is the one registries and container engines share (the distribution project's
reference grammar), with one restriction: the registry must be named. A short name
("ubuntu:24.04") would be resolved by each host's own search list, so the same spec could run
different images at different sites, and a site's registry allow-list could not be checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_REFERENCE = 255
_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_REGISTRY = re.compile(rf"{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?")
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")


class ImageReferenceError(ValueError):
    """A malformed image reference; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed reference; ``str()`` gives it back as written."""

    registry: str
    """Host, with its port if it has one: "registry.example.org:5000"."""
    repository: str
    tag: str = ""
    digest: str = ""

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"{self.registry}/{self.repository}{tag}{digest}"


def registry_problem(registry: str) -> str | None:
    """Why ``registry`` is not a registry's host (with an optional port), or None."""
    if not _REGISTRY.fullmatch(registry) or len(registry) > MAX_REFERENCE:
        return f"registry {registry[:64]!r} is not a host name with an optional port"
    return None


def parse_image(reference: str) -> ImageRef:
    """The reference parsed; ImageReferenceError saying why it is not one."""
    if not reference:
        raise ImageReferenceError("is empty")
    if len(reference) > MAX_REFERENCE:
        raise ImageReferenceError(f"is over {MAX_REFERENCE} characters")
    rest, _, digest = reference.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        raise ImageReferenceError(f"digest {digest!r} is not sha256: and 64 hex digits")
    registry, slash, path = rest.partition("/")
    if not slash or not ("." in registry or ":" in registry or registry == "localhost"):
        raise ImageReferenceError(
            f"{reference!r} does not name its registry: write registry/name:tag "
            "(e.g. docker.io/library/busybox:1.36)"
        )
    if not _REGISTRY.fullmatch(registry):
        raise ImageReferenceError(f"registry {registry!r} is not a host name with an optional port")
    tag = ""
    last = path.rfind("/")
    if ":" in path[last + 1 :]:
        path, _, tag = path.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise ImageReferenceError(f"tag {tag!r} is not valid (letters, digits, '_', '.', '-')")
    if not all(_COMPONENT.fullmatch(part) for part in path.split("/")):
        raise ImageReferenceError(
            f"repository {path!r} is not valid: lower-case letters, digits and separators "
            "('.', '_', '-') in each '/'-separated part"
        )
    return ImageRef(registry, path, tag, digest)
