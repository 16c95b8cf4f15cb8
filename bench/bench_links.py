"""Pipeline step time on a shaped link against the bandwidth bound (a benchmark, not a test).

Two pipeline stages run in threads of this process, joined by real loopback TCP (DataListener on
127.0.0.1, as in tests/unit/test_pipeline_inprocess.py). Each stage's LinkShaper has its tx
bucket at ``--mbps`` (80 Mbit/s by default) and rx unlimited, so activations (stage 0 -> 1) and
gradients (stage 1 -> 0) each get one shaped direction, like a symmetric link. Model: d_model
256, 2 layers (one per stage), seq 128, batch 16 in 4 micro-batches, 1f1b, one torch thread per
stage.

* calibration: frames through one shaped PeerLink alone (no model): the rate the token bucket
  really lets through, and (full run) what its 64 KiB burst credit does on a 1 Mbit/s link;
* A: ``none``, ``fixed_int8``, ``learned_dim64_int8`` at ``--mbps``: step (mean interval
  between stage 0's step completions, first step skipped), bound (bytes the busier stage sends
  per step, ``expected_wire_bytes``, over the rate; the two directions run in parallel),
  step/bound, fill bound ((M+1)/M x bound: with whole-tensor frames the gradient direction
  idles while the first activation is in flight and vice versa at the end), compute-only (the
  same run unshaped) and the issue's target: within 15 % of the bound when communication
  dominates (bound > compute-only), else "n/a: compute-bound";
* A2: A's specs and rate with the slow-link settings of E (schedule ``eager``, 16
  micro-batches): where ``none`` at ``--mbps`` is link-bound (a fast core), 1F1B's 4
  micro-batches leave the link idle at both ends of the step, and these settings do not;
* B (full run): each spec on a link slow enough that the bound is ~3x its compute-only step,
  tx bucket burst 4 KiB (the default 64 KiB of credit per idle gap flatters slow links);
* C (full run): micro-batch sweep for ``none`` at B's rate, 1f1b and the "ahead" candidate:
  does step/bound follow (M+1)/M?
* E (full run): B's specs and rates as a researcher would run a slow link: the ``eager``
  schedule and 16 micro-batches (the fill floor (M+1)/M drops to 1.06);
* D (full run): schedules 1f1b, gpipe and a candidate ("ahead": early stages run all forwards
  first, the last stage 1f1b), swapped in by patching ``stage.ops_for`` in this process only;
* where each stage thread's time goes: waiting in ``PeerLink.recv``, in ``send_tensor``
  (encode + checksum + enqueue on the compute thread), in ``flush``, and the rest (compute).

Usage::

    .venv/bin/python bench/bench_links.py            # all tables, 6 measured steps (~5 min)
    .venv/bin/python bench/bench_links.py --quick    # calibration + A, 1 step (~12 s)

Only 127.0.0.1; every run is bounded by frame timeouts and a join timeout, and stops itself.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.config.schemas import ModelConfig, TrainingConfig  # noqa: E402
from swarm_core.data import TokenData, load_token_data  # noqa: E402
from swarm_core.pipeline import codecs, schedules  # noqa: E402
from swarm_core.pipeline import stage as stage_mod  # noqa: E402
from swarm_core.pipeline.frames import Kind, job_tag  # noqa: E402
from swarm_core.pipeline.links import BURST, LinkShaper, TokenBucket  # noqa: E402
from swarm_core.pipeline.listener import DataListener  # noqa: E402
from swarm_core.pipeline.local import run_local_pipeline  # noqa: E402
from swarm_core.pipeline.stage import (  # noqa: E402
    StageRunner,
    StepReport,
    expected_wire_bytes,
)
from swarm_core.pipeline.transport import PeerLink, connect  # noqa: E402

TARGET = 1.15
MODEL = dict(d_model=256, n_layers=2, n_heads=4, seq_len=128)
BATCH = 16
SPECS = ("none", "fixed_int8", "learned_dim64_int8")
RUN_TIMEOUT_S = 180.0
LINK_BOUND_FACTOR = 3.0  # table B: the link rate that makes the bound this x compute-only
STRICT_BURST = 4096  # table B's bucket: 64 KiB of credit per idle gap would skew slow links
SLOW_LINK_MICRO = 16  # table E: micro-batches of one sequence on a slow link


# --- where a stage thread's time goes (bench-only instrumentation, no swarm_core edits) -------

_local = threading.local()
_spent: dict[str, dict[str, float]] = collections.defaultdict(
    lambda: collections.defaultdict(float))


def _instrument() -> None:
    """Wrap PeerLink.recv / send_tensor / flush and StageRunner.train_step so each stage thread
    adds up, for steps after the first, the seconds it spends waiting for frames, encoding and
    queueing (send_tensor: codec + checksum on the compute thread) and waiting for the sender."""

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if getattr(_local, "step", 0) >= 1:
                    _spent[threading.current_thread().name][key] += time.perf_counter() - t0
        return wrapper

    train_step = StageRunner.train_step

    def train_step_wrapper(self: StageRunner, step: int) -> StepReport:
        _local.step = step
        return train_step(self, step)

    PeerLink.recv = timed(PeerLink.recv, "recv")  # type: ignore[method-assign]
    PeerLink.send_tensor = timed(PeerLink.send_tensor, "send")  # type: ignore[method-assign]
    PeerLink.flush = timed(PeerLink.flush, "flush")  # type: ignore[method-assign]
    StageRunner.train_step = train_step_wrapper  # type: ignore[method-assign]
    stage_mod.ops_for = _bench_ops_for  # the schedule comes from _schedule, not the config


def forwards_ahead(stage: int, num_stages: int, micro_batches: int) -> list[schedules.Op]:
    """Candidate schedule: every stage but the last runs all its forwards first (as gpipe), so its
    outgoing link streams activations back to back; the last stage alternates F/B (as 1f1b), so
    gradients start flowing back after one micro-batch. Backward ops stay in micro-batch order
    (the exactness anchor). Costs gpipe's activation memory on the early stages."""
    if stage == num_stages - 1:
        return schedules.one_f_one_b(stage, num_stages, micro_batches)
    return schedules.gpipe(stage, num_stages, micro_batches)


