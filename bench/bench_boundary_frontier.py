"""The boundary frontier at laptop scale: eval loss against boundary bytes for every boundary
spec, trained through the real pipeline (a benchmark, not a test).

Issue "Pipeline boundaries at the field's frontier", the table. Each spec trains the same
model on the same windows from the same seed (only the boundary differs) through
``swarm_core.pipeline.local.run_local_pipeline``: two stages in this process, each with its own
links over loopback TCP, exactly the stage code a fellow runs, fp32 wire beneath the spec's own
codes. The default is the issue's independent reference setting, so the rows compare with its
numbers (``none`` 2.377, ``subspace_k32`` 2.425, ``subspace_k16`` 2.441, ``subspace_k8``
2.572, this project's ``learned_dim64_int8`` 2.449): byte-level Shakespeare (the plays), d=128,
4 layers, 4 heads, seq 128, split after layer 2, 400 steps, batch 16 in 4 micro-batches (1F1B),
lr 3e-3 cosine to 3e-4 after 20 warm-up steps, weight decay 0.1, clipping at 1.

Columns, per spec: eval loss (``--eval-batches`` held-out batches after the last step, the mean
over the seeds run, ± half their range), its ratio to ``none``'s; boundary bytes per step
forward (ACT frames) and backward (GRAD frames), as planned (``wire_math``) and checked against
what the stages' links measured (both directions, the clip's NORM frames included: ``meas``);
``none``/this, the planned fp32 ``none`` bytes at the same shapes over this spec's (both
directions); the codec errors (relative L2 of what the receiver decoded against what was sent,
micro-batch 0 of each step, the mean over the steps: ACT from stage 0, GRAD from stage 1); and
step times: ``--timing-steps`` more steps of each spec unshaped and with both fellows' links
at ``--mbps`` (80 Mbit/s), the mean after the first ``--warmup``.

Under the table, a line per issue target, met or NOT met (nothing is tuned to meet them). The
issue's 32x target is set at d=256; at this d=128 setting the line reports the best ratio
within 3 % of ``none``. The subspace exactness target is a test (tests/unit/test_subspace.py),
the codec speed target bench_codec.py's.

Usage::

    .venv/bin/python bench/bench_boundary_frontier.py                   # one seed, ~10 min idle
    .venv/bin/python bench/bench_boundary_frontier.py --seeds 0,1,2     # the table of record
    .venv/bin/python bench/bench_boundary_frontier.py --keep runs.jsonl               # seed 0,
    .venv/bin/python bench/bench_boundary_frontier.py --keep runs.jsonl --seeds 0,1,2 # then more
    .venv/bin/python bench/bench_boundary_frontier.py --specs none,subspace_k16 --steps 200
    .venv/bin/python bench/bench_boundary_frontier.py --timing-steps 0  # losses and bytes only
    .venv/bin/python bench/bench_boundary_frontier.py --quick           # a tiny run, seconds

``--quick`` is a smoke run (numbers meaningless). Exits 0 when every row ran, whether or not
the targets are met; 1 when a row failed. Only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

SPECS = ("none", "fixed_int8", "fixed_int4_b64", "hadamard_int4_b64", "hadamard_int2_b64",
         "learned_dim64_int8", "subspace_k32", "subspace_k32_int8", "subspace_k16",
         "subspace_k16_int8", "subspace_k8", "subspace_k8_int8")
MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128, "dropout": 0.0,
         "dtype": "float32", "wire_dtype": "fp32"}
TRAINING = {"dataset": "shakespeare", "tokenizer": "byte", "real_min_tokens": 1000000,
            "batch_size": 16, "micro_batches": 4, "schedule": "1f1b", "lr": 3e-3,
            "min_lr": 3e-4, "warmup_steps": 20, "weight_decay": 0.1, "betas": [0.9, 0.95],
            "grad_clip": 1.0, "eval_every": 0, "threads": 1, "shard_push_interval_steps": 0}
FULL = {"steps": 400, "eval_batches": 16, "timing_steps": 20, "warmup": 3, "model": {},
        "training": {}}
# (d=128 still: every default spec's shape stays legal, K < d and tiles of 64)
QUICK = {"steps": 3, "eval_batches": 1, "timing_steps": 3, "warmup": 1,
         "model": {"d_model": 128, "n_layers": 2, "seq_len": 16},
         "training": {"batch_size": 4, "micro_batches": 2, "warmup_steps": 1}}


def _configs(cfg: dict[str, Any], spec: str, seed: int, steps: int) -> tuple[Any, Any]:
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.schema import structure

    model = {**MODEL, **cfg["model"], "name": f"frontier_{spec}", "compression": spec}
    training = {**TRAINING, **cfg["training"], "seed": seed, "steps": steps,
                "eval_batches": cfg["eval_batches"]}
    return structure(model, ModelConfig), structure(training, TrainingConfig)


def _train(cfg: dict[str, Any], spec: str, seed: int, steps: int,
           mbps: float | None = None) -> dict[str, Any]:
    """One run of ``spec`` through two in-process stages; its figures."""
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.local import run_local_pipeline
    from swarm_core.protocol import LinkLimits

    mc, tc = _configs(cfg, spec, seed, steps)
    data = load_token_data(tc, mc.seq_len)
    shapers = [LinkShaper() for _ in range(2)]
    if mbps is not None:
        for s in shapers:
            s.apply(LinkLimits(tx_mbps=mbps, rx_mbps=mbps))
    marks: list[float] = []

    def on_step(stage: int, _report: Any) -> None:
        if stage == 1:  # (the last stage ends each step: its loss needs every stage's work)
            marks.append(time.perf_counter())

    results = run_local_pipeline(mc, tc, data, 2, shapers=shapers, on_step=on_step,
                                 timeout=3600.0)
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
    first, last = results[0].metrics, results[1].metrics  # type: ignore[union-attr]
    w = cfg["warmup"]
    step_s = (marks[-1] - marks[w - 1]) / (len(marks) - w) if len(marks) > w else None
    return {"eval_loss": last.eval_loss,
            "measured": (first.wire_tx_bytes_per_step or 0) + (last.wire_tx_bytes_per_step or 0),
            "act_error": first.codec_error.act if first.codec_error else None,
            "grad_error": last.codec_error.grad if last.codec_error else None,
            "step_s": step_s}


class _Kept:
    """``--keep``: the runs' figures by what defines the run, read back where present."""

    def __init__(self, path: str | None, setting: str) -> None:
        self.path, self.setting = path, setting
        self.runs: dict[str, dict[str, Any]] = {}
        if path and Path(path).exists():
            for line in Path(path).read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.runs[rec["key"]] = rec["figures"]

    def run(self, cfg: dict[str, Any], spec: str, seed: int, steps: int,
            mbps: float | None = None) -> dict[str, Any]:
        key = f"{self.setting}/{spec}/s{seed}/{steps}/{mbps}"
        if key in self.runs:
            return self.runs[key]
        got = _train(cfg, spec, seed, steps, mbps)
        self.runs[key] = got
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "figures": got}) + "\n")
        return got


