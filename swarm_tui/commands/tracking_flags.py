"""The tracking flags of ``swarm sweep`` and ``swarm suite``: TensorBoard files (on by default
when the package is installed) and an MLflow tracking URI. Asked for and not installed: one
line that says what to install, before anything is queued."""

from __future__ import annotations

import argparse
import importlib.util

from swarm_core.tracking import TRACKING_EXTRA, Tracking, tensorboard_installed
from swarm_tui.commands.base import CommandError, ExitCode


def add_tracking_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="write TensorBoard files under each run's tb/ while it trains "
                        "(default: when the tensorboard package is installed)")
    add_mlflow_flag(p)


def add_mlflow_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mlflow-uri", default=None, metavar="URI",
                   help="also log each run to MLflow (e.g. file:./mlruns; needs mlflow-skinny)")


def check_mlflow(uri: str | None) -> None:
    if uri is None:
        return
    if not uri.strip():
        raise CommandError("--mlflow-uri is empty", ExitCode.USAGE)
    if importlib.util.find_spec("mlflow") is None:
        raise CommandError("--mlflow-uri needs MLflow, which is not installed: "
                           "pip install mlflow-skinny")


def tracking_from(args: argparse.Namespace) -> Tracking:
    check_mlflow(args.mlflow_uri)
    if args.tensorboard and not tensorboard_installed():
        raise CommandError("--tensorboard needs the tensorboard package, which is not "
                           f"installed: {TRACKING_EXTRA}")
    # Unasked and not installed: tracking is off without a word (scripts read the output).
    tb = tensorboard_installed() if args.tensorboard is None else args.tensorboard
    return Tracking(tensorboard=tb, mlflow_uri=args.mlflow_uri)
