"""HTTP routes of the leader. The ROUTES table drives both the router and the OpenAPI document."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from aiohttp import WSCloseCode, web

import swarm_core
from swarm_core import jsonio
from swarm_core.artifacts.manifests import PushedManifest, ReplicaStateManifest, ShardManifest
from swarm_core.contract import (
    DEFAULT_LOG_LINES,
    JOB_ORDERS,
    MAX_JOB_PAGE,
    MAX_LOG_LINES,
    FellowLog,
    FellowLogTail,
    Heartbeat,
    JobInfo,
    JobList,
    JobStatusBatch,
    JobStatusUpdate,
    JobSubmit,
    ProgressList,
    RegroupAnswer,
    RegroupReport,
)
from swarm_core.contract.events import Event, FellowReleased, Hello, SpeedSet, event_json
from swarm_core.contract.metrics import MAX_REPORTS_AT_ONCE
from swarm_core.leader import content_coding
from swarm_core.leader.errors import ApiError
from swarm_core.leader.keys import CONFIG_KEY, STATE_KEY, WEBSOCKETS_KEY
from swarm_core.leader.openapi import INT_PATH_PARAMS
from swarm_core.leader.registry import FellowRecord
from swarm_core.leader.state import LeaderState
from swarm_core.protocol import (
    API_PREFIX,
    SESSION_HEADER,
    FellowInfo,
    FellowList,
    JobState,
    LeaderInfo,
    LinkLimits,
    NodeList,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResult,
    SetSpeedRequest,
    SignalBatch,
)
from swarm_core.schema import structure, unstructure

MAX_POLL_S = 30.0


@attrs.frozen
class Route:
    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    summary: str
    body: type | None = None
    response: type | None = None
    auth: bool = True
    fellow_session: bool = False
    # (name, type, description[, extra JSON Schema])
    query: tuple[tuple[Any, ...], ...] = ()
    errors: tuple[int, ...] = ()
    upload: bool = False  # multipart body (manifest JSON, then weights)


def _state(request: web.Request) -> LeaderState:
    return request.app[STATE_KEY]


def ok(obj: Any, status: int = 200) -> web.Response:
    data = unstructure(obj) if attrs.has(type(obj)) else obj
    return web.Response(status=status, body=jsonio.dumps(data), content_type="application/json")


async def read_body(request: web.Request, cls: type) -> Any:
    return structure(await read_json(request), cls)


async def read_json(request: web.Request) -> Any:
    """A request's JSON body, decoded but not structured (a handler that asks which fields
    the body named, as set-speed does, structures it itself)."""
    if request.content_type not in ("application/json", "application/octet-stream", ""):
        raise ApiError(415, f"expected application/json, got {request.content_type}")
    name = content_coding.coding(request)  # (refused before the body is read)
    raw = content_coding.decode(request, name, await request.read())
    if not raw:
        # Not read as {}: a request that lost its body would run on every default (a POST
        # /jobs so cut short would start a training job). {} asks for them outright.
        raise ApiError(400, "empty body: expected a JSON object ({} for every default)",
                       code="invalid_json")
    try:
        data = jsonio.loads(raw)
    except jsonio.JSONDecodeError as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
    return data


def _int_param(request: web.Request, name: str) -> int:
    raw = request.match_info.get(name) or request.query.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {raw!r}", code="invalid_param",
                       field=name) from None
    if not 0 <= value < 2**63:
        raise ApiError(400, f"{name} must be between 0 and 2**63-1", code="invalid_param",
                       field=name)
    return value


def _float_query(request: web.Request, name: str, default: float, hi: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be a number, got {raw!r}", code="invalid_param",
                       field=name) from None
    if not 0 <= value <= hi:
        raise ApiError(400, f"{name} must be between 0 and {hi:g}", code="invalid_param",
                       field=name)
    return value


# --- meta ---------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return ok({"ok": True, "version": swarm_core.__version__})


async def info(request: web.Request) -> web.Response:
    st = _state(request)
    return ok(LeaderInfo(
        version=swarm_core.__version__, started_at=st.started_at, state_dir=str(st.state_dir),
        stale_after_s=st.registry.stale_after_s,
        heartbeat_interval_s=st.registry.heartbeat_interval_s,
        fellows_total=len(st.registry), fellows_ready=len(st.registry.ready()),
        jobs_pending=st.jobs.count(JobState.PENDING),
        jobs_running=st.jobs.count(JobState.RUNNING),
    ))


async def openapi(request: web.Request) -> web.Response:
    from swarm_core.leader.openapi import build_openapi

    return ok(build_openapi(ROUTES))


# --- fellows ------------------------------------------------------------------------------------


async def register(request: web.Request) -> web.Response:
    st = _state(request)
    req = await read_body(request, RegisterRequest)
    rec, replaced = st.registry.register(req)
    if replaced:
        st.jobs.fellow_replaced(rec)
    st.flush()
    st.fellow_event("fellow.registered", rec)
    st.jobs.dispatch()
    return ok(RegisterResponse(
        fellow_id=rec.fellow_id, session=rec.session,
        heartbeat_interval_s=st.registry.heartbeat_interval_s,
        stale_after_s=st.registry.stale_after_s,
    ), status=201)


async def heartbeat(request: web.Request) -> web.Response:
    st = _state(request)
    fellow_id = _int_param(request, "fellow_id")
    hb = await read_body(request, Heartbeat)
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER), fellow_id)
    before = st.registry.heartbeat(rec, hb)
    st.jobs.reconciler.heartbeat(rec, hb)
    after = st.registry.status(rec)
    st.fellow_event("fellow.heartbeat" if before == after else "fellow.status", rec)
    if before != after:
        st.jobs.dispatch()  # the tick dispatches too: an unchanged heartbeat needs no scan
    # send_log: someone reads this fellow's log; it posts its new lines to .../log.
    return ok({"pending_signals": len(rec.pending),
               "send_log": st.logs.wanted(rec.fellow_id)})


async def poll_signals(request: web.Request) -> web.Response:
    st = _state(request)
    fellow_id = _int_param(request, "fellow_id")
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER), fellow_id)
    after = _int_param(request, "after") if "after" in request.query else 0
    wait = _float_query(request, "wait", 0.0, MAX_POLL_S)
    signals = await st.registry.wait_signals(rec, after, wait)
    return ok(SignalBatch(signals=signals))


async def list_fellows(request: web.Request) -> web.Response:
    st = _state(request)
    now = time.monotonic()
    return ok(FellowList(fellows=[st.registry.info(r, now) for r in st.registry.all()]))


async def get_fellow(request: web.Request) -> web.Response:
    st = _state(request)
    return ok(st.registry.info(st.registry.get(_int_param(request, "fellow_id"))))


async def set_speed(request: web.Request) -> web.Response:
    st = _state(request)
    rec = st.registry.get(_int_param(request, "fellow_id"))
    body = await read_json(request)
    req = structure(body, SetSpeedRequest)
    if st.registry.status(rec).left:
        raise ApiError(409, f"fellow {rec.fellow_id} has left the cluster", code="fellow_gone")
    if req.to is not None:
        _check_pair(st, rec, req)
    if req.link_given(body):
        _check_shaped(st, rec)
    limits = LinkLimits(tx_mbps=req.tx_mbps, rx_mbps=req.rx_mbps, latency_ms=req.latency_ms) \
        if req.link_given(body) else None  # (a slowdown alone leaves the link as it is)
    link = unstructure(limits) if limits is not None else None
    # (first: a record the store refuses sends nothing)
    job_id = st.jobs.link_set(rec, limits, req.slowdown, to_fellow=req.to)
    payload = {**(link or {}), **({"slowdown": req.slowdown} if req.slowdown else {}),
               **({"to": req.to} if req.to is not None else {})}
    sig = st.registry.send(rec, "SET_SPEED", None, payload)
    st.hub.publish(SpeedSet(rec.fellow_id, job_id, limits or LinkLimits(),
                            slowdown=req.slowdown, link_kept=True if limits is None else None,
                            to_fellow=req.to))
    return ok({"fellow_id": rec.fellow_id, "signal_seq": sig.seq, "link": link,
               "slowdown": req.slowdown, "job_id": job_id}, status=202)


def _check_shaped(st: LeaderState, rec: FellowRecord) -> None:
    """A link set on a fellow whose running job moves its bytes over torch.distributed would
    change nothing that job sends (gloo's sockets are not the app's): refused, not pretended.
    A slowdown (the fellow's compute) still applies."""
    job = st.jobs.find(rec.assigned_job)
    if job is None or job.state is not JobState.RUNNING:
        return
    if job.spec.train is not None and job.spec.train.transport == "torch":
        raise ApiError(409, f"fellow {rec.fellow_id} runs {job.job_id} on the torch transport, "
                            "whose links are unshaped (gloo's sockets are not the app's): a "
                            "link setting would change nothing; a slowdown still applies",
                       code="unshaped_transport")


def _check_pair(st: LeaderState, rec: FellowRecord, req: SetSpeedRequest) -> None:
    """A per-pair set-speed names a peer this fellow has a shaped pair link to now (its last
    heartbeat lists them) and sets a link, not a slowdown: else it would change nothing."""
    if req.slowdown is not None:
        raise ApiError(400, "a slowdown is the fellow's own, not a pair's: leave out 'to' or "
                            "'slowdown'", field="$.to")
    assert req.to is not None
    peer = st.registry.get(req.to)  # (404 for an unknown fellow)
    if peer.fellow_id == rec.fellow_id:
        raise ApiError(400, f"fellow {rec.fellow_id} has no link to itself", field="$.to")
    if not any(p.peer_fellow == peer.fellow_id for p in rec.peers):
        raise ApiError(409, f"fellow {rec.fellow_id} has no link to fellow {peer.fellow_id} "
                            "that a link matrix shapes (a per-pair set-speed needs a running "
                            "job with a network matrix)", code="no_pair_link")


async def release(request: web.Request) -> web.Response:
    st = _state(request)
    req = await read_body(request, ReleaseRequest)
    if req.all:
        targets = [r for r in st.registry.all() if st.registry.status(r).live]
    else:
        targets = [st.registry.get(fid) for fid in dict.fromkeys(req.fellow_ids)]
        # (a fellow that does not heartbeat would never take the signal: saying "released"
        # would change nothing; checked whole before any is sent)
        for rec in targets:
            status = st.registry.status(rec)
            if not status.live:
                raise ApiError(409, f"fellow {rec.fellow_id} ({rec.name}) is {status.value}: "
                                    "it does not heartbeat, so nothing can release it; "
                                    f"'swarm forget --fellow-id {rec.fellow_id}' drops its "
                                    "record", code="fellow_gone", field="$.fellow_ids")
    for rec in targets:
        st.registry.send(rec, "RELEASE", rec.assigned_job, {})
        st.hub.publish(FellowReleased(rec.fellow_id, rec.name))
    return ok(ReleaseResult(released=[r.fellow_id for r in targets]), status=202)


async def forget_fellow(request: web.Request) -> web.Response:
    """Drop the record of a fellow that is gone (stale, offline, released or leaving), so
    that views stop listing it. A fellow that still heartbeats, or holds a cell of a running
    or recovering job, is refused: its record is how the leader knows it."""
    st = _state(request)
    rec = st.registry.get(_int_param(request, "fellow_id"))
    status = st.registry.status(rec)
    if status.live:
        raise ApiError(409, f"fellow {rec.fellow_id} ({rec.name}) is {status.value}: it still "
                            "heartbeats (release it first)", code="fellow_live")
    job = st.jobs.running()
    if job is not None and rec.fellow_id in job.fellows \
            and not job.stages_done_by(rec.fellow_id):
        raise ApiError(409, f"fellow {rec.fellow_id} ({rec.name}) holds a cell of the running "
                            f"job {job.job_id}", code="fellow_in_job")
    if rec.assigned_job is not None:
        raise ApiError(409, f"fellow {rec.fellow_id} ({rec.name}) is assigned to job "
                            f"{rec.assigned_job}", code="fellow_in_job")
    st.store.forget_fellow(rec.fellow_id)  # (first: refused, nothing changes; errors.py)
    st.registry.forget(rec)
    st.logs.forget(rec.fellow_id)
    return ok({"fellow_id": rec.fellow_id, "name": rec.name, "status": status.value})


async def fellow_log(request: web.Request) -> web.Response:
    """The tail of a fellow's own log as it last posted it; asks the fellow for a fresh one
    (its next heartbeat answer says so), so a reader polling every second or two follows it."""
    st = _state(request)
    rec = st.registry.get(_int_param(request, "fellow_id"))
    n = DEFAULT_LOG_LINES
    if "lines" in request.query:
        raw = request.query["lines"]
        try:
            n = int(raw)
        except ValueError:
            raise ApiError(400, f"lines must be an integer, got {raw[:32]!r}",
                           code="invalid_param", field="lines") from None
        if not 1 <= n <= MAX_LOG_LINES:
            raise ApiError(400, f"lines must be between 1 and {MAX_LOG_LINES}, got {n}",
                           code="invalid_param", field="lines")
    status = st.registry.status(rec)
    if status.live:  # (a stale or departed fellow would never answer)
        st.logs.want(rec.fellow_id)
    held = st.logs.held(rec.fellow_id)
    if held is None:
        message = f"fellow {rec.fellow_id} has sent no log yet" + (
            "; asked it now, it sends with its next heartbeat" if status.live
            else f" and is {status.value}")
        return ok(FellowLog(fellow_id=rec.fellow_id, name=rec.name, lines=[], seq=0,
                            received_at=None, age_s=None, message=message,
                            asked=status.live))
    age = round(time.monotonic() - held.received_mono, 3)
    message = "" if status.live else \
        f"fellow {rec.fellow_id} is {status.value}: its last log, {age:.0f}s old"
    lines = list(held.lines)[-n:]
    return ok(FellowLog(fellow_id=rec.fellow_id, name=rec.name, lines=lines, seq=held.seq,
                        received_at=held.received_at, age_s=age, message=message,
                        asked=status.live))


async def post_fellow_log(request: web.Request) -> web.Response:
    st = _state(request)
    # A fellow posts only its own log: its session names its id (403 for another's).
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER),
                                 _int_param(request, "fellow_id"))
    tail = await read_body(request, FellowLogTail)
    return ok({"seq": st.logs.post(rec.fellow_id, tail)})


