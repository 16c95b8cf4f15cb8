"""``swarm jobs``, ``submit``, ``cancel``, ``watch``."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from swarm_core import jsonio
from swarm_core.client import LeaderUnreachable, SwarmClient
from swarm_core.config.methods import BOUNDARY_FORMS
from swarm_core.config.schemas import SYNC_MODES, ModelConfig, SyncConfig, TrainingConfig
from swarm_core.contract import (
    JOB_ORDERS,
    MAX_JOB_PAGE,
    JobInfo,
    JobList,
    JobSubmit,
    LinkChange,
    MembershipChange,
    StageMetrics,
    Topology,
    link_changes_in_all,
    perplexity,
)
from swarm_core.contract.events import (
    Event,
    Hello,
    JobMembership,
    JobShard,
    JobUpdate,
    MetricReport,
    Unknown,
    event_json,
    read_event,
)
from swarm_core.protocol import JobState
from swarm_core.schema import FieldError, SchemaError, structure, unstructure
from swarm_core.validators import printable
from swarm_tui.commands.argtypes import (
    cell_layout,
    fellow_count,
    job_id,
    number,
    positive_int,
    rebalance_every,
    step_count,
    sync_field,
    warm_start,
)
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    emit_json,
    emit_table,
    print_line,
    run_with_client,
    warn,
)
from swarm_tui.fmt import (
    describe_speed,
    fmt_age,
    fmt_bytes,
    fmt_cell,
    fmt_codec_error,
    fmt_loss,
)
from swarm_tui.grid import grid_table, grid_title, is_grid, move_fellows, move_text

TERMINAL = {s.value for s in JobState if s.terminal}


def cmd_jobs(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> None:
        if args.limit is None and args.after is None and args.order == "queue":
            page = JobList(jobs=await c.jobs(args.state))
        else:
            page = await c.job_page(args.state, limit=args.limit or MAX_JOB_PAGE,
                                    after=args.after, order=args.order)
        jobs = page.jobs
        if args.format == "json":
            emit_json(page)
            return
        emit_table("jobs", ["job", "name", "kind", "state", "step", "loss", "fellows", "age",
                            "note"], [
            [j.job_id, j.name, j.kind, j.state, j.last_step, fmt_loss(j.last_loss),
             ",".join(map(str, j.fellows)) or "-", fmt_age(time.time() - j.created_at),
             j.waiting_for or j.reason or "-"]
            for j in jobs
        ])
        if page.next_after:
            again = "" if args.order == "queue" else f" --order {args.order}"
            print_line(f"more: swarm jobs{again} --after {page.next_after}")

    return run_with_client(args, body)


LINK_CHANGES_SHOWN = 10  # the newest; --format json has the first and the newest 199


def cmd_job(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> None:
        job = await c.job(args.job_id)
        boundary = job_boundary(job)
        if args.format == "json":
            # (the leader's job as it sent it, with the boundary's planned bytes beside it)
            emit_json({**unstructure(job), **({"boundary": boundary} if boundary else {})})
            return
        m = job.metrics
        rows: list[list[Any]] = [["job", job.job_id], ["name", job.name], ["kind", job.kind],
                ["state", job.state], ["step", job.last_step], ["loss", fmt_loss(job.last_loss)],
                ["fellows", ",".join(map(str, job.fellows)) or "-"],
                ["note", job.waiting_for or job.reason or "-"]]
        warm = job.train.warm_start if job.train is not None else None
        if warm is not None:
            rows.append(["warm start", f"{warm.job_id} step {warm.step} (its weights; fresh "
                                       "optimiser and schedule)"])
        if job.train is not None and job.train.transport != "shaped":
            rows.append(["transport", f"{job.train.transport} (gloo; unshaped: link limits "
                                      "and set-speed do not reach it)"])
        for key in ("eval_loss", "perplexity", "tokens_per_s", "wire_bytes_per_step",
                    "sync_bytes_per_step"):
            value = getattr(m, key)
            if value is not None:
                rows.append([key.replace("_", " "), f"{value:.4g}"])
        if boundary:
            rows.append(["boundary per step", " · ".join([
                f"ACT {fmt_bytes(int(boundary['act_bytes_per_step']))} forward",
                f"GRAD {fmt_bytes(int(boundary['grad_bytes_per_step']))} backward",
                f"{boundary['ratio_to_none']:.1f}x fewer than none (planned)"])])
        grid = is_grid(job)
        if job.placement and not grid:
            p = job.placement
            for st in p.stages:
                rows.append([f"stage {st.stage}", " · ".join([
                    f"fellow {st.fellow_id} ({st.name}) layers "
                    f"{st.layers.start}-{st.layers.stop}",
                    *_stage_figures(m.stage(p.label(st.stage, st.replica)))])])
        rows += link_change_rows(job.link_changes, job.link_changes_total)
        rows += membership_rows(job)
        emit_table(None, ["what", "value"], rows)
        if grid:  # (its per-cell figures are the grid's alone: stage rows would repeat them)
            emit_grid(job)

    return run_with_client(args, body)


def job_boundary(job: JobInfo) -> dict[str, float] | None:
    """What a job's stage boundaries carry per step, as its spec plans it at its shapes
    (``wire_math``): the ACT frames forward and the GRAD frames backward of every stage,
    fp32 ``none``'s both ways at the same shapes, and their ratio. None for a job without
    boundaries (one stage) or not yet placed. The measured bytes are the metrics' own."""
    from swarm_core.pipeline.wire_math import step_boundary_bytes, uncompressed_model

    model, training, p = job.model, job.train, job.placement
    if model is None or training is None or p is None or p.num_stages < 2:
        return None
    act, grad = step_boundary_bytes(model, training, p.num_stages, p.replicas)
    plain = sum(step_boundary_bytes(uncompressed_model(model), training, p.num_stages,
                                    p.replicas))
    return {"act_bytes_per_step": act, "grad_bytes_per_step": grad,
            "none_bytes_per_step": plain, "ratio_to_none": plain / (act + grad)}


