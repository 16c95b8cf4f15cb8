"""Data parallel against DiLoCo on shaped links: S=1 x R=2, the quickstart's model (a
benchmark, not a test).

The issue's targets ("The second dimension", Benchmarks): at 80 Mbit/s per fellow, one stage
and two replicas, the model of the quickstart, ``dp`` against ``diloco`` with H = 10 and 50:

* sync bytes per inner step >= H x smaller than ``dp``'s;
* DiLoCo's step time within 10 % of the unshaped step;
* eval loss after the same tokens within 3 % of ``dp``'s.

Each row is one stage of the quickstart's model (``swarm_core.config.defaults``: d_model 128,
4 layers, seq 64) and its training (batch 16 in 4 micro-batches, lr 3e-3 cosine to 3e-4,
byte-level Shakespeare, seed 0), two replicas (``run_stage``) in two spawned processes with one
torch thread each, their ring over loopback TCP. Every fellow's ``LinkShaper`` has tx and rx at
``--mbps`` (80 Mbit/s); each row runs again unshaped for its reference step. All rows train on
the same windows from the same seed for the same steps (so the same tokens); only the
synchronisation differs. DiLoCo uses the codebase's defaults (outer lr 0.7, Nesterov momentum
0.9; ``--outer-lr``/``--outer-momentum`` add rows per outer optimiser) and every row the
default sync compression (``none``: fp32), unless told otherwise. ``--loss-only`` runs each
row once, unshaped (bytes and eval loss; no step times).
``--warm-start W`` first trains the model by dp for W steps (unshaped, a schedule of its own,
on the windows of another seed) and starts every row from it, as the DiLoCo paper's runs start
from a pretrained model. Each H runs once per ``--overlap`` fraction: ``sync.overlap_steps``
d = that share of H (at most H - 1; 0, the default of the codebase and the paper, waits for
the outer step's average; d > 0 lets it cross while the replicas train d more steps).

Columns: sync B/step, what replica 0's ring sent, measured, averaged over every step (DiLoCo's
outer steps, and the run's last step, which syncs too, spread over the inner steps); dp/this,
dp's bytes over this row's; step shaped and unshaped, the mean over the timed steps (the
first ``--warmup`` left out) of the slower replica's time, the outer steps' syncs included;
the final eval loss (``--eval-batches`` held-out batches, replica 0 after the last sync) and
its ratio to dp's. A line per target says met or NOT met; nothing is tuned to meet them.

Usage::

    .venv/bin/python bench/bench_sync_modes.py                  # 500 steps, H = 10 and 50 (~14 min)
    .venv/bin/python bench/bench_sync_modes.py --steps 400 --inner-steps 10,50,100
    .venv/bin/python bench/bench_sync_modes.py --warm-start 2000 --steps 1000 --overlap 0 \
        --outer-lr 0.7,0.2,1 --outer-momentum 0.9,0.9,0 --loss-only   # outer optimisers
    .venv/bin/python bench/bench_sync_modes.py --quick          # a tiny model, a few seconds

SparseLoCo rows (``--modes diloco,sparseloco``, ``--density``, ``--replicas 4``): its paper's
outer step (lr 1, no momentum) and its own 2-bit values; compared with DiLoCo at the same H.
A DeMo row (``--modes demo``): every step, Psyche's defaults (DCT blocks of 64, top 8, 1-bit
signs), plain SGD on the sign at the training profile's lr; compared with dp.
Streaming DiLoCo's fragments (``--fragments 1,4``, e.g. with ``--compression fp4``): each
periodic row once per count; the ``burst B`` column is the most one step's sync sent (the
last step aside, where every fragment syncs once a run), compared with the whole model's.

Only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

HOST = "127.0.0.1"
FULL = {"model": None, "steps": 500, "warmup": 2, "inner_steps": "10,50", "eval_batches": 16}
QUICK = {"model": dict(d_model=32, n_layers=1, n_heads=2, seq_len=16),
         "training": dict(batch_size=8, micro_batches=2, warmup_steps=1),  # (R up to 4)
         "steps": 6, "warmup": 1, "inner_steps": "2,3", "eval_batches": 1}


def _configs(cfg: dict[str, Any], mode: str, inner: int, overlap: int = 0,
             outer: tuple[float | None, float | None] = (0.7, 0.9),
             fragments: int = 1) -> tuple[Any, Any]:
    import attrs

    from swarm_core.config.defaults import DEFAULT_MODEL, DEFAULT_TRAINING
    from swarm_core.config.methods import SYNC_METHODS
    from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig
    from swarm_core.schema import structure

    model = {**DEFAULT_MODEL, **(cfg["model"] or {})}
    training = {**DEFAULT_TRAINING, **cfg.get("training", {})}
    mc = structure(model, ModelConfig)
    tc = structure(training, TrainingConfig)
    own = SYNC_METHODS[mode].own_coding  # (sparseloco: its values' bits, its paper's outer)
    sync = SyncConfig(mode=mode, inner_steps=inner,
                      compression="none" if own else cfg["compression"],
                      overlap_steps=overlap, outer_lr=None if own else outer[0],
                      outer_momentum=None if own else outer[1], density=cfg["density"],
                      topk=cfg["topk"], fragments=fragments)
    # Only the final evaluation: one mid-run would hold replica 0 while replica 1 waits on
    # the ring, and count in the step times.
    tc = attrs.evolve(tc, steps=cfg["steps"], eval_every=0, eval_batches=cfg["eval_batches"],
                      threads=1, shard_push_interval_steps=0, sync=sync)
    if mode == "demo" and cfg.get("demo_lr"):  # (sign-SGD's own step size, its schedule's shape)
        scale = cfg["demo_lr"] / tc.lr
        tc = attrs.evolve(tc, lr=cfg["demo_lr"], min_lr=tc.min_lr * scale)
    if cfg.get("warming"):  # (a run of its own, on other windows than the rows train on)
        tc = attrs.evolve(tc, steps=cfg["warm_start"], seed=tc.seed + 1)
    return mc, tc


# mode, H, d, Mbit/s, outer, fragments
Row = tuple[str, int, int, float | None, tuple[float, float], int]


def _stage(cfg: dict[str, Any], row: Row, rank: int, out: Any, side: Any) -> None:
    """Replica ``rank`` of the one-stage job, its links shaped at ``mbps`` (None: unshaped)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import threading

    from swarm_core.contract import chain_starts
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.listener import DataListener
    from swarm_core.pipeline.stage import StageSpec, run_stage
    from swarm_core.protocol import LinkLimits

    mode, inner, overlap, mbps, outer, fragments = row
    mc, tc = _configs(cfg, mode, inner, overlap, outer, fragments)
    data = load_token_data(tc, mc.seq_len)
    shaper = LinkShaper()
    if mbps is not None:
        shaper.apply(LinkLimits(tx_mbps=mbps, rx_mbps=mbps))
    listener = DataListener(HOST)
    side["addrs"].put((rank, listener.addr))
    addrs = side[f"to{rank}"].get(timeout=120)
    spec = StageSpec.from_start(chain_starts(mc, tc, addrs, replicas=cfg["replicas"])[rank],
                                threads=1)
    marks: list[float] = []
    bursts: list[int] = []  # (each step's sync bytes: the largest is the link's burst)

    def on_step(r: Any) -> None:
        marks.append(time.perf_counter())
        bursts.append(r.sync_tx_bytes or 0)

    kwargs: dict[str, Any] = {}
    if cfg.get("warming"):
        if rank == 0:  # (its final checkpoint: the replicas' one set of weights)
            kwargs["on_checkpoint"] = lambda ck: np.savez(cfg["warm_file"], **{
                k: v.detach().cpu().numpy() for k, v in ck.module.state_dict().items()})
    elif cfg.get("warm_file"):
        with np.load(cfg["warm_file"], allow_pickle=False) as z:
            kwargs["initial_state"] = {k: torch.from_numpy(z[k]) for k in z.files}
    try:
        res = run_stage(spec, data, shaper, listener, threading.Event(), on_step,
                        connect_timeout=120, **kwargs)
    finally:
        listener.close()
    m = res.metrics
    out.put((rank, marks, {"sync_bytes": m.sync_tx_bytes_per_step,
                           "expected_sync_bytes": m.expected_sync_tx_bytes_per_step,
                           "sync_fraction": m.sync_fraction, "eval_loss": m.eval_loss,
                           # (but the last step's: every fragment syncs there, once a run)
                           "burst": max(bursts[:-1], default=0),
                           "losses": res.losses}))