async def list_nodes(request: web.Request) -> web.Response:
    st = _state(request)
    return ok(NodeList(nodes=[st.registry.node(r) for r in st.registry.all()]))


# --- jobs ---------------------------------------------------------------------------------------


async def submit_job(request: web.Request) -> web.Response:
    st = _state(request)
    req = await read_body(request, JobSubmit)
    job = st.jobs.submit(req)
    st.jobs.dispatch()
    return ok(st.jobs.info(job), status=201)


async def list_jobs(request: web.Request) -> web.Response:
    """``state`` (one or several, comma-separated) in ``order`` (queue, newest or finished),
    then a page: ``limit`` jobs ``after`` a job id (the last page's ``next_after``). Linear in
    the jobs it may hold, and only the page is built: one pass orders the queue for all."""
    st = _state(request)
    states = _job_states(request.query["state"]) if "state" in request.query else None
    order = request.query.get("order", "queue")
    if order not in JOB_ORDERS:
        raise ApiError(400, f"order must be one of {', '.join(JOB_ORDERS)}, got {order[:32]!r}",
                       code="invalid_param", field="order")
    if order == "finished" and states is not None and not all(s.terminal for s in states):
        raise ApiError(400, "state: order=finished lists only finished jobs (COMPLETED, FAILED, "
                       "CANCELLED)", code="invalid_param", field="state")
    cursor = None
    if "after" in request.query:
        after = request.query["after"]
        cursor = st.jobs.find(after)
        if cursor is None or (order == "finished" and not cursor.state.terminal):
            why = "no job" if cursor is None else "order=finished: not finished:"
            raise ApiError(400, f"after: {why} {after[:64]!r}", code="invalid_param",
                           field="after")
    limit = None
    if "limit" in request.query:
        limit = _int_param(request, "limit")
        if not 1 <= limit <= MAX_JOB_PAGE:
            raise ApiError(400, f"limit must be between 1 and {MAX_JOB_PAGE}", code="invalid_param",
                           field="limit")
    page = st.jobs.page(states, order, cursor, limit)
    queue = st.jobs.order()
    return ok(JobList(jobs=[st.jobs.info(j, order=queue) for j in page.jobs],
                      next_after=page.next_after, total=page.total))


