"""The tree's layers hold: the coordinator and the site agents share only what lies beneath
both (``federation.common``, the API, placement, security...), never each other's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COORDINATOR = ("federation.coordinator",)
AGENTS = ("federation.agent", "edge_agent", "datacenter_agent")


def imported(folder: Path) -> set[tuple[str, str]]:
    """(file, module) for every absolute import in the Python files under ``folder``."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add((str(path.relative_to(ROOT)), node.module))
            elif isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name) for a in node.names}
    return found


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize(
    ("folders", "forbidden"),
    [
        (["federation/coordinator"], AGENTS),
        (["federation/agent", "edge_agent", "datacenter_agent"], COORDINATOR),
    ],
)
def test_neither_side_imports_the_other(folders: list[str], forbidden: tuple[str, ...]) -> None:
    crossing = sorted(
        f"{path}: {module}"
        for folder in folders
        for path, module in imported(ROOT / folder)
        if within(module, forbidden)
    )
    assert not crossing, "\n".join(crossing)


def test_the_check_sees_imports() -> None:
    modules = {module for _, module in imported(ROOT / "federation/agent")}
    assert "federation.common.keys" in modules


SCHEDULING = ROOT / "federation" / "coordinator" / "scheduling"
MAX_SCHEDULING_MODULE_LINES = 600
MAX_SCHEDULING_FUNCTION_LINES = 80


def test_the_scheduling_parts_stay_small() -> None:
    """Each part of the scheduling cycle reads in one sitting: no module of
    ``federation.coordinator.scheduling`` over 600 lines, no function there over 80."""
    modules = sorted(SCHEDULING.glob("*.py"))
    assert modules, "the scheduling package is where this test looks"
    long_modules, long_functions = [], []
    for path in modules:
        text = path.read_text()
        if len(text.splitlines()) > MAX_SCHEDULING_MODULE_LINES:
            long_modules.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_SCHEDULING_FUNCTION_LINES:
                    long_functions.append(f"{path.name}:{node.name} ({length} lines)")
    assert long_modules == []
    assert long_functions == []
