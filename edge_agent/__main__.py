"""``fed-edge-agent``: a site agent with edge defaults."""

from __future__ import annotations

from federation.agent.main import run_agent


def main(argv: list[str] | None = None) -> None:
    run_agent(argv, prog="fed-edge-agent", domain="edge")


if __name__ == "__main__":
    main()