_ONE_STATE = "|".join(v for s in JobState for v in (s.value, s.value.lower()))
_STATES_PATTERN = f"^({_ONE_STATE})(,({_ONE_STATE}))*$"


def _job_states(raw: str) -> frozenset[JobState]:
    try:
        return frozenset(JobState(part.strip().upper()) for part in raw.split(","))
    except ValueError:
        raise ApiError(400, f"state must be one or more of {', '.join(s.value for s in JobState)}"
                       f" (comma-separated), got {raw[:64]!r}", code="invalid_param",
                       field="state") from None


async def get_job(request: web.Request) -> web.Response:
    st = _state(request)
    return ok(st.jobs.info(st.jobs.get(request.match_info["job_id"]), with_history=True))


async def job_progress(request: web.Request) -> web.Response:
    st = _state(request)
    after = _int_param(request, "after") if "after" in request.query else 0
    # (the stored records as written: ProgressList's shape, without rebuilding each one)
    return ok({"records": st.jobs.progress_rows(request.match_info["job_id"], after)})


async def cancel_job(request: web.Request) -> web.Response:
    st = _state(request)
    job = st.jobs.cancel(request.match_info["job_id"])
    st.jobs.dispatch()
    return ok(st.jobs.info(job))


async def job_status(request: web.Request) -> web.Response:
    st = _state(request)
    upd = await read_body(request, JobStatusUpdate)
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER), upd.fellow_id)
    job = st.jobs.status_update(request.match_info["job_id"], rec, upd)
    if job.state.terminal:
        st.jobs.dispatch()
    return ok(st.jobs.info(job))


