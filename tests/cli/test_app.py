"""fedctl's command line: where to connect may be given before or after the subcommand."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.cli.app import build_parser


@pytest.mark.parametrize(
    "argv",
    [
        ["pki", "rotate-ca", "--pki-dir", "p"],  # as the README's CA rollover has it
        ["--pki-dir", "p", "pki", "rotate-ca"],
        ["pki", "--pki-dir", "p", "rotate-ca"],
    ],
)
def test_connection_options_go_anywhere(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.pki_dir == Path("p")
    assert args.coordinator is None


def test_a_subcommand_does_not_undo_an_option_given_before_it() -> None:
    args = build_parser().parse_args(["--coordinator", "c:7070", "--key", "k", "jobs", "list"])
    assert (args.coordinator, args.key, args.cert) == ("c:7070", Path("k"), None)
