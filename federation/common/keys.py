"""The keys both sides name work by."""

from __future__ import annotations

TaskKey = tuple[str, str]
"""(job id, task name): one task of a job, wherever and however often it runs."""
RunKey = tuple[str, str, int]
"""(job id, task name, epoch): one run of a task at a site, as its delegation names it."""
DATASET = "dataset:"
"""How an input names a dataset its job's tenant registered (``dataset:NAME``)."""