async def job_statuses(request: web.Request) -> web.Response:
    st = _state(request)
    batch = await read_body(request, JobStatusBatch)
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER),
                                 batch.updates[0].fellow_id)
    return ok(st.jobs.info(st.jobs.status_updates(request.match_info["job_id"], rec,
                                                  batch.updates)))


async def regroup(request: web.Request) -> web.Response:
    st = _state(request)
    rep = await read_body(request, RegroupReport)
    st.registry.by_session(request.headers.get(SESSION_HEADER), rep.fellow_id)
    wait = _float_query(request, "wait", 0.0, MAX_POLL_S)
    job = st.jobs.get(request.match_info["job_id"])
    with st.jobs.kept(job):
        order = st.jobs.membership.report(job, rep)
    if order is None and wait > 0:
        await st.jobs.membership.wait(job, wait)
        order = st.jobs.membership.answer(job, rep)
    return ok(RegroupAnswer(order=order))


async def push_shard(request: web.Request) -> web.Response:
    """A stage's shard from the member that leads its group, or (DiLoCo) another member's own
    optimiser state at that checkpoint, kept beside it and never published."""
    from swarm_core.leader.membership import undone_from
    from swarm_core.leader.uploads import (
        PushTarget,
        checkpoint_dir,
        publish,
        receive_shard,
        replica_state_dir,
    )

    st = _state(request)
    job = st.jobs.get(request.match_info["job_id"])
    stage = _int_param(request, "stage")
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER))
    began = time.time()

    def still_wanted(manifest: PushedManifest | None = None) -> None:
        # Checked again once the upload is in: an ended job's record and export stay as they
        # ended, and a stage handed to a replacement fellow meanwhile is not overwritten by
        # the push of the one it replaced.
        replica = _manifest_replica(job, manifest)
        if not (st.jobs.holds(job, rec.fellow_id, stage, replica) if manifest is not None
                else st.jobs.holds_stage(job, rec.fellow_id, stage)):
            raise ApiError(403, f"fellow {rec.fellow_id} does not hold stage {stage} of "
                                f"{job.job_id}" + (f" (replica {replica})" if replica else ""),
                           code="wrong_fellow")
        if job.state is not JobState.RUNNING:
            raise ApiError(409, f"job {job.job_id} is {job.state.value}, not RUNNING",
                           code="job_not_running")
        # A replica the survivors regrouped without: its late shard would take the stage's
        # export back to older weights (and drop the newer shard of the member that leads).
        if manifest is not None and st.jobs.membership.left(job, replica):
            raise ApiError(409, f"replica {replica} has left {job.job_id}: its shard of stage "
                                f"{stage} comes too late", code="replica_left",
                           field="manifest.replica")
        if manifest is not None:
            not_undone(manifest)

    def not_undone(manifest: PushedManifest) -> None:
        # Swarm wiring's redo: a state at or past the step the survivors train again, on its
        # way before they were told to, is one they undid.
        undone = undone_from(job, began)
        if undone is not None and manifest.step >= undone:
            raise ApiError(409, f"checkpoint step {manifest.step} of {job.job_id} holds a "
                                f"state undone when step {undone} was trained again",
                           code="checkpoint_undone", field="manifest.step")

    def dest_for(m: PushedManifest) -> Path:
        if isinstance(m, ReplicaStateManifest):
            return replica_state_dir(runs, job.job_id, m.step, stage, m.replica)
        return checkpoint_dir(runs, job.job_id, m.step, stage)

    still_wanted()
    cfg = request.app[CONFIG_KEY]
    runs = st.state_dir / "runs"
    manifest = await receive_shard(request, dest_for, cfg.max_upload_bytes,
                                   PushTarget(job.job_id, stage, rec.fellow_id), still_wanted)
    if isinstance(manifest, ReplicaStateManifest):
        return ok(st.jobs.shard_receipt(stage, rec, manifest), status=201)
    # One publish at a time (it prunes the checkpoints another would link from), in a worker
    # thread: its fsyncs and copies would stall the event loop.
    async with st.publishing:
        still_wanted(manifest)  # (a redo decided while it arrived dropped its checkpoint)
        try:
            await asyncio.to_thread(publish, runs, job.job_id, manifest.step, stage,
                                    rec.fellow_id, job.num_stages)
        except FileNotFoundError:  # (... or while it was published)
            raise ApiError(409, f"checkpoint step {manifest.step} of {job.job_id} was "
                                "dropped while it was published: the step was trained again",
                           code="checkpoint_undone", field="manifest.step") from None
        try:  # (... or once it was: its files are the fellow's shard now, of undone weights)
            not_undone(manifest)
        except ApiError:
            st.jobs.shard_withdrawn(job, stage, rec.fellow_id)
            raise
    return ok(st.jobs.shard_pushed(job, stage, rec, manifest), status=201)


