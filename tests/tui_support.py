"""Helpers of the console tests: a real leader on a loopback port, in-process fellows (the real
daemon code, minus the torch warm-up), a fixed-data client for snapshots, and waiting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from aiohttp.test_utils import TestServer

from swarm_core.client import ApiError, SwarmClient
from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import (
    FellowLog,
    JobInfo,
    JobList,
    JobSubmit,
    LinkChange,
    SmokeTraining,
    Topology,
)
from swarm_core.fellow import daemon as fellow_daemon
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.protocol import ByteCounters, FellowInfo, LinkLimits, SetSpeedRequest
from tests.clusters import free_port
from tests.support import TOKEN

WAIT_S = 20.0  # generous: the CI machine may be a loaded 2-core box


async def wait_for(pilot: Any, cond: Callable[[], Any], what: str,
                   timeout: float = WAIT_S) -> Any:
    """Let the app run until ``cond()`` is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


class LiveLeader:
    """A real leader app served on 127.0.0.1, stoppable and restartable on the same port."""

    def __init__(self, state_dir: Path, stale_after_s: float = 5.0) -> None:
        self.state_dir = state_dir
        self.stale_after_s = stale_after_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: TestServer | None = None

    async def start(self) -> None:
        cfg = LeaderConfig(state_dir=self.state_dir, token=TOKEN,
                           stale_after_s=self.stale_after_s, tick_s=0.05)
        self.server = TestServer(create_app(cfg), host="127.0.0.1", port=self.port)
        await self.server.start_server()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None

    def client(self) -> SwarmClient:
        return SwarmClient(self.url, TOKEN)


