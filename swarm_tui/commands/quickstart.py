"""``swarm quickstart``: the README's main job on the embedded default.

Starts a local leader and fellows, queues the embedded default job (a small GPT on the bundled
Shakespeare corpus, split into one pipeline stage per fellow), streams it to the end, shows the
loss falling and stops the cluster (unless ``--keep``).
"""

from __future__ import annotations

import argparse

from swarm_core.client import SwarmClient
from swarm_core.config.defaults import DEFAULT_MODEL, DEFAULT_TRAINING
from swarm_core.config.schemas import ModelConfig
from swarm_core.contract import Topology
from swarm_core.experiments.runner import peaks_by_stage, wait_by_stage
from swarm_core.local_cluster import ClusterSpec, start_cluster, stop_cluster, token_for
from swarm_core.protocol import JobState
from swarm_core.schema import structure
from swarm_tui.commands.argtypes import local_fellow_count, positive_int
from swarm_tui.commands.base import ExitCode, print_line, run_async
from swarm_tui.commands.jobs import smoke_job, train_job, watch_job


def cmd_quickstart(args: argparse.Namespace) -> int:
    print_line(f"starting a local leader and {args.fellows} fellow(s)…")
    record = start_cluster(ClusterSpec(fellows=args.fellows))
    print_line(f"leader {record.leader_url}; fellows "
               + ", ".join(f.name for f in record.fellows) + " ready")

    async def body() -> int:
        async with SwarmClient(record.leader_url, token_for(record)) as c:
            if args.smoke:
                req = smoke_job(args.fellows, args.steps or 10, "quickstart-smoke")
            else:
                training = dict(DEFAULT_TRAINING)
                if args.steps:
                    training["steps"] = args.steps
                req = train_job(structure(DEFAULT_MODEL, ModelConfig), training,
                                Topology(fellows=args.fellows), "quickstart")
            job = await c.submit(req)
            print_line(f"queued {job.job_id}")
            final = await watch_job(c, job.job_id)
            if final.loss_history:
                first, last = final.loss_history[0], final.loss_history[-1]
                print_line(f"loss {first[1]:.4f} at step {first[0]:.0f} -> {last[1]:.4f} at "
                           f"step {last[0]:.0f}")
            m = final.metrics
            if m.eval_loss is not None:
                ppl = m.perplexity if m.perplexity is not None else float("nan")
                print_line(f"validation loss {m.eval_loss:.4f}, perplexity {ppl:.2f}, "
                           f"{m.tokens_per_s or 0:.0f} tokens/s, "
                           f"{(m.wire_bytes_per_step or 0) / 1e6:.2f} MB on the wire per step")
            records = await c.progress(job.job_id)
            peaks = peaks_by_stage(records, len(final.fellows))
            if peaks:
                print_line("activations held for backward, at the peak: " + ", ".join(
                    f"stage {k} " + ("-" if n is None else f"{n / 1e6:.2f} MB")
                    for k, n in enumerate(peaks)))
            waits = None if args.smoke else wait_by_stage(
                records, final.topology.num_stages, final.train, final.restarts,
                final.topology.replicas)
            if waits:
                print_line("time blocked on links (neighbours, network, bubble): " + ", ".join(
                    f"stage {k} " + ("-" if w is None else f"{w:.0%}")
                    for k, w in enumerate(waits)))
            return 0 if final.state == JobState.COMPLETED.value else int(ExitCode.FAILURE)

    try:
        code = run_async(body())
    finally:
        if not args.keep:
            stop_cluster()
            print_line("local cluster stopped")
        else:
            print_line(f"cluster kept at {record.leader_url} ('swarm stop-cluster' stops it)")
    return code


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart",
                       help="start a local cluster, train the default model, show the loss fall")
    p.add_argument("--fellows", type=local_fellow_count, default=2,
                   help="fellows (default 2)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps (default: the profile's 40)")
    p.add_argument("--smoke", action="store_true",
                   help="run a control-plane smoke job instead of training")
    p.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    p.set_defaults(func=cmd_quickstart)