def _manifest_replica(job: Any, manifest: PushedManifest | None) -> int:
    """The replica a pushed manifest speaks for (0 where it names none), and the replicas
    whose states it says go with it, checked against the job's grid (a layout's ids), and
    its step against the job's steps (the manifest's class checked the rest as it came
    in)."""
    if manifest is None:
        return 0
    # (the replicas; a layout's largest id + 1, of the placement now: a move may add an id)
    replicas = max(job.spec.topology.width,
                   job.placement.width if job.placement is not None else 0)
    if not manifest.replica < replicas:
        raise ApiError(400, f"manifest replica must be an integer from 0 to {replicas - 1}",
                       field="manifest.replica")
    if isinstance(manifest, ShardManifest) and any(r >= replicas
                                                   for r in manifest.replica_states):
        raise ApiError(400, "manifest replica_states must list other replicas of the job, "
                            "each once", field="manifest.replica_states")
    steps = job.spec.training.steps if job.spec.training is not None else 0
    if manifest.step > steps:
        raise ApiError(400, f"manifest step {manifest.step} is past the job's last ({steps})",
                       field="manifest.step")
    return manifest.replica


async def get_checkpoint(request: web.Request) -> web.StreamResponse:
    """A fellow resuming a job fetches its stage's manifest, weights and optimiser state at a
    step."""
    from swarm_core.artifacts.layout import MANIFEST, OPTIMIZER, WEIGHTS
    from swarm_core.leader.uploads import checkpoint_dir

    part = request.match_info["part"]
    step, stage, job = _checkpoint_request(request, warm=part in ("manifest", "weights"))
    name = {"weights": WEIGHTS, "manifest": MANIFEST, "optimizer": OPTIMIZER}.get(part)
    if name is None:
        raise ApiError(404, f"no checkpoint part {part!r} (manifest, weights or optimizer)")
    path = checkpoint_dir(_state(request).state_dir / "runs", job.job_id, step, stage) / name
    if not path.exists():
        raise ApiError(404, f"no checkpoint of stage {stage} at step {step}",
                       code="no_checkpoint")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"
                                           if part != "manifest" else "application/json"})


