"""The documentation cannot drift: the docs site builds with no broken link, and every command
it shows is one the project takes.

Commands are read from the shell blocks (```bash, ```sh, ```console) of README.md and docs/,
and from inline code that starts with ``fedctl``. A ``fedctl`` command must name subcommands
that exist and flags its subcommand takes (checked against fedctl's own parser, synopsis
forms such as ``[list|cordon NAME]`` included); ``make`` targets must be in the Makefile; a
daemon's and a script's flags must be in its ``--help``. A shell block of other programs
(pip, systemctl, etcd, kubectl...) is marked ``<!-- example: why -->`` on the line before it:
it shows what to run elsewhere, and is not run here.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.cli.app import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "console")
DAEMONS = {
    "fed-coordinator": "federation.coordinator",
    "fed-edge-agent": "edge_agent",
    "fed-datacenter-agent": "datacenter_agent",
}


def shell_blocks(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line number, language, lines) of each shell block not marked as an example."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        if fence[1] in SHELL and not before.startswith("<!-- example:"):
            yield i + 1, fence[1], lines[i + 1 : end]
        i = end + 1


def commands(block: list[str], console: bool = False) -> Iterator[str]:
    """Each command of a shell block: continuation lines joined, comments gone, ``&&``, ``;``
    and pipes split. In a console block only lines after a ``$`` prompt are commands (the
    others are what they print)."""
    joined = "\n".join(block).replace("\\\n", " ")
    for line in joined.splitlines():
        if console and not line.startswith("$ "):
            continue
        line = line.strip().removeprefix("$ ")
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|"):
                if command:
                    yield shlex.join(command)
                command = []
            else:
                command.append(word)


def inline_fedctl(text: str) -> Iterator[str]:
    """The fedctl commands of inline code (what a pipe passes them to is prose)."""
    for span in re.findall(r"`(fedctl [^`]+)`", text):
        yield from (c for c in commands([span]) if c.startswith("fedctl "))


def documented() -> Iterator[tuple[str, str]]:
    """(where, command) for every command the docs show."""
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT)
        for line, language, block in shell_blocks(text):
            for command in commands(block, console=language == "console"):
                yield f"{name}:{line}", command
        for command in inline_fedctl(text):
            yield f"{name} (inline)", command


def test_the_docs_site_builds_with_no_broken_link(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "deployment" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: a page linking to a missing page or anchor stops the build."""
    site = tmp_path / "docs"
    site.mkdir()
    (site / "index.md").write_text("# Home\n\n[gone](missing.md) and [nowhere](#no-such)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().split("\nnav:")[0] + "\n")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode != 0
    assert "missing.md" in built.stderr


@functools.cache
def fedctl_parser() -> argparse.ArgumentParser:
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def fedctl_problems(command: str) -> list[str]:
    """What fedctl would refuse in ``command`` (a command or a synopsis)."""
    words = command.split()[1:]
    parser = fedctl_parser()
    problems: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        bare = word.strip("[](){}.,")
        flag = bare.split("=")[0]
        if flag.startswith("-"):
            action = options(parser).get(flag) or options(fedctl_parser()).get(flag)
            if action is None:
                problems.append(f"{flag} is not an option of {parser.prog}")
            elif action.nargs != 0 and "=" not in bare:
                skip = True
            continue
        subs = subcommands(parser)
        alternatives = [a for a in bare.split("|") if a]
        if not subs or not alternatives:
            continue
        if all(a in subs for a in alternatives):
            if len(alternatives) == 1:
                parser = subs[alternatives[0]]
                continue
            break  # a choice of subcommands: each one's flags are not in this line
        if re.fullmatch(r"[a-z][a-z-]*", alternatives[0]) and bare == word:
            problems.append(f"{alternatives[0]!r} is not a subcommand of {parser.prog}")
        break
    return problems


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def program_problems(command: str) -> list[str] | None:
    """What is wrong with a command of one of the project's programs; None: not one of them."""
    words = shlex.split(command)
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words = words[1:]  # VAR=value in front
    if not words:
        return []
    program = Path(words[0]).name
    if program in ("export", "cd"):
        return []  # the shell's own
    if program == "fedctl":
        return fedctl_problems(command)
    if program == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        return [f"make has no target {t}" for t in words[1:] if t not in targets]
    if program in DAEMONS:
        argv: tuple[str, ...] = (sys.executable, "-m", DAEMONS[program])
        flags = words[1:]
    elif program.startswith("python") and len(words) > 1 and words[1].endswith(".py"):
        script = ROOT / words[1]
        if not script.exists():
            return [f"{words[1]} does not exist"]
        argv, flags = (sys.executable, str(script)), words[2:]
    else:
        return None
    text = help_text(argv)
    return [
        f"{flag} is not in {program} --help"
        for flag in (w.split("=")[0] for w in flags if w.startswith("--"))
        if flag not in text
    ]


def test_every_documented_command_is_one_the_project_takes() -> None:
    problems, unmarked = [], []
    checked = 0
    for where, command in documented():
        found = program_problems(command)
        if found is None:
            unmarked.append(f"{where}: {command}")
            continue
        checked += 1
        problems += [f"{where}: {command}: {p}" for p in found]
    assert checked > 50, checked
    assert not problems, "\n".join(problems)
    assert not unmarked, (
        "commands of other programs in a shell block not marked <!-- example: why -->:\n"
        + "\n".join(unmarked)
    )


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("fedctl jobs lgs ID", "'lgs' is not a subcommand"),
        ("fedctl jobs logs ID --follw", "--follw is not an option"),
        ("fedctl sites [list|cordon NAME|uncordon NAME]", ""),
        ("fedctl -o wide jobs list --state RUNNING", ""),
    ],
)
def test_the_fedctl_check_finds_what_fedctl_refuses(command: str, problem: str) -> None:
    found = fedctl_problems(command)
    assert (problem in "\n".join(found)) if problem else not found, found
