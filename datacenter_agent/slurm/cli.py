"""Running Slurm's commands without blocking, and reading what they print.

Every command runs as a child process through asyncio, bounded by a timeout; a command that
fails raises ``SlurmError`` carrying Slurm's own message, so callers pass it on instead of
guessing. The parsers read the one-record-per-line ``key=value`` output of ``scontrol ... -o``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import structlog

from federation.agent.config import SlurmSettings
from federation.agent.embedded.launching import INHERITED_ENV

log = structlog.get_logger()

# A key starts a field when it follows whitespace (or the line start) and is followed by '='.
# Keys are CamelCase words, some with '/', ':' or '_' (e.g. "AllocNode:Sid", "CPUs/Task").
_FIELD_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/.]*)=")
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_UNSET = frozenset({"", "(null)", "N/A", "n/a", "None", "Unknown", "NONE"})
_MAX_MESSAGE_CHARS = 2000


class SlurmError(Exception):
    """A Slurm command failed; ``message`` is what Slurm said (its stderr, else stdout)."""

    def __init__(self, command: str, message: str, returncode: int | None = None) -> None:
        self.command = command
        self.message = message
        self.returncode = returncode
        super().__init__(f"{command}: {message}")


@dataclass(frozen=True, slots=True)
class Output:
    """What a successful command printed."""

    stdout: str
    stderr: str


@dataclass(frozen=True, slots=True)
class SlurmCli:
    """Runs Slurm client commands with a fixed environment and a timeout.

    Args:
        env: The complete environment of every command (PATH, SLURM_CONF, ...).
        timeout_s: A command still running after this is killed and raises ``SlurmError``.
    """

    env: Mapping[str, str]
    timeout_s: float = 4.0

    async def run(self, *argv: str, timeout_s: float | None = None) -> Output:
        """Runs ``argv`` and returns its output.

        Raises:
            SlurmError: The program is missing, timed out or exited non-zero.
        """
        name = " ".join(argv[:3])
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=dict(self.env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError:
            raise SlurmError(
                name, f"{argv[0]} not found on PATH; is slurm-client installed?"
            ) from None
        except OSError as exc:
            raise SlurmError(name, f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
        try:
            async with asyncio.timeout(limit):
                out, err = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise SlurmError(name, f"no answer within {limit:g}s") from None
        stdout = out.decode("utf-8", errors="replace")
        stderr = err.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            message = _message(stderr) or _message(stdout) or f"exited with {proc.returncode}"
            raise SlurmError(name, message, proc.returncode)
        return Output(stdout, stderr)


def slurm_env(settings: SlurmSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of every Slurm command, and so of every job (sbatch --export=ALL).

    Only the basics of the agent's environment pass (it may hold the agent's secrets), never
    its ``SBATCH_*``/``SLURM_*`` variables, which would change what sbatch does; SLURM_CONF
    comes from the settings, else from the agent's environment.
    """
    env = {k: v for k, v in environ.items() if k in INHERITED_ENV}
    conf = str(settings.conf) if settings.conf else environ.get("SLURM_CONF", "")
    if conf:
        env["SLURM_CONF"] = conf
    return env


def _message(text: str) -> str:
    """Slurm's complaint on one line: its non-empty lines joined, bounded in length."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines)[-_MAX_MESSAGE_CHARS:]


# Parsing ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One ``scontrol show ... -o`` line: its fields in order, repeated keys included."""

    pairs: tuple[tuple[str, str], ...]

    def get(self, key: str, default: str = "") -> str:
        """The first value of ``key``; ``default`` when absent."""
        return next((v for k, v in self.pairs if k == key), default)

    def value(self, key: str) -> str:
        """The first value of ``key``, with Slurm's placeholders ("(null)", "N/A") as ""."""
        raw = self.get(key)
        return "" if raw in _UNSET else raw


def parse_fields(line: str) -> tuple[tuple[str, str], ...]:
    """Splits one ``Key=value Key2=value with spaces`` line into pairs.

    A value runs until the next ``Key=`` that follows whitespace, so values with spaces (a
    node's drain reason, say) survive; values are stripped.
    """
    matches = list(_FIELD_RE.finditer(line))
    pairs = []
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        pairs.append((match.group(1), line[match.end() : end].strip()))
    return tuple(pairs)


def parse_records(text: str) -> list[Record]:
    """Every non-empty line of ``scontrol show node|job|partition -o`` output as a record."""
    records = []
    for line in text.splitlines():
        pairs = parse_fields(line.strip())
        if pairs:
            records.append(Record(pairs))
    return records


def parse_index_list(text: str) -> list[int]:
    """``"0-2,5"`` → ``[0, 1, 2, 5]``; placeholders such as ``"N/A"`` give ``[]``."""
    indices: list[int] = []
    for part in text.split(","):
        match = _RANGE_RE.match(part.strip())
        if match:
            first = int(match.group(1))
            last = int(match.group(2) or first)
            indices.extend(range(first, last + 1))
    return indices


def expand_hostlist(expression: str) -> list[str]:
    """Expands a Slurm host list such as ``"gpu[01-03,7],login1"`` into names.

    Zero padding is kept (``01-03`` gives ``01``, ``02``, ``03``); one bracket group per name.
    """
    names: list[str] = []
    for item in split_outside(expression):
        if "[" not in item:
            if item and item not in _UNSET:
                names.append(item)
            continue
        prefix, _, rest = item.partition("[")
        ranges, _, suffix = rest.partition("]")
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{number:0{width}d}{suffix}")
    return names


def split_outside(text: str, brackets: str = "[]") -> list[str]:
    """Splits on commas outside ``brackets`` (``"[]"`` or ``"()"``); items are stripped."""
    opening, closing = brackets[0], brackets[1]
    items: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_time(value: str) -> float | None:
    """Slurm's local ``2026-01-31T12:00:00`` as a Unix time; None for "Unknown", "N/A"..."""
    if value in _UNSET:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def parse_duration_s(value: str) -> float | None:
    """A Slurm time limit (``"5"``, ``"01:00:00"``, ``"2-00:00:00"``) in seconds.

    Returns:
        Seconds; ``math.inf`` for ``UNLIMITED``/``INFINITE``; None when unset or unreadable.
    """
    if value in ("UNLIMITED", "INFINITE", "Partition_Limit"):
        return math.inf
    if value in _UNSET:
        return None
    days, _, clock = value.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        day_s = int(days) * 86400 if days else 0
    except ValueError:
        return None
    if len(parts) == 1:
        return day_s + parts[0] * 60.0  # bare minutes
    while len(parts) < 3:
        parts.insert(0, 0)
    hours, minutes, seconds = parts[-3:]
    return float(day_s + hours * 3600 + minutes * 60 + seconds)


def parse_exit_code(value: str) -> int:
    """``"3:0"`` → 3; ``"0:15"`` (killed by signal 15) → -15, as ``returncode`` has it."""
    code, _, signal = value.partition(":")
    try:
        signum = int(signal or 0)
        return -signum if signum else int(code or 0)
    except ValueError:
        return 0