async def get_replica_state(request: web.Request) -> web.StreamResponse:
    """A replica resuming a DiLoCo job fetches its own optimiser state at a checkpoint."""
    from swarm_core.artifacts.layout import MANIFEST, OPTIMIZER
    from swarm_core.leader.uploads import replica_state_dir

    step, stage, job = _checkpoint_request(request)
    replica = _int_param(request, "replica")
    part = request.match_info["part"]
    name = {"manifest": MANIFEST, "optimizer": OPTIMIZER}.get(part)
    if name is None:
        raise ApiError(404, f"no replica state part {part!r} (manifest or optimizer)")
    path = replica_state_dir(_state(request).state_dir / "runs", job.job_id, step, stage,
                             replica) / name
    if not path.exists():
        raise ApiError(404, f"no state of replica {replica} of stage {stage} at step {step}",
                       code="no_checkpoint")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"
                                           if part != "manifest" else "application/json"})


def _checkpoint_request(request: web.Request, warm: bool = False) -> tuple[int, int, Any]:
    """(step, stage, job) of a checkpoint fetch, from a fellow that runs some replica
    of that stage (every replica resumes from the stage's checkpoint). With ``warm`` (the
    weights and their manifest), also from a fellow of the running job that warm-starts from
    this job at this step: it takes every stage of it, whatever its own split."""
    st = _state(request)
    job = st.jobs.get(request.match_info["job_id"])
    step, stage = _int_param(request, "step"), _int_param(request, "stage")
    rec = st.registry.by_session(request.headers.get(SESSION_HEADER))
    # (a resume is an attempt of a running job: an ended job's placement still names the
    # fellows that held it, which may no longer fetch what it left)
    holds = job.state is JobState.RUNNING and st.jobs.holds_stage(job, rec.fellow_id, stage)
    if not holds and not (warm and _warm_starts_from(st, rec, job.job_id, step)):
        ended = "" if not job.state.terminal else f" ({job.job_id} is {job.state.value})"
        raise ApiError(403, f"fellow {rec.fellow_id} does not hold stage {stage} of "
                            f"{job.job_id}{ended}", code="wrong_fellow")
    return step, stage, job


def _warm_starts_from(st: LeaderState, rec: FellowRecord, job_id: str, step: int) -> bool:
    """Whether ``rec`` runs a cell of a running job whose spec warm-starts from ``job_id``'s
    checkpoint at ``step`` (the one the leader resolved at submit, and no other)."""
    mine = st.jobs.find(rec.assigned_job)
    if mine is None or mine.state is not JobState.RUNNING or mine.placement is None \
            or rec.fellow_id not in mine.placement.fellows:
        return False
    warm = mine.spec.train.warm_start if mine.spec.train is not None else None
    return warm is not None and (warm.job_id, warm.step) == (job_id, step)


async def get_export(request: web.Request) -> web.Response:
    """A job's export as the leader holds it: its run manifest (the newest shard of each
    stage, and whether they make one model)."""
    st = _state(request)
    job = st.jobs.get(request.match_info["job_id"])
    return ok(st.jobs.files.run_manifest(job))


async def get_export_part(request: web.Request) -> web.StreamResponse:
    """The newest pushed shard of a stage, part by part, for whoever holds the token (a sweep
    or suite runner copying the export next to its run, on this machine or another)."""
    from swarm_core.artifacts.layout import MANIFEST, WEIGHTS
    from swarm_core.leader.uploads import shard_dir

    st = _state(request)
    job = st.jobs.get(request.match_info["job_id"])
    stage = _int_param(request, "stage")
    part = request.match_info["part"]
    name = {"manifest": MANIFEST, "weights": WEIGHTS}.get(part)
    if name is None:
        raise ApiError(404, f"no export part {part!r} (manifest or weights)")
    receipt = job.latest_shard_pushes.get(str(stage))
    path = None if receipt is None else \
        shard_dir(st.state_dir / "runs", job.job_id, stage, receipt.fellow_id) / name
    if path is None or not path.exists():
        raise ApiError(404, f"{job.job_id} has no pushed shard of stage {stage}",
                       code="no_shard")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"
                                           if part != "manifest" else "application/json"})


# --- events -------------------------------------------------------------------------------------

