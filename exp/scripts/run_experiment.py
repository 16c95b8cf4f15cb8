#!/usr/bin/env python3
"""Run an experiment config on a SilentSwarm cluster and write its run artifacts.

    exp/scripts/run_experiment.py --leader-url http://127.0.0.1:8765 \
        --config-path exp/configs/exp_distributed_smoke_v1.json

Needs a reachable leader with enough active fellows (the training profile's cluster_profile);
runs never execute standalone in this process. Same engine as ``swarm sweep``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leader-url", help="the leader to run on (required)")
    parser.add_argument("--config-path", required=True, help="experiment config JSON")
    parser.add_argument("--token", help="bearer token (default: SWARM_TOKEN)")
    parser.add_argument("--runs-dir", help="run directories (default: the profile's)")
    parser.add_argument("--skip-netem", action="store_true", help="no tc shaping")
    parser.add_argument("--detach", action="store_true", help="return once queued")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    if not args.leader_url:
        sys.stderr.write("run_experiment.py: needs --leader-url: runs execute on a cluster of "
                         "fellows, never standalone (start one with 'swarm restart-cluster')\n")
        return 2
    from swarm_tui.cli import run

    forwarded = ["--leader-url", args.leader_url, "sweep", "--config", args.config_path,
                 "--format", args.format]
    if args.token:
        forwarded[2:2] = []
        forwarded = ["--token", args.token, *forwarded]
    if args.runs_dir:
        forwarded += ["--runs-dir", args.runs_dir]
    if args.skip_netem:
        forwarded.append("--skip-netem")
    if args.detach:
        forwarded.append("--detach")
    return run(forwarded, prog="run_experiment.py")


if __name__ == "__main__":
    sys.exit(main())
