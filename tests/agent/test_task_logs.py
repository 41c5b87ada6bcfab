"""A replica's log as the supervisor writes it and the agent reads it: each line stamped in
order, long lines in pieces, rotated at a size, and read from where a reader left off."""

from __future__ import annotations

from pathlib import Path

from federation.agent.supervisor import LOG_LINE_BYTES, LogWriter
from federation.agent.task_logs import read_log
from federation.api.v1 import site_link_service_pb2 as pb


def texts(answer: pb.LogsAnswer) -> list[str]:
    return [line.text for line in answer.lines]


def test_lines_come_stamped_in_order_with_partial_and_long_lines(tmp_path: Path) -> None:
    writer = LogWriter(str(tmp_path / "log"), 1 << 20)
    writer.write(b"one\ntw")
    writer.write(b"o\nthree")  # "three" waits for its newline
    assert texts(read_log(tmp_path, pb.ReadLogs())) == ["one", "two"]
    writer.write(b"x" * (LOG_LINE_BYTES + 10) + b"\n")
    writer.close()  # the unfinished line is logged as it is
    answer = read_log(tmp_path, pb.ReadLogs())
    assert texts(answer)[:2] == ["one", "two"]
    assert texts(answer)[2] == "three" + "x" * (LOG_LINE_BYTES - 5)
    assert texts(answer)[3:] == ["x" * 15]
    stamps = [line.stamp_ns for line in answer.lines]
    assert stamps == sorted(set(stamps))


def test_a_reader_goes_on_after_the_last_line_across_a_rotation(tmp_path: Path) -> None:
    writer = LogWriter(str(tmp_path / "log"), 200)  # three lines a file
    for i in range(5):
        writer.write(f"line {i:02d} ........................\n".encode())
    first = read_log(tmp_path, pb.ReadLogs(tail_lines=2))
    assert texts(first) == ["line 03 ........................", "line 04 ........................"]
    for i in range(5, 8):
        writer.write(f"line {i:02d} ........................\n".encode())
    writer.close()
    assert (tmp_path / "log.1").exists()
    after = read_log(tmp_path, pb.ReadLogs(after_ns=first.lines[-1].stamp_ns))
    assert [t[:7] for t in texts(after)] == ["line 05", "line 06", "line 07"]
    # Past twice the limit, the oldest lines are gone, not the newest.
    kept = texts(read_log(tmp_path, pb.ReadLogs()))
    assert kept[-1].startswith("line 07")
    assert not kept[0].startswith("line 00")


def test_since_and_a_run_without_a_log(tmp_path: Path) -> None:
    writer = LogWriter(str(tmp_path / "log"), 1 << 30)
    for i in range(3):
        writer.write(f"{i}\n".encode())
    writer.close()
    lines = read_log(tmp_path, pb.ReadLogs()).lines
    since = read_log(tmp_path, pb.ReadLogs(since_ns=lines[1].stamp_ns))
    assert texts(since) == ["1", "2"]
    assert read_log(tmp_path / "nowhere", pb.ReadLogs()).error


def test_an_answer_is_cut_at_its_size_and_says_more(tmp_path: Path) -> None:
    writer = LogWriter(str(tmp_path / "log"), 1 << 30)
    chunk = b"y" * 1000 + b"\n"
    writer.write(chunk * 2000)  # about 2 MB
    writer.close()
    first = read_log(tmp_path, pb.ReadLogs())
    assert first.more
    assert 900 < len(first.lines) < 1100
    rest = read_log(tmp_path, pb.ReadLogs(after_ns=first.lines[-1].stamp_ns))
    assert not rest.more
    assert len(first.lines) + len(rest.lines) == 2000
