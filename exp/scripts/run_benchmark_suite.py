#!/usr/bin/env python3
"""Run a benchmark suite over cluster shapes on a SilentSwarm leader.

    exp/scripts/run_benchmark_suite.py --suite exp/configs/benchmarks/multinode_training_v1.json \
        --leader-url http://127.0.0.1:8765 [--dry-run] [--continue-on-fail]

Same engine as ``swarm suite``: writes suite_plan.json, suite_manifest.json, per-scenario run
directories and suite_summary.json.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, help="suite JSON")
    parser.add_argument("--leader-url", help="the leader (default: SWARM_LEADER_URL, then the "
                                             "local cluster)")
    parser.add_argument("--token", help="bearer token (default: SWARM_TOKEN)")
    parser.add_argument("--dry-run", action="store_true", help="plan only")
    parser.add_argument("--continue-on-fail", action="store_true",
                        help="keep going past a failed scenario")
    parser.add_argument("--out", help="output directory")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    from swarm_tui.cli import run

    forwarded = []
    if args.leader_url:
        forwarded += ["--leader-url", args.leader_url]
    if args.token:
        forwarded += ["--token", args.token]
    forwarded += ["suite", "--suite", args.suite, "--format", args.format]
    if args.dry_run:
        forwarded.append("--dry-run")
    if args.continue_on_fail:
        forwarded.append("--continue-on-fail")
    if args.out:
        forwarded += ["--out", args.out]
    return run(forwarded, prog="run_benchmark_suite.py")


if __name__ == "__main__":
    sys.exit(main())
