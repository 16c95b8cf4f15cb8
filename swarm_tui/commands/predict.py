"""``swarm predict``: each run's step time, its stages' utilisation and what bounds it (compute,
a link, or latency), from this machine's measured compute (see ``swarm_core.predict``). No
leader needed."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from swarm_core.config.profiles import ConfigError, load_network_scenario
from swarm_core.contract.placement import slot_count
from swarm_core.contract.rebalance import MIN_GAIN
from swarm_core.predict.calibrate import StageWork, default_cache, measure_stage
from swarm_core.predict.critical_path import StageTimes
from swarm_core.predict.network import MatrixNetwork, UniformNetwork, network_for
from swarm_core.predict.rebalance import RebalanceStep
from swarm_core.predict.runs import PredictInputError, load_runs, profile_run
from swarm_core.predict.service import PredictedRun, predict_run, prediction_json
from swarm_core.predict.step import Prediction, RunShape
from swarm_core.schema import unstructure
from swarm_tui.commands.argtypes import (
    cell_slowdown,
    core_count,
    fellow_count,
    latency_ms,
    link_mbps,
)
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    emit_json,
    emit_table,
    print_line,
    warn,
)


def _shapes(args: argparse.Namespace) -> list[RunShape]:
    profiles = args.model or args.training or args.stages or args.replicas
    try:
        if args.config is not None:
            if profiles:
                raise CommandError("give CONFIG or --model/--training/--stages/--replicas, "
                                   "not both", ExitCode.USAGE)
            shapes = load_runs(args.config)
        elif profiles:
            shapes = [profile_run(args.model, args.training, args.stages, args.replicas)]
        else:
            raise CommandError("give CONFIG (an experiment config or a job body), or "
                               "--model/--training", ExitCode.USAGE)
    except PredictInputError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    if args.scenario is not None:
        shapes = [_over_scenario(s, args.scenario) for s in shapes]
    if args.mbps is not None or args.latency_ms is not None:
        shapes = [attrs.evolve(s, network=_override(s, args)) for s in shapes]
    if args.cores is not None:
        shapes = [attrs.evolve(s, cores=args.cores) for s in shapes]
    if args.slowdown:
        shapes = [_slowed(s, args.slowdown) for s in shapes]
    return shapes


def _slowed(shape: RunShape, slowdowns: list[tuple[int, int, float]]) -> RunShape:
    """``shape`` with its cells slowed as ``--slowdown`` says (a cell it lacks: one line)."""
    for stage, replica, _x in slowdowns:
        if stage >= shape.stages or replica not in shape.ids(stage):
            raise CommandError(f"--slowdown: no cell {stage}.{replica} in {shape.name} "
                               f"({_grid_text(shape)})", ExitCode.USAGE)
    return attrs.evolve(shape, slowdowns=tuple(slowdowns))


def _grid_text(shape: RunShape) -> str:
    """"2 x 2", or "2 x 2, layout [[0, 1], [0, 1, 2]]": how an error names a run's cells."""
    return f"{shape.stages} x {shape.replicas}" + (
        "" if shape.layout is None else f", layout {[list(ids) for ids in shape.layout]}")


def _over_scenario(shape: RunShape, which: str) -> RunShape:
    """``shape`` over a library scenario (or a network profile file) instead of its own."""
    try:
        profile = load_network_scenario(which)
    except ConfigError as exc:
        raise CommandError(f"--scenario: {exc}", ExitCode.USAGE) from None
    if profile.matrix is not None:
        width = max(shape.replicas, slot_count(shape.layout, shape.replicas))
        problem = profile.matrix.shape_error(shape.stages, shape.replicas, width)
        if problem is not None:
            raise CommandError(f"--scenario {which}: {problem} ({shape.name} is "
                               f"{_grid_text(shape)})", ExitCode.USAGE)
    uniform = {"name": profile.name, **({} if profile.link is None
                                        else unstructure(profile.link))}
    return attrs.evolve(shape, network=network_for(uniform, profile.matrix, shape.stages),
                        training=attrs.evolve(shape.training, network=profile.matrix))


def _override(shape: RunShape, args: argparse.Namespace) -> UniformNetwork | MatrixNetwork:
    """The uniform caps and latency set by --mbps/--latency-ms (a link matrix stays)."""
    net = shape.network
    base = net.uniform if isinstance(net, MatrixNetwork) else \
        net if isinstance(net, UniformNetwork) else UniformNetwork()
    if args.mbps is not None:
        base = attrs.evolve(base.with_rate(args.mbps), name=f"{args.mbps:g}mbit")
    if args.latency_ms is not None:
        base = attrs.evolve(base, latency_ms=args.latency_ms,
                            name=f"{base.name}-{args.latency_ms:g}ms")
    return attrs.evolve(net, uniform=base) if isinstance(net, MatrixNetwork) else base


def _measure_loudly(work: StageWork) -> StageTimes:
    warn(f"calibrating stage {work.stage} of {work.stages} (layers {work.layers[0]}-"
         f"{work.layers[1] - 1}, micro-batch {work.micro_batch}) on this machine ...")
    return measure_stage(work)