def link_change_rows(changes: list[LinkChange], total: int = 0,
                     shown: int = LINK_CHANGES_SHOWN) -> list[list[str]]:
    """``swarm job``'s rows for the set-speeds a job saw while it ran: the newest ``shown``,
    after a row that counts them all and names the first, when there were more."""
    rows = []
    total = link_changes_in_all(changes, total)
    if total > shown and changes:
        rows.append(["link set", f"{total} times, the first @{changes[0].at_step}; "
                                 f"the newest {shown}:"])
    for ch in changes[-shown:]:
        rows.append([f"link set @{ch.at_step}", f"fellow {ch.fellow_id}: "
                     + describe_speed(ch.link, ch.slowdown)])
    return rows


def membership_rows(job: JobInfo) -> list[list[str]]:
    """``swarm job``'s rows for the replicas that left a job or joined it, and the peers that
    moved between its stages, and when: a loss curve is read against them."""
    fellows = move_fellows(job)
    return [[f"{_kind(ch)} @{ch.step}",
             _membership_change(ch, fellows.get(i))] for i, ch in enumerate(job.membership)]


def _kind(ch: MembershipChange) -> str:
    """What a membership row is of: a move, cells of a swarm job that left alone, replicas."""
    if ch.moved is not None:
        return "moved"
    return "cells" if ch.cells_left and not ch.left and not ch.joined else "replicas"


def _membership_change(ch: MembershipChange, fellow: int | None = None) -> str:
    """One change of a job's membership: who left or joined and who trains on; of a move
    (a swarm layout's rebalancing), the peer's old cell and new one, "f3 moved 0.1 -> 1.2"
    (``fellow``: the one that moved, where known)."""
    if ch.moved is not None:
        return move_text(ch.moved, fellow) + (
            f" ({printable(ch.reason)})" if ch.reason else "")
    what = "; ".join(part for part in (
        ch.left_text(),
        f"replica(s) {','.join(map(str, ch.joined))} joined" if ch.joined else "") if part)
    if len(set(ch.stage_steps)) > 1:  # (a group that had finished the step kept it)
        what += " (by stage from step " + ", ".join(
            f"s{k} @{at}" for k, at in enumerate(ch.stage_steps)) + ")"
    return f"{what}; training: {','.join(map(str, ch.members))}" + (
        f" ({printable(ch.reason)})" if ch.reason else "")


