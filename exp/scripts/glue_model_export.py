#!/usr/bin/env python3
"""Glue a run's stage shards into one model.

    exp/scripts/glue_model_export.py --export-dir <leader-state>/runs/job-000001/model_export

Checks that every global layer is covered exactly once, by shards of one config fingerprint and
one step, rebuilds one ExperimentModel and writes model_export/full_model/{weights.npz,
inference_manifest.json}. Same as ``swarm glue``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export-dir", required=True, help="a run's model_export directory")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    from swarm_tui.cli import run

    return run(["glue", args.export_dir, "--format", args.format], prog="glue_model_export.py")


if __name__ == "__main__":
    sys.exit(main())