BENCH_SCHEDULES: dict[str, Any] = {"1f1b": schedules.one_f_one_b, "gpipe": schedules.gpipe,
                                   "ahead": forwards_ahead, "eager": schedules.eager}
_schedule = ["1f1b"]  # the schedule both stages use in the next run_pipeline


def _bench_ops_for(schedule: str, stage: int, num_stages: int,
                   micro_batches: int) -> list[schedules.Op]:
    return BENCH_SCHEDULES[_schedule[0]](stage, num_stages, micro_batches)


@attrs.define
class RunResult:
    step_s: float  # mean interval between stage 0's step completions, first step skipped
    stage_s: tuple[float, ...]  # mean StepReport.seconds per stage, first step skipped
    tx_bytes: tuple[float, ...]  # measured wire bytes per step per stage (shaper counter)
    spent: tuple[dict[str, float], ...]  # per stage: seconds per step in recv / send / flush
    wall_s: float
    losses: list[float]  # the last stage's loss per step


def run_pipeline(mc: ModelConfig, tc: TrainingConfig, data: TokenData,
                 mbps: float | None, burst: int = BURST) -> RunResult:
    n = 2
    reports: dict[int, list[tuple[float, StepReport]]] = {s: [] for s in range(n)}
    _spent.clear()
    t0 = time.perf_counter()
    try:
        # rx stays unlimited: each direction is shaped once, at its sender.
        results = run_local_pipeline(
            mc, tc, data, n, shapers=[LinkShaper(tx=TokenBucket(mbps, burst=burst))
                                      for _ in range(n)],
            on_step=lambda s, r: reports[s].append((time.perf_counter(), r)),
            timeout=RUN_TIMEOUT_S)
    except TimeoutError:
        raise RuntimeError(f"pipeline did not finish within {RUN_TIMEOUT_S:g} s") from None
    wall = time.perf_counter() - t0
    for s in range(n):
        if isinstance(results.get(s), BaseException):
            raise RuntimeError(f"stage {s} failed: {results[s]!r}") from results[s]
    stamps = [ts for ts, _ in reports[0]]
    intervals = [b - a for a, b in itertools.pairwise(stamps)]
    measured = len(intervals)
    return RunResult(
        step_s=statistics.mean(intervals),
        stage_s=tuple(statistics.mean(r.seconds for _, r in reports[s][1:]) for s in range(n)),
        tx_bytes=tuple(statistics.mean(r.wire_tx_bytes for _, r in reports[s][1:])
                       for s in range(n)),
        spent=tuple({k: v / measured for k, v in _spent[f"stage-{s}"].items()}
                    for s in range(n)),
        wall_s=wall,
        losses=list(results[n - 1].losses))  # type: ignore[union-attr]


