"""``swarm suite``: benchmark suites over cluster shapes (exp/scripts/run_benchmark_suite.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from swarm_core import jsonio
from swarm_core.client import ClientError, SwarmClient
from swarm_core.config.grid import layout_label
from swarm_core.config.profiles import ConfigError
from swarm_core.experiments.runner import Experiment, ExperimentError, git_commit
from swarm_core.experiments.suites import as_experiment, load_suite, plan, summarize, write_json
from swarm_core.schema import unstructure
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    check_dir,
    emit_json,
    emit_table,
    print_line,
    resolve_leader,
    run_async,
    warn,
)
from swarm_tui.commands.progress_bars import follow
from swarm_tui.commands.tracking_flags import add_tracking_flags, tracking_from
from swarm_tui.fmt import fmt_number


def cmd_suite(args: argparse.Namespace) -> int:
    try:
        suite = load_suite(args.suite)
    except ConfigError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else \
        Path(suite.path).resolve().parents[2] / "runs" / "suites" / f"{suite.spec.name}-{stamp}"
    tracking = tracking_from(args)
    url, token = resolve_leader(args)
    check_dir(out, "--out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"--out: cannot create {out}: {exc.strerror}", ExitCode.USAGE) \
            from None
    say = print_line if args.format == "table" else warn

    async def main() -> int:
        async with SwarmClient(url, token) as client:
            try:
                fellows = await client.fellows()
            except ClientError:
                if not args.dry_run:
                    raise
                fellows = None
                say(f"leader at {url} unreachable: the plan skips the topology check")
            the_plan = plan(suite, fellows)
            the_plan["leader_url"] = url
            write_json(out / "suite_plan.json", the_plan)
            bad = [s for s in the_plan["scenarios"] if not s["topology_ok"]]
            if args.dry_run:
                _print_plan(the_plan, args.format)
                if bad:
                    raise CommandError(f"{len(bad)} scenario(s) cannot run on this cluster: "
                                       f"{bad[0]['name']} {bad[0]['topology_note']}")
                return 0
            if bad and not args.continue_on_fail:
                raise CommandError(f"scenario {bad[0]['name']}: {bad[0]['topology_note']} "
                                   "(--continue-on-fail runs the others)")
            runnable = [s for s in suite.scenarios
                        if not any(b["name"] == s.spec.name for b in bad)]
            exp = as_experiment(suite, out)
            keep = {s.spec.artifacts.dir for s in runnable}
            exp.runs = [r for r in exp.runs if r.run_name.rsplit("-r", 1)[0] in keep
                        or r.run_name in keep]
            runner = Experiment(client, exp, runs_dir=out, on_line=say,
                                names=[r.run_name for r in exp.runs],
                                stop_on_failure=not args.continue_on_fail,
                                tracking=tracking)
            try:
                await runner.start()
            except ExperimentError as exc:
                raise CommandError(str(exc)) from None
            say(f"{suite.spec.name}: {len(exp.runs)} run(s) queued, artifacts in {out}")
            await follow(runner, args.format)
            run_dirs: dict[str, Path] = {}
            for st in runner.states:
                sc = next(s for s in suite.scenarios
                          if st.run_name_base() == s.spec.artifacts.dir)
                run_dirs.setdefault(sc.spec.name, st.run_dir)
                write_json(st.run_dir / "infra_resolved.json", {
                    "scenario": sc.spec.name, "infra": the_plan["scenarios"][
                        suite.scenarios.index(sc)]["infra"],
                    "stages": sc.stages, "replicas": sc.replicas, "sync_mode": sc.sync_mode,
                    "fellows": sc.fellows, "emulated": sc.emulated,
                    "not_emulated": sc.not_emulated})
                if st.job_id:
                    job = await client.job(st.job_id)
                    write_json(st.run_dir / "job_final.json", jsonio.loads(
                        jsonio.dumps(unstructure(job))))
                    if job.placement:
                        write_json(st.run_dir / "placement_plan.json",
                                   unstructure(job.placement))
            summary = summarize(suite, out, run_dirs)
            write_json(out / "suite_summary.json", summary)
            write_json(out / "suite_manifest.json", {
                "suite": suite.spec.name, "source": suite.path, "leader_url": url,
                "git_commit": git_commit(Path(suite.path).resolve().parent),
                "written_at": time.time(), "out_dir": str(out),
                "runs": [{"run": st.run_id, "scenario": st.run_name_base(), "job_id": st.job_id,
                          "state": st.state, "dir": str(st.run_dir), "note": st.note}
                         for st in runner.states],
                "skipped": [{"scenario": b["name"], "why": b["topology_note"]} for b in bad],
            })
            _print_summary(summary, args.format)
            ok = all(st.state == "COMPLETED" for st in runner.states) and not bad
            return 0 if ok else int(ExitCode.FAILURE)

    return run_async(main())


def _grid(row: dict) -> str:
    """A scenario's ``stages x replicas`` (a swarm layout's cells by stage: ``cells 1+3``),
    as its plan or summary row has them."""
    if row.get("layout"):
        return layout_label(row["layout"])
    return f"{row['stages']}x{row['replicas']}"


def _print_plan(the_plan: dict, fmt: str) -> None:
    if fmt == "json":
        emit_json(the_plan)
        return
    emit_table(f"{the_plan['suite']}: plan", ["scenario", "grid", "sync", "topology",
                                               "not emulated"],
               [[s["name"], _grid(s), s["sync_mode"],
                 "ok" if s["topology_ok"] else s["topology_note"],
                 "; ".join(s["not_emulated"]) or "-"] for s in the_plan["scenarios"]])


def _print_summary(summary: dict, fmt: str) -> None:
    if fmt == "json":
        emit_json(summary)
        return
    emit_table(f"{summary['suite']} (baseline {summary['baseline']})",
               ["scenario", "status", "grid", "sync", "tok/s", "step s", "final loss",
                "eval loss", "wire B/step", "sync B/step", "slow-down", "link bound s",
                "vs predicted"],
               [[r["scenario"], r["status"], _grid(r), r["sync_mode"],
                 fmt_number(r["tokens_per_s"], ".0f"),
                 fmt_number(r["step_time_s"], ".3f"), fmt_number(r["final_loss"], ".4f"),
                 fmt_number(r["eval_loss"], ".4f"), fmt_number(r["wire_bytes_per_step"], ",.0f"),
                 fmt_number(r["sync_bytes_per_step"], ",.0f"),
                 fmt_number(r.get("slowdown_vs_baseline"), ".2f"),
                 fmt_number(r.get("link_bound_s"), ".3f"),
                 fmt_number(r.get("measured_vs_predicted"), ".2f")] for r in summary["scenarios"]])
    for r in summary["scenarios"]:
        if r.get("damage"):
            warn(f"{r['scenario']}: {r['damage']}")
    print_line(f"wrote {summary['out_dir']}/suite_summary.json")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("suite", help="run a benchmark suite over cluster shapes "
                                     "(exit 1 if a scenario failed)")
    p.add_argument("--suite", required=True,
                   help="e.g. exp/configs/benchmarks/multinode_training_v1.json")
    p.add_argument("--dry-run", action="store_true",
                   help="plan only: validate, resolve, check the topology, write suite_plan.json")
    p.add_argument("--continue-on-fail", action="store_true",
                   help="keep going past a failed or unrunnable scenario and record why")
    p.add_argument("--out", default=None,
                   help="output directory (default: exp/runs/suites/<suite>-<time>)")
    add_tracking_flags(p)
    add_format(p)
    p.set_defaults(func=cmd_suite)