def emit_grid(job: JobInfo) -> None:
    """The stages x replicas table of a job with replicas (of a layout's: its cells)."""
    emit_table(grid_title(job), *grid_table(job))


def _stage_figures(reported: StageMetrics) -> list[str]:
    """What a chain's stage last reported, for ``swarm job``: the run's figures once it
    COMPLETED, the last step's while it runs."""
    out = []
    wait = reported.wait_share
    if wait is not None:
        out.append(f"link wait {wait:.0%}")
    if reported.activation_peak_bytes is not None:
        out.append(f"act mem {fmt_bytes(reported.activation_peak_bytes)}")
    sync = reported.sync_bytes
    if sync is not None:
        out.append(f"sync {fmt_bytes(int(sync))}/step")
    errors = fmt_codec_error(reported.codec_error)
    if errors:
        out.append("codec error " + errors)
    return out


def smoke_job(fellows: int, steps: int, name: str = "smoke") -> JobSubmit:
    return _validated_job({"name": name, "kind": "smoke", "topology": {"fellows": fellows},
                           "training": {"steps": steps, "step_seconds": 0.2}})


def _load_payload(path: str) -> JobSubmit:
    data = _load_json(path)
    try:
        return structure(data, JobSubmit)
    except SchemaError as exc:
        raise CommandError(f"{path}: {exc}", ExitCode.USAGE) from None


def _validated_job(req_data: dict[str, Any]) -> JobSubmit:
    try:
        return structure(req_data, JobSubmit)
    except SchemaError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


def train_job(model: ModelConfig, training: dict[str, Any], topology: Topology,
              name: str, sync: SyncConfig | None = None) -> JobSubmit:
    """A train job of a model and a training profile's fields (``sync``, where given, in
    place of theirs), checked here as the leader will check it."""
    try:
        config = structure(training, TrainingConfig, "$.training")
        if sync is not None:
            config = attrs.evolve(config, sync=sync)
        return JobSubmit(name=name, kind="train", model=model, topology=topology,
                         training=config)
    except SchemaError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    except FieldError as exc:  # (the job's own fields: its name, its fellows)
        raise CommandError(f"$.{exc.field}: {exc}", ExitCode.USAGE) from None


def _load_json(path: str) -> Any:
    try:
        return jsonio.loads(Path(path).read_bytes())
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}", ExitCode.USAGE) from None
    except jsonio.JSONDecodeError as exc:
        raise CommandError(f"{path}: not valid JSON: {exc}", ExitCode.USAGE) from None


def _topology(args: argparse.Namespace, cluster: Any) -> Topology:
    """The grid a submit asks for: the training profile's cluster, then the flags."""
    from swarm_core.config.profiles import job_topology

    topo = job_topology(cluster, args.fellows, args.stages, args.replicas, args.wiring,
                        args.routing)
    if args.layout is not None:  # (its cells are the fellows, its length the stages)
        for name, given in (("fellows", args.fellows), ("stages", args.stages)):
            if given is None:
                topo.pop(name, None)
        topo["layout"] = args.layout
    if args.rebalance_every is not None:
        topo["rebalance_every"] = args.rebalance_every
    try:
        return structure(topo, Topology, "$.topology")
    except SchemaError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


# Each sync flag, by the SyncConfig field it sets (argparse's dest is the flag's own name).
SYNC_FLAGS = {"mode": "--sync", "inner_steps": "--inner-steps",
              "overlap_steps": "--overlap-steps", "fragments": "--fragments",
              "compression": "--sync-compression",
              "density": "--density", "chunk": "--chunk", "value_bits": "--value-bits",
              "error_decay": "--error-decay", "dct_chunk": "--dct-chunk", "topk": "--topk",
              "sign_values": "--sign-values", "momentum_decay": "--momentum-decay"}


