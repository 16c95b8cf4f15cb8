"""``swarm validate`` and ``swarm sweep``: experiment configs, checked and run on the leader."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from swarm_core.client import SwarmClient
from swarm_core.config.profiles import (
    ConfigError,
    ResolvedExperiment,
    RunSpec,
    dataset_files,
    load_experiment,
    warm_started,
)
from swarm_core.config.schemas import SyncConfig
from swarm_core.experiments.report import (
    HEADERS,
    OUTPUT_SUFFIXES,
    ReportError,
    find_run_dirs,
    load_runs,
    read_records,
    read_summary,
    summary_rows,
    write_report,
)
from swarm_core.experiments.runner import Experiment, ExperimentError
from swarm_core.experiments.summary import MetricsSummary, summary_json
from swarm_core.schema import structure, unstructure
from swarm_core.tracking import (
    TRACKING_EXTRA,
    Tracking,
    TrackingError,
    TrackingUnavailable,
    tensorboard_installed,
)
from swarm_core.tracking.run_log import convert_run
from swarm_tui.commands.argtypes import warm_start
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
from swarm_tui.commands.tracking_flags import (
    add_mlflow_flag,
    add_tracking_flags,
    check_mlflow,
    tracking_from,
)


def load(path: str, code: ExitCode, warm_up: bool = True) -> ResolvedExperiment:
    try:
        return load_experiment(path, warm_up)
    except ConfigError as exc:
        raise CommandError(str(exc), code) from None


def _warn_unmatched_dataset_paths(exp: ResolvedExperiment) -> None:
    """A warning, not an error: the fellows read their own copies of the files, which may be
    on other machines; on this one, the runs would fail at their first step."""
    seen: set[str] = set()
    for run in exp.runs:
        if run.training.get("dataset") != "textfiles":
            continue
        for pat in dataset_files(run.training.get("dataset_paths") or [])[1]:
            if pat not in seen:
                seen.add(pat)
                warn(f"warning: dataset_paths {pat!r} matches no file on this machine "
                     "(fellows elsewhere read their own copies)")


def cmd_validate(args: argparse.Namespace) -> int:
    exp = load(args.config, ExitCode.FAILURE)
    _warn_unmatched_dataset_paths(exp)
    if args.format == "json":
        emit_json({"config": exp.config_path, "name": exp.config.name,
                   "training_profile": exp.training_path, "runs_dir": str(exp.runs_dir),
                   "runs": [unstructure(r) for r in exp.runs]})
        return 0
    warm = exp.config.sweep.warm_up
    title = f"{exp.config.name}: {len(exp.runs)} run(s), valid" + (
        f"; a warm-up of {warm.steps} steps first (run 0's job, dp"
        f"{', without its variant' if exp.config.sweep.variants else ''}), every run from its "
        "weights" if warm is not None else "")
    rows = exp.config.sweep.variants is not None  # (a column only where it names rows)
    emit_table(title,
               ["#", "run", "fellows", "grid", "wiring", *(["variant"] if rows else []),
                "sync", "steps", "compression", "network"],
               [[r.index, r.run_name, r.fellows, f"{r.stages}x{r.replicas}", r.wiring_label,
                 *([r.variant] if rows else []), _sync(r), r.training["steps"],
                 r.compression, r.network["name"]]
                for r in exp.runs])
    return 0


def _sync(run: RunSpec) -> str:
    """A run's sync as the validate table shows it: ``none`` (one replica), ``dp``,
    ``diloco H=10`` (``diloco H=10 overlap 5``, ``dp int8``: as ``SyncConfig.label``)."""
    if run.sync_mode == "none":
        return "none"
    return structure(run.training["sync"], SyncConfig).label


def cmd_sweep(args: argparse.Namespace) -> int:
    exp = load(args.config, ExitCode.USAGE, warm_up=args.warm_start is None)
    trained, given = exp.config.sweep.warm_up, exp.config.sweep.overrides.get("warm_start")
    if args.warm_start is not None:
        exp = warm_started(exp, args.warm_start)
    replayed = next((r for r in exp.runs if r.churn or r.network.get("trace")), None)
    if args.detach and replayed is not None:
        # (the sweep's own process plays them against each running job)
        raise CommandError(f"--detach: run {replayed.run_name} replays a churn script or link "
                           "trace, which needs the sweep to follow its runs", ExitCode.USAGE)
    tracking = tracking_from(args)
    url, token = resolve_leader(args)
    runs_dir = Path(args.runs_dir).resolve() if args.runs_dir else None
    holder: dict[str, Experiment] = {}

    async def main() -> int:
        async with SwarmClient(url, token) as client:
            runner = Experiment(client, exp, runs_dir=runs_dir, skip_netem=args.skip_netem,
                                on_line=print_line if args.format == "table" else warn,
                                poll_s=args.poll, tracking=tracking)
            holder["runner"] = runner
            if args.warm_start is not None:
                job, step = args.warm_start["job_id"], args.warm_start.get("step")
                start = f"{job} step {step}" if step else f"{job}'s newest checkpoint"
                runner.on_line(f"every run from {start} (--warm-start)" + (
                    f"; the config's warm-up of {trained.steps} steps is not trained"
                    if trained is not None else
                    f", not the config's overrides.warm_start ({given.get('job_id')})"
                    if isinstance(given, dict) else ""))
            try:
                await runner.start()
            except ExperimentError as exc:
                raise CommandError(str(exc)) from None
            mode = "one at a time (tc profiles)" if runner.sequential else "all queued"
            runner.on_line(f"{exp.config.name}: {len(runner.states)} run(s), {mode}, "
                           f"artifacts in {runner.runs_dir}")
            if args.detach:
                _report(runner, args.format)
                return 0
            await follow(runner, args.format)
            _report(runner, args.format)
            ok = all(st.state == "COMPLETED" for st in runner.states)
            return 0 if ok else int(ExitCode.FAILURE)

    try:
        return run_async(main())
    except KeyboardInterrupt:
        runner = holder.get("runner")
        open_jobs = runner.open_jobs() if runner else []
        if open_jobs and runner is not None and sys.stdin.isatty():
            answer = input(f"\ncancel the {len(open_jobs)} run(s) this sweep queued? [y/N] ")
            if answer.strip().lower() in ("y", "yes"):
                cancelled = asyncio.run(_cancel(url, token, runner))
                warn(f"cancelled {len(cancelled)} run(s)")
                return int(ExitCode.INTERRUPTED)
        if open_jobs:
            warn(f"left {len(open_jobs)} run(s) queued: {' '.join(open_jobs)} "
                 "('swarm cancel JOB' stops one)")
        return int(ExitCode.INTERRUPTED)


async def _cancel(url: str, token: str | None, runner: Experiment) -> list[str]:
    async with SwarmClient(url, token) as client:
        runner.client = client
        return await runner.cancel_open()


def _report(runner: Experiment, fmt: str) -> None:
    rows: list[dict[str, Any]] = []
    for st in runner.states:
        s = MetricsSummary()
        if (st.run_dir / "metrics_summary.json").exists():  # (not yet, for a queued run)
            try:
                s = read_summary(st.run_dir)
            except ReportError as exc:
                warn(str(exc))
        rows.append({"run_id": st.run_id, "job_id": st.job_id, "state": st.state,
                     "run_dir": str(st.run_dir), "final_loss": s.final_loss,
                     "eval_loss": s.eval_loss, "tokens_per_s": s.tokens_per_s,
                     "wire_bytes_per_step": s.wire_bytes_per_step,
                     "sync_bytes_per_step": s.sync_bytes_per_step,
                     "compression_ratio": s.compression_ratio,
                     "thresholds_met": s.thresholds_met,
                     # (the boundary each way, as planned, and what its codecs changed)
                     "act_bytes_per_step": s.act_bytes_per_step,
                     "grad_bytes_per_step": s.grad_bytes_per_step,
                     "boundary_ratio": s.boundary_ratio,
                     "codec_error_by_stage": s.codec_error_by_stage})
    if fmt == "json":
        emit_json({"runs": rows})
        return

    def f(v: object, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    emit_table("runs", ["run", "job", "state", "final loss", "eval loss", "tok/s",
                        "wire B/step", "sync B/step", "ratio", "thresholds"],
               [[r["run_id"].split("-", 2)[-1], r["job_id"], r["state"],
                 f(r["final_loss"], ".4f"), f(r["eval_loss"], ".4f"),
                 f(r["tokens_per_s"], ".0f"), f(r["wire_bytes_per_step"], ".0f"),
                 f(r["sync_bytes_per_step"], ".0f"), f(r["compression_ratio"], ".1f"),
                 "-" if r["thresholds_met"] is None else ("met" if r["thresholds_met"]
                                                          else "MISSED")]
                for r in rows])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check an experiment config and list its runs "
                                        "(no leader needed; exit 1 if invalid)")
    p.add_argument("config", help="e.g. exp/configs/exp_distributed_smoke_v1.json")
    add_format(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("sweep", help="queue every run of an experiment config and follow them "
                                     "(exit 1 if any run failed)")
    p.add_argument("--config", required=True, help="experiment config JSON")
    p.add_argument("--detach", action="store_true", help="return once the runs are queued")
    p.add_argument("--runs-dir", default=None,
                   help="where run directories go (default: the profile's artifacts.runs_dir)")
    p.add_argument("--skip-netem", action="store_true",
                   help="do not apply network_profile.tc_profile with tc")
    p.add_argument("--warm-start", type=warm_start, default=None, metavar="JOB[:STEP]",
                   help="start every run from the weights of JOB's checkpoint at STEP "
                        "(default: its newest), in place of the config's sweep.warm_up: one "
                        "warm-up shared by several configs")
    p.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    add_tracking_flags(p)
    add_format(p)
    p.set_defaults(func=cmd_sweep)
    register_report(sub)


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.output) if args.output else None
    if out is not None:
        if out.suffix not in OUTPUT_SUFFIXES:  # (checked before any run is read)
            raise CommandError(f"--output must end in .html or .png, got {out.name}",
                               ExitCode.USAGE)
        if out.is_dir():
            raise CommandError(f"--output: {out} is a directory", ExitCode.USAGE)
        check_dir(out.parent, "--output")
    tb_root = Path(args.tensorboard) if args.tensorboard else None
    if tb_root is not None:
        check_dir(tb_root, "--tensorboard")
        if not tensorboard_installed():
            raise CommandError("--tensorboard needs the tensorboard package, which is not "
                               f"installed: {TRACKING_EXTRA}")
    check_mlflow(args.mlflow_uri)
    converted: list[str] = []
    try:
        runs, unreadable = load_runs(find_run_dirs([Path(raw) for raw in args.run_dirs]))
        if not runs and len(unreadable) == 1:
            raise ReportError(unreadable[0][1])
        for _, why in unreadable:
            warn(f"skipped {why}")
        if not runs:
            raise ReportError(f"none of the {len(unreadable)} run directories could be read")
        if out is not None:
            write_report(runs, out, calibrate=args.calibrate)
        if tb_root is not None or args.mlflow_uri:
            tracking = Tracking(tensorboard=tb_root is not None, mlflow_uri=args.mlflow_uri)
            for r in runs:
                done = convert_run(r.run_dir, read_records(r.run_dir),
                                   summary_json(r.summary), tracking, tb_root)
                converted.append(str(done) if done is not None else str(r.run_dir))
    except ReportError as exc:
        raise CommandError(str(exc)) from None
    except (TrackingUnavailable, TrackingError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"--tensorboard: cannot write {exc.filename or tb_root}: "
                           f"{exc.strerror or exc}") from None
    if args.format == "json":
        emit_json({"runs": [{"run_dir": str(r.run_dir), **summary_json(r.summary)}
                            for r in runs],
                   "skipped": [{"run_dir": str(d), "error": why} for d, why in unreadable],
                   "output": args.output, "tensorboard": args.tensorboard,
                   "converted": converted})
    else:
        emit_table("runs", HEADERS, summary_rows(runs))
        if out is not None:
            print_line(f"wrote {out}")
        if tb_root is not None:
            print_line(f"wrote TensorBoard files of {len(runs)} run(s) under {tb_root} "
                       f"(tensorboard --logdir {tb_root})")
        if args.mlflow_uri:
            print_line(f"logged {len(runs)} run(s) to MLflow at {args.mlflow_uri}")
    # The report leaves out what it could not read; a script must not take it as complete.
    return int(ExitCode.FAILURE) if unreadable else 0


def register_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="compare run directories: loss by step, wall time and "
                                      "bytes, eval loss by wall time and bytes (pipeline + "
                                      "sync) in each sync mode's line style, plus a summary "
                                      "(HTML or PNG); a run that cannot be read is left out "
                                      "and named on stderr (exit 1)")
    p.add_argument("run_dirs", nargs="+", help="run directories (or a folder of them)")
    p.add_argument("--output", help="report.html (self-contained) or report.png (matplotlib)")
    p.add_argument("--calibrate", action="store_true",
                   help="the HTML's predictor section: measure the stages this machine's "
                        "calibration cache lacks (CPU time, on this machine) instead of "
                        "naming them not calibrated")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write each run's TensorBoard files under DIR/<run> (for runs "
                        "written without them; needs the [tracking] extra)")
    add_mlflow_flag(p)
    add_format(p)
    p.set_defaults(func=cmd_report)
