"""Every benchmark runs (``--quick``) and prints its table. Speed targets are read from the
full runs, not asserted here."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow

BENCHES = {
    "bench_boundary_frontier.py": "none/this",
    "bench_codec.py": "int8",
    "chaos.py": "wedged jobs",
    # (bench_dp.py runs below, once, with its rounds: a quick run of it alone adds nothing)
    "bench_link_bound.py": "step/overlap",
    "bench_links.py": "step/bound",
    "bench_leader.py": "p99 ms",
    "bench_pipeline.py": "tokens/s",
    "bench_predict_scenarios.py": "step/pred",
    "bench_profiles.py": "vs small_none",
    "bench_rebalance_fellows.py": "rebalancing across 6 fellow processes",
    "bench_reports.py": "batched / one by one",
    "bench_ring.py": "cpu / gloo",
    "bench_stage.py": "paired ratio to plain",
    "bench_sync_modes.py": "sync B/step",
    "bench_tui.py": "ms",
    "check_device.py": "resume bfloat16 none",
    "reference_diloco.py": "average H=",
    "reference_gpt.py": "val/ref",
}


@pytest.mark.parametrize("script", ["reference_gpt.py", "reference_diloco.py"])
def test_the_independent_references_import_nothing_of_the_code_under_test(script):
    """The references take the data from the project, never its model, optimiser or sync
    (their own imports, and the bench modules they import, checked)."""
    import ast

    seen, todo = set(), [script]
    while todo:
        name = todo.pop()
        seen.add(name)
        tree = ast.parse((REPO / "bench" / name).read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m and m.startswith("swarm_core.pipeline") for m in mods), (name, mods)
        todo += [f"{m}.py" for m in mods if m and (REPO / "bench" / f"{m}.py").exists()
                 and f"{m}.py" not in seen]


@pytest.mark.parametrize("script, needle", sorted(BENCHES.items()))
def test_benchmark_runs_quick(script, needle, cli_env):
    res = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick"],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert needle in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize("script, args, needle", [
    # Rows in rounds: the ratios of each round, their median the figure.
    ("bench_dp.py", ["--rounds", "2"], "per round (the figures are their medians)"),
    # Every row from one model trained first.
    ("reference_diloco.py", ["--warm-start", "2"], "warm start: 2 steps"),
    # Rows per outer optimiser (momentum 0: plain SGD, no Nesterov), once each, unshaped.
    ("bench_sync_modes.py", ["--loss-only", "--overlap", "0", "--inner-steps", "2",
                             "--outer-lr", "0.7,1", "--outer-momentum", "0.9,0"],
     "diloco H=2 d=0 outer 1/0: sync bytes/step"),
    # The same jobs on a local leader's fellow processes.
    ("bench_predict_scenarios.py", ["--fellows"], "step measured in fellow processes"),
])
def test_benchmark_options_run(script, args, needle, cli_env):
    res = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", *args],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert needle in res.stdout, res.stdout[-2000:]
    if script == "bench_dp.py":  # (the table, then two ratios a figure, one a round)
        assert "vs (d)" in res.stdout.split(needle, 1)[0], res.stdout[-2000:]
        per_round = res.stdout.split(needle, 1)[1].splitlines()[1]
        assert per_round.split()[:2] == ["(r)", "/"] and len(per_round.split()) == 5, per_round


def test_pipeline_benchmark_runs_rows_step_by_step(cli_env):
    """--interleave: every row's workers at once, one row's step at a time; the verdicts
    come from step-by-step ratios over the undisturbed steps."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_pipeline.py"), "--quick",
                          "--interleave", "--only", "a,b", "--schedules", "gpipe",
                          "--no-profile"],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "step by step (--interleave" in out, out[-2000:]
    assert "(b) gpipe >= 1.70x (a):" in out.split("step by step", 1)[1], out[-2000:]
    assert "split backward on over off" in out, out[-2000:]


def test_a_failing_row_leaves_the_other_rows_of_an_interleaved_trial_measured(cli_env):
    """One row's worker raising mid-trial marks that row FAILED (exit 1); the rows beside it
    take their steps to the end and get their verdicts."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_pipeline.py"), "--quick",
                          "--interleave", "--only", "a,b", "--schedules", "gpipe",
                          "--no-profile", "--fail-row", "b-gpipe-plain"],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=240)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "failure injected by --fail-row" in res.stderr
    table = res.stdout.split("targets:", 1)[0]
    assert "split backward off" in table and "FAILED" in table.split("split backward off")[1]
    verdicts = res.stdout.split("step by step", 1)[1]
    # (Over the steps no other process disturbed: 1 or 2 of the 2 timed, on a busy machine.)
    assert re.search(r"\(b\) gpipe >= 1\.70x \(a\): [0-9.]+x over [12] steps", verdicts), verdicts
    assert "split backward on over off" not in verdicts


def test_pair_links_benchmark_prints_both_tables(cli_env):
    """bench_pair_links.py --quick: every ordered pair of its 4-site matrix measured (rate and
    latency), then the link-bound step of 2 and 4 stages against the predictor."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_pair_links.py"), "--quick"],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    pairs = out.split("== P:", 1)[1].split("== S:", 1)[0]
    assert "got/set" in pairs and "lat ±2ms+5%" in pairs, out[-2000:]
    rows = re.findall(r"^  ([a-d]->[a-d]) ", pairs, re.MULTILINE)
    assert len(rows) == 12 and len(set(rows)) == 12, pairs
    steps = out.split("== S:", 1)[1]
    assert "step/perfect" in steps and "chain+schedule" in steps, steps
    for run in ("2 st 1f1b M=4", "4 st 1f1b M=4"):
        assert run in steps, steps


def test_hetero_benchmark_sets_chain_against_swarm_wiring(cli_env):
    """bench_hetero.py --quick: chain and swarm wiring, unslowed and with one peer slowed 4x
    (routed by given and by measured weights), side by side against the capacity bound, and
    the issue's targets said; then rebalancing's table (S=2 x R=3)."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_hetero.py"), "--quick"],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    for row in ("chain, unslowed", "swarm, unslowed", "swarm regroup-ready, unslowed",
                "chain, slowed 4x",
                "swarm, slowed, equal weights", "swarm, slowed, oracle weights",
                "swarm, slowed, measured"):
        assert re.search(rf"^{re.escape(row)} +\d+\.\d{{3}}", out, re.MULTILINE), out
    assert "capacity bound, slowed:" in out
    # (each row beside the predictor's figure for it, and the ratio)
    assert re.search(r"^swarm, slowed, measured( +\S+)+ +\d+\.\d{3} +\d+\.\d{2}$", out,
                     re.MULTILINE), out
    assert "targets, oracle: swarm >= 90% of capacity" in out
    assert "targets, measured: swarm >= 90% of capacity" in out
    assert "target: unslowed cost, regroup-ready <= 3%" in out
    # Then rebalancing: the same job without and with it, and its target said.
    rebalancing = out.split("== rebalancing: S=2 x R=3", 1)[1]
    assert re.search(r"^no rebalancing: \d+\.\d{3} s/step", rebalancing, re.MULTILINE), out
    assert ">= 1.3x" in rebalancing, out