def _given_sync_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The SyncConfig fields the sync flags set, by field."""
    given = {field: getattr(args, flag.removeprefix("--").replace("-", "_"))
             for field, flag in SYNC_FLAGS.items()}
    return {field: value for field, value in given.items() if value is not None}


def _sync_config(args: argparse.Namespace, training: dict[str, Any]) -> SyncConfig | None:
    """The training profile's sync with the flags over it, as one SyncConfig; None where no
    flag is given (the profile's stays). A bad value or combination is a usage error that
    names the flag it comes from (the flags given, where the field is the profile's)."""
    from swarm_core.config.profiles import sync_over

    given = _given_sync_flags(args)
    if not given:
        return None
    try:
        return sync_over(training, given)
    except SchemaError as exc:
        field = (exc.field or "").rsplit(".", 1)[-1]
        if field in given:
            said = f"{SYNC_FLAGS[field]} {given[field]}"
        else:  # (a field of the profile's that the flags no longer fit)
            said = " ".join(f"{SYNC_FLAGS[f]} {v}" for f, v in given.items()) \
                + " over the training profile's sync"
        raise CommandError(f"{said}: {exc}", ExitCode.USAGE) from None


def _with_compression(model: ModelConfig, spec: str) -> ModelConfig:
    """The model profile with ``--compression``'s boundary spec in place of its own."""
    try:
        return attrs.evolve(model, compression=spec)
    except (FieldError, SchemaError) as exc:
        raise CommandError(f"--compression {spec}: {exc}", ExitCode.USAGE) from None


def cmd_submit(args: argparse.Namespace) -> int:
    if args.name == "":
        raise CommandError("--name is empty", ExitCode.USAGE)
    if args.payload:
        given = [flag for flag, value in (("--model", args.model), ("--training", args.training),
                                          ("--compression", args.compression),
                                          ("--name", args.name), ("--fellows", args.fellows),
                                          ("--stages", args.stages),
                                          ("--replicas", args.replicas),
                                          ("--wiring", args.wiring),
                                          ("--routing", args.routing),
                                          ("--layout", args.layout),
                                          ("--rebalance-every", args.rebalance_every),
                                          ("--steps", args.steps),
                                          ("--optimizer", args.optimizer),
                                          ("--transport", args.transport),
                                          ("--warm-start", args.warm_start),
                                          *((SYNC_FLAGS[f], v)
                                            for f, v in _given_sync_flags(args).items()))
                 if value is not None]
        if given:
            raise CommandError(f"--payload is the whole job body; {', '.join(given)} would be "
                               "ignored: set them in the payload", ExitCode.USAGE)
        req = _load_payload(args.payload)
    elif args.model or args.training or args.compression:
        from swarm_core.config.defaults import DEFAULT_MODEL, DEFAULT_TRAINING
        from swarm_core.config.profiles import (
            ConfigError,
            load_job_cluster,
            load_job_training,
            load_model_profile,
        )
        cluster = None
        try:
            model = load_model_profile(Path(args.model)) if args.model \
                else structure(DEFAULT_MODEL, ModelConfig)
            if args.training:
                training, _ = load_job_training(Path(args.training))
                cluster = load_job_cluster(Path(args.training))
            else:
                training = dict(DEFAULT_TRAINING)
        except ConfigError as exc:
            raise CommandError(str(exc), ExitCode.USAGE) from None
        if args.compression is not None:
            model = _with_compression(model, args.compression)
        if args.steps is not None:
            training["steps"] = args.steps
        if args.optimizer is not None:
            training["optimizer"] = args.optimizer
        if args.transport is not None:
            training["transport"] = args.transport
        if args.warm_start is not None:
            training["warm_start"] = args.warm_start
        sync = _sync_config(args, training)
        req = train_job(model, training, _topology(args, cluster), args.name or model.name,
                        sync)
    elif args.stages or args.replicas or args.optimizer or args.wiring or args.routing \
            or args.layout or args.rebalance_every or args.transport or args.warm_start \
            or _given_sync_flags(args):
        raise CommandError("--stages, --replicas, --wiring, --routing, --layout, "
                           "--rebalance-every, --optimizer, --transport, --warm-start and the "
                           "sync flags are for train jobs (--model, --training)", ExitCode.USAGE)
    else:
        req = smoke_job(args.fellows or 1, args.steps or 5, args.name or "smoke")

    async def body(c: SwarmClient) -> int:
        job = await c.submit(req)
        if not args.watch:
            if args.format == "json":
                emit_json(job)
            else:
                print_line(f"{job.job_id} {job.state} ({job.waiting_for or 'queued'})")
            return 0
        return _watched(await watch_job(c, job.job_id, json_lines=args.format == "json"))

    return run_with_client(args, body)


def cmd_cancel(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> None:
        job = await c.cancel(args.job_id)
        if args.format == "json":
            emit_json(job)
        else:
            print_line(f"{job.job_id} {job.state}")

    return run_with_client(args, body)


def cmd_watch(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> int:
        return _watched(await watch_job(c, args.job_id, json_lines=args.format == "json"))

    return run_with_client(args, body)


def _describe(event: Event | Mapping[str, Any]) -> str | None:
    """A watch line for an event (a frame not yet read is read here), or None for one that
    says nothing worth a line."""
    data = (event if isinstance(event, Event) else read_event(event)).data
    match data:
        case MetricReport():
            return _describe_metric(data)
        case JobShard():
            return f"stage {data.receipt.stage} shard at step {data.receipt.step} reached " \
                "the leader"
        case JobMembership():
            return f"{data.job_id} {_kind(data.change)} @{data.change.step}: " \
                + _membership_change(data.change)
        case JobUpdate() if data.type != "job.updated":
            reason = f": {data.reason}" if data.reason else ""
            return f"{data.job_id} {data.state}{reason}"
    return None


def _describe_metric(m: MetricReport) -> str | None:
    figures = m.metrics
    if figures.eval_loss is not None and m.state == "RUNNING":
        loss = figures.eval_loss
        return f"step {m.step}  eval loss {loss:.4f}  perplexity {perplexity(loss):.2f}"
    if m.loss is None and m.state == "RUNNING" and figures != StageMetrics():
        return None  # a training stage without the loss: the last stage speaks for all
    parts = [f"step {m.step}", f"fellow {m.fellow_id}"]
    if m.replica is not None and m.stage is not None:  # (a job with replicas)
        parts.insert(1, fmt_cell(m.stage, m.replica))
    if m.loss is not None:
        parts.append(f"loss {m.loss:.4f}")
    if m.tokens_per_s:
        parts.append(f"{m.tokens_per_s:.0f} tok/s")
    if m.replica is not None:
        parts += _sync_figures(figures)
    if m.state != "RUNNING":
        parts.append(m.state)
    return "  ".join(parts)


def _sync_figures(figures: StageMetrics) -> list[str]:
    """A cell's group synchronisation in a watch line: bytes and share of the step."""
    out = []
    if figures.sync_bytes is not None:
        out.append(f"sync {fmt_bytes(int(figures.sync_bytes))}")
    share = figures.sync_share
    if share is not None:
        out.append(f"sync wait {share:.0%}")
    return out


async def watch_job(c: SwarmClient, job_id: str, *, json_lines: bool = False,
                    reconnect_s: float = 30.0) -> JobInfo:
    """Print the job's events until it is terminal; survives a leader restart for a while."""
    job = await c.job(job_id)
    if not json_lines:
        print_line(f"{job.job_id} {job.state} ({job.waiting_for or job.reason or job.name})")
        if is_grid(job) and job.placement is not None and job.state not in TERMINAL:
            emit_grid(job)  # (where each cell runs; its lines below name it)
    lost_since: float | None = None
    while job.state not in TERMINAL:
        try:
            stream = c.event_stream(types=["job", "metric"], job_id=job_id)
            async for event in stream:
                lost_since = None
                if isinstance(event.data, Hello):
                    # Subscribed: re-read so nothing between GET and subscribe is missed.
                    job = await c.job(job_id)
                    if job.state in TERMINAL:
                        break
                    continue
                if isinstance(event.data, Unknown):
                    continue  # (a newer leader's kind of event)
                if json_lines:
                    print_line(jsonio.dumps(event_json(event)).decode())
                else:
                    line = _describe(event)
                    if line:
                        print_line(line)
                if isinstance(event.data, JobUpdate) and event.data.state in TERMINAL:
                    job = await c.job(job_id)
                    break
            else:
                job = await c.job(job_id)
        except LeaderUnreachable:
            now = time.monotonic()
            lost_since = lost_since or now
            if now - lost_since > reconnect_s:
                raise
            await asyncio.sleep(1.0)
    if not json_lines:
        if is_grid(job) and job.placement is not None:
            emit_grid(job)  # each cell's final figures
        reason = f": {job.reason}" if job.reason else ""
        print_line(f"{job.job_id} {job.state} at step {job.last_step}{reason}")
    return job


def _watched(final: JobInfo) -> int:
    """A watch's exit code: 0 if the job COMPLETED; else 1, with why on stderr in one line
    (in json mode too, whose stdout holds only events)."""
    if final.state == JobState.COMPLETED.value:
        return 0
    reason = f": {final.reason}" if final.reason else ""
    warn(f"{final.job_id} {final.state} at step {final.last_step}{reason}")
    return int(ExitCode.FAILURE)


def _job_states(text: str) -> str:
    values = [part.strip().upper() for part in text.split(",")]
    known = {s.value for s in JobState}
    if not all(v in known for v in values):
        raise argparse.ArgumentTypeError(
            f"expected one or more of {', '.join(s.value for s in JobState)} (comma-separated), "
            f"got {text!r}")
    return ",".join(values)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="list jobs, oldest first")
    p.add_argument("--state", type=_job_states, default=None,
                   help="only jobs in this state (or these: comma-separated)")
    p.add_argument("--order", choices=JOB_ORDERS, default="queue",
                   help="queue: oldest submitted first; newest: newest first; finished: only "
                        "finished jobs, the last to finish first (default: %(default)s)")
    p.add_argument("--limit", type=number(int, 1, MAX_JOB_PAGE, "--limit"), default=None,
                   help=f"at most this many (1-{MAX_JOB_PAGE}); the last line names the next page")
    p.add_argument("--after", type=job_id, default=None, metavar="JOB",
                   help="only jobs listed after this one (a page's next_after)")
    add_format(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", help="one job in detail (json: with its loss history)")
    p.add_argument("job_id", type=job_id, help="e.g. job-000001")
    add_format(p)
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("submit", help="enqueue a job: train with --model/--training, a whole "
                                      "body with --payload, else a smoke job")
    p.add_argument("--payload", help="JSON file with a job body (name, kind, model, training, "
                                     "topology)")
    p.add_argument("--model", help="model profile JSON (a train job; default profile: "
                                   "small_none)")
    p.add_argument("--training", help="training profile JSON (a train job; default: "
                                      "quickstart_shakespeare)")
    p.add_argument("--compression", default=None,
                   help="the boundary's compression spec in place of the model profile's (a "
                        "train job): " + ", ".join(f.grammar for f in BOUNDARY_FORMS)
                        + " (K, B integers; see docs/configs.md)")
    p.add_argument("--name", default=None, help="job name (smoke job)")
    p.add_argument("--fellows", type=fellow_count, default=None,
                   help="fellows the job needs (default: the training profile's "
                        "cluster_profile, else 1)")
    p.add_argument("--stages", type=fellow_count, default=None,
                   help="pipeline stages of a train job (default: fellows / replicas)")
    p.add_argument("--replicas", type=fellow_count, default=None,
                   help="data-parallel replicas of every stage (default: the training "
                        "profile's cluster_profile, else 1); batch_size stays the step's")
    p.add_argument("--wiring", choices=("chain", "swarm"), default=None,
                   help="how micro-batches travel between replicas (topology.wiring): chain, "
                        "replica r to replica r (default); swarm, each routed to a replica "
                        "of the next stage by throughput (SWARM parallelism; sync dp)")
    p.add_argument("--routing", choices=("given", "measured"), default=None,
                   help="swarm wiring: deal micro-batches by topology.route_weights (given, "
                        "default: a run repeats bit for bit) or by each replica's measured "
                        "throughput (measured, SWARM's estimate, agreed every step)")
    p.add_argument("--layout", type=cell_layout, default=None, metavar="IDS",
                   help="swarm wiring, sync dp: stages of unequal cells, per stage its cells' "
                        "ids (topology.layout), e.g. '0;0,1,2' (stage 0 one cell, stage 1 "
                        "three); the fellows are the cells")
    p.add_argument("--rebalance-every", type=rebalance_every, default=None, metavar="K",
                   help="swarm wiring, measured routing, sync dp: every K steps move a peer "
                        "to the stage that bounds the pipeline where that raises it by 20%% "
                        "(SWARM's rebalancing; topology.rebalance_every)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps (smoke default 5; overrides the training profile's)")
    p.add_argument("--sync", choices=SYNC_MODES, default=None,
                   help="how the replicas keep one set of weights (training.sync.mode; default: "
                        "the training profile's, else dp)")
    p.add_argument("--inner-steps", type=step_count, default=None,
                   help="diloco, sparseloco: inner steps between two outer steps "
                        "(training.sync.inner_steps)")
    p.add_argument("--overlap-steps", type=step_count, default=None,
                   help="diloco, sparseloco: inner steps the outer step's average crosses during "
                        "(training.sync.overlap_steps; 0 waits for it)")
    p.add_argument("--fragments", type=sync_field(int, "fragments"), default=None,
                   help="diloco, sparseloco: parameter fragments taking turns, one outer step "
                        "every inner_steps / fragments (Streaming DiLoCo; training.sync."
                        "fragments)")
    p.add_argument("--sync-compression", default=None,
                   help="what the replicas' ring sends: none, fp16, bf16, int8[_bB] "
                        "(training.sync.compression)")
    p.add_argument("--density", type=sync_field(float, "density"), default=None,
                   help="sparseloco: the share of each chunk sent, 0 < d <= 1 "
                        "(training.sync.density)")
    p.add_argument("--chunk", type=sync_field(int, "chunk"), default=None,
                   help="sparseloco: elements of a tile the top density is chosen in "
                        "(training.sync.chunk)")
    p.add_argument("--value-bits", type=sync_field(int, "value_bits"), default=None,
                   help="sparseloco: bits of each value sent: 1, 2, 4, 8 or 32 "
                        "(training.sync.value_bits)")
    p.add_argument("--error-decay", type=sync_field(float, "error_decay"), default=None,
                   help="sparseloco: what the error feedback keeps of itself each outer step, "
                        "0..1 (training.sync.error_decay)")
    p.add_argument("--transport", choices=("shaped", "torch"), default=None,
                   help="training.transport: shaped (the app's TCP links, link shaping "
                        "applies) or torch (torch.distributed gloo groups, unshaped)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default=None,
                   help="training.optimizer: adamw, or muon (Muon on the hidden matrices, AdamW "
                        "on the rest; under diloco/sparseloco the inner optimiser)")
    p.add_argument("--dct-chunk", type=sync_field(int, "dct_chunk"), default=None,
                   help="demo: the side of a DCT block (training.sync.dct_chunk)")
    p.add_argument("--topk", type=sync_field(int, "topk"), default=None,
                   help="demo: components sent of each DCT block (training.sync.topk)")
    p.add_argument("--sign-values", action=argparse.BooleanOptionalAction, default=None,
                   help="demo: send the components' signs alone, a bit each "
                        "(training.sync.sign_values)")
    p.add_argument("--momentum-decay", type=sync_field(float, "momentum_decay"), default=None,
                   help="demo: what each replica's momentum keeps of itself each step "
                        "(training.sync.momentum_decay)")
    p.add_argument("--warm-start", type=warm_start, default=None, metavar="JOB[:STEP]",
                   help="start from the weights of JOB's checkpoint at STEP (default: its "
                        "newest) instead of the seeded init; fresh optimiser and lr schedule "
                        "(training.warm_start)")
    p.add_argument("--watch", action="store_true", help="stream the job until it ends")
    add_format(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("cancel", help="cancel a pending or running job")
    p.add_argument("job_id", type=job_id, help="e.g. job-000001")
    add_format(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("watch", help="stream a job's events until it ends "
                                     "(exit 0 if it COMPLETED)")
    p.add_argument("job_id", type=job_id, help="e.g. job-000001")
    add_format(p)
    p.set_defaults(func=cmd_watch)


