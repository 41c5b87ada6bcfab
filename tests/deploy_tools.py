"""Finding the external tools the deploy/ checks run (systemd-analyze, promtool, etcd, ...).

Locally a missing tool skips its check, with the reason. CI installs every one of them and
sets FEDERATION_REQUIRE_DEPLOY_TOOLS=1 (.ci/run), so there a missing tool fails the check:
a check that silently stopped running would prove nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
REQUIRED = os.environ.get("FEDERATION_REQUIRE_DEPLOY_TOOLS") == "1"


def need_tool(name: str, how: str) -> str:
    """The tool's path; without it a skip saying ``how`` to get it (a failure in CI)."""
    # Tools installed with pip (hadolint) lie beside the interpreter, which may not be on PATH.
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        missing(f"{name} is not installed ({how})")
    return str(path)


def missing(reason: str) -> None:
    """Skip for ``reason``, or fail where the deploy checks are required."""
    if REQUIRED:
        pytest.fail(f"{reason}; FEDERATION_REQUIRE_DEPLOY_TOOLS=1 requires it")
    pytest.skip(reason)
