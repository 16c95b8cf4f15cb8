"""Pipeline throughput benchmark (not a test): one table, one invocation, the same GPT-style
model and global batch run several ways, as tokens/s and as a ratio to row (a).

* (a) one process, one thread: ``train_reference`` over the same micro-batches (the whole
  model, one micro-batch after another, then clip and one AdamW step);
* (b) our pipeline: two processes of one thread each, each running ``run_stage`` for its stage
  (stage 1 listens on a ``DataListener``, stage 0 dials it over loopback TCP), schedules
  ``gpipe`` and ``1f1b`` as configured by default (split backward on), and the same with
  ``split_backward`` off;
* (c) ``torch.distributed.pipelining`` over gloo: two ranks of one thread each, ``ScheduleGPipe``
  and ``Schedule1F1B``; the stage modules are our ``StageModule`` for stage 0 and 1 (same split,
  same weights), the loss on the last stage, the same global clipping (an all-reduce) and AdamW;
* (x) a diagnostic ceiling: the same two processes computing their halves on local data with no
  communication and no bubble, i.e. about the most two one-thread processes get out of this
  machine (a little optimistic: each micro-batch's backward follows its forward at once, while its
  activations are still in cache).

Every worker is a fresh process (``spawn``) that sets one intra-op and one inter-op thread
before any torch work (and inherits ``OMP_NUM_THREADS=1``), so two processes fill the two cores
of the reference machine; this parent process only waits. Rows run one after another, each
after waiting (``--wait-idle``) for the machine to be idle; (b) and (c) of a schedule run back
to back, and with ``--repeats`` the table also gives their paired ratio trial by trial (each
(b) trial against the (c) trial that followed it), which a drift of the VM's core speed over
minutes barely moves.

Tokens/s is global tokens (batch x seq_len) over the step time, the median of the timed steps
(warm-up excluded, ``--repeats`` trials pooled) that no other process disturbed: after every step
each worker notes its own CPU and the machine's (/proc/stat, steal included), and a step during
which others used >= 0.1 cores is set aside. The table says how many steps were clean and warns
when a row had none (a shared machine: run again, or with ``--repeats 3``). Even clean, a small
VM's per-core speed drifts, by up to ~20 % between trials minutes apart (the same step's CPU
time with it); more repeats interleave the rows, and the drift-free figures under the table
(below) cross-check.

``--interleave`` removes the drift instead of averaging it: every row's workers start at once and
wait at a gate after each step; the parent lets one row take a step at a time, row after row,
round after round, so step k of (a), (b) and (c) run within seconds of each other. Each worker
takes its time at the gate off its clock, and a step's 'other load' window starts when its gate
opens. The verdicts are then medians of step-by-step ratios ((a)'s step k over (b)'s step k,
and so on). A probe of the machine's speed (a fixed matmul before and after each trial) was tried
first and dropped: it spread 29 % itself and did not narrow the rows' spread.

Each (b) and (c) worker also records where its step time goes, by wrapping (in that process only)
the module forward, loss, backward, and for (b) the link's recv/send/flush, the norm exchange and
the optimiser (for (c) ``schedule.step``, the all-reduce and the optimiser), plus the CPU time of
each of its threads. Printed under the table with the schedule bound implied by the measured
compute, and the ratio to (a) that the same compute would give at equal per-core speed (a check
that does not depend on the machine staying equally fast from row to row); ``--no-profile`` runs
unwrapped.

Usage::

    .venv/bin/python bench/bench_pipeline.py                 # the default model, ~2-4 minutes
    .venv/bin/python bench/bench_pipeline.py --repeats 3     # the verdicts of record: rows
                                                             # interleaved 3 times, so a drift
                                                             # of the VM's core speed evens out
    .venv/bin/python bench/bench_pipeline.py --schedules gpipe --repeats 4   # one schedule
    .venv/bin/python bench/bench_pipeline.py --interleave --repeats 4 --steps 8 \
        --only a,b,c                                         # step by step, ~12 minutes
    .venv/bin/python bench/bench_pipeline.py --quick         # tiny model, 2 timed steps, ~10 s
    .venv/bin/python bench/bench_pipeline.py --steps 8 --warmup 2 \\
        --model d_model=384,n_layers=12,n_heads=6 --only a,b

``--quick`` is a smoke run (numbers meaningless): it starts workers from a ``forkserver`` with
torch preloaded, so the start-up is paid once.

Exits 0 when every row ran (whether or not the targets are met), 1 when a row failed.
Only ever uses 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

HOST = "127.0.0.1"
NUM_STAGES = 2
TARGET_VS_A = 1.70
TARGET_VS_C = 1.05
DEFAULT_MODEL = dict(d_model=256, n_layers=8, n_heads=8, seq_len=128)
QUICK_MODEL = dict(d_model=64, n_layers=2, n_heads=2, seq_len=32)
NOISY_CORES = 0.1
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def _undisturbed(step: tuple[float, float, float]) -> bool:
    """A timed step (seconds, other processes' load in cores, runqueue wait) that no other
    process disturbed: the one rule for which steps count."""
    return step[1] < NOISY_CORES


# --- configuration (plain dicts: they cross the spawn boundary) ---------------------------------


def _configs(cfg: dict[str, Any], schedule: str = "gpipe") -> tuple[Any, Any]:
    from swarm_core.config.schemas import ModelConfig, TrainingConfig

    mc = ModelConfig(**cfg["model"])
    # "1f1b" runs our default (split backward); "1f1b-plain" the same schedule without it.
    schedule, _, variant = schedule.partition("-")
    tc = TrainingConfig(steps=cfg["warmup"] + cfg["steps"], batch_size=cfg["batch"],
                        micro_batches=cfg["micro_batches"], schedule=schedule,
                        split_backward=variant != "plain",
                        eval_batches=0, eval_every=0, threads=1, seed=cfg["seed"],
                        warmup_steps=cfg["warmup"] + cfg["steps"], frame_timeout_s=300.0)
    return mc, tc


def _init_torch() -> Any:
    """First thing in every worker: one thread, before any torch work; and the heap setting
    fellows run with (every row gets it, so that rows differ only in how they train)."""
    import torch

    from swarm_core.pipeline.heap import keep_large_blocks

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    keep_large_blocks()
    return torch


# --- per-thread CPU time from /proc -------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, keyed by the Python thread name's prefix
    (``MainThread``, ``tx``, ``rx``) or ``native`` for threads Python did not start; plus the
    main thread's system time (``main sys``) and the process's minor page faults (``minflt``)."""
    names = {}
    for th in threading.enumerate():
        if th.native_id is not None:
            names[th.native_id] = th.name.split("-", 1)[0]
    out: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        name = names.get(int(tid), "native")
        out[name] += (int(fields[11]) + int(fields[12])) / _TICK
        if name == "MainThread":
            out["main sys"] += int(fields[12]) / _TICK
    try:
        with open("/proc/self/stat") as f:
            out["minflt"] = float(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        pass
    return dict(out)


def _machine_cpu() -> dict[str, float]:
    """Machine-wide CPU seconds from /proc/stat: busy (user+nice+system+irq+softirq), steal."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return {}
    vals += [0] * (8 - len(vals))
    return {"busy": (vals[0] + vals[1] + vals[2] + vals[5] + vals[6]) / _TICK,
            "steal": vals[7] / _TICK}


def _rq_wait() -> float:
    """Seconds this (compute) thread has been runnable but waiting for a CPU (schedstat)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _proc_cpu() -> float:
    """CPU seconds of this process, all threads."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return time.process_time()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


class _Gate:
    """``--interleave``: this worker runs a step only when the parent lets it. Time spent
    waiting at the gate is taken off the worker's clock, so its marks measure its own steps."""

    def __init__(self, go: Any, done: Any, key: str, rank: int) -> None:
        self.go, self.done, self.key, self.rank = go, done, key, rank
        self.waited = 0.0

    def wait(self) -> None:
        t = time.monotonic()
        self.go.acquire()
        self.waited += time.monotonic() - t

    def step_done(self) -> None:
        self.done.put((self.key, self.rank))
        self.wait()


_GATE: _Gate | None = None


def _sample() -> tuple[float, float, float]:
    mach = _machine_cpu()
    return _proc_cpu(), mach.get("busy", 0.0) + mach.get("steal", 0.0), _rq_wait()


def _mark(marks: list[float], snaps: dict[str, Any], warm: int, total: int) -> None:
    """After each step: a timestamp, this process's CPU and the machine's (to tell which steps
    other processes disturbed); at the end of warm-up and of the run, per-thread CPU. Under a
    gate, the next step's window starts when the gate opens (other rows ran meanwhile)."""
    marks.append(time.monotonic() - (_GATE.waited if _GATE else 0.0))
    samples = snaps.setdefault("samples", [])
    samples.append(_sample())
    if len(marks) in (warm, total):
        snaps["start" if len(marks) == warm else "end"] = _thread_cpu()
    if _GATE is not None:
        _GATE.step_done()
        snaps.setdefault("starts", []).append(_sample())  # the next step starts now


def _cpu_result(snaps: dict[str, Any]) -> dict[str, Any]:
    # samples[k]: at the end of step k+1; under a gate, starts[k]: when step k+2 began.
    return {"cpu": _diff(snaps["end"], snaps["start"]), "samples": snaps["samples"],
            "starts": snaps.get("starts") or snaps["samples"]}


# --- (b)/(c) instrumentation: exclusive wall time per bucket on the compute thread ------------


class _Profiler:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []
        self._owner = threading.get_ident()

    def wrap(self, owner: Any, attr: str, name: str | Callable[[tuple], str]) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:  # renamed upstream: that time shows up under "other"
            return
        prof = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != prof._owner:
                return orig(*args, **kwargs)
            with prof.section(name if isinstance(name, str) else name(args)):
                return orig(*args, **kwargs)

        setattr(owner, attr, wrapper)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time spent inside, less the time of sections nested in it, goes to ``name``."""
        self._stack.append(0.0)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            self.acc[name] += elapsed - self._stack.pop()
            if self._stack:
                self._stack[-1] += elapsed

    def install(self) -> None:
        import torch

        import swarm_core.pipeline.stage as stage_mod
        from swarm_core.data import TokenData
        from swarm_core.pipeline.frames import Kind
        from swarm_core.pipeline.model import StageModule
        from swarm_core.pipeline.transport import PeerLink
        from swarm_core.pipeline.wgrad import WeightGradQueue

        self.wrap(StageModule, "forward", "forward")
        self.wrap(stage_mod, "lm_loss", "loss")
        self.wrap(torch.Tensor, "backward", "backward")
        self.wrap(PeerLink, "recv", lambda a: "norm wait" if a[1] == Kind.NORM else "recv wait")
        self.wrap(PeerLink, "recv_tensor", "decode")
        self.wrap(PeerLink, "send_tensor", "send+enc")
        self.wrap(PeerLink, "send_raw", "send+enc")
        self.wrap(PeerLink, "flush", "flush wait")
        self.wrap(WeightGradQueue, "run_one", "wgrad")
        self.wrap(WeightGradQueue, "run_batch", "wgrad")
        self.wrap(stage_mod.StageRunner, "_global_sq", "grad norm")
        self.wrap(stage_mod, "scale_grads", "grad norm")
        self.wrap(torch.optim.Optimizer, "zero_grad", "optimizer")
        self.wrap(TokenData, "batch", "data")
        make = getattr(stage_mod, "make_optimizer", None)
        if make is None:
            return

        def make_wrapped(module: Any, cfg: Any, **kwargs: Any) -> Any:
            opt = make(module, cfg, **kwargs)
            self.wrap(opt, "step", "optimizer")
            return opt

        stage_mod.make_optimizer = make_wrapped


PROFILE_COLUMNS = ["forward", "loss", "backward", "wgrad", "send+enc", "decode", "recv wait",
                   "grad norm", "norm wait", "optimizer", "flush wait", "data", "other"]


# --- workers --------------------------------------------------------------------------------


def _worker_single(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(a): ``train_reference`` itself (the run every pipeline is held against), with a
    timestamp after every step."""
    _init_torch()
    from swarm_core.contract.placement import split_layers
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.reference import train_reference

    mc, tc = _configs(cfg)
    data = load_token_data(tc, mc.seq_len)
    marks: list[float] = []
    snaps: dict[str, Any] = {}
    losses, _ = train_reference(
        mc, tc, data, split_layers(mc.n_layers, [1] * NUM_STAGES),
        on_step=lambda _step, _loss: _mark(marks, snaps, cfg["warmup"], tc.steps))
    return {"marks": marks, "losses": losses, **_cpu_result(snaps)}


def _worker_swarm(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(b): one stage of our pipeline, via run_stage, in a process of its own."""
    _init_torch()
    from swarm_core.contract.placement import split_layers
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.listener import DataListener
    from swarm_core.pipeline.stage import StageSpec, run_stage

    mc, tc = _configs(cfg, ctx["schedule"])
    data = load_token_data(tc, mc.seq_len)
    prof = _Profiler() if cfg["profile"] else None
    if prof is not None:
        prof.install()
    ranges = split_layers(mc.n_layers, [1] * NUM_STAGES)
    listener = DataListener(HOST) if rank > 0 else None
    if listener is not None:
        ctx["side"].put(listener.addr)  # the upstream stage dials this
        downstream = None
    else:
        downstream = ctx["side"].get(timeout=120)
    spec = StageSpec("bench-pipeline", "k" * 32, rank, NUM_STAGES, ranges[rank], downstream,
                     mc, tc)
    warm = cfg["warmup"]
    marks: list[float] = []
    step_s: list[float] = []
    snaps: dict[str, Any] = {}
    acc: dict[str, dict[str, float]] = {}

    def on_step(rep: Any) -> None:
        # Snapshots while the link threads are still alive: they end when the run closes.
        _mark(marks, snaps, warm, tc.steps)
        step_s.append(rep.seconds)
        if rep.step in (warm, tc.steps):
            acc["start" if rep.step == warm else "end"] = dict(prof.acc) if prof else {}

    try:
        metrics = run_stage(spec, data, LinkShaper(), listener, threading.Event(), on_step,
                            connect_timeout=120)
    finally:
        if listener is not None:
            listener.close()
    timed_step_s = sum(step_s[warm:])
    out: dict[str, Any] = {"marks": marks, "losses": metrics.losses,
                           "step_s": timed_step_s, **_cpu_result(snaps)}
    if prof is not None:
        buckets = _diff(acc["end"], acc["start"])
        buckets["other"] = timed_step_s - sum(buckets.values())
        out["buckets"] = buckets
    return out


def _worker_torch(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(c): torch.distributed.pipelining over gloo; stage modules are our StageModules."""
    torch = _init_torch()
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from swarm_core.contract.placement import split_layers
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.model import StageModule, lm_loss
    from swarm_core.pipeline.optim import (
        clip_scale,
        grad_sq_sum,
        lr_at,
        make_optimizer,
        scale_grads,
        set_lr,
    )

    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    mc, tc = _configs(cfg, ctx["schedule"])
    data = load_token_data(tc, mc.seq_len)
    vocab = mc.vocab_size or data.vocab_size
    ranges = split_layers(mc.n_layers, [1] * NUM_STAGES)
    prof = _Profiler() if cfg["profile"] else None
    section: Callable[[str], Any] = prof.section if prof else lambda _n: contextlib.nullcontext()
    if prof is not None:
        prof.wrap(StageModule, "forward", "forward")
        prof.wrap(torch.autograd, "backward", "backward")
        prof.wrap(torch.autograd, "grad", "backward")
        prof.wrap(torch.Tensor, "backward", "backward")

    def loss_fn(out: Any, target: Any) -> Any:
        with section("loss"):
            return lm_loss(out, target)

    # Rank 0's store takes a port the kernel picks while it binds, and tells rank 1: a port
    # looked up free beforehand was taken meanwhile by another row starting (EADDRINUSE).
    if rank == 0:
        store = dist.TCPStore(HOST, 0, NUM_STAGES, is_master=True, wait_for_workers=False)
        ctx["side"].put(store.port)
    else:
        store = dist.TCPStore(HOST, ctx["side"].get(timeout=120), NUM_STAGES, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=NUM_STAGES)
    try:
        module = StageModule(mc, vocab, tc.seed, ranges[rank][0], ranges[rank][1], rank,
                             NUM_STAGES)
        params = [p for p in module.parameters() if p.requires_grad]
        m, mb, t, d = tc.micro_batches, tc.batch_size // tc.micro_batches, mc.seq_len, mc.d_model
        # Static shapes; requires_grad marks what carries gradients (all but the token ids).
        if rank == 0:
            example_in = torch.zeros(mb, t, dtype=torch.long)
            example_out = torch.zeros(mb, t, d, requires_grad=True)
        else:
            example_in = torch.zeros(mb, t, d, requires_grad=True)
            example_out = torch.zeros(mb, t, vocab, requires_grad=True)
        stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"),
                              input_args=example_in, output_args=example_out)
        cls = ScheduleGPipe if ctx["schedule"] == "gpipe" else Schedule1F1B
        sched = cls(stage, m, loss_fn=loss_fn)  # scale_grads: grads / m, as loss / m in (a)
        opt = make_optimizer(module, tc)
        last = rank == NUM_STAGES - 1
        marks: list[float] = []
        losses: list[float] = []
        snaps: dict[str, Any] = {}
        acc: dict[str, dict[str, float]] = {}
        for step in range(tc.steps):
            module.train()
            set_lr(opt, lr_at(step, tc))
            with section("data"):
                x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
            # Inside schedule.step, all but forward/loss/backward is p2p comm and waiting.
            with section("recv wait"):
                if rank == 0:
                    sched.step(x, return_outputs=False)
                else:
                    mb_losses: list[Any] = []
                    sched.step(target=y, losses=mb_losses, return_outputs=False)
                    losses.append(sum(float(v.detach()) for v in mb_losses) / m)
            with section("grad norm"):
                sq = torch.tensor([grad_sq_sum(params)], dtype=torch.float64)
            with section("norm wait"):
                dist.all_reduce(sq)
            with section("grad norm"):
                scale_grads(params, clip_scale(float(sq), tc.grad_clip))
            with section("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            _mark(marks, snaps, cfg["warmup"], tc.steps)
            if prof is not None and len(marks) in (cfg["warmup"], tc.steps):
                acc["start" if len(marks) == cfg["warmup"] else "end"] = dict(prof.acc)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    out: dict[str, Any] = {"marks": marks, "losses": losses if last else [],
                           **_cpu_result(snaps)}
    if prof is not None:
        out["step_s"] = marks[-1] - marks[cfg["warmup"] - 1]
        out["buckets"] = _diff(acc["end"], acc["start"])
        out["buckets"]["other"] = out["step_s"] - sum(out["buckets"].values())
    return out


def _worker_ceiling(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(x): this stage's forward+backward of every micro-batch, clip and AdamW, on local inputs:
    no communication, no bubble. Two of these side by side bound any 2-process pipeline."""
    torch = _init_torch()
    from swarm_core.contract.placement import split_layers
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.model import StageModule, lm_loss
    from swarm_core.pipeline.optim import (
        clip_scale,
        grad_sq_sum,
        lr_at,
        make_optimizer,
        scale_grads,
        set_lr,
    )

    mc, tc = _configs(cfg)
    data = load_token_data(tc, mc.seq_len)
    vocab = mc.vocab_size or data.vocab_size
    ranges = split_layers(mc.n_layers, [1] * NUM_STAGES)
    module = StageModule(mc, vocab, tc.seed, ranges[rank][0], ranges[rank][1], rank, NUM_STAGES)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(module, tc)
    m, mb = tc.micro_batches, tc.batch_size // tc.micro_batches
    gen = torch.Generator().manual_seed(rank)
    acts = torch.randn(m, mb, mc.seq_len, mc.d_model, generator=gen)
    grads = torch.randn(m, mb, mc.seq_len, mc.d_model, generator=gen) * 1e-3
    marks: list[float] = []
    snaps: dict[str, Any] = {}
    for step in range(tc.steps):
        module.train()
        set_lr(opt, lr_at(step, tc))
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        for i, (xs, ys) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            if rank == 0:
                module(xs).backward(grads[i])
            else:
                inp = acts[i].clone().requires_grad_(True)
                (lm_loss(module(inp), ys) / m).backward()
        scale_grads(params, clip_scale(grad_sq_sum(params), tc.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _mark(marks, snaps, cfg["warmup"], tc.steps)
    return {"marks": marks, **_cpu_result(snaps)}


WORKERS: dict[str, Callable[[dict[str, Any], int, dict[str, Any]], dict[str, Any]]] = {
    "single": _worker_single, "swarm": _worker_swarm, "torch": _worker_torch,
    "ceiling": _worker_ceiling,
}


def _entry(kind: str, cfg: dict[str, Any], rank: int, ctx: dict[str, Any],
           results: Any) -> None:
    global _GATE
    try:
        if ctx.get("gates") is not None:
            _GATE = _Gate(ctx["gates"][rank], ctx["done"], ctx["key"], rank)
            _GATE.wait()  # set-up and the first (warm-up) step run in the first window
        if rank == 0 and cfg.get("fail_row") is not None and cfg["fail_row"] == ctx.get("key"):
            raise RuntimeError("failure injected by --fail-row")
        results.put((rank, WORKERS[kind](cfg, rank, ctx)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


# --- orchestration --------------------------------------------------------------------------


class Launched:
    """``nprocs`` spawned workers of one kind, started; ``collect`` waits for their results.
    With ``done`` (a queue shared by every gated row) each rank gets a gate of its own."""

    def __init__(self, kind: str, cfg: dict[str, Any], nprocs: int, schedule: str = "gpipe",
                 key: str = "", done: Any = None) -> None:
        mpc = mp.get_context(cfg["start_method"])
        self.kind, self.nprocs, self.key, self.done = kind, nprocs, key, done
        self.results = mpc.Queue()
        self.gates = [mpc.Semaphore(0) for _ in range(nprocs)] if done is not None else None
        # Held for the workers' lifetime: a queue collected here unlinks its semaphores
        # before a spawned child has unpickled them.
        self.ctx = {"schedule": schedule, "side": mpc.Queue(),
                    "gates": self.gates, "done": done, "key": key}
        self.procs = [mpc.Process(target=_entry, args=(kind, cfg, r, self.ctx, self.results),
                                  daemon=True, name=f"bench-{kind}-{r}")
                      for r in range(nprocs)]
        self.out: dict[int, dict[str, Any]] = {}
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.stop()
            raise

    def open_gates(self) -> None:
        assert self.gates is not None
        for g in self.gates:
            g.release()

    def take_step(self, timeout: float, label: str, dropped: Collection[str] = ()) -> None:
        """Open the gates for one step and wait until every rank has taken it (a late report
        of a row already ``dropped`` from the trial is ignored)."""
        self.open_gates()
        deadline = time.monotonic() + timeout
        waiting = set(range(self.nprocs))
        while waiting:
            try:
                key, rank = self.done.get(timeout=0.5)
            except queue.Empty:
                self.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: no step within {timeout:g}s") from None
                continue
            if key in dropped:
                continue
            if key != self.key:
                raise RuntimeError(f"{key} stepped outside its window")
            waiting.discard(rank)

    def check(self) -> None:
        """Raise if a worker failed or died (while the parent waits on it)."""
        with contextlib.suppress(queue.Empty):
            while True:
                rank, res = self.results.get_nowait()
                self.out[rank] = res
        errors = [f"rank {r}:\n{res['error']}" for r, res in sorted(self.out.items())
                  if "error" in res]
        if errors:
            raise RuntimeError("\n".join(errors))
        dead = [p for i, p in enumerate(self.procs) if i not in self.out and
                p.exitcode is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode} without "
                               "a result")

    def collect(self, timeout: float) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        try:
            while len(self.out) < self.nprocs:
                try:
                    rank, res = self.results.get(timeout=0.5)
                    self.out[rank] = res
                    if "error" in res:
                        break
                except queue.Empty:
                    self.check()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.kind} run did not finish in {timeout:g}s") \
                            from None
            self.check()
        finally:
            self.stop()
        return self.out

    def stop(self) -> None:
        started = [p for p in self.procs if p.pid is not None]
        for p in started:
            p.join(timeout=10 if len(self.out) == self.nprocs else 0.5)
        for p in started:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def launch(kind: str, cfg: dict[str, Any], nprocs: int, schedule: str = "gpipe",
           timeout: float = 900.0) -> dict[int, dict[str, Any]]:
    """Run ``nprocs`` spawned workers of ``kind`` side by side; their results by rank."""
    return Launched(kind, cfg, nprocs, schedule).collect(timeout)


def run_interleaved(rows: list[Row], cfg: dict[str, Any]) -> None:
    """One trial of every row at once, step by step: all rows' workers start, and the parent
    lets one row take a step at a time, in row order, round after round. Rows compared step
    by step ran seconds apart, so a drift of the machine's speed over minutes cancels out."""
    mpc = mp.get_context(cfg["start_method"])
    done = mpc.Queue()
    t0 = time.monotonic()
    live = [r for r in rows if r.error is None]
    runs: dict[str, Launched] = {}
    results: dict[str, dict[int, dict[str, Any]]] = {}

    dropped: set[str] = set()

    def drop(r: Row, exc: Exception) -> None:
        # A failing row leaves the trial (its earlier trials kept); the others go on, since
        # each row's workers are processes of their own.
        r.error = str(exc)
        live.remove(r)
        dropped.add(r.key)
        if r.key in runs:
            runs[r.key].stop()
        print(f"  {r.label}: interleaved trial FAILED\n{exc}", file=sys.stderr, flush=True)

    def each(action: Callable[[Row], None]) -> None:
        for r in list(live):
            try:
                action(r)
            except Exception as exc:
                drop(r, exc)

    try:
        each(lambda r: runs.__setitem__(
            r.key, Launched(r.kind, cfg, r.procs, r.schedule, r.key, done)))
        # One window per step of each row, and a last one that lets them all finish.
        for _step in range(cfg["warmup"] + cfg["steps"]):
            each(lambda r: runs[r.key].take_step(cfg["timeout"], r.label, dropped))
        each(lambda r: runs[r.key].open_gates())
        each(lambda r: results.__setitem__(r.key, runs[r.key].collect(cfg["timeout"])))
    finally:
        for run in runs.values():  # also on Ctrl-C: no worker left waiting at its gate
            run.stop()
    for r in live:
        r.absorb(cfg, results[r.key], t0)


def wait_for_idle(limit_s: float, sample_s: float = 2.0) -> float:
    """Wait (at most ``limit_s``) until other processes use under NOISY_CORES of CPU over
    ``sample_s``; returns the load last seen (cores)."""
    deadline = time.monotonic() + limit_s
    while True:
        m0, t0 = _machine_cpu(), time.monotonic()
        time.sleep(sample_s)
        d = _diff(_machine_cpu(), m0)
        load = (d.get("busy", 0.0) + d.get("steal", 0.0)) / (time.monotonic() - t0)
        if load < NOISY_CORES or time.monotonic() >= deadline:
            return load


# --- rows, table, targets ---------------------------------------------------------------------


class Row:
    """One way of running the step; its trials' timed steps pooled. The row's figure is the
    median step time over the steps no other process disturbed (other load < NOISY_CORES),
    or over all its steps when there are none (then flagged)."""

    def __init__(self, key: str, label: str, kind: str, procs: int,
                 schedule: str = "gpipe") -> None:
        self.key, self.label, self.kind, self.procs, self.schedule = (key, label, kind, procs,
                                                                      schedule)
        self.steps: list[tuple[float, float, float]] = []  # (s, other load, runqueue wait s)
        self.trials: list[float] = []  # each trial's median step (s), in run order
        self.error: str | None = None
        self.res: dict[int, dict[str, Any]] = {}  # the least disturbed trial (for the profile)
        self._res_load = float("inf")
        self.loss: float | None = None

    def run(self, cfg: dict[str, Any]) -> None:
        t0 = time.monotonic()
        try:
            res = launch(self.kind, cfg, self.procs, self.schedule, cfg["timeout"])
        except Exception as exc:
            self.error = str(exc)
            print(f"  {self.label}: FAILED\n{exc}", file=sys.stderr, flush=True)
            return
        self.absorb(cfg, res, t0)

    def absorb(self, cfg: dict[str, Any], res: dict[int, dict[str, Any]], t0: float) -> None:
        """Take one trial's results (by rank) in."""
        warm, total = cfg["warmup"], cfg["warmup"] + cfg["steps"]
        ranks = [res[r] for r in sorted(res)]
        steps = []
        for k in range(warm, total):
            # The slowest process sets the pace (the pipeline's ranks end each step together).
            d = max(r["marks"][k] - r["marks"][k - 1] for r in ranks)
            own = sum(r["samples"][k][0] - r["starts"][k - 1][0] for r in ranks)
            mach = ranks[0]["samples"][k][1] - ranks[0]["starts"][k - 1][1]
            window = ranks[0]["marks"][k] - ranks[0]["marks"][k - 1]
            rq = sum(r["samples"][k][2] - r["starts"][k - 1][2] for r in ranks)
            steps.append((d, max(0.0, mach - own) / window, rq))
        self.steps += steps
        self.trials.append(statistics.median(d for d, _, _ in steps))
        load = sum(f for _, f, _ in steps) / len(steps)
        if load < self._res_load:
            self.res, self._res_load = res, load
        losses = ranks[-1].get("losses")
        self.loss = losses[-1] if losses else None
        mean = sum(d for d, _, _ in steps) / len(steps)
        rq = sum(q for _, _, q in steps) / len(steps)
        main_cpu = sum(r["cpu"].get("MainThread", 0.0) for r in ranks) / len(steps)
        clean = sum(map(_undisturbed, steps))
        print(f"  {self.label}: {self.tokens(cfg) / mean:,.0f} tokens/s, {mean * 1e3:.0f} "
              f"ms/step, compute-thread CPU {main_cpu * 1e3:.0f} ms/step and runqueue wait "
              f"{rq * 1e3:.0f} ms/step (all procs), other load {load:.2f} cores, "
              f"{clean}/{len(steps)} steps undisturbed "
              f"({time.monotonic() - t0:.1f} s with start-up)", file=sys.stderr, flush=True)

    @staticmethod
    def tokens(cfg: dict[str, Any]) -> int:
        return cfg["batch"] * cfg["model"]["seq_len"]

    def _used(self) -> list[tuple[float, float, float]]:
        clean = [s for s in self.steps if _undisturbed(s)]
        return clean or self.steps

    @property
    def clean(self) -> int:
        return sum(map(_undisturbed, self.steps))

    @property
    def seconds_per_step(self) -> float | None:
        used = self._used()
        return statistics.median(d for d, _, _ in used) if used else None

    @property
    def ms_per_step(self) -> float | None:
        s = self.seconds_per_step
        return None if s is None else s * 1e3

    @property
    def foreign(self) -> float | None:
        used = self._used()
        return statistics.mean(f for _, f, _ in used) if used else None

    @property
    def rq_ms(self) -> float | None:
        """Runqueue wait of the compute threads (all processes), ms per step."""
        used = self._used()
        return statistics.mean(q for _, _, q in used) * 1e3 if used else None

    def tokens_per_s(self, cfg: dict[str, Any]) -> float | None:
        s = self.seconds_per_step
        return None if not s else self.tokens(cfg) / s


def _ratio(row: Row | None, base: Row | None) -> float | None:
    """Throughput of ``row`` over that of ``base`` (same tokens per step)."""
    if row is None or base is None or not row.seconds_per_step or not base.seconds_per_step:
        return None
    return base.seconds_per_step / row.seconds_per_step


def _trial_step_s(cfg: dict[str, Any], res: dict[int, dict[str, Any]]) -> float:
    warm = cfg["warmup"]
    return max(r["marks"][-1] - r["marks"][warm - 1] for r in res.values()) / cfg["steps"]


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def print_table(cfg: dict[str, Any], rows: list[Row]) -> None:
    by = {r.key: r for r in rows}
    base = by.get("a")
    mdl = cfg["model"]
    m = cfg["micro_batches"]
    tokens = cfg["batch"] * mdl["seq_len"]
    print()
    print(f"model d_model={mdl['d_model']} n_layers={mdl['n_layers']} n_heads={mdl['n_heads']} "
          f"seq_len={mdl['seq_len']} vocab=256 (byte, shakespeare); global batch "
          f"{cfg['batch']} seqs = {tokens} tokens/step, {m} micro-batches of "
          f"{cfg['batch'] // m}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps; "
          f"{os.cpu_count()} CPUs, 1 thread per process; {cfg['repeats']} trial(s) per row")
    w = max(len(r.label) for r in rows)
    head = f"{'row':<{w}} {'procs':>5} {'tokens/s':>10} {'ms/step':>9} {'vs (a)':>7} " \
           f"{'loss@last':>10} {'clean':>7} {'other load':>10} {'rq wait':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.error is not None:
            print(f"{r.label:<{w}} {r.procs:>5} {'FAILED':>10}")
            continue
        clean = f"{r.clean}/{len(r.steps)}"
        print(f"{r.label:<{w}} {r.procs:>5} {_fmt(r.tokens_per_s(cfg), ',.0f'):>10} "
              f"{_fmt(r.ms_per_step, '.0f'):>9} {_fmt(_ratio(r, base), '.2f', 'x'):>7} "
              f"{_fmt(r.loss, '.5f'):>10} {clean:>7} {_fmt(r.foreign, '.2f', ' cpu'):>10} "
              f"{_fmt(r.rq_ms, '.0f', ' ms'):>8}")
    print("-" * len(head))
    print(f"tokens/s and ms/step: median over the timed steps (all trials) that other processes "
          f"left alone ('clean': other load < {NOISY_CORES} cores); 'other load': mean CPU "
          "used outside this benchmark (+ hypervisor steal) during those steps; 'rq wait': "
          "time per step our compute threads were runnable but had no CPU")
    noisy = [r.key for r in rows if r.error is None and r.steps and r.clean == 0]
    if noisy:
        print(f"WARNING: rows {', '.join(noisy)} had no undisturbed step (other processes used "
              "the CPUs): their figures are low; rerun on an idle machine or with --repeats")
    cap = NUM_STAGES * m / (m + NUM_STAGES - 1)
    print(f"bubble cap, {NUM_STAGES} stages x {m} micro-batches: {NUM_STAGES * m}/"
          f"{m + NUM_STAGES - 1} = {cap:.2f}x (a)")
    ceiling = _ratio(by.get("x"), base)
    if ceiling is not None:
        print(f"this machine, 2 one-thread processes, no comms/bubble (x): {ceiling:.2f}x (a); "
              f"with the bubble ~ {ceiling * m / (m + NUM_STAGES - 1):.2f}x (a) (optimistic: "
              "(x) runs each backward right after its forward)")
    print("targets:")

    def verdict(ratio: float, target: float, *involved: Row | None) -> str:
        word = "met" if ratio >= target else "NOT met"
        if round(ratio, 2) >= target > ratio:  # printed as the target itself: say by how much
            word += f" ({ratio:.3f}x)"
        if any(r is not None and r.clean == 0 for r in involved):
            word += " (unreliable: a row had no undisturbed step)"
        return word

    if cfg.get("interleave"):
        print_step_paired(by, verdict)
        print("pooled (each row's median step, as without --interleave):")
    for sched, tname in SCHEDULES.items():
        b, c = by.get(f"b-{sched}"), by.get(f"c-{sched}")
        if b is not None and c is not None and len(b.trials) == len(c.trials) > 1:
            # Each (b) trial ran right before its (c) trial: drift between them is small.
            pairs = [ct / bt for bt, ct in zip(b.trials, c.trials, strict=True)]
            print(f"  paired, trial by trial: (b) {sched} / (c) {tname} = "
                  f"{', '.join(f'{x:.2f}' for x in pairs)}; median {statistics.median(pairs):.2f}x")
        vs_a, vs_c = _ratio(b, base), _ratio(b, c)
        if vs_a is not None:
            print(f"  (b) {sched:<5} >= {TARGET_VS_A:.2f}x (a): {vs_a:.2f}x -> "
                  f"{verdict(vs_a, TARGET_VS_A, b, base)}")
        if vs_c is not None:
            print(f"  (b) {sched:<5} >= {TARGET_VS_C:.2f}x (c) {tname}: {vs_c:.2f}x -> "
                  f"{verdict(vs_c, TARGET_VS_C, b, c)}")
    ref = base.loss if base is not None else None
    diffs = [f"{r.key} {abs(r.loss - ref):.1e}" for r in rows
             if r.key[0] in "bc" and ref is not None and r.loss is not None]
    if diffs:
        print(f"same training: |last loss - (a)'s| = {', '.join(diffs)}")


def _step_pairs(num: Row | None, den: Row | None) -> tuple[list[float], str]:
    """num's step time over den's, step by step (they ran one after the other under
    --interleave), over the steps that other processes left alone in both (all steps, and a
    warning, when there are none)."""
    if num is None or den is None or len(num.steps) != len(den.steps) or not num.steps:
        return [], ""
    pairs = list(zip(num.steps, den.steps, strict=True))
    clean = [n[0] / d[0] for n, d in pairs if _undisturbed(n) and _undisturbed(d)]
    if clean:
        return clean, ""
    return [n / d for (n, _, _), (d, _, _) in pairs], " (unreliable: no undisturbed pair)"


def _quartiles(xs: list[float]) -> str:
    if len(xs) < 4:
        return ", ".join(f"{x:.2f}" for x in xs)
    q = statistics.quantiles(xs, n=4)
    return f"quartiles {q[0]:.2f}-{q[2]:.2f}"


def print_step_paired(by: dict[str, Row], verdict: Callable[..., str]) -> None:
    """The verdicts of record under --interleave: medians of step-by-step ratios."""
    print("step by step (--interleave: each row's step k ran right after the previous row's):")
    base = by.get("a")
    ceiling, warn = _step_pairs(base, by.get("x"))
    if ceiling:
        print(f"  (x) no comms, no bubble: {statistics.median(ceiling):.2f}x (a) over "
              f"{len(ceiling)} steps ({_quartiles(ceiling)}): what two one-thread processes get "
              f"out of this machine at all{warn}")
    for sched, tname in SCHEDULES.items():
        b, c = by.get(f"b-{sched}"), by.get(f"c-{sched}")
        vs_a, warn = _step_pairs(base, b)
        if vs_a:
            x = statistics.median(vs_a)
            print(f"  (b) {sched:<5} >= {TARGET_VS_A:.2f}x (a): {x:.2f}x over {len(vs_a)} "
                  f"steps ({_quartiles(vs_a)}) -> {verdict(x, TARGET_VS_A, b, base)}{warn}")
        vs_c, warn = _step_pairs(c, b)
        if vs_c:
            x = statistics.median(vs_c)
            print(f"  (b) {sched:<5} >= {TARGET_VS_C:.2f}x (c) {tname}: {x:.2f}x over "
                  f"{len(vs_c)} steps ({_quartiles(vs_c)}) -> "
                  f"{verdict(x, TARGET_VS_C, b, c)}{warn}")
        plain, warn = _step_pairs(by.get(f"b-{sched}-plain"), b)
        if plain:
            print(f"  (b) {sched:<5} split backward on over off: "
                  f"{statistics.median(plain):.2f}x over {len(plain)} steps "
                  f"({_quartiles(plain)}){warn}")


def print_profile(cfg: dict[str, Any], rows: list[Row]) -> None:
    prof_rows = [r for r in rows if r.kind in ("swarm", "torch") and r.error is None
                 and "buckets" in r.res.get(0, {})]
    steps, m = cfg["steps"], cfg["micro_batches"]
    if prof_rows:
        print()
        print(f"where a stage's step goes: ms per step on its compute thread (exclusive wall "
              f"time), mean of {steps} timed steps of each row's least disturbed trial; (c) "
              "'recv wait' is all of schedule.step that is not forward/loss/backward (p2p "
              "comm, waits, bookkeeping), 'norm wait' the all-reduce")
        cols = ["step", *PROFILE_COLUMNS]
        print(f"{'':<18}" + "".join(f"{c:>11}" for c in cols))
        for r in prof_rows:
            for rank, res in sorted(r.res.items()):
                b = res["buckets"]
                vals = [res["step_s"], *(b.get(c, 0.0) for c in PROFILE_COLUMNS)]
                tag = f"{'b' if r.kind == 'swarm' else 'c'} {r.schedule} s{rank}"
                print(f"{tag:<18}" + "".join(f"{v / steps * 1e3:>11.1f}" for v in vals))
        print()
        print(f"schedule bound from the measured compute (c_s = stage s forward+loss+backward "
              f"per micro-batch): (m-1)*max(c0,c1) + c0 + c1 + the slower stage's grad norm "
              f"+ optimizer, m = {m}; 'as (a)': the same compute run as (a) does, "
              f"m*(c0+c1) + both stages' grad norm + optimizer, over the measured step: the "
              f"ratio to (a) at equal per-core speed, robust to the machine's drift between rows")
        as_a: dict[str, float] = {}
        for r in prof_rows:
            comp, tail = [], []
            for _rank, res in sorted(r.res.items()):
                b = res["buckets"]
                comp.append(sum(b.get(k, 0.0) for k in ("forward", "loss", "backward", "wgrad"))
                            / steps / m)
                tail.append((b.get("grad norm", 0.0) + b.get("optimizer", 0.0)) / steps)
            bound = (m - 1) * max(comp) + sum(comp) + max(tail)
            serial = m * sum(comp) + sum(tail)
            step = _trial_step_s(cfg, r.res)
            print(f"  {r.label}: bound {bound * 1e3:.0f} ms, measured {step * 1e3:.0f} ms/step "
                  f"-> {step / bound - 1:+.1%} over the bound; as (a) {serial * 1e3:.0f} ms "
                  f"-> {serial / step:.2f}x")
            as_a[r.key] = serial / step
        for sched, tname in SCHEDULES.items():
            b, c = as_a.get(f"b-{sched}"), as_a.get(f"c-{sched}")
            if b is not None and c is not None:
                print(f"  cross-check at equal per-core speed: (b) {sched} / (c) {tname} = "
                      f"{b / c:.2f}x (target {TARGET_VS_C:.2f}x; each row normalised by its own "
                      "compute, so a row's extra compute does not count against it here)")
    cpu_rows = [r for r in rows if r.kind in ("swarm", "torch") and r.error is None]
    if not cpu_rows:
        return
    print()
    print("CPU ms per step by thread (main = compute thread, 'sys' its kernel part; tx/rx = link "
          "threads; native = threads torch/gloo started), main-thread CPU / step wall, and the "
          "process's minor page faults per step:")
    print(f"{'':<12}{'main':>9}{'sys':>9}{'tx':>9}{'rx':>9}{'native':>9}{'busy':>8}"
          f"{'faults':>9}")
    for r in cpu_rows:
        for rank, res in sorted(r.res.items()):
            cpu = res.get("cpu", {})
            wall = _trial_step_s(cfg, r.res) * steps
            main = cpu.get("MainThread", 0.0)
            tag = f"{'b' if r.kind == 'swarm' else 'c'} {r.schedule} s{rank}"
            print(f"{tag:<12}" + "".join(f"{cpu.get(k, 0.0) / steps * 1e3:>9.1f}"
                                         for k in ("MainThread", "main sys", "tx", "rx",
                                                   "native"))
                  + f"{(main / wall if wall else 0.0):>8.0%}"
                  + f"{cpu.get('minflt', 0.0) / steps:>9.0f}")


def parse_model(spec: str | None, base: dict[str, int]) -> dict[str, int]:
    out = dict(base)
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        k = k.strip()
        if k not in DEFAULT_MODEL or not v:
            raise SystemExit(f"--model: expected key=value with key in "
                             f"{', '.join(DEFAULT_MODEL)}, got {part!r}")
        out[k] = int(v)
    return out


def main(argv: list[str] | None = None) -> int:
    # This process never imports torch; the workers inherit this before they do.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 1 warm-up + 2 timed steps: a smoke run (< 30 s)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; quick 2)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up steps, not timed (default 2; quick 1; at least 1)")
    ap.add_argument("--model", default=None,
                    help="overrides, e.g. d_model=256,n_layers=8,n_heads=8,seq_len=128")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 32)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--only", default=None,
                    help="rows to run, e.g. a,b (default a,b,c,x; quick a,b,c)")
    ap.add_argument("--schedules", default="gpipe,1f1b",
                    help="comma-separated schedules for the (b) and (c) rows (default both)")
    ap.add_argument("--no-profile", action="store_true",
                    help="run (b) and (c) without the timing wrappers")
    ap.add_argument("--interleave", action="store_true",
                    help="start every row at once and let them take steps in turn (row "
                         "after row, step after step), so rows compared step by step ran "
                         "seconds apart; the verdicts of record on a VM whose speed drifts")
    ap.add_argument("--repeats", type=int, default=1,
                    help="trials per row, rows in rotation; a row's figure pools the clean steps "
                         "of all its trials (default 1)")
    ap.add_argument("--wait-idle", type=float, default=None,
                    help="before each trial wait up to this many seconds for the machine to be "
                         "idle (default 30; quick 0)")
    ap.add_argument("--start-method", choices=("spawn", "forkserver"), default=None,
                    help="how worker processes start (default spawn; quick forkserver, with "
                         "torch preloaded in the server, to skip most of the start-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per row")
    # The test suite's: under --interleave, a row (its key, e.g. b-gpipe-plain) whose first
    # worker raises.
    ap.add_argument("--fail-row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model = parse_model(args.model, QUICK_MODEL if args.quick else DEFAULT_MODEL)
    cfg = {
        "model": model,
        "batch": args.batch or (16 if args.quick else 32),
        "micro_batches": args.micro_batches,
        "steps": args.steps or (2 if args.quick else 5),
        "warmup": max(1, args.warmup if args.warmup is not None else (1 if args.quick else 2)),
        "seed": args.seed,
        "profile": not args.no_profile,
        "timeout": args.timeout,
        "repeats": max(1, args.repeats),
        "interleave": args.interleave,
        "start_method": args.start_method or ("forkserver" if args.quick else "spawn"),
        "fail_row": args.fail_row,
    }
    if cfg["start_method"] == "forkserver":
        # Imported once in the server (OMP_NUM_THREADS=1 already set; no torch work done
        # there), so each worker forks with torch loaded and still sets its threads first.
        mp.set_forkserver_preload(["torch", "torch.distributed.pipelining",
                                   "swarm_core.pipeline.stage", "swarm_core.data"])
    if cfg["batch"] % cfg["micro_batches"]:
        raise SystemExit("--batch must be divisible by --micro-batches")
    if model["n_layers"] < NUM_STAGES:
        raise SystemExit(f"need at least {NUM_STAGES} layers")
    only_arg = args.only or ("a,b,c" if args.quick else "a,b,c,x")
    only = {s.strip() for s in only_arg.split(",") if s.strip()}
    plan = [Row("a", "(a) 1 process, 1 thread, plain loop", "single", 1)]
    scheds = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in scheds if s not in SCHEDULES]
    if unknown or not scheds:
        raise SystemExit(f"--schedules: expected some of {', '.join(SCHEDULES)}, got "
                         f"{args.schedules!r}")
    # (b) and (c) of a schedule run back to back, so the VM's drift between them stays small.
    for sch in scheds:
        plan += [Row(f"b-{sch}", f"(b) SilentSwarm pipeline, {sch}, 2 procs x 1 thread", "swarm",
                     2, sch),
                 Row(f"c-{sch}", f"(c) torch.pipelining {SCHEDULES[sch]} (gloo), 2 x 1 thread",
                     "torch", 2, sch),
                 Row(f"b-{sch}-plain", f"(b) same, {sch}, split backward off", "swarm", 2,
                     f"{sch}-plain")]
    plan += [Row("x", "(x) 2 procs x 1 thread, no comms, no bubble", "ceiling", 2)]
    rows = [r for r in plan if r.key.split("-")[0] in only]
    print(f"bench_pipeline: {len(rows)} rows, {cfg['warmup']}+{cfg['steps']} steps each ...",
          file=sys.stderr, flush=True)
    wait_s = args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 30.0)
    def settle() -> None:
        if wait_s > 0:
            load = wait_for_idle(wait_s)
            if load >= NOISY_CORES:
                print(f"  (machine still busy: {load:.2f} cores used by others; "
                      "running anyway)", file=sys.stderr, flush=True)

    for _ in range(cfg["repeats"]):
        if cfg["interleave"]:
            settle()
            run_interleaved(rows, cfg)
            continue
        for r in rows:
            if r.error is not None:
                continue
            settle()
            r.run(cfg)
    print_table(cfg, rows)
    print_profile(cfg, rows)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