def _context() -> Any:
    # As bench_dp: a fork server that imported torch and the stage once, so each row's
    # processes start in milliseconds, clean of this process's threads.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "swarm_core.pipeline.stage",
                                "swarm_core.data"])
    return ctx


def _run(cfg: dict[str, Any], row: Row) -> list[tuple[int, list, dict]]:
    ctx = _context()
    out = ctx.Queue()
    n = cfg["replicas"]
    side: dict[str, Any] = {"addrs": ctx.Queue(), **{f"to{r}": ctx.Queue() for r in range(n)}}
    procs = [ctx.Process(target=_stage, args=(cfg, row, r, out, side)) for r in range(n)]
    for p in procs:
        p.start()
    got = dict(side["addrs"].get(timeout=300) for _ in range(n))
    for r in range(n):
        side[f"to{r}"].put([got[r] for r in range(n)])
    results = [out.get(timeout=3600) for _ in range(n)]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"replica worker of {row} exited with {p.exitcode}")
    return sorted(results, key=lambda r: r[0])


def _step_s(results: list[tuple[int, list, dict]], warmup: int) -> float:
    """The mean step over the timed ones, of the slower replica (the outer steps included)."""
    return max((marks[-1] - marks[warmup - 1]) / (len(marks) - warmup)
               for _r, marks, _m in results)


