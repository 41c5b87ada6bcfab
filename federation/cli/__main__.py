"""``python -m federation.cli`` is ``fedctl``."""

from __future__ import annotations

from federation.cli.app import main

main()