class Fellows:
    """N fellow daemons in this process and event loop."""

    def __init__(self, url: str, names: list[str], heartbeat_s: float = 0.25) -> None:
        self.daemons = [fellow_daemon.FellowDaemon(fellow_daemon.FellowOptions(
            leader_url=url, token=TOKEN, name=name, heartbeat_s=heartbeat_s, poll_wait_s=2.0,
            max_backoff_s=0.5)) for name in names]
        self.tasks: list[asyncio.Task[int]] = []

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(d.run(), name=f"fellow-{d.opts.name}")
                      for d in self.daemons]

    async def stop(self) -> None:
        for d in self.daemons:
            d.request_stop("test over")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 10)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # the daemons installed these
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fellows here run smoke jobs only: skip the torch warm-up the daemon starts with."""
    monkeypatch.setattr(fellow_daemon, "import_engine", lambda: None)


@contextlib.asynccontextmanager
async def live_cluster(tmp_path: Path, n: int = 3, **leader_kw: Any
                       ) -> AsyncIterator[tuple[LiveLeader, Fellows]]:
    leader = LiveLeader(tmp_path / "state", **leader_kw)
    await leader.start()
    fellows = Fellows(leader.url, [f"sim-{i}" for i in range(n)])
    await fellows.start()
    try:
        yield leader, fellows
    finally:
        await fellows.stop()
        await leader.stop()


# --- fixed data for snapshots -------------------------------------------------------------------

T0 = 1_700_000_000.0  # the frozen clock of snapshot tests (leader and console agree)
HISTORY_S = 30  # seconds of heartbeats the fake stream replays for busy fellows


def frozen_clock() -> float:
    return T0


def _fellow(fid: int, name: str, status: str, *, host: str = "node-a", job: str | None = None,
            stage: int | None = None, step: int = 0, loss: float | None = None,
            tps: float = 0.0, tx: float | None = None, rx: float | None = None,
            lat: float = 0.0, data_tx: int = 0, data_rx: int = 0, age: float = 1.0,
            devices: list[str] | None = None, note: str = "") -> FellowInfo:
    hb = T0 - age
    return FellowInfo(
        fellow_id=fid, name=name, host=host, pid=1000 + fid, devices=devices or ["cpu"],
        threads=2, data_addr=f"127.0.0.1:{9000 + fid}", status=status,
        reported_status=status if status not in ("stale", "offline") else "ready",
        current_job=job, current_stage=stage, current_step=step, last_loss=loss,
        tokens_per_s=tps, counters=ByteCounters(control_tx=5_000 * fid, control_rx=9_000 * fid,
                                                data_tx=data_tx, data_rx=data_rx),
        link=LinkLimits(tx_mbps=tx, rx_mbps=rx, latency_ms=lat), registered_at=T0 - 600,
        last_heartbeat=hb, heartbeat_age_s=age, note=note)


def fixed_fellows() -> list[FellowInfo]:
    return [
        # Busy fellows as of HISTORY_S ago; the fake stream brings them to step 120.
        _fellow(0, "gpu-a", "busy", host="node-a", job="job-000002", stage=0, step=90,
                loss=3.0312, tps=1830, tx=80, rx=80, lat=20, data_tx=480_000_000,
                data_rx=470_000_000, devices=["cuda:0", "cuda:1"], age=HISTORY_S),
        _fellow(1, "gpu-b", "busy", host="node-b", job="job-000002", stage=1, step=90,
                loss=3.0312, tps=1825, tx=80, rx=80, data_tx=470_000_000, data_rx=481_000_000,
                devices=["cuda:0"], age=HISTORY_S),
        _fellow(2, "cpu-c", "ready", host="node-c"),
        _fellow(3, "cpu-d", "stale", host="node-d", age=9.0),
        _fellow(4, "laptop", "released", host="laptop"),
        _fellow(5, "cpu-f", "ready", host="node-c", tx=10, rx=None,
                note="throttled link: tx 10 Mbit/s"),
    ]


def _job(n: int, state: str, *, name: str, kind: str = "train", step: int = 0,
         loss: float | None = None, fellows: list[int] | None = None, steps: int = 400,
         created: float = 0.0, reason: str = "", waiting: str = "",
         history: list[list[float]] | None = None,
         evals: list[list[float]] | None = None,
         link_changes: list[LinkChange] | None = None) -> JobInfo:
    return JobInfo(
        job_id=f"job-{n:06d}", name=name, kind=kind, state=state, created_at=T0 - created,
        started_at=None if state == "PENDING" else T0 - created + 2,
        finished_at=T0 - 5 if state in ("COMPLETED", "FAILED", "CANCELLED") else None,
        last_step=step, last_loss=loss, fellows=fellows or [], topology=Topology(2),
        reason=reason,
        model=ModelConfig(name=name, compression="fixed_int8") if kind == "train" else None,
        training=TrainingConfig(steps=steps, dataset="shakespeare") if kind == "train"
        else SmokeTraining(steps=steps), waiting_for=waiting,
        loss_history=history or [], eval_history=evals or [],
        link_changes=link_changes or [], link_changes_total=len(link_changes or []))


def fixed_jobs() -> list[JobInfo]:
    curve = [[float(s), 4.2 * (0.985 ** s) + 1.78] for s in range(0, 121, 4)]
    return [
        _job(1, "COMPLETED", name="smoke", kind="smoke", step=5, fellows=[0, 1], steps=5,
             created=900, reason="smoke: 5 control-plane round trips in 1.02s"),
        _job(2, "RUNNING", name="small_fixed_int8", step=120, loss=2.4312, fellows=[0, 1],
             created=300, history=curve, evals=[[40.0, 4.15], [80.0, 3.12], [120.0, 2.55]],
             # gpu-a's link set to 80/80 +20 ms from step 100 (the plots mark it)
             link_changes=[LinkChange(at_step=100, fellow_id=0, at=T0 - 20, link=LinkLimits(
                 tx_mbps=80.0, rx_mbps=80.0, latency_ms=20.0))]),
        _job(3, "PENDING", name="large_fixed_int8", created=60,
             waiting="needs 4 ready fellows, 2 ready"),
        _job(4, "FAILED", name="xlarge", fellows=[2], steps=100, step=3, loss=7.1, created=1200,
             reason="fellow 2 (cpu-c) failed at step 3: out of memory"),
    ]


class FakeClient(SwarmClient):
    """The leader's answers, fixed: fellows, jobs, then one heartbeat per live fellow (so byte
    rates exist), with timestamps on the frozen clock. Records the calls that change things."""

    def __init__(self) -> None:
        super().__init__("http://leader.test:8765", "t")
        self.calls: list[tuple[str, Any]] = []
        self.fetched: list[str] = []  # job ids asked of GET /jobs/{id}
        self.speed_links: list[bool] = []  # each set_speed's link flag, in order
        self._fellows = fixed_fellows()
        self._jobs = fixed_jobs()
        self._snapshot_served = asyncio.Event()

    async def fellows(self) -> list[FellowInfo]:
        self._snapshot_served.set()
        return list(self._fellows)

    async def fellow(self, fellow_id: int) -> FellowInfo:
        return next(f for f in self._fellows if f.fellow_id == fellow_id)

    async def fellow_log(self, fellow_id: int, lines: int | None = None) -> FellowLog:
        """A remote fellow's own log as the leader relays it: gpu-b's three lines, 0.8 s old;
        the others have sent none."""
        name = next(f.name for f in self._fellows if f.fellow_id == fellow_id)
        if fellow_id != 1:
            return FellowLog(fellow_id=fellow_id, name=name, lines=[], seq=0, received_at=None,
                             age_s=None, message=f"fellow {fellow_id} has sent no log yet",
                             asked=True)
        own = [f"2023-11-14 22:13:{s:02d},000 swarm.fellow INFO step {90 + s} done"
               for s in range(3)]
        return FellowLog(fellow_id=1, name=name, lines=own[-(lines or 200):], seq=3,
                         received_at=T0 - 0.8, age_s=0.8, asked=True)

    async def jobs(self, state: str | None = None) -> list[JobInfo]:
        # As the leader's list route: new objects each time, and no loss history.
        return [attrs.evolve(j, loss_history=[], eval_history=[]) for j in self._jobs
                if state is None or j.state in state.split(",")]

    async def job_page(self, state: str | None = None, *, limit: int,
                       after: str | None = None, order: str = "queue") -> JobList:
        # (the fixed data is smaller than any page the console asks for: no paging here)
        assert after is None and limit >= len(self._jobs)
        jobs = await self.jobs(state)
        if order == "finished":
            jobs = [j for j in jobs if j.finished_at is not None][::-1]
        return JobList(jobs=jobs, total=len(jobs))

    async def job(self, job_id: str) -> JobInfo:
        self.fetched.append(job_id)
        job = next((j for j in self._jobs if j.job_id == job_id), None)
        if job is None:  # (as the leader answers)
            raise ApiError(404, "unknown_job", f"no job {job_id!r}")
        return attrs.evolve(job, loss_history=[list(p) for p in job.loss_history],
                            eval_history=[list(p) for p in job.eval_history])

    async def set_speed(self, fellow_id: int, req: SetSpeedRequest, *,
                        link: bool = True) -> dict[str, Any]:
        self.calls.append(("set_speed", (fellow_id, req)))
        self.speed_links.append(link)  # (False: the slowdown alone, the link left as it is)
        return {}

    async def release(self, fellow_ids: list[int] | None = None, *, all: bool = False
                      ) -> list[int]:
        self.calls.append(("release", (fellow_ids, all)))
        return list(fellow_ids or [])

    async def forget(self, fellow_id: int) -> dict[str, Any]:
        """As the leader: a live fellow is refused (409), a gone one dropped."""
        fi = next((f for f in self._fellows if f.fellow_id == fellow_id), None)
        if fi is None:
            raise ApiError(404, "unknown_fellow", f"no fellow with id {fellow_id}")
        if fi.status in ("ready", "busy"):
            raise ApiError(409, "fellow_live", f"fellow {fellow_id} ({fi.name}) is "
                           f"{fi.status}: it still heartbeats (release it first)")
        self.calls.append(("forget", fellow_id))
        self._fellows.remove(fi)
        return {"fellow_id": fellow_id, "name": fi.name, "status": fi.status}

    async def submit(self, req: JobSubmit) -> JobInfo:
        """Queued, as the leader answers (the job is not added to the fixed data)."""
        self.calls.append(("submit", req))
        return attrs.evolve(_job(10 + len(self.calls), "PENDING", name=req.name),
                            topology=req.topology)

    @property
    def expected_events(self) -> int:
        """How many events (besides hello) the fake stream sends: heartbeats, a set-speed
        and two metrics."""
        return sum(HISTORY_S if f.status == "busy" else 1 for f in self._fellows
                   if f.status not in ("stale", "offline", "released")) + 3

    async def events(self, *, types: list[str] | None = None, job_id: str | None = None
                     ) -> AsyncIterator[dict[str, Any]]:
        yield {"seq": 100, "ts": T0, "type": "hello", "data": {}}
        await self._snapshot_served.wait()
        seq = 100
        for fi in self._fellows:
            if fi.status in ("stale", "offline", "released"):
                continue
            busy = fi.status == "busy"
            # Heartbeats once a second since the snapshot's (HISTORY_S ago): histories for
            # the detail panes, and rates from the counters (busy: about 20 Mbit/s each way).
            c = fi.counters
            tx, rx = c.data_tx, c.data_rx
            for i in range(1, HISTORY_S + 1) if busy else [HISTORY_S]:
                seq += 1
                k = i if busy else 0
                if busy:
                    tx += 2_000_000 + 250_000 * ((i * 3) % 5)
                    rx += 2_400_000 + 100_000 * ((i * 2) % 3)
                yield {"seq": seq, "ts": T0 - HISTORY_S + i, "type": "fellow.heartbeat",
                       "data": {
                    "fellow_id": fi.fellow_id, "name": fi.name, "status": fi.status,
                    "job_id": fi.current_job, "step": fi.current_step + k,
                    "loss": None if fi.last_loss is None else
                    fi.last_loss - 0.02 * k + 0.01 * (k % 3),
                    "tokens_per_s": fi.tokens_per_s * (0.9 + 0.1 * ((i * 7) % 5) / 4),
                    "link": {"tx_mbps": fi.link.tx_mbps, "rx_mbps": fi.link.rx_mbps,
                             "latency_ms": fi.link.latency_ms},
                    "counters": {"control_tx": c.control_tx, "control_rx": c.control_rx,
                                 "data_tx": tx, "data_rx": rx}}}
        # The set-speed that gave gpu-a its link 20 s ago (its detail's plots mark it).
        seq += 1
        yield {"seq": seq, "ts": T0 - 20, "type": "fellow.set_speed", "data": {
            "fellow_id": 0, "job_id": "job-000002", "tx_mbps": 80.0, "rx_mbps": 80.0,
            "latency_ms": 20.0}}
        # What the running job's two stages last reported (the watch view's columns).
        for fid, loss, peak, wait in ((0, None, 18_400_000, 0.092), (1, 2.4312, 9_700_000, 0.049)):
            seq += 1
            yield {"seq": seq, "ts": T0, "type": "metric", "data": {
                "job_id": "job-000002", "fellow_id": fid, "step": 120, "loss": loss,
                "tokens_per_s": 1825.0, "state": "RUNNING",
                "metrics": {"wire_tx_bytes": 1_050_000, "activation_peak_bytes": peak,
                            "step_seconds": 0.61, "wait_seconds": wait}}}
        await asyncio.Event().wait()  # then quiet, forever


GRID_JOB = "job-000005"


def grid_job() -> tuple[list[FellowInfo], JobInfo]:
    """A 2 stages x 2 replicas job running on fellows 6-9 (one cell each; replica r of stage k
    on fellow 6 + 2r + k), with the leader's newest figures of each cell."""
    from swarm_core.contract import (
        JobMetrics,
        LayerRange,
        Placement,
        StageMetrics,
        StagePlacement,
    )

    fellows = [_fellow(6 + i, f"dp-{i}", "busy", host=f"node-{i}", job=GRID_JOB, stage=i % 2,
                       step=40, loss=2.9 if i % 2 else None, tps=900 + 10 * i)
               for i in range(4)]
    cells = [StagePlacement(stage=i % 2, fellow_id=6 + i, name=f"dp-{i}", slot=0, device="cpu",
                            layers=LayerRange(2 * (i % 2), 2 * (i % 2) + 2),
                            data_addr=f"127.0.0.1:{9006 + i}", replica=i // 2)
             for i in range(4)]
    stages = {f"{i % 2}.{i // 2}": StageMetrics(
        fellow_id=6 + i, step=40, tokens_per_s=900.0 + 10 * i, step_seconds=0.5,
        wait_seconds=0.05 * (1 + i % 2), sync_tx_bytes=300_000 * (1 + i % 2),
        sync_seconds=0.1 + 0.05 * (i // 2)) for i in range(4)}
    job = _job(5, "RUNNING", name="dp_2x2", step=40, loss=2.9, fellows=[6, 7, 8, 9],
               created=120)
    job = attrs.evolve(job, topology=Topology(stages=2, replicas=2),
                       placement=Placement(num_stages=2, n_layers=4, stages=cells, replicas=2),
                       metrics=JobMetrics(stages=stages))
    return fellows, job


class GridFakeClient(FakeClient):
    """The fixed data and a running 2 x 2 job (``grid_job``)."""

    def __init__(self) -> None:
        super().__init__()
        fellows, job = grid_job()
        self._fellows += fellows
        self._jobs.append(job)


def grid_metric(seq: int) -> dict[str, Any]:
    """Replica 1 of stage 1 of the grid job reports step 41."""
    return {"seq": seq, "ts": T0, "type": "metric", "data": {
        "job_id": GRID_JOB, "fellow_id": 9, "stage": 1, "replica": 1, "step": 41,
        "loss": 2.8, "tokens_per_s": 950.0, "state": "RUNNING",
        "metrics": {"wire_tx_bytes": 1000, "step_seconds": 0.4, "wait_seconds": 0.1,
                    "sync_tx_bytes": 2_500_000, "sync_seconds": 0.2}}}


FIXED_CONFIGS: dict[str, dict[str, Any]] = {
    "model/small_fixed_int8.json": {
        "name": "small_fixed_int8", "d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64,
        "dropout": 0.0, "dtype": "float32", "compression": "fixed_int8"},
    "model/small_none.json": {
        "name": "small_none", "d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64,
        "dropout": 0.0, "dtype": "float32", "compression": "none", "wire_dtype": "fp32"},
    "training/quickstart_shakespeare.json": {
        "name": "quickstart_shakespeare", "dataset": "shakespeare", "tokenizer": "byte",
        "seed": 0, "steps": 40, "batch_size": 16, "micro_batches": 4, "schedule": "1f1b",
        "lr": 0.003, "min_lr": 0.0003, "warmup_steps": 5, "weight_decay": 0.01,
        "grad_clip": 1.0, "eval_every": 20, "eval_batches": 4, "real_min_tokens": 1000000},
    "training/tiny_sweep.json": {
        "name": "tiny_sweep", "dataset": "shakespeare", "tokenizer": "byte", "steps": 3,
        "batch_size": 4, "micro_batches": 2, "schedule": "1f1b", "warmup_steps": 1,
        "eval_batches": 1, "cluster_profile": {"fellows": 2},
        "network_profile": {"name": "unconstrained"},
        "artifacts": {"runs_dir": "../../runs", "shard_push_interval_steps": 0}},
    "exp_tiny_sweep_v1.json": {
        "name": "exp_tiny_sweep_v1", "description": "two compressions, three steps each",
        "training_config": "training/tiny_sweep.json",
        "model_configs": ["model/small_none.json"],
        "sweep": {"compressions": ["none", "fixed_int8"], "seeds": [0], "repeats": 1}},
}


def snapshot_configs(tmp_path: Path) -> Path:
    """Fixed profiles for the launcher (as exp/configs had them), so that edits to the real
    ones do not move snapshots."""
    dest = tmp_path / "configs"
    for rel, body in FIXED_CONFIGS.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(json.dumps(body, indent=2))
    return dest


def screen_text(app: Any) -> str:
    """What the terminal shows now, as plain text."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system=None, record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens, simplify=True))
    return console.export_text()
