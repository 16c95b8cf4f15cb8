"""``swarm launch --slurm``: a leader and its fellows as one Slurm batch job.

The script runs the leader on the first node of the allocation and the fellows on every node
(``srun``, one step each, ``--overlap`` so the leader's step and the fellows' may share the first
node). It carries no token: the fellows read ``SWARM_TOKEN`` from their environment, which srun
hands down from the batch script's: the one sbatch was given when the user exported one, else
the leader's token file, which the script reads once the leader has written it (the batch script
runs on the first node, beside the leader, so the state directory need not be shared for that;
it defaults to the submit directory so that the login node can read the token too).

Fellows per node: one per GPU (``--devices cuda``: each picks ``cuda:LOCAL_RANK``, see
:mod:`swarm_core.launch.torchrun`), or one owning all the node's GPUs, or N on the CPU. The
``SWARM_*`` settings at the top of the script take the environment's value where one is set,
so a site (or a test on one machine) can change the bind address or the port without editing it.

Pure text in, text out: nothing here runs a process.
"""

from __future__ import annotations

import re
import shlex

import attrs

MARKER = "# Written by `swarm launch --slurm`"
DEFAULT_PORT = 8765
MAX_NODES = 1024
MAX_PER_NODE = 64
# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
TIME = re.compile(r"[0-9]+(:[0-9]{1,2}){0,2}|[0-9]+-[0-9]{1,2}(:[0-9]{1,2}){0,2}")
# Partition, account and job names as they go on an #SBATCH line: one word, nothing a shell or
# sbatch's own option parser would read as more (partitions may be a comma list).
NAME = re.compile(r"[A-Za-z0-9_.+-]+")
PARTITION = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")
PATH = re.compile(r"[^\s'\"`$\\;|&<>(){}*?!#]+")
ADDRESS = re.compile(r"[A-Za-z0-9_.:%-]+")


class SlurmError(ValueError):
    """A setting the script cannot carry: one line naming the flag."""


@attrs.frozen
class SlurmPlan:
    nodes: int
    fellows_per_node: int
    gpus_per_node: int = 0
    job_name: str = "swarm"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    python: str = "python3"
    state_dir: str | None = None  # None: the submit directory's swarm-state-<job id>
    port: int = DEFAULT_PORT
    data_host: str = "0.0.0.0"

    @property
    def devices(self) -> str:
        """The fellows' ``--devices``: each its own GPU, all of them, or the CPU."""
        if self.gpus_per_node == 0:
            return "cpu"
        if self.fellows_per_node == self.gpus_per_node:
            return "cuda"  # cuda:LOCAL_RANK (the task's), see swarm_core.launch.torchrun
        return ",".join(f"cuda:{i}" for i in range(self.gpus_per_node))


def make_plan(nodes: int, *, gpus_per_node: int = 0, fellows_per_node: int | None = None,
              job_name: str = "swarm", partition: str | None = None, time: str | None = None,
              account: str | None = None, python: str = "python3",
              state_dir: str | None = None, port: int = DEFAULT_PORT,
              data_host: str = "0.0.0.0") -> SlurmPlan:
    """The settings, checked: a SlurmError naming the flag for the first that is wrong."""
    if not 1 <= nodes <= MAX_NODES:
        raise SlurmError(f"--nodes must be from 1 to {MAX_NODES}, got {nodes}")
    if not 0 <= gpus_per_node <= MAX_PER_NODE:
        raise SlurmError(f"--gpus-per-node must be from 0 to {MAX_PER_NODE}, got {gpus_per_node}")
    if fellows_per_node is None:
        fellows_per_node = gpus_per_node or 1
    if not 1 <= fellows_per_node <= MAX_PER_NODE:
        raise SlurmError(f"--fellows-per-node must be from 1 to {MAX_PER_NODE}, "
                         f"got {fellows_per_node}")
    if gpus_per_node and fellows_per_node not in (1, gpus_per_node):
        raise SlurmError(f"--fellows-per-node {fellows_per_node} with --gpus-per-node "
                         f"{gpus_per_node}: give {gpus_per_node} (one fellow per GPU) or 1 "
                         "(one fellow owning them all)")
    _check(NAME, job_name, "--job-name", "letters, digits and _.+-")
    if partition is not None:
        _check(PARTITION, partition, "--partition", "a partition name, or a comma list of them")
    if time is not None:
        _check(TIME, time, "--time", "minutes, H:M:S or D-H:M:S as Slurm takes it")
    if account is not None:
        _check(NAME, account, "--account", "letters, digits and _.+-")
    _check(PATH, python, "--python", "a plain path")
    if state_dir is not None:
        _check(PATH, state_dir, "--state-dir", "a plain path")
    if not 1 <= port <= 65535:
        raise SlurmError(f"--port must be from 1 to 65535, got {port}")
    _check(ADDRESS, data_host, "--data-host", "a host name or address")
    return SlurmPlan(nodes=nodes, fellows_per_node=fellows_per_node,
                     gpus_per_node=gpus_per_node, job_name=job_name, partition=partition,
                     time=time, account=account, python=python, state_dir=state_dir,
                     port=port, data_host=data_host)


