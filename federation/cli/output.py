"""How every fedctl command prints: ``-o table|wide|json|yaml``, whole tables when piped, and
a quiet end when the reader of a pipe goes away.

kubectl's habit: ``-o`` picks tables for people (``wide`` adds the columns a command has
beyond its usual ones; elsewhere it is ``table``) or data for scripts. ``--json`` is ``-o
json``, kept for the scripts that use it. Both are accepted before a subcommand and after it
(``fedctl --json status``, ``fedctl jobs list -o yaml``), because ``add_to_every_command``
gives every parser in the tree the same two options.

On a terminal, tables fit its width. Piped or redirected, they print whole at their natural
width however wide (nothing cut with "…" or wrapped), so scripts and grep see every name in
full.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from rich.console import RenderableType

from federation.cli.connection import CliError
from federation.cli.render import console, print_whole

FORMATS = ("table", "wide", "json", "yaml")
"""What ``-o`` takes: two for people, two for scripts."""


def add_output_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Give ``parser`` ``-o/--output`` and ``--json``.

    Only the top-level parser (``top``) sets defaults. argparse copies every attribute a
    subcommand's parser sets over what the parsers above it set, so a default there would
    undo an earlier ``fedctl --json status``; below the top, an option not given sets nothing.
    """
    parser.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default=None if top else argparse.SUPPRESS,
        help="table (default), wide (more columns where a command has them), json or yaml",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="the same as -o json",
    )


def add_to_every_command(
    parser: argparse.ArgumentParser,
    *adders: Callable[[argparse.ArgumentParser, bool], None],
) -> None:
    """``-o`` and ``--json`` (and what each of ``adders`` adds, called with ``top``) on
    ``parser`` and on every subcommand below it, however deep."""
    for add in (_add_output, *adders):
        add(parser, True)
    seen = {id(parser)}
    pending = list(_subcommands(parser))
    while pending:
        sub = pending.pop()
        if id(sub) in seen:  # an alias names the same parser twice
            continue
        seen.add(id(sub))
        for add in (_add_output, *adders):
            add(sub, False)
        pending.extend(_subcommands(sub))


def _add_output(parser: argparse.ArgumentParser, top: bool) -> None:
    add_output_options(parser, top=top)


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


@dataclass(frozen=True, slots=True)
class Output:
    """One command's output format, and the two ways of printing: data, or views for people."""

    format: str = "table"
    """One of ``FORMATS``."""

    @property
    def is_data(self) -> bool:
        """JSON or YAML for scripts, rather than tables for people."""
        return self.format in ("json", "yaml")

    @property
    def is_wide(self) -> bool:
        """Tables with the extra columns a command has."""
        return self.format == "wide"

    def data(self, doc: object, *, stream: bool = False) -> None:
        """Print plain data (dicts, lists, strings, numbers, None) as JSON or YAML.

        Args:
            doc: What to print.
            stream: One of many documents (``jobs watch``): YAML marks each start with ``---``.
        """
        if self.format == "yaml":
            # ASCII only, as JSON: a control character or bidi override a tenant chose stays
            # an escape in double quotes, never raw bytes on a terminal.
            yaml.safe_dump(doc, sys.stdout, sort_keys=True, explicit_start=stream)
            return
        # One write: json.dump writes each token apart, ten million writes for a large site list.
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")

    def messages(self, messages: Message | Sequence[Message], *, stream: bool = False) -> None:
        """Print API messages as data, with the field names of the ``.proto`` files."""
        self.data(message_data(messages), stream=stream)


def message_data(messages: Message | Sequence[Message]) -> object:
    """A message (or a list of them) as plain data, as the JSON mapping of protobuf has it,
    except that fields at their zero value are printed too (a script reads ``"retries": 0``
    rather than guessing from an absent key) and 64-bit integers are numbers, not strings."""

    def as_dict(m: Message) -> object:
        data = json_format.MessageToDict(
            m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        return _with_numbers(data, cast(Descriptor, m.DESCRIPTOR))

    if isinstance(messages, Sequence):
        return [as_dict(m) for m in messages]
    return as_dict(messages)


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _with_numbers(data: dict[str, object], descriptor: Descriptor) -> dict[str, object]:
    """``data`` (one message's JSON mapping) with its 64-bit integers as ints, at any depth."""
    for name, value in data.items():
        field = descriptor.fields_by_name.get(name)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            data[name] = {k: _field_value(v, entry) for k, v in value.items()}  # type: ignore[attr-defined]
        elif isinstance(value, list):
            data[name] = [_field_value(v, field) for v in value]
        else:
            data[name] = _field_value(value, field)
    return data


def _field_value(value: object, field: FieldDescriptor) -> object:
    if field.type in _INT64 and isinstance(value, str):
        return int(value)
    if field.message_type is not None and isinstance(value, dict):
        if field.message_type.full_name.startswith("google.protobuf."):
            return value  # well-known types have JSON forms of their own (timestamps)
        return _with_numbers(value, field.message_type)
    return value


def output_of(args: argparse.Namespace) -> Output:
    """The output the command line asked for; ``--json`` is ``-o json``.

    Reads what is there, so a command called from code with a bare ``Namespace`` prints
    tables.

    Raises:
        CliError: ``--json`` and ``-o`` name different formats.
    """
    chosen = getattr(args, "output", None)
    if getattr(args, "json", False):
        if chosen not in (None, "json"):
            raise CliError(f"--json and -o {chosen} ask for different output. To fix: give one")
        return Output("json")
    return Output(chosen or "table")


def show(*renderables: RenderableType) -> None:
    """Print tables and lines for people: fitted to a terminal, whole when piped."""
    if _is_terminal():
        for renderable in renderables:
            console.print(renderable)
    else:
        print_whole(console, renderables)


def _is_terminal() -> bool:
    # The file itself, not rich's is_terminal: FORCE_COLOR (set in many CI systems) makes
    # rich treat a pipe as a terminal, and then cut tables to 80 columns.
    isatty = getattr(console.file, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def quiet_on_closed_pipe() -> Iterator[None]:
    """End with status 0 and no traceback when stdout's reader goes away (``| head -1``).

    Python ignores SIGPIPE, so writing to a pipe nobody reads raises ``BrokenPipeError``
    where it happens, often only at the last flush. The reader chose to stop; fedctl did
    nothing wrong, so it ends quietly with status 0 (not 1, nor 141 as a process killed by
    SIGPIPE: a ``set -o pipefail`` script that reads one line goes on). stdout then points
    at /dev/null, or the interpreter's own last flush would fail and print a warning.
    """
    try:
        try:
            yield
        finally:
            sys.stdout.flush()  # meet a closed pipe here, not at interpreter exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise SystemExit(0) from None
