"""Which local account runs a tenant's tasks, and their private work folders.

Tasks of different tenants run as different accounts, so the kernel keeps them apart: one
tenant's task cannot read another's files or ``/proc/<pid>/environ``, nor signal its processes,
and none can read the agent's state (its key among it), which is private to the agent. An
account is a configured one (``task_accounts``), or a uid allocated to the tenant from
``task_uid_range`` and kept in the state folder, or the one shared ``task_user``. Running
tasks as the agent's own account (``run_tasks_as_agent``) is for development only: they can
then read the site key.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from federation.config import ConfigError

log = structlog.get_logger()

UIDS_FILE = "task_uids.json"
MIN_ALLOCATED_UID = 1000
"""Below are system accounts; an allocated uid never is one of them."""
MAX_ALLOCATED_UID = 2**31 - 2


@dataclass(frozen=True, slots=True)
class Account:
    """A uid and gid to run tasks as; ``home`` is empty for an allocated uid."""

    name: str
    uid: int
    gid: int
    home: str = ""


class NoAccountError(Exception):
    """The site has no account for this tenant's tasks."""


def _named(name: str, setting: str) -> Account:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"{setting}: no such account {name!r} on this machine") from None
    if entry.pw_uid == 0:
        raise ConfigError(
            f"{setting}: {name!r} is root; tasks never run as root through an account "
            "(run_tasks_as_agent on a root agent is the explicit way)"
        )
    return Account(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def parse_uid_range(text: str, setting: str = "task_uid_range") -> tuple[int, int]:
    """``"200000-299999"`` → (200000, 299999); ConfigError when it is not such a range."""
    first, sep, last = text.partition("-")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ConfigError(f"{setting}: {text!r} is not a range such as '200000-299999'")
    low, high = int(first), int(last)
    if not MIN_ALLOCATED_UID <= low <= high <= MAX_ALLOCATED_UID:
        raise ConfigError(
            f"{setting}: {text!r} must lie within {MIN_ALLOCATED_UID}-{MAX_ALLOCATED_UID}, "
            "first ≤ last"
        )
    return low, high


class TaskAccounts:
    """The account for each tenant's tasks at this site.

    Args:
        accounts: Tenant → local account name.
        uid_range: Uids to allocate, one per tenant not in ``accounts``; None allocates none.
        shared_user: The account for every other tenant ("" for none): they share it.
        as_agent: Without any of these, run tasks as the agent's own account.
        state_dir: Where allocated uids are kept across restarts.
    """

    def __init__(
        self,
        *,
        accounts: Mapping[str, str],
        uid_range: tuple[int, int] | None,
        shared_user: str,
        as_agent: bool,
        state_dir: Path,
    ) -> None:
        self._named = {t: _named(n, f"task_accounts.{t}") for t, n in accounts.items()}
        self._range = uid_range
        self._shared = _named(shared_user, "task_user") if shared_user else None
        self._as_agent = as_agent
        self._uids_file = state_dir / UIDS_FILE
        self._allocated: dict[str, int] = self._load()

    @property
    def switches(self) -> bool:
        """Whether tasks may run as accounts other than the agent's."""
        return bool(self._named or self._range or self._shared)

    def for_tenant(self, tenant: str) -> Account | None:
        """The tenant's account; None runs the task as the agent itself.

        Raises:
            NoAccountError: No account applies, or the uid range is used up.
        """
        if tenant in self._named:
            return self._named[tenant]
        if self._range is not None:
            uid = self._allocated.get(tenant) or self._allocate(tenant)
            return Account(str(uid), uid, uid)
        if self._shared is not None:
            return self._shared
        if self._as_agent:
            return None
        raise NoAccountError(f"this site has no account for tenant {tenant!r}'s tasks")

    def _load(self) -> dict[str, int]:
        try:
            data = json.loads(self._uids_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self._uids_file}: cannot read allocated uids: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(v, int) for v in data.values()):
            raise ConfigError(f"{self._uids_file}: not a map of tenant to uid")
        return data

    def _allocate(self, tenant: str) -> int:
        assert self._range is not None
        low, high = self._range
        taken = set(self._allocated.values())
        for uid in range(low, high + 1):
            if uid in taken or _has_passwd_entry(uid):
                continue
            self._allocated[tenant] = uid
            self._save()
            log.info("task_uid_allocated", tenant=tenant, uid=uid)
            return uid
        raise NoAccountError(
            f"task_uid_range {low}-{high} is used up: no uid left for tenant {tenant!r}"
        )

    def _save(self) -> None:
        tmp = self._uids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._allocated, indent=1, sort_keys=True))
        tmp.chmod(0o600)
        tmp.replace(self._uids_file)  # whole or not at all: a uid must never change owner


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def task_accounts(
    *,
    accounts: Mapping[str, str],
    uid_range: str,
    shared_user: str,
    as_agent: bool,
    state_dir: Path,
    work_dir: Path,
) -> TaskAccounts:
    """The site's accounts from its settings, checked against what this agent can do.

    Raises:
        ConfigError: No way to run tasks was chosen; accounts that need root without root;
            root tasks not asked for; a work folder the accounts could not reach.
    """
    chosen = TaskAccounts(
        accounts=accounts,
        uid_range=parse_uid_range(uid_range) if uid_range else None,
        shared_user=shared_user,
        as_agent=as_agent,
        state_dir=state_dir,
    )
    if chosen.switches:
        if sys.platform != "linux" or os.geteuid() != 0:
            raise ConfigError(
                "task_accounts, task_uid_range and task_user need an agent running as root on "
                "Linux (it switches to them). To fix: run the agent as root, or set "
                "run_tasks_as_agent = true instead (development only)"
            )
        if work_dir.resolve().is_relative_to(state_dir.resolve()):
            raise ConfigError(
                f"work_dir {work_dir} lies in state_dir, which is private to the agent, so task "
                "accounts could not reach it. To fix: set work_dir outside state_dir, e.g. "
                "/var/lib/fed-agent/work"
            )
    elif not as_agent:
        raise ConfigError(
            "tasks need an account: set task_uid_range (a uid per tenant, e.g. "
            '"200000-299999"), task_accounts (tenant = "account") or task_user (one account '
            "for all), or run_tasks_as_agent = true (development only: tasks can then read "
            "the site key)"
        )
    elif os.geteuid() == 0:
        log.warning("tasks_run_as_root", why="run_tasks_as_agent on an agent running as root")
    return chosen


def private_folder(path: Path, account: Account | None) -> None:
    """Create ``path`` (its parent must exist) as a folder only ``account`` may enter.

    The parent is the agent's, so a task cannot have put a link where the folder goes; a
    folder already there (a retried start) is taken only if it is a real folder.
    Blocking: run it in a thread.
    """
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not stat.S_ISDIR(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a folder") from None
    if account is not None:
        os.chown(path, account.uid, account.gid, follow_symlinks=False)
    path.chmod(0o700)


def agent_folder(path: Path) -> None:
    """Create ``path`` (and what is missing above it) as the agent's: others may pass
    through to the folders they own, not list it. Blocking: run it in a thread."""
    for folder in reversed([p for p in (path, *path.parents) if not p.exists()]):
        folder.mkdir(mode=0o711, exist_ok=True)
        folder.chmod(0o711)  # the agent's umask is 077
    if stat.S_IMODE(path.stat().st_mode) != 0o711:
        path.chmod(0o711)
