"""``fed-datacenter-agent``: a site agent for datacenter and cloud sites."""

from __future__ import annotations

from federation.agent.main import run_agent


def main(argv: list[str] | None = None) -> None:
    run_agent(argv, prog="fed-datacenter-agent", domain="datacenter")


if __name__ == "__main__":
    main()