# What ?types= filters on: the part of an event's type before the dot.
EVENT_GROUPS = frozenset({"fellow", "job", "metric"})


async def events(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    types_q = request.query.get("types")
    types = frozenset(t for t in types_q.split(",") if t) if types_q else None
    unknown = sorted((types or frozenset()) - EVENT_GROUPS)
    if unknown:
        raise ApiError(400, f"unknown event type(s) {', '.join(unknown)}: expected "
                       f"{', '.join(sorted(EVENT_GROUPS))}", code="invalid_param", field="types")
    job_id = request.query.get("job_id") or None
    if job_id is not None:
        st.jobs.get(job_id)  # 404 for a job that does not exist: its stream would stay empty
    if request.headers.get("Upgrade", "").lower() != "websocket":
        # Without a WebSocket: the recent events, for polling scripts.
        after = _int_param(request, "after") if "after" in request.query else 0
        return ok({"seq": st.hub.seq, "events": [event_json(e) for e in
                                                  st.hub.recent(after, types, job_id)]})
    ws = web.WebSocketResponse(heartbeat=20.0)
    await ws.prepare(request)
    sub = st.hub.subscribe(types, job_id)
    request.app[WEBSOCKETS_KEY].add(ws)
    # Read what the client sends (nothing but control frames), so that its close is answered
    # at once and ends this handler instead of lingering until the next event.
    reader = asyncio.create_task(_until_closed(ws))
    try:
        await ws.send_bytes(jsonio.dumps(event_json(Event(Hello(), st.hub.seq, time.time()))))
        while not reader.done():
            if sub.queue.empty():
                getter = asyncio.ensure_future(sub.queue.get())
                await asyncio.wait((getter, reader), return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                published = getter.result()
            else:
                published = sub.queue.get_nowait()
            if published is None:
                if sub.overflowed:
                    await ws.close(code=WSCloseCode.TRY_AGAIN_LATER,
                                   message=b"event backlog overflowed; reconnect")
                break
            await ws.send_bytes(published.frame())
    except (ConnectionResetError, RuntimeError):
        pass
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        st.hub.unsubscribe(sub)
        request.app[WEBSOCKETS_KEY].discard(ws)
    return ws


async def _until_closed(ws: web.WebSocketResponse) -> None:
    async for _msg in ws:
        pass


A = API_PREFIX
ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", healthz, "Liveness; needs no token", auth=False),
    Route("GET", f"{A}/info", info, "Leader version, timeouts and counts", response=LeaderInfo),
    Route("GET", f"{A}/openapi.json", openapi, "This document"),
    Route("POST", f"{A}/fellows/register", register, "Register a fellow (same name, same id)",
          body=RegisterRequest, response=RegisterResponse, errors=(400, 409, 413, 503)),
    Route("GET", f"{A}/fellows", list_fellows, "All fellows with live status",
          response=FellowList),
    Route("POST", f"{A}/fellows/release", release, "Release fellows (they leave the cluster)",
          body=ReleaseRequest, response=ReleaseResult, errors=(400, 404, 409)),
    Route("GET", f"{A}/fellows/{{fellow_id}}", get_fellow, "One fellow", response=FellowInfo,
          errors=(400, 404)),
    Route("DELETE", f"{A}/fellows/{{fellow_id}}", forget_fellow,
          "Forget a fellow that is gone (stale, offline, released or leaving); one that "
          "heartbeats or holds a running job's cell is refused (409)",
          errors=(400, 404, 409, 503)),
    Route("POST", f"{A}/fellows/{{fellow_id}}/heartbeat", heartbeat, "Fellow heartbeat",
          body=Heartbeat, fellow_session=True, errors=(400, 401, 403, 503)),
    Route("GET", f"{A}/fellows/{{fellow_id}}/signals", poll_signals,
          "Long-poll the fellow's control signals", response=SignalBatch, fellow_session=True,
          query=(("after", "integer", "last signal seq already seen"),
                 ("wait", "number", f"seconds to wait for a signal, at most {MAX_POLL_S:g}")),
          errors=(400, 401, 403)),
    Route("POST", f"{A}/fellows/{{fellow_id}}/speed", set_speed,
          "Set link limits and/or the emulated compute slowdown of a fellow",
          body=SetSpeedRequest, errors=(400, 404, 409, 503)),
    Route("GET", f"{A}/fellows/{{fellow_id}}/log", fellow_log,
          "The tail of a fellow's own log, as it last sent it (reading asks it for more)",
          response=FellowLog,
          query=(("lines", "integer", f"at most this many of the newest lines "
                  f"(default {DEFAULT_LOG_LINES})", {"minimum": 1, "maximum": MAX_LOG_LINES}),),
          errors=(400, 404)),
    Route("POST", f"{A}/fellows/{{fellow_id}}/log", post_fellow_log,
          "A fellow posts the newest lines of its own log (when a heartbeat answer asks)",
          body=FellowLogTail, fellow_session=True, errors=(400, 401, 403, 409, 413)),
    Route("GET", f"{A}/nodes", list_nodes, "Per-fellow byte counters", response=NodeList),
    Route("POST", f"{A}/jobs", submit_job, "Enqueue a job", body=JobSubmit, response=JobInfo,
          errors=(400, 413, 503)),
    Route("GET", f"{A}/jobs", list_jobs,
          "Jobs of `state` (one or several, comma-separated) in `order` (`queue`: oldest first, "
          "`newest`, `finished`: the last to finish first), a page at a time (`limit`, `after`; "
          "`total` counts all pages)",
          response=JobList,
          query=(("state", "string", "only jobs in this state, or these (comma-separated)",
                  {"pattern": _STATES_PATTERN}),
                 ("order", "string", "queue (default), newest, or finished (finished jobs only)",
                  {"enum": list(JOB_ORDERS)}),
                 ("limit", "integer", "at most this many; next_after then names the last",
                  {"minimum": 1, "maximum": MAX_JOB_PAGE}),
                 ("after", "string", "only jobs listed after this job (a page's next_after)")),
          errors=(400,)),
    Route("GET", f"{A}/jobs/{{job_id}}", get_job, "One job", response=JobInfo, errors=(404,)),
    Route("GET", f"{A}/jobs/{{job_id}}/progress", job_progress,
          "Per-step records of a train job: loss, tokens/s, wire bytes, eval loss",
          response=ProgressList, query=(("after", "integer", "only steps after this one"),),
          errors=(400, 404)),
    Route("POST", f"{A}/jobs/{{job_id}}/cancel", cancel_job, "Cancel a pending or running job",
          response=JobInfo, errors=(404, 409, 503)),
    Route("POST", f"{A}/jobs/{{job_id}}/status", job_status, "A fellow reports job progress",
          body=JobStatusUpdate, response=JobInfo, fellow_session=True,
          errors=(400, 401, 403, 404, 409, 503)),
    Route("POST", f"{A}/jobs/{{job_id}}/statuses", job_statuses,
          "A fellow reports several steps of a job at once, in order (RUNNING reports, at "
          f"most {MAX_REPORTS_AT_ONCE}): taken as /status takes each, stored together; one "
          "refused, none taken",
          body=JobStatusBatch, response=JobInfo, fellow_session=True,
          errors=(400, 401, 403, 404, 409, 503)),
    Route("POST", f"{A}/jobs/{{job_id}}/regroup", regroup,
          "A replica whose stage group's ring broke says where it stands; the answer, once "
          "every cell is accounted for, is the replicas it trains with from now on",
          body=RegroupReport, response=RegroupAnswer, fellow_session=True,
          query=(("wait", "number", f"seconds to wait for the answer, at most {MAX_POLL_S:g}"),),
          errors=(400, 401, 403, 404, 409, 503)),
    Route("POST", f"{A}/jobs/{{job_id}}/shards/{{stage}}", push_shard,
          "A fellow pushes its stage's latest weights (multipart: manifest, weights, optimizer)",
          fellow_session=True, upload=True, errors=(400, 401, 403, 404, 409, 413, 415, 503)),
    Route("GET", f"{A}/jobs/{{job_id}}/checkpoints/{{step}}/{{stage}}/{{part}}", get_checkpoint,
          "A fellow fetches a stage checkpoint to resume from (manifest, weights, optimizer), "
          "or a fellow of a job that warm-starts from it its weights (manifest, weights)",
          fellow_session=True, errors=(400, 401, 403, 404, 409)),
    Route("GET", f"{A}/jobs/{{job_id}}/checkpoints/{{step}}/{{stage}}/replicas/{{replica}}/"
          "{part}", get_replica_state,
          "A replica fetches its own optimiser state at a stage checkpoint (DiLoCo; part: "
          "manifest or optimizer)",
          fellow_session=True, errors=(400, 401, 403, 404, 409)),
    Route("GET", f"{A}/jobs/{{job_id}}/export", get_export,
          "A job's export: the run manifest of its newest shard per stage", errors=(404,)),
    Route("GET", f"{A}/jobs/{{job_id}}/export/{{stage}}/{{part}}", get_export_part,
          "Download a stage's newest pushed shard (part: manifest or weights)",
          errors=(400, 404)),
    Route("GET", f"{A}/events", events,
          "WebSocket stream of fellow, job and metric events (plain GET: the last 1000)",
          query=(("types", "string", "comma-separated: fellow,job,metric"),
                 ("job_id", "string", "only events of this job"),
                 ("after", "integer", "plain GET: only events after this seq")),
          errors=(400, 404)),
)


def add_routes(app: web.Application) -> None:
    for r in ROUTES:
        # Integer ids only match digits, so /fellows/register is never "fellow 'register'".
        path = re.sub(r"{(" + "|".join(INT_PATH_PARAMS) + r")}", r"{\1:\\d+}", r.path)
        app.router.add_route(r.method, path, r.handler)