def cmd_predict(args: argparse.Namespace) -> int:
    shapes = _shapes(args)
    out: list[PredictedRun] = []
    for shape in shapes:
        try:
            out.append(predict_run(shape, default_cache(), args.calibrate, _measure_loudly))
        except ValueError as exc:
            raise CommandError(f"{shape.name}: {exc}", ExitCode.USAGE) from None
    if args.format == "json":
        emit_json({"config": args.config, "cache": str(default_cache()),
                   "runs": [prediction_json(r) for r in out]})
        return 0
    for run in out:
        _table(run)
    print_line(f"(step: the schedule played out, each frame queued on its sender's link and "
               f"a latency a hop; perfect overlap: its lower bound, which the Mbit/s for "
               f"50/90/99 % utilisation assume; compute measured here, cached in "
               f"{default_cache()}; --calibrate measures again)")
    return 0


def _mbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _table(run: PredictedRun) -> None:
    p = run.prediction
    bound = "compute-bound" if p.bound_by == "compute" else f"bound by {p.bound_by}"
    print_line(f"\n{p.run} ({p.network}, {p.schedule}): step {p.step_seconds:.4f} s, {bound}; "
               f"compute {p.compute_seconds:.4f} s ({p.utilisation:.0%}), latency adds "
               f"{p.latency_seconds:.4f} s; perfect overlap {p.step_seconds_overlap:.4f} s "
               f"(a lower bound), no overlap {p.step_seconds_no_overlap:.4f} s")
    deals: list[dict[int, float] | None] = [*p.deals] or [None] * len(p.stages)
    emit_table(None, ["stage", "compute s", "utilisation", "micro-batches by cell"],
               [[s.stage, f"{s.compute_seconds:.4f}", f"{s.utilisation:.0%}",
                 "-" if deal is None else " ".join(f"{r}:{n:g}" for r, n in deal.items())]
                for s, deal in zip(p.stages, deals, strict=True)])
    if run.rebalance is not None:
        _rebalancing(run, run.rebalance)
    if not p.links:
        return
    rows: list[list[Any]] = [
        [x.name, ", ".join(x.carries), _mbps(x.mbps), f"{x.latency_s * 1000:g}",
         f"{x.nbytes:,.0f}", f"{x.seconds:.4f}", "yes" if x.bound else "",
         *(_mbps(x.mbps_for[u]) for u in ("50", "90", "99"))] for x in p.links]
    emit_table(None, ["link", "carries", "Mbit/s", "ms", "bytes/step", "s/step", "bound",
                      "Mbit/s 50%", "90%", "99%"], rows)


def _rebalancing(run: PredictedRun, moves: list[tuple[RebalanceStep, Prediction]]) -> None:
    """A rebalancing run's moves as its rule would make them, each layout's step beside the
    step before any."""
    if not moves:
        print_line("rebalancing: its rule finds no move worth it at any look (none raises "
                   f"the slowest stage's throughput by {MIN_GAIN:.0%})")
        return
    first = run.prediction.step_seconds
    emit_table(None, ["rebalancing: before step", "move", "layout", "step s", "vs start"],
               [[m.move.at, m.move.cells(),
                 " ".join(",".join(map(str, m.shape.ids(s))) for s in range(m.shape.stages)),
                 f"{after.step_seconds:.4f}", f"{first / after.step_seconds:.2f}x"]
                for m, after in moves])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predict each run's step time, stage utilisation and "
                                       "bounding link from this machine's compute (no leader), "
                                       "and a rebalancing job's moves")
    p.add_argument("config", nargs="?", default=None,
                   help="an experiment config (every run of its sweep) or a job body JSON")
    p.add_argument("--model", default=None, help="model profile JSON (instead of CONFIG)")
    p.add_argument("--training", default=None,
                   help="training profile JSON (instead of CONFIG; its network_profile's link)")
    p.add_argument("--stages", type=fellow_count, default=None,
                   help="pipeline stages (with --model/--training)")
    p.add_argument("--replicas", type=fellow_count, default=None,
                   help="replicas of every stage (with --model/--training)")
    p.add_argument("--scenario", default=None, metavar="NAME",
                   help="over this network scenario instead of the config's: a library name "
                        "(exp/configs/network/NAME.json, e.g. dtfm-worldwide) or a network "
                        "profile file")
    p.add_argument("--mbps", type=link_mbps, default=None,
                   help="every fellow's tx and rx in Mbit/s, over the runs' network profiles")
    p.add_argument("--latency-ms", type=latency_ms, default=None,
                   help="every fellow's added one-way latency, over the runs' profiles")
    p.add_argument("--cores", type=core_count, default=None, metavar="N",
                   help="every stage on one machine of N cores (a local cluster): an op also "
                        "waits for a core where the stages' threads outnumber them (default: "
                        "a machine per stage)")
    p.add_argument("--slowdown", type=cell_slowdown, action="append", default=[],
                   metavar="STAGE.REPLICA=X",
                   help="a cell computes X times slower (an emulated slowdown, as swarm "
                        "set-speed --slowdown sets it for every cell of a fellow); "
                        "repeatable. A chain's dp step waits for the slowed chain; swarm "
                        "wiring deals by the route weights (or, measured, by the cells' "
                        "speeds)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's compute again instead of using the cache")
    add_format(p)
    p.set_defaults(func=cmd_predict)
