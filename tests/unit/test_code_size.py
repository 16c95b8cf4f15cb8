"""The ceiling on a function's length in the leader, the fellow and the stage: past 80 lines a
handler mixes what it checks, what it writes and what it answers (a stage's step, what it
computes, sends and syncs), and splits into named steps read better."""

from __future__ import annotations

import ast

from tests.support import REPO

MAX_LINES = 80


def test_no_leader_function_is_over_80_lines():
    _check(sorted((REPO / "swarm_core" / "leader").rglob("*.py")))


def test_no_fellow_or_stage_function_is_over_80_lines():
    pipeline = REPO / "swarm_core" / "pipeline"
    _check(sorted([*(REPO / "swarm_core" / "fellow").rglob("*.py"), *pipeline.glob("stage*.py"),
                   pipeline / "replica_group.py"]))


def test_the_stage_runner_leaves_membership_and_algorithms_to_others():
    """StageRunner keeps the model, the schedule and the optimiser step (issue "Methods as
    plugins": at most 350 lines); the group's membership and the sync algorithms live apart."""
    tree = ast.parse((REPO / "swarm_core" / "pipeline" / "stage.py").read_text())
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StageRunner")
    assert (runner.end_lineno or runner.lineno) - runner.lineno + 1 <= 350


def _check(paths: list) -> None:
    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} "
                                f"({lines} lines)")
    assert long == []
