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


@pytest.mark.parametrize(
    ("folder", "above"),
    [
        ("federation/cli", ("datacenter_agent", "edge_agent", "federation.agent")),
        ("federation/security", ("federation.store",)),
        ("federation/testing", ("federation.cli",)),
    ],
)
def test_no_upward_import(folder: str, above: tuple[str, ...]) -> None:
    """Nothing imports what is built on it: the CLI from the agents, the store from
    security, the test harness from the CLI."""
    crossing = sorted(
        f"{path}: {module}" for path, module in imported(ROOT / folder) if within(module, above)
    )
    assert not crossing, "\n".join(crossing)


def module_graph(files: dict[str, str], *, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the tree's modules it imports at module level (imports inside functions and
    ``if TYPE_CHECKING:`` blocks run later or never, so they close no cycle at import time);
    with ``typing``, those of ``if TYPE_CHECKING:`` blocks too."""
    graph: dict[str, set[str]] = {}
    for name, source in files.items():
        edges: set[str] = set()
        body = list(ast.parse(source).body)
        if typing:
            body += [
                inner
                for node in body
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for inner in node.body
            ]
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    whole = f"{node.module}.{alias.name}"
                    edges.add(whole if whole in files else node.module)
            elif isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
        graph[name] = {m for m in edges if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            part = [stack.pop()]
            while part[-1] != module:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def tree_sources() -> dict[str, str]:
    files = {}
    for package in ("federation", "edge_agent", "datacenter_agent"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path.read_text()
    return files


def test_the_local_federation_does_not_import_the_cli() -> None:
    """``federation.local`` is the library ``fedctl demo`` and the tests start federations
    with; the CLI imports it, never the other way."""
    source = (ROOT / "federation" / "local.py").read_text()
    modules = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in modules if within(m, ("federation.cli",))}


def test_no_module_level_import_cycle() -> None:
    assert cycles(module_graph(tree_sources())) == []


def test_no_import_cycle_even_for_the_type_checker() -> None:
    """Not even type-only imports run back: a module that needs another's types only to
    annotate sits beneath it, or the types move beneath both."""
    assert cycles(module_graph(tree_sources(), typing=True)) == []


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    planted = {
        "pkg.a": "from pkg.b import x\n",
        "pkg.b": "import pkg.c\n",
        "pkg.c": "from pkg import a\n",
        "pkg": "",
        "pkg.d": "def later() -> None:\n    from pkg.a import y\n",
    }
    assert cycles(module_graph(planted)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_check_sees_imports() -> None:
    modules = {module for _, module in imported(ROOT / "federation/agent")}
    assert "federation.common.keys" in modules


SCHEDULING = ROOT / "federation" / "coordinator" / "scheduling"
MAX_SCHEDULING_MODULE_LINES = 600
MAX_SCHEDULING_FUNCTION_LINES = 80


def too_long(paths: list[Path], max_module: int, max_function: int) -> tuple[list[str], list[str]]:
    """The modules of ``paths`` over ``max_module`` lines, and their functions over
    ``max_function``."""
    long_modules, long_functions = [], []
    for path in paths:
        text = path.read_text()
        if len(text.splitlines()) > max_module:
            long_modules.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > max_function:
                    long_functions.append(f"{path.name}:{node.name} ({length} lines)")
    return long_modules, long_functions


def longer_than(folder: Path, max_lines: int) -> list[str]:
    """The modules anywhere under ``folder`` over ``max_lines`` lines."""
    return sorted(
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for path in folder.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > max_lines
    )


def test_the_scheduling_parts_stay_small() -> None:
    """Each part of the scheduling cycle reads in one sitting: no module of
    ``federation.coordinator.scheduling`` over 600 lines, no function there over 80."""
    modules = sorted(SCHEDULING.glob("*.py"))
    assert modules, "the scheduling package is where this test looks"
    too = too_long(modules, MAX_SCHEDULING_MODULE_LINES, MAX_SCHEDULING_FUNCTION_LINES)
    assert too == ([], [])


MAX_COORDINATOR_MODULE_LINES = 800


def test_no_coordinator_module_is_too_long_to_read() -> None:
    """No module anywhere under ``federation/coordinator`` is over 800 lines: a concern that
    outgrows that is split into a package of its own, as the scheduling cycle was."""
    coordinator = ROOT / "federation" / "coordinator"
    assert longer_than(coordinator, MAX_COORDINATOR_MODULE_LINES) == []


EMBEDDED_CORE = [
    ROOT / "federation" / "agent" / "embedded_core.py",
    *sorted((ROOT / "federation" / "agent" / "embedded").glob("*.py")),
]
MAX_EMBEDDED_CORE_MODULE_LINES = 600
MAX_EMBEDDED_CORE_FUNCTION_LINES = 80


def test_the_embedded_core_parts_stay_small() -> None:
    """The embedded core and each of its parts read in one sitting: no module of
    ``federation.agent.embedded`` (nor ``embedded_core`` itself) over 600 lines, no function
    there over 80."""
    assert len(EMBEDDED_CORE) > 1, "the embedded package is where this test looks"
    too = too_long(EMBEDDED_CORE, MAX_EMBEDDED_CORE_MODULE_LINES, MAX_EMBEDDED_CORE_FUNCTION_LINES)
    assert too == ([], [])


MAX_AGENT_MODULE_LINES = 800


def test_no_agent_module_is_too_long_to_read() -> None:
    """No module anywhere under ``federation/agent`` is over 800 lines: a concern that
    outgrows that is split into parts of its own, as the embedded core was."""
    assert longer_than(ROOT / "federation" / "agent", MAX_AGENT_MODULE_LINES) == []


def assigned(node: ast.stmt) -> list[str]:
    """The names a top-level statement defines."""
    if isinstance(node, ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def test_task_key_is_defined_once() -> None:
    """One ``TaskKey`` (``federation.common.keys``): every module that speaks of a task by
    (job id, task) imports it rather than defining its own."""
    defined = sorted(
        f"{name}:{node.lineno}"
        for name, source in tree_sources().items()
        for node in ast.parse(source).body
        if "TaskKey" in assigned(node)
    )
    assert defined == ["federation.common.keys:5"]