def bound_s(mc: ModelConfig, tc: TrainingConfig, mbps: float) -> float:
    sent = max(expected_wire_bytes(mc, tc, s, 2) for s in range(2))
    return sent / (mbps * 1e6 / 8)


def calibrate(cases: list[tuple[float, int, tuple[int, ...], int]]) -> list[tuple[str, ...]]:
    """Frames through one shaped PeerLink, no model: the rate the bucket really lets through."""
    listener = DataListener("127.0.0.1")
    tag = job_tag("bench-calib")
    key = "c" * 32
    got: dict[str, Any] = {}

    def accept() -> None:
        got["rx"] = listener.accept(key, 1, tag, LinkShaper(), timeout=10)

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    tx_shaper = LinkShaper()
    tx = connect(listener.addr, key, 0, tag, tx_shaper, timeout=10)
    th.join(10)
    rx = got["rx"]
    rows = []
    try:
        for step, (mbps, burst, shape, frames) in enumerate(cases):
            tx_shaper.tx = TokenBucket(mbps, burst=burst)  # fresh bucket: full burst credit
            x = torch.randn(*shape)
            sent = 0
            t0 = time.perf_counter()
            for i in range(frames):
                sent += tx.send_tensor(Kind.ACT, step, i, x, codecs.FP32_WIRE)
            for i in range(frames):
                rx.recv_tensor(Kind.ACT, step, i, timeout=30)
            dt = time.perf_counter() - t0
            achieved = sent * 8 / dt / 1e6
            rows.append((f"{sent // frames / 1024:.0f} KiB x {frames}", f"{mbps:g}",
                         f"{burst / 1024:g}", f"{dt:.3f}", f"{sent / (mbps * 1e6 / 8):.3f}",
                         f"{achieved:.2f}", f"{achieved / mbps:.1%}"))
    finally:
        tx.close()
        rx.close()
        listener.close()
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]], first: int = 20) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    widths[0] = max(widths[0], first)
    fmt = "  " + "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}"
                           for i, w in enumerate(widths))
    print(fmt.format(*header))
    for r in rows:
        print(fmt.format(*r))


def measure(spec: str, micro: int, steps: int, mbps: float, data: TokenData,
            schedule: str = "1f1b", burst: int = BURST) -> dict[str, Any]:
    _schedule[0] = schedule
    mc = ModelConfig(**MODEL, compression=spec)
    tc = TrainingConfig(steps=steps + 1, batch_size=BATCH, micro_batches=micro,
                        eval_batches=0, warmup_steps=0, frame_timeout_s=30.0)
    shaped = run_pipeline(mc, tc, data, mbps, burst)
    free = run_pipeline(mc, tc, data, None)
    b = bound_s(mc, tc, mbps)
    return dict(spec=spec, micro=micro, mbps=mbps, schedule=schedule, burst=burst, shaped=shaped,
                free=free, bound=b,
                sent=max(expected_wire_bytes(mc, tc, s, 2) for s in range(2)),
                ratio=shaped.step_s / b, fill=b * (micro + 1) / micro,
                comm_dominates=b > free.step_s)


def verdict(r: dict[str, Any]) -> str:
    if not r["comm_dominates"]:
        return "n/a: compute-bound"
    if r["ratio"] <= TARGET:
        return "MET"
    floor = (r["micro"] + 1) / r["micro"]
    # Whole-tensor frames: no step of M micro-batches beats (M+1)/M x the bound. Said only
    # when the floor explains the miss (the step is within the target of the floor).
    explained = floor > TARGET and r["ratio"] <= floor * TARGET
    return f"MISSED (fill floor {floor:.2f}x > target)" if explained else "MISSED"


