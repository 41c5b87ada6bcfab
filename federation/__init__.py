"""A federated control plane for heterogeneous compute across edge, datacenter and cloud sites."""

from __future__ import annotations

__version__ = "0.1.0"
"""The one place the version is written: pyproject.toml reads it (``dynamic``), and fedctl
``--version``, the coordinator and the agents report it."""
