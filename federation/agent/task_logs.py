"""Reading a replica's log, as its supervisor writes it (``supervisor.LogWriter``).

Each line of the files ``log.1`` (older) and ``log`` is ``STAMP TEXT``: STAMP in nanoseconds,
strictly increasing, so ``after_ns`` (the last stamp a reader got) says where to go on from,
across a rotation too.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from federation.api.v1 import jobs_pb2
from federation.api.v1 import site_link_service_pb2 as pb

LOG_FILE = "log"
LOG_BYTES = 8 << 20
"""A replica's log is rotated past this: at most twice it is kept per replica."""
ANSWER_BYTES = 1 << 20
"""About the most text one answer carries."""


def read_log(run_dir: Path, request: pb.ReadLogs) -> pb.LogsAnswer:
    """The lines ``request`` asks for from the replica whose supervisor files are in
    ``run_dir``: after ``after_ns``, from ``since_ns``, the last ``tail_lines`` of them."""
    files = [run_dir / f"{LOG_FILE}.1", run_dir / LOG_FILE]
    if not any(path.exists() for path in files):
        return pb.LogsAnswer(error="this site keeps no log of that run")
    low = max(request.after_ns + 1, request.since_ns)
    wanted: deque[tuple[int, bytes]] = deque(
        maxlen=request.tail_lines if request.tail_lines and not request.after_ns else None
    )
    for path in files:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue  # rotated away meanwhile: its lines are in the next file or gone
        for record in data.splitlines():
            stamp, _, text = record.partition(b" ")
            if stamp.isdigit() and int(stamp) >= low:
                wanted.append((int(stamp), text))
    answer = pb.LogsAnswer()
    size = 0
    for stamp_ns, text in wanted:
        if size + len(text) > ANSWER_BYTES and answer.lines:
            answer.more = True
            break
        line = jobs_pb2.LogLine(stamp_ns=stamp_ns, text=text.decode(errors="replace"))
        answer.lines.append(line)
        size += len(text) + 16
    return answer