def print_step_table(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        sh, fr, b = r["shaped"], r["free"], r["bound"]
        rows.append((r["spec"], f"{r['mbps']:.3g}", f"{r['sent'] / 1024:.0f}",
                     f"{max(sh.tx_bytes) / 1024:.0f}", f"{sh.step_s * 1e3:.1f}",
                     f"{b * 1e3:.1f}", f"{r['ratio']:.2f}", f"{r['fill'] * 1e3:.1f}",
                     f"{sh.step_s / r['fill']:.2f}", f"{fr.step_s * 1e3:.1f}",
                     f"{sh.step_s / max(b, fr.step_s):.2f}", verdict(r)))
    table(("spec", "Mbit/s", "KiB/step", "measured", "step ms", "bound ms", "step/bound",
           "fill ms", "step/fill", "compute ms", "step/max(b,c)", f"<= {TARGET:.2f}x bound"),
          rows)


def print_breakdown(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        for label, res in (("shaped", r["shaped"]), ("compute", r["free"])):
            for s in range(2):
                sp = res.spent[s]
                busy = res.stage_s[s] - sum(sp.values())
                sched = "" if r["schedule"] == "1f1b" else f" {r['schedule']}"
                rows.append((f"{r['spec']}{sched} @{r['mbps']:.3g} {label} s{s}",
                             f"{res.stage_s[s] * 1e3:.1f}",
                             f"{busy * 1e3:.1f}", f"{sp.get('recv', 0.0) * 1e3:.1f}",
                             f"{sp.get('send', 0.0) * 1e3:.1f}",
                             f"{sp.get('flush', 0.0) * 1e3:.1f}"))
    table(("run / stage", "step ms", "compute+opt", "recv wait", "send_tensor", "flush"),
          rows, first=38)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 measured step, calibration and tables A and A2 of two specs only")
    ap.add_argument("--mbps", type=float, default=80.0)
    ap.add_argument("--steps", type=int, default=None, help="measured steps (one more runs)")
    args = ap.parse_args()
    steps = args.steps or (1 if args.quick else 6)
    mbps = args.mbps
    torch.set_num_threads(1)
    _instrument()
    t_start = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; torch "
          f"{torch.__version__}; model {MODEL}, batch {BATCH}, 1f1b, grad_clip 1.0, 1 torch "
          f"thread per stage; {steps} measured steps (+1 skipped) per run")
    data = load_token_data(TrainingConfig(), MODEL["seq_len"])

    print("\n== calibration: fp32 frames through one shaped PeerLink, no model, fresh bucket ==")
    n_frames = 4 if args.quick else 8
    cases = [(mbps, BURST, (4, 128, 256), n_frames), (mbps, BURST, (4, 128, 64), n_frames)]
    if not args.quick:
        cases += [(1.0, BURST, (4, 128, 16), 4), (1.0, STRICT_BURST, (4, 128, 16), 4)]
    table(("frames", "Mbit/s", "burst KiB", "seconds", "ideal s", "Mbit/s", "of set"),
          calibrate(cases))

    specs = SPECS[::2] if args.quick else SPECS  # (a smoke run: the ends of the range)
    results_a = [measure(spec, 4, steps, mbps, data) for spec in specs]
    print(f"\n== A: 2 stages, batch {BATCH} = 4 micro-batches of 4x128, {mbps:g} Mbit/s each "
          "direction ==")
    print_step_table(results_a)
    print("  KiB/step: expected_wire_bytes of the busier stage; measured: its shaper tx counter;"
          "\n  fill = (M+1)/M x bound; compute = same run unshaped; comm dominates when bound > "
          "compute.")

    # The same link and specs with the settings a slow link calls for (as in E below): on a
    # core fast enough that `none` at this rate is link-bound, 1F1B's 4 micro-batches leave
    # the link idle at each end of the step and between a gradient and the next activation.
    results_a2 = [measure(spec, SLOW_LINK_MICRO, steps, mbps, data, "eager") for spec in specs]
    print(f"\n== A2: A's specs at {mbps:g} Mbit/s with the slow-link settings: schedule eager, "
          f"{SLOW_LINK_MICRO} micro-batches of {BATCH // SLOW_LINK_MICRO} ==")
    print_step_table(results_a2)

    results_b: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    if not args.quick:
        for r in results_a:
            # A rate at which the link clearly dominates: bound = LINK_BOUND_FACTOR x compute.
            slow = float(f"{mbps * r['bound'] / (LINK_BOUND_FACTOR * r['free'].step_s):.2g}")
            results_b.append(measure(r["spec"], 4, steps, min(slow, mbps), data,
                                     burst=STRICT_BURST))
        print(f"\n== B: the same, each spec on a link slow enough that the bound is ~"
              f"{LINK_BOUND_FACTOR:g}x its compute-only step (bucket burst "
              f"{STRICT_BURST // 1024} KiB) ==")
        print_step_table(results_b)
        none_rate = results_b[0]["mbps"]
        for sched in ("1f1b", "ahead"):
            for micro in (2, 4, 8, 16):
                if sched == "1f1b" and micro == 4:
                    sweep.append(results_b[0])  # the same run as B's first row
                    continue
                sweep.append(measure("none", micro, steps, none_rate, data, sched,
                                     burst=STRICT_BURST))
        print(f"\n== C: micro-batch sweep, spec none, batch {BATCH}, {none_rate:g} Mbit/s: does "
              "step/bound follow (M+1)/M? (1f1b, then the ahead candidate) ==")
        table(("schedule, M", "step ms", "bound ms", "step/bound", "(M+1)/M", "compute ms",
               "step-fill ms", f"<= {TARGET:.2f}x bound"),
              [(f"{r['schedule']} M={r['micro']}", f"{r['shaped'].step_s * 1e3:.1f}",
                f"{r['bound'] * 1e3:.1f}", f"{r['ratio']:.2f}",
                f"{(r['micro'] + 1) / r['micro']:.2f}", f"{r['free'].step_s * 1e3:.1f}",
                f"{(r['shaped'].step_s - r['fill']) * 1e3:.1f}", verdict(r)) for r in sweep])

    results_e: list[dict[str, Any]] = []
    if not args.quick:
        # What a researcher sets for a slow link: the eager schedule (the activation link is busy
        # from the first micro-batch, gradients flow back from the first) and more, smaller
        # micro-batches, so the one-micro-batch fill at each end of the step is a small part.
        for r in results_b:
            results_e.append(measure(r["spec"], SLOW_LINK_MICRO, steps, r["mbps"], data,
                                     "eager", burst=STRICT_BURST))
        print(f"\n== E: B's specs and rates with the slow-link settings: schedule eager, "
              f"{SLOW_LINK_MICRO} micro-batches of {BATCH // SLOW_LINK_MICRO} (split backward "
              "on) ==")
        print_step_table(results_e)

    results_d: list[dict[str, Any]] = []
    if not args.quick:
        cases = [("none", mbps, results_a[0]), ("fixed_int8", mbps, results_a[1]),
                 ("none", results_b[0]["mbps"], results_b[0])]
        rows = []
        for spec, rate, base in cases:
            for sched in ("1f1b", "gpipe", "ahead"):
                r = base if sched == "1f1b" else measure(spec, 4, steps, rate, data, sched,
                                                         burst=base["burst"])
                if sched != "1f1b":
                    results_d.append(r)
                rows.append((f"{spec} {sched}", f"{rate:.3g}", f"{r['shaped'].step_s * 1e3:.1f}",
                             f"{r['bound'] * 1e3:.1f}", f"{r['ratio']:.2f}",
                             f"{r['shaped'].step_s / r['fill']:.2f}",
                             f"{r['free'].step_s * 1e3:.1f}",
                             f"{base['shaped'].step_s / r['shaped'].step_s:.2f}x",
                             "yes" if r["shaped"].losses == base["shaped"].losses else "NO"))
        print("\n== D: schedules, 4 micro-batches (ahead = candidate: stage 0 runs all forwards "
              "first, the last stage 1f1b) ==")
        table(("spec / schedule", "Mbit/s", "step ms", "bound ms", "step/bound", "step/fill",
               "compute ms", "vs 1f1b", "same losses"), rows, first=24)

    print("\n== where each stage thread's time goes, ms per step (recv wait: blocked on a frame; "
          "send_tensor: encode + checksum + enqueue; flush: waiting for the sender) ==")
    print_breakdown(results_a + results_a2 + results_b + results_e + results_d)

    print("\n== verdicts (target: step <= 1.15 x bound when communication dominates) ==")
    for label, res in (("A", results_a), ("A2", results_a2), ("B", results_b),
                       ("E", results_e)):
        for r in res:
            print(f"  {label:<2} {r['spec']:<20} {r['mbps']:>5.3g} Mbit/s  step/bound "
                  f"{r['ratio']:.2f}  step/fill {r['shaped'].step_s / r['fill']:.2f}: "
                  f"{verdict(r)}")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.1f} s; load average "
          f"{os.getloadavg()[0]:.2f} (two stages share {os.cpu_count()} cores with anything "
          "else running)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