def _check(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, a few steps (smoke)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps of every row (default 500; best a multiple of each H)")
    ap.add_argument("--inner-steps", default=None,
                    help="DiLoCo's H values, comma-separated (default 10,50)")
    ap.add_argument("--overlap", default="0,0.5,0.9",
                    help="DiLoCo rows per H: sync.overlap_steps as fractions of H, "
                         "comma-separated (0: the outer step blocks; default %(default)s)")
    ap.add_argument("--mbps", type=float, default=80.0,
                    help="tx and rx limit of each fellow, Mbit/s (default %(default)s)")
    ap.add_argument("--compression", default="none",
                    help="training.sync.compression of every row (default: the codebase's, "
                         "%(default)s)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="first steps left out of the step times (default 2)")
    ap.add_argument("--warm-start", type=int, default=0,
                    help="first train the model by dp (unshaped, its own schedule, on other "
                         "windows) for this many steps; every row starts from it, as the "
                         "DiLoCo paper's runs start from a pretrained model (default: none)")
    ap.add_argument("--eval-batches", type=int, default=None,
                    help="held-out batches of the final eval (default 16)")
    ap.add_argument("--outer-lr", default="0.7",
                    help="DiLoCo rows per outer lr, comma-separated (default: the codebase's "
                         "and the paper's, %(default)s)")
    ap.add_argument("--outer-momentum", default="0.9",
                    help="the outer Nesterov momentum of each --outer-lr, comma-separated, or "
                         "one for all (default %(default)s; 0 with lr 1: plain averaging)")
    ap.add_argument("--replicas", type=int, default=2,
                    help="replicas of the one stage, each a process (default %(default)s)")
    ap.add_argument("--modes", default="diloco",
                    help="the periodic modes of the rows beside dp, comma-separated: diloco, "
                         "sparseloco (its own outer step and bits; default %(default)s)")
    ap.add_argument("--density", type=float, default=0.02,
                    help="sparseloco's density (default %(default)s)")
    ap.add_argument("--fragments", default="1",
                    help="the periodic rows once per fragment count, comma-separated (Streaming "
                         "DiLoCo; each must divide every H, the overlap a fraction of H/P)")
    ap.add_argument("--topk", type=int, default=8,
                    help="demo's components per DCT block (default %(default)s, Psyche's)")
    ap.add_argument("--demo-lr", type=float, default=None,
                    help="demo's peak lr (sign-SGD takes steps of lr a weight; default: the "
                         "training profile's, its floor scaled alike)")
    ap.add_argument("--loss-only", action="store_true",
                    help="each row once, unshaped: the bytes and eval loss, no step times")
    args = ap.parse_args(argv)
    try:
        lrs = [float(v) for v in args.outer_lr.split(",")]
        moms = [float(v) for v in args.outer_momentum.split(",")]
    except ValueError:
        ap.error("--outer-lr and --outer-momentum take numbers separated by commas")
    if len(moms) == 1:
        moms *= len(lrs)
    if len(moms) != len(lrs):
        ap.error("--outer-momentum takes one value, or one per --outer-lr")
    outers = list(zip(lrs, moms, strict=True))
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("steps", "warmup", "inner_steps", "eval_batches"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["compression"] = args.compression
    cfg["replicas"], cfg["density"], cfg["topk"] = args.replicas, args.density, args.topk
    cfg["demo_lr"] = args.demo_lr
    periodic = args.modes.split(",")
    from swarm_core.config.methods import SYNC_METHODS
    if any(m not in SYNC_METHODS or m == "dp" for m in periodic) \
            or args.replicas < 2 or not 0 < args.density <= 1:
        ap.error("--modes takes sync modes beside dp (diloco, sparseloco, demo), --replicas "
                 "at least 2, --density in (0, 1]")
    hs = [int(h) for h in str(cfg["inner_steps"]).split(",")]
    if not 1 <= cfg["warmup"] < cfg["steps"]:
        ap.error("--warmup must be at least 1 and fewer than --steps")
    mc, tc = _configs(cfg, "dp", 1)
    from swarm_core.config.schemas import job_shape_error
    shape = job_shape_error(mc, tc, 1, args.replicas)  # (the leader's rule, as it refuses)
    if shape is not None:
        ap.error(f"{shape[1]}: {shape[0]}")
    tokens = tc.steps * tc.batch_size * mc.seq_len
    print(f"bench_sync_modes: d_model {mc.d_model}, {mc.n_layers} layers, seq {mc.seq_len}; "
          f"S=1 x R={args.replicas}, batch {tc.batch_size} ({tc.batch_size // args.replicas} a "
          f"replica), {tc.steps} steps "
          f"= {tokens:,} tokens a row, {cfg['warmup']} untimed; links {args.mbps:g} Mbit/s tx/rx "
          f"a fellow; sync compression {cfg['compression']}; DiLoCo outer lr/momentum "
          f"{', '.join(f'{lr:g}/{m:g}' for lr, m in outers)} (Nesterov); {os.cpu_count()} "
          "CPUs, 1 thread a process", flush=True)
    if args.warm_start > 0:
        import tempfile

        cfg["warm_start"] = args.warm_start
        cfg["warm_file"] = str(Path(tempfile.mkdtemp(prefix="bench-sync-")) / "warm.npz")
        t0 = time.monotonic()
        res = _run({**cfg, "warming": True}, ("dp", 1, 0, None, outers[0], 1))
        print(f"  warm start: dp, {args.warm_start} steps on other windows, eval loss "
              f"{res[0][2]['eval_loss']:.4f} ({time.monotonic() - t0:.0f} s); every row "
              "starts from it", flush=True)
    fractions = [float(f) for f in args.overlap.split(",")]
    parts = [int(p) for p in args.fragments.split(",")]
    if any(p < 1 or any(h % p for h in hs) for p in parts):
        ap.error("--fragments: each count must divide every --inner-steps")
    modes = [("dp", 1, 0, outers[0], 1)] + [
        (mode, h, d, outer, p) for mode in periodic
        for p in (parts if SYNC_METHODS[mode].periodic else [1])
        for h in (hs if SYNC_METHODS[mode].periodic else [1])
        for d in dict.fromkeys(min(h // p - 1, int(f * h // p)) if h // p > 1 else 0
                               for f in fractions)
        for outer in (outers if not SYNC_METHODS[mode].own_coding else [(1.0, 0.0)])]
    runs = (False,) if args.loss_only else (True, False)
    rows: list[dict[str, Any]] = []
    for mode, h, d, outer, p in modes:
        row: dict[str, Any] = {"mode": mode, "H": h, "d": d, "outer": outer, "P": p}
        for shaped in runs:
            t0 = time.monotonic()
            res = _run(cfg, (mode, h, d, args.mbps if shaped else None, outer, p))
            lead = res[0][2]
            key = "shaped" if shaped else "unshaped"
            row[key] = _step_s(res, cfg["warmup"])
            row[f"{key}_losses"] = [statistics.fmean(s) for s in
                                    zip(*(r[2]["losses"] for r in res), strict=True)]
            if shaped == runs[0]:  # (the bytes and the losses do not depend on the shaping)
                row["eval"] = lead["eval_loss"]
                row["bytes"], row["expected"] = lead["sync_bytes"], lead["expected_sync_bytes"]
                row["sync_fraction"], row["burst"] = lead["sync_fraction"], lead["burst"]
            name = "dp" if mode == "dp" else \
                f"{mode} H={h} d={d} P={p} outer {outer[0]:g}/{outer[1]:g}"
            print(f"  {name} {key}: {row[key] * 1000:.1f} ms/step, eval loss "
                  f"{lead['eval_loss']:.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
        rows.append(row)
    dp = rows[0]
    print(f"\n{'mode':<10} {'H':>4} {'d':>4} {'P':>3} {'outer':>8} {'sync B/step':>12} "
          f"{'dp/this':>8} {'burst B':>11} {'shaped ms':>10} {'unshaped ms':>12} {'sh/unsh':>8} "
          f"{'eval loss':>10} {'eval/dp':>8}")
    print("-" * 118)
    for r in rows:
        h, d, o = ("-", "-", "-") if r["mode"] == "dp" else \
            (str(r["H"]), str(r["d"]), f"{r['outer'][0]:g}/{r['outer'][1]:g}")
        shaped = "-" if args.loss_only else f"{r['shaped'] * 1000:.1f}"
        slow = "-" if args.loss_only else f"{r['shaped'] / r['unshaped']:.3f}"
        print(f"{r['mode']:<10} {h:>4} {d:>4} {r['P']:>3} {o:>8} {r['bytes']:>12,.0f} "
              f"{dp['bytes'] / r['bytes']:>7.1f}x {r['burst']:>11,} {shaped:>10} "
              f"{r['unshaped'] * 1000:>12.1f} {slow:>8} {r['eval']:>10.4f} "
              f"{r['eval'] / dp['eval']:>8.4f}")
    print("-" * 118)
    for r in rows[1:]:
        h = r["H"]
        if r["mode"] == "demo":  # (every step, as dp: its own targets)
            ratio, ev = dp["bytes"] / r["bytes"], r["eval"] / dp["eval"]
            print(f"targets, demo: sync bytes/step <= 1/30 of dp's: {ratio:.1f}x -> "
                  f"{_check(ratio >= 30)}; eval loss within 5 % of dp: {ev:.4f} -> "
                  f"{_check(ev <= 1.05)}")
            continue
        ratio = dp["bytes"] / r["bytes"]
        ev = r["eval"] / dp["eval"]
        step = "not measured (--loss-only)" if args.loss_only else \
            f"{r['shaped'] / r['unshaped']:.3f} -> {_check(r['shaped'] / r['unshaped'] <= 1.10)}"
        frag = f" P={r['P']}" if r["P"] > 1 else ""
        print(f"targets, {r['mode']} H={h} d={r['d']}{frag} outer "
              f"{r['outer'][0]:g}/{r['outer'][1]:g}: "
              f"sync bytes/step >= {h}x smaller than dp: {ratio:.1f}x -> {_check(ratio >= h)}; "
              f"step within 10 % of unshaped: {step}; eval loss within 3 % of dp: {ev:.4f} "
              f"-> {_check(ev <= 1.03)}")
    for r in rows:  # (the fragments' targets, against the same mode whole at the same H)
        whole = next((q for q in rows if q["mode"] == r["mode"] and q["H"] == r["H"]
                      and q["P"] == 1), None)
        if r["P"] == 1 or whole is None:
            continue
        burst, ev = r["burst"] / max(whole["burst"], 1), r["eval"] / whole["eval"]
        print(f"targets, {r['mode']} H={r['H']} d={r['d']} {r['P']} fragments: largest burst <= "
              f"1/3 of the whole model's (d={whole['d']}): {burst:.3f} -> "
              f"{_check(burst <= 1 / 3)}; eval loss within 1 %: {ev:.4f} -> "
              f"{_check(ev <= 1.01)}")
    for r in rows:  # (SparseLoCo's own targets, against DiLoCo at the same H, as it is run)
        base = next((q for q in rows if q["mode"] == "diloco" and q["H"] == r["H"]
                     and q["d"] == r["d"] and q["P"] == r["P"]), None)
        if r["mode"] != "sparseloco" or base is None:
            continue
        ratio, ev = base["bytes"] / r["bytes"], r["eval"] / base["eval"]
        print(f"targets, sparseloco H={r['H']} d={r['d']}: sync bytes <= 1/50 of diloco's "
              f"({cfg['compression']}): {ratio:.1f}x -> {_check(ratio >= 50)}; eval loss / "
              f"diloco's: {ev:.4f} (the issue: <= diloco int8's + 1 %)")
    worst_bytes = max(abs(r["bytes"] - r["expected"]) / r["expected"] for r in rows)
    if args.loss_only:
        print(f"measured sync bytes against expected, worst {worst_bytes:.1%}")
        return 0
    print(f"(dp itself: shaped/unshaped {dp['shaped'] / dp['unshaped']:.3f}, sync "
          f"{dp['sync_fraction']:.0%} of its shaped step)")
    same = max(max(abs(p - q) for p, q in zip(r["shaped_losses"], r["unshaped_losses"],
                                              strict=True)) for r in rows)
    print(f"same training: shaped against unshaped, max |loss diff| over {tc.steps} steps = "
          f"{same:.1e}; measured sync bytes against expected, worst {worst_bytes:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
