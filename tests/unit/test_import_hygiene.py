"""Import rules of the layout: each checked in a fresh interpreter by inspecting sys.modules."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import swarm_core

REPO = Path(__file__).resolve().parents[2]


def loaded_modules(*imports: str) -> set[str]:
    code = "import json, sys\n" + "".join(f"import {m}\n" for m in imports) + \
        "print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    return set(json.loads(out.stdout))


def _roots(mods: set[str]) -> set[str]:
    return {m.split(".", 1)[0] for m in mods}


def test_leader_imports_no_torch():
    mods = loaded_modules("swarm_core.leader", "swarm_core.leader.app",
                          "swarm_core.leader.routes", "swarm_core.leader.openapi")
    assert "swarm_core.leader.app" in mods
    assert "torch" not in _roots(mods)
    assert "numpy" not in _roots(mods)


def test_swarm_core_imports_no_textual():
    names = [m.name for m in pkgutil.walk_packages(swarm_core.__path__, "swarm_core.")]
    assert "swarm_core.fellow.daemon" in names
    mods = loaded_modules(*names)
    assert "textual" not in _roots(mods)


def test_commands_import_no_textual():
    mods = loaded_modules("swarm_tui.cli", "swarm_tui.commands")
    assert "swarm_tui.commands.jobs" in mods
    assert "textual" not in _roots(mods)


def test_headless_commands_import_no_torch_or_numpy():
    """Every ``swarm`` call (scripts poll with it) pays its imports: torch alone is ~2.5 s.
    The commands that train or read weights import it when they run, not at start."""
    mods = loaded_modules("swarm_tui.cli", "swarm_tui.commands")
    assert "swarm_core.artifacts.fetch" in mods
    assert {"torch", "numpy"} & _roots(mods) == set()


def test_nothing_outside_the_leader_reaches_into_it():
    """Outside swarm_core.leader only the package's exported names may be imported."""
    offenders = []
    for path in [*REPO.glob("swarm_core/**/*.py"), *REPO.glob("swarm_tui/**/*.py"),
                 *REPO.glob("bench/*.py"), *REPO.glob("exp/**/*.py")]:
        if "swarm_core/leader" in path.as_posix():
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("swarm_core.leader."):
                offenders.append(f"{path.relative_to(REPO)}: from {node.module}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.relative_to(REPO)}: import {a.name}" for a in node.names
                              if a.name.startswith("swarm_core.leader.")]
    assert offenders == []


def test_the_leader_imports_nothing_of_the_training_engine():
    """The placement planner and the job contract are torch-free and live beside each other;
    the leader takes them from there, never from swarm_core.pipeline."""
    mods = loaded_modules("swarm_core.leader", "swarm_core.leader.app",
                          "swarm_core.leader.routes", "swarm_core.leader.openapi")
    assert "swarm_core.contract.placement" in mods
    assert not [m for m in mods if m.startswith(("swarm_core.pipeline", "swarm_core.fellow"))]


def test_headless_commands_import_nothing_of_the_console():
    mods = loaded_modules("swarm_tui.cli", "swarm_tui.commands")
    assert not [m for m in mods if m.startswith("swarm_tui.app")]
    assert not [imp for imp in _imports(REPO / "swarm_tui" / "commands")
                if imp[1].startswith("swarm_tui.app")]


# What may start daemons, and so use swarm_core.leader at all (its exports only).
LEADER_USERS = {"swarm_tui/commands/daemons.py", "swarm_core/local_cluster.py"}


def test_only_what_starts_daemons_touches_the_leader_package():
    users = {where for where, module in _imports(REPO / "swarm_core", REPO / "swarm_tui")
             if module.split(".")[:2] == ["swarm_core", "leader"]
             and not where.startswith("swarm_core/leader/")}
    assert users <= LEADER_USERS, users - LEADER_USERS


def test_no_import_cycle_crosses_folders():
    """Modules of one folder may need each other; folders form no cycle among themselves at
    the level of their modules (function-level imports included)."""
    graph: dict[str, set[str]] = {}
    paths = {_module_name(p): p for root in ("swarm_core", "swarm_tui")
             for p in (REPO / root).rglob("*.py")}
    for where, module in _imports(REPO / "swarm_core", REPO / "swarm_tui"):
        src = _module_name(REPO / where)
        while module and module not in paths:
            module = module.rpartition(".")[0]
        if module and module != src:
            graph.setdefault(src, set()).add(module)
    crossing = []
    for cycle in _cycles(graph):
        folders = {paths[m].parent for m in cycle}
        if len(folders) > 1:
            crossing.append(sorted(cycle))
    assert crossing == []


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports(*roots: Path) -> list[tuple[str, str]]:
    """(file relative to the repository, module it imports) for every import statement
    outside ``if TYPE_CHECKING:`` blocks; ``from pkg import name`` counts as pkg.name where
    that is a module."""
    out = []
    for root in roots:
        for path in root.rglob("*.py"):
            name = _module_name(path)
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            rel = path.relative_to(REPO).as_posix()
            for node in _walk(ast.parse(path.read_text(), filename=str(path)).body):
                if isinstance(node, ast.Import):
                    out += [(rel, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        base = ".".join(pkg[:len(pkg) - node.level + 1] + [base] * bool(base))
                    out += [(rel, f"{base}.{a.name}") for a in node.names]
    return out


def _walk(nodes: list[ast.stmt]) -> Any:
    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield node
        yield from _walk([n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)])


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in list(graph):
        if v not in index:
            visit(v)
    return found
