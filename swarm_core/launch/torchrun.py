"""What ``swarm fellow`` takes from a launcher's environment: torchrun's variables (which
``swarm launch --slurm`` also sets, from srun's), so ``torchrun --nproc-per-node G`` starts a
node's fellows.

- ``RANK`` makes the default name unique: ``hostname-rRANK``.
- ``LOCAL_RANK`` picks the GPU of ``--devices cuda`` (and of ``--devices auto`` on a machine
  with a GPU): ``cuda:LOCAL_RANK``, or ``cuda:0`` where ``CUDA_VISIBLE_DEVICES`` names a single
  GPU (the launcher bound this process to its GPU already).
- ``MASTER_ADDR`` names the leader's host when no leader URL is given (``--leader-url``,
  ``SWARM_LEADER_URL``): ``http://MASTER_ADDR:8765``, the leader's default port, and not
  ``MASTER_PORT``, which is torchrun's own rendezvous store on that host.
- ``WORLD_SIZE`` and ``MASTER_PORT`` are only checked (``RANK < WORLD_SIZE``; a port).

Flags always win. A variable that is set but malformed is an error (one line naming it): a
fellow that quietly ignored it would take another's name or GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LEADER_PORT = 8765  # `swarm leader`'s default
HOST = re.compile(r"[A-Za-z0-9_.%-]+|\[?[0-9A-Fa-f:.%]+\]?")
# How many digits a rank may have: far beyond any cluster, short enough to stay one line.
MAX_DIGITS = 9


class LaunchEnvError(ValueError):
    """A launcher variable that is set but malformed: one line naming it."""


@attrs.frozen
class LaunchEnv:
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """torchrun's variables from ``environ``; those not set are None."""
    rank = _whole(environ, "RANK", 0)
    world = _whole(environ, "WORLD_SIZE", 1)
    local = _whole(environ, "LOCAL_RANK", 0)
    port = _whole(environ, "MASTER_PORT", 1)
    if port is not None and port > 65535:
        raise LaunchEnvError(f"MASTER_PORT must be a port from 1 to 65535, got {port}")
    if rank is not None and world is not None and rank >= world:
        raise LaunchEnvError(f"RANK {rank} is not below WORLD_SIZE {world}")
    addr = environ.get("MASTER_ADDR")
    if addr is not None and not HOST.fullmatch(addr):
        raise LaunchEnvError(f"MASTER_ADDR: expected a host name or address, got {addr[:40]!r}")
    return LaunchEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr,
                     master_port=port)


def _whole(environ: Mapping[str, str], name: str, low: int) -> int | None:
    text = environ.get(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS) or int(text) < low:
        raise LaunchEnvError(f"{name} must be a whole number >= {low}, got {text[:40]!r}")
    return int(text)


def fellow_name(hostname: str, env: LaunchEnv) -> str:
    """The default name: the host's, and the rank where a launcher started several."""
    return hostname if env.rank is None else f"{hostname}-r{env.rank}"


def fellow_devices(requested: str, env: LaunchEnv, visible: str | None,
                   has_gpu: bool) -> str:
    """``--devices`` with ``cuda`` and ``auto`` made concrete (anything else as given).
    ``visible``: ``CUDA_VISIBLE_DEVICES``; ``has_gpu``: whether torch sees one (for ``auto``)."""
    if requested not in ("cuda", "auto"):
        return requested
    if requested == "auto" and not has_gpu:
        return "cpu"
    listed = [d for d in (visible or "").split(",") if d.strip()]
    if visible is not None and len(listed) == 1:
        return "cuda:0"
    return f"cuda:{env.local_rank or 0}"


def leader_url(env: LaunchEnv) -> str | None:
    """The leader's URL MASTER_ADDR implies; None without one."""
    if env.master_addr is None:
        return None
    host = env.master_addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{LEADER_PORT}"