def _check(pattern: re.Pattern[str], value: str, flag: str, what: str) -> None:
    if not pattern.fullmatch(value):
        raise SlurmError(f"{flag}: expected {what}, got {value[:40]!r}")


def sbatch_lines(plan: SlurmPlan) -> list[str]:
    lines = [f"--job-name={plan.job_name}", f"--nodes={plan.nodes}",
             f"--ntasks-per-node={plan.fellows_per_node}"]
    if plan.gpus_per_node:
        lines.append(f"--gpus-per-node={plan.gpus_per_node}")
    for flag, value in (("partition", plan.partition), ("time", plan.time),
                        ("account", plan.account)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    return [f"#SBATCH {x}" for x in lines]


def sbatch_script(plan: SlurmPlan, version: str = "") -> str:
    """The batch script: no token, nothing secret, in its text."""
    state = shlex.quote(plan.state_dir) if plan.state_dir else \
        '"${SLURM_SUBMIT_DIR:-$PWD}/swarm-state-${SLURM_JOB_ID}"'
    per = ("one per GPU" if plan.devices == "cuda" else
           f"owning {plan.devices}" if plan.gpus_per_node else "on the CPU")
    total = plan.nodes * plan.fellows_per_node
    # RANK/LOCAL_RANK/WORLD_SIZE as torchrun sets them: `swarm fellow` names itself
    # hostname-rRANK and picks cuda:LOCAL_RANK from them (single quotes: the task's shell
    # expands them, each task its own).
    fellow = ('bash -c \'export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" '
              'WORLD_SIZE="$SLURM_NTASKS"; exec "$SWARM_PYTHON" -m swarm_tui.cli fellow '
              f'--devices {plan.devices} --data-host "$SWARM_DATA_HOST"\'')
    body = f"""\
#!/bin/bash
{chr(10).join(sbatch_lines(plan))}
{MARKER}{f" (SilentSwarm {version})" if version else ""}: the leader on the
# first node of the allocation; on each of its {plan.nodes} node(s), {plan.fellows_per_node} \
fellow(s) {per} ({total} in all).
# No token in this file: the fellows read SWARM_TOKEN from their environment (export it before
# sbatch, or the leader's token file in the state directory is read below).
# A SWARM_* setting below set in the environment sbatch is given wins over the value written here.
set -euo pipefail

SWARM_PYTHON=${{SWARM_PYTHON:-{shlex.quote(plan.python)}}}
SWARM_STATE_DIR=${{SWARM_STATE_DIR:-{state}}}
SWARM_LEADER_PORT=${{SWARM_LEADER_PORT:-{plan.port}}}
SWARM_LEADER_BIND=${{SWARM_LEADER_BIND:-0.0.0.0}}
SWARM_DATA_HOST=${{SWARM_DATA_HOST:-{plan.data_host}}}
SWARM_LEADER_NODE=${{SWARM_LEADER_NODE:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | \
head -n 1)}}
SWARM_LEADER_URL="http://${{SWARM_LEADER_NODE}}:${{SWARM_LEADER_PORT}}"
export SWARM_PYTHON SWARM_DATA_HOST SWARM_LEADER_URL

srun --nodes=1 --ntasks=1 --nodelist="$SWARM_LEADER_NODE" --overlap "$SWARM_PYTHON" -m \
swarm_tui.cli leader --host "$SWARM_LEADER_BIND" --allow-remote --port "$SWARM_LEADER_PORT" \
--state-dir "$SWARM_STATE_DIR" &
leader=$!
if [ -z "${{SWARM_TOKEN:-}}" ]; then
  # The leader writes its token once it listens; the fellows get it through srun's environment.
  for _ in $(seq 600); do
    [ -s "$SWARM_STATE_DIR/token" ] && break
    kill -0 "$leader" 2>/dev/null || {{ echo "swarm: the leader exited before it wrote \
$SWARM_STATE_DIR/token" >&2; exit 1; }}
    sleep 0.2
  done
  [ -s "$SWARM_STATE_DIR/token" ] || {{ echo "swarm: no token in $SWARM_STATE_DIR after 120 s" \
>&2; kill "$leader"; exit 1; }}
  SWARM_TOKEN=$(cat "$SWARM_STATE_DIR/token")
  export SWARM_TOKEN
fi
echo "swarm: leader at $SWARM_LEADER_URL (state and token file: $SWARM_STATE_DIR)"

srun --nodes={plan.nodes} --ntasks-per-node={plan.fellows_per_node} --overlap {fellow} &
fellows=$!
trap 'kill "$fellows" "$leader" 2>/dev/null || true' TERM INT
# The fellows leave when released (swarm release --all); then the leader is stopped too.
status=0
wait "$fellows" || status=$?
kill "$leader" 2>/dev/null || true
wait "$leader" || true
exit "$status"
"""
    return body


def is_generated(text: str) -> bool:
    """Whether a file is a script this module wrote (one that may be written over)."""
    return any(line.startswith(MARKER) for line in text.splitlines()[:40])
