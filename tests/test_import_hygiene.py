"""Import rules of the layout: each checked in a fresh interpreter by inspecting sys.modules."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import swarm_core

REPO = Path(__file__).resolve().parents[1]


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