def _planned(cfg: dict[str, Any], spec: str) -> tuple[int, int, int]:
    """The spec's ACT and GRAD bytes per step, and fp32 ``none``'s both ways, as planned."""
    from swarm_core.pipeline.wire_math import step_boundary_bytes, uncompressed_model

    mc, tc = _configs(cfg, spec, 0, 1)
    act, grad = step_boundary_bytes(mc, tc, 2)
    plain = sum(step_boundary_bytes(uncompressed_model(mc), tc, 2))
    return act, grad, plain


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _mean_spread(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (max(xs) - min(xs)) / 2


def _check(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="a tiny smoke run (numbers meaningless)")
    ap.add_argument("--specs", default=",".join(SPECS), help="boundary specs, comma-separated")
    ap.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 400)")
    ap.add_argument("--timing-steps", type=int, default=None,
                    help="steps of each timing run, unshaped and shaped (0: none; default 20)")
    ap.add_argument("--mbps", type=float, default=80.0, help="the shaped links' Mbit/s")
    ap.add_argument("--d-model", type=int, default=None,
                    help="the model's width (default 128; the issue's figure sets 256)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the model's layers, split evenly over the 2 stages (default 4; "
                         "the issue's figure sets 8)")
    ap.add_argument("--keep", default=None, metavar="FILE",
                    help="a JSON-lines file of the runs' figures: each run done is added, and "
                         "a run already in it (same spec, seed, steps, links, setting) is "
                         "read back instead of trained again, so seeds can be added later")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # (each stage one thread, as a fellow of one core runs it)
    cfg = dict(QUICK if args.quick else FULL)
    cfg["model"] = {**cfg["model"], **({"d_model": args.d_model} if args.d_model else {}),
                    **({"n_layers": args.layers} if args.layers else {})}
    specs = [s for s in args.specs.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    steps = args.steps or cfg["steps"]
    timing = cfg["timing_steps"] if args.timing_steps is None else args.timing_steps
    d = cfg["model"].get("d_model", MODEL["d_model"])
    layers = cfg["model"].get("n_layers", MODEL["n_layers"])
    print(f"boundary frontier: d={d}, {layers} layers, {steps} steps, seeds {seeds}, "
          f"2 stages in-process, fp32 wire; timing {timing} steps unshaped and at "
          f"{args.mbps:g} Mbit/s", flush=True)
    setting = "quick" if args.quick else "full"
    if (d, layers) != (MODEL["d_model"], MODEL["n_layers"]) and not args.quick:
        setting = f"full-d{d}-l{layers}"  # (runs of another shape are other runs)
    kept = _Kept(args.keep, setting)
    rows: dict[str, dict[str, Any]] = {}
    failed = False
    for spec in specs:
        row: dict[str, Any] = {"runs": []}
        rows[spec] = row
        try:
            row["planned"] = _planned(cfg, spec)
            for seed in seeds:
                t0 = time.perf_counter()
                got = kept.run(cfg, spec, seed, steps)
                row["runs"].append(got)
                print(f"  {spec} seed {seed}: eval {_fmt(got['eval_loss'])} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if timing > cfg["warmup"]:
                row["plain_s"] = kept.run(cfg, spec, seeds[0], timing)["step_s"]
                row["shaped_s"] = kept.run(cfg, spec, seeds[0], timing, args.mbps)["step_s"]
        except Exception:  # (a row that fails is reported; the others still run)
            traceback.print_exc()
            row["failed"] = True
            failed = True
    _table(rows, seeds, args.mbps)
    _targets(rows)
    return 1 if failed else 0


def _summary(row: dict[str, Any]) -> dict[str, Any] | None:
    losses = [r["eval_loss"] for r in row["runs"] if r["eval_loss"] is not None]
    if row.get("failed") or not losses:
        return None
    act, grad, plain = row["planned"]

    def mean_of(key: str) -> float | None:
        xs = [r[key] for r in row["runs"] if r[key] is not None]
        return statistics.fmean(xs) if xs else None

    loss, spread = _mean_spread(losses)
    return {"loss": loss, "spread": spread, "act": act, "grad": grad,
            "ratio": plain / (act + grad), "measured": mean_of("measured"),
            "act_error": mean_of("act_error"), "grad_error": mean_of("grad_error"),
            "plain_s": row.get("plain_s"), "shaped_s": row.get("shaped_s")}


def _table(rows: dict[str, dict[str, Any]], seeds: list[int], mbps: float) -> None:
    base = _summary(rows["none"]) if "none" in rows else None
    print()
    print(f"| spec | eval loss ({len(seeds)} seed{'s' * (len(seeds) > 1)}) | vs none | "
          f"ACT B/step | GRAD B/step | meas B/step | none/this | err act | err grad | "
          f"step s | step s {mbps:g} Mbit/s |")
    print("| " + " | ".join(["---"] * 11) + " |")
    for spec, row in rows.items():
        s = _summary(row)
        if s is None:
            print(f"| `{spec}` | FAILED |" + " |" * 9)
            continue
        vs = f"{(s['loss'] / base['loss'] - 1) * 100:+.2f} %" if base else "-"
        print(f"| `{spec}` | {s['loss']:.4f} ± {s['spread']:.4f} | {vs} | {s['act']:,} | "
              f"{s['grad']:,} | {_fmt(s['measured'], ',.0f')} | {s['ratio']:.1f}x | "
              f"{_fmt(s['act_error'])} | {_fmt(s['grad_error'])} | {_fmt(s['plain_s'], '.3f')} "
              f"| {_fmt(s['shaped_s'], '.3f')} |")


def _targets(rows: dict[str, dict[str, Any]]) -> None:
    got = {spec: s for spec, row in rows.items() if (s := _summary(row)) is not None}
    print("\ntargets:")
    none = got.get("none")
    if none is None:
        print("  (none's row is missing: no target can be judged)")
        return
    within3 = [sp for sp, s in got.items() if s["loss"] <= none["loss"] * 1.03]
    subspace = {sp: s for sp, s in got.items() if sp.startswith("subspace_")}
    learned = got.get("learned_dim64_int8")
    if learned is not None and subspace:
        fewer = {sp: s for sp, s in subspace.items() if s["ratio"] >= learned["ratio"]}
        best = min(fewer.items(), key=lambda kv: kv[1]["loss"]) if fewer else None
        ok = best is not None and best[1]["loss"] <= learned["loss"]
        said = (f"{best[0]} {best[1]['loss']:.4f} at {best[1]['ratio']:.1f}x" if best
                else "no subspace spec at as few bytes")
        print(f"  a subspace spec at learned_dim64_int8's bytes or fewer "
              f"({learned['ratio']:.1f}x) no worse than its {learned['loss']:.4f}: {said}: "
              f"{_check(ok)}")
    if subspace:
        near = {sp: s for sp, s in subspace.items() if sp in within3}
        best = max(near.items(), key=lambda kv: kv[1]["ratio"]) if near else None
        said = f"{best[0]} at {best[1]['ratio']:.1f}x" if best else "none within 3 %"
        print(f"  >= 32x fewer boundary bytes than none within 3 % of its loss (the issue "
              f"sets it at d=256): {said}: {_check(best is not None and best[1]['ratio'] >= 32)}")
    h4 = got.get("hadamard_int4_b64")
    if h4 is not None:
        ok = h4["loss"] <= none["loss"] * 1.01 and h4["ratio"] >= 7
        print(f"  hadamard_int4_b64 within 1 % of none at >= 7x fewer bytes: "
              f"{(h4['loss'] / none['loss'] - 1) * 100:+.2f} % at {h4['ratio']:.1f}x: "
              f"{_check(ok)}")
        plain4 = got.get("fixed_int4_b64")
        if plain4 is not None:
            print(f"  the rotation beats plain int4 (eval loss): hadamard {h4['loss']:.4f} "
                  f"against fixed_int4_b64 {plain4['loss']:.4f}: "
                  f"{_check(h4['loss'] < plain4['loss'])}")
    timed = {sp: s for sp, s in got.items() if s["plain_s"] and s["shaped_s"]}
    if timed:
        print("  shaped step over unshaped step, by spec: " + ", ".join(
            f"{sp} {s['shaped_s'] / s['plain_s']:.2f}" for sp, s in timed.items()))
        near = {sp: s for sp, s in timed.items() if sp in within3 and sp != "none"}
        best = min(near.items(), key=lambda kv: kv[1]["shaped_s"] / kv[1]["plain_s"]) \
            if near else None
        base = timed.get("none")
        bound = base["shaped_s"] / base["plain_s"] if base else None
        if best is not None and (bound is None or bound < 2):
            # (the target's premise: none's shaped step several times its unshaped one)
            print(f"  the best spec within 3 % of none's loss brings the shaped step within "
                  f"10 % of the unshaped one: not judged, none's own shaped step is "
                  f"{_fmt(bound, '.2f')}x its unshaped one (the link does not bind here)")
        elif best is not None:
            r = best[1]["shaped_s"] / best[1]["plain_s"]
            print(f"  the best spec within 3 % of none's loss brings the shaped step within "
                  f"10 % of the unshaped one (none {bound:.2f}x): {best[0]} {r:.2f}x: "
                  f"{_check(r <= 1.10)}")
        else:
            print("  no spec other than none within 3 % of none's loss: NOT met")


if __name__ == "__main__":
    sys.exit(main())
