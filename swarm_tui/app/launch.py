"""What the launcher can launch (no Textual): sources of job bodies, expanded into a plan.

A *source* turns the launcher's choices into a :class:`LaunchPlan`: the ``JobSubmit`` bodies it
would send, in order, or the first error that stops it. The launcher screen shows the fields a
source asks for, previews its plan and launches it; it knows nothing else about the source.

* :class:`ExperimentSource`: an experiment config (``exp/configs/*.json``) expanded by
  ``load_experiment`` into its sweep's runs; launched through the same
  :class:`~swarm_core.experiments.runner.Experiment` runner as ``swarm sweep`` (preflight, run
  artifacts under the profile's ``runs_dir``).
* :class:`ProfileSource`: one train job from a model profile (``exp/configs/model/*.json``), a
  training profile (``exp/configs/training/*.json``, read as ``swarm submit --training`` reads
  it: its cluster, network and artifacts sections too), the grid (fellows and replicas) and
  the replicas' sync over the profile's (as ``swarm submit``'s sync flags set it), the
  wiring (``swarm submit --wiring``) and the transport (``swarm submit --transport``).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any, Protocol

import attrs

from swarm_core import jsonio
from swarm_core.config.profiles import (
    ConfigError,
    ResolvedExperiment,
    job_topology,
    load_experiment,
    load_job_cluster,
    load_job_training,
    sync_over,
)
from swarm_core.config.schemas import SYNC_MODES, TrainingConfig
from swarm_core.contract import JobSubmit, Topology
from swarm_core.schema import SchemaError, structure, unstructure
from swarm_tui.typed import clip, decimal_number, whole_number

# The schema's own Literals (shaped, torch; chain, swarm), so a value added there is offered
# here too.
TRANSPORTS: tuple[str, ...] = typing.get_args(typing.get_type_hints(TrainingConfig)["transport"])
WIRINGS: tuple[str, ...] = typing.get_args(typing.get_type_hints(Topology)["wiring"])
# What a torch job's preview and confirmation say of it: nothing the console does reaches its
# links (the leader refuses a link set-speed on its fellows).
TORCH_NOTE = "transport: torch (gloo; unshaped: link limits and set-speed do not reach it)"


@attrs.define
class LaunchChoice:
    """What the person picked. Sources read the fields they need."""

    model: str | None = None  # a path relative to the configs directory
    training: str | None = None
    config: str | None = None  # an experiment config, relative to the configs directory
    # The grid: pipeline stages (the form's field, as `swarm submit --stages`: stages 2 and
    # replicas 2 are a 2 x 2 job of 4 fellows), or the fellows in all (`--fellows`), each
    # empty for the training profile's cluster (else 2 stages), and the replicas of every
    # stage (empty: the profile's, else 1).
    stages: str = ""
    fellows: str = ""
    replicas: str = ""
    steps: str = ""  # empty: as the profile says
    name: str = ""  # empty: the model profile's name
    # The sync of the replicas, each empty for the profile's: a mode (dp, diloco, sparseloco),
    # a periodic mode's inner steps H and the steps its outer step overlaps, and the share of
    # each chunk SparseLoCo sends.
    sync: str | None = None
    inner_steps: str = ""
    overlap_steps: str = ""
    density: str = ""
    # The data plane (shaped, torch); None: the profile's. A torch job over a profile whose
    # network shapes its links is refused, as the leader refuses it.
    transport: str | None = None
    # How micro-batches travel between the replicas (chain, swarm); None: the profile's.
    wiring: str | None = None


@attrs.define
class LaunchPlan:
    runs: list[JobSubmit] = attrs.field(factory=list)
    bodies: list[dict[str, Any]] = attrs.field(factory=list)  # each run as written (preview)
    error: str | None = None  # the first problem, one line
    field: str | None = None  # its JSON path when there is one
    notes: list[str] = attrs.field(factory=list)
    # Set by ExperimentSource: the launch goes through the Experiment runner (artifacts).
    experiment: ResolvedExperiment | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)


class LaunchSource(Protocol):
    key: str
    label: str
    fields: tuple[str, ...]  # LaunchChoice fields this source reads, in form order

    def options(self, field: str) -> list[str]:
        """The choices of a pick-one field (configs-relative paths); [] for free text."""
        ...

    def plan(self, choice: LaunchChoice) -> LaunchPlan: ...


def _json_files(configs_dir: Path, sub: str = "") -> list[str]:
    folder = configs_dir / sub if sub else configs_dir
    if not folder.is_dir():
        return []
    return sorted(p.relative_to(configs_dir).as_posix()
                  for p in folder.glob("*.json") if p.is_file())


def default_configs_dir() -> Path:
    """``exp/configs`` under the working directory, else the one beside this checkout."""
    here = Path.cwd() / "exp" / "configs"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / "exp" / "configs"


class ExperimentSource:
    """Every run of one experiment config's sweep, queued up front (as ``swarm sweep``)."""

    key = "experiment"
    label = "experiment config (sweep)"
    fields: tuple[str, ...] = ("config",)

    def __init__(self, configs_dir: Path) -> None:
        self.configs_dir = configs_dir

    def options(self, field: str) -> list[str]:
        # Experiment configs sit at the top of the configs directory; profiles and suites in
        # folders below it.
        return _json_files(self.configs_dir) if field == "config" else []

    def plan(self, choice: LaunchChoice) -> LaunchPlan:
        if not choice.config:
            return LaunchPlan(error="pick an experiment config")
        try:
            exp = load_experiment(self.configs_dir / choice.config)
            bodies = [r.job_body(r.run_name) for r in exp.runs]
            runs = [structure(body, JobSubmit) for body in bodies]
        except ConfigError as exc:
            where = Path(exc.path).resolve()
            root = self.configs_dir.resolve()
            name = where.relative_to(root).as_posix() if where.is_relative_to(root) else where
            field = f"{exc.field}: " if exc.field else ""
            return LaunchPlan(error=f"{name}: {field}{exc.message}")
        except SchemaError as exc:
            return LaunchPlan(error=exc.message, field=exc.field)
        grids = list(dict.fromkeys(grid_text(r.topology) for r in runs))
        notes = [f"{exp.config.name}: {len(runs)} run{'s' if len(runs) != 1 else ''}",
                 f"grid{'s' if len(grids) > 1 else ''}: {'; '.join(grids)}",
                 f"artifacts in {_display(exp.runs_dir, self.configs_dir)}",
                 "checked locally; the leader checks again"]
        if any(r.tc_profile for r in exp.runs):
            notes.append("tc profiles: runs go one at a time, each wrapped in setup_netem.sh "
                         "(needs root)")
        return LaunchPlan(runs=runs, bodies=bodies,
                          notes=notes, experiment=exp)


def _display(path: Path, configs_dir: Path) -> str:
    """Relative to the working directory when below it, else to the configs directory."""
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return f"{configs_dir.name}/{os.path.relpath(path, configs_dir.resolve())}"


class ProfileSource:
    """One train job from a model profile, a training profile and its grid (fellows, and the
    replicas of every stage among them)."""

    key = "profiles"
    label = "model + training profile"
    fields: tuple[str, ...] = ("model", "training", "stages", "replicas", "wiring", "sync",
                               "inner_steps", "overlap_steps", "density", "transport", "steps",
                               "name")

    def __init__(self, configs_dir: Path) -> None:
        self.configs_dir = configs_dir

    def options(self, field: str) -> list[str]:
        if field == "sync":
            return list(SYNC_MODES)
        if field == "transport":
            return list(TRANSPORTS)
        if field == "wiring":
            return list(WIRINGS)
        sub = {"model": "model", "training": "training"}.get(field)
        return _json_files(self.configs_dir, sub) if sub else []

    def _load(self, rel: str | None, what: str) -> dict[str, Any]:
        if not rel:
            raise SchemaError(f"pick a {what} profile")
        path = self.configs_dir / rel
        try:
            data = jsonio.loads(path.read_bytes())
        except OSError as exc:
            raise SchemaError(f"cannot read {rel}: {exc.strerror}") from None
        except jsonio.JSONDecodeError as exc:
            raise SchemaError(f"{rel}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise SchemaError(f"{rel}: expected a JSON object")
        return data

    def _training(self, rel: str | None) -> tuple[dict[str, Any], Any]:
        """The training profile's job fields and its cluster (None where it names none)."""
        if not rel:
            raise SchemaError("pick a training profile")
        path = self.configs_dir / rel
        try:
            return load_job_training(path)[0], load_job_cluster(path)
        except ConfigError as exc:
            field = f"{exc.field}: " if exc.field else ""
            raise SchemaError(f"{rel}: {field}{exc.message}") from None

    def plan(self, choice: LaunchChoice) -> LaunchPlan:
        try:
            model = self._load(choice.model, "model")
            training, cluster = self._training(choice.training)
            fellows, stages, replicas = (
                _int(text, key, f"$.topology.{key}") if text.strip() else None
                for key, text in (("fellows", choice.fellows), ("stages", choice.stages),
                                  ("replicas", choice.replicas)))
            topology = job_topology(cluster, fellows, stages, replicas, choice.wiring)
            if not {"fellows", "stages", "layout"} & set(topology):
                topology["stages"] = 2  # (no cluster in the profile, nothing typed)
            if choice.steps.strip():
                training["steps"] = _int(choice.steps, "steps", "$.training.steps")
            fields = _sync_fields(choice)
            if fields:  # (checked at once, as one SyncConfig; the body carries it whole)
                training["sync"] = unstructure(sync_over(training, fields))
            if choice.transport:
                training["transport"] = choice.transport
            name = choice.name.strip() or str(model.get("name") or "job")
            body = {"name": name, "kind": "train", "topology": topology,
                    "model": model, "training": training}
            # What the leader checks too; catching it here makes the preview say so at once.
            req = structure(body, JobSubmit)
        except SchemaError as exc:
            return LaunchPlan(error=exc.message, field=exc.field)
        torch = req.train is not None and req.train.transport == "torch"
        return LaunchPlan(runs=[req], bodies=[body],
                          notes=[f"grid: {grid_text(req.topology)}",
                                 *([TORCH_NOTE] if torch else []),
                                 "checked locally; the leader checks again"])


def _sync_fields(choice: LaunchChoice) -> dict[str, Any]:
    """The ``training.sync`` fields the person set (the blank ones stay the profile's)."""
    fields: dict[str, Any] = {"mode": choice.sync} if choice.sync else {}
    for key in ("inner_steps", "overlap_steps"):
        if text := getattr(choice, key).strip():
            fields[key] = _int(text, key, f"$.training.sync.{key}")
    if text := choice.density.strip():  # (its range is SyncConfig's to check, as the flag's)
        fields["density"] = _number(text, "density", "$.training.sync.density")
    return fields


def _int(text: str, label: str, field: str) -> int:
    try:
        return whole_number(text)
    except ValueError:
        raise SchemaError(f"{label}: {clip(text.strip())!r} is not a whole number",
                          field) from None


def _number(text: str, label: str, field: str) -> float:
    try:
        return decimal_number(text)
    except ValueError:
        raise SchemaError(f"{label}: {clip(text.strip())!r} is not a number", field) from None


def grid_text(topo: Topology) -> str:
    """``2 stages x 2 replicas = 4 fellows``: the grid a job asks for, in the form's words."""
    def n(count: int, what: str) -> str:
        return f"{count} {what}{'s' if count != 1 else ''}"

    text = f"{n(topo.num_stages, 'stage')} x {n(topo.replicas, 'replica')} = " \
        f"{n(topo.num_fellows, 'fellow')}"
    if topo.layout is not None:  # (stages of their own cells: the cells are the fellows)
        text = f"{n(topo.num_stages, 'stage')} of cells " \
            f"{'+'.join(str(len(ids)) for ids in topo.layout)} = {n(topo.num_fellows, 'fellow')}"
    if topo.slots_per_fellow > 1:
        text += f" of {topo.slots_per_fellow} slots"
    if topo.wiring != "chain":
        text += f", {topo.wiring}-wired" + (" (measured routes)" if topo.routing == "measured"
                                             else "")
    return text


def launch_summary(plan: LaunchPlan, limit: int = 4) -> str:
    """What a launch queues, for its confirmation: each run's name, grid and details (the
    first ``limit``, then how many more)."""
    n, exp = len(plan.runs), plan.experiment
    paced = exp is not None and any(r.tc_profile for r in exp.runs)  # (see ExperimentSource)
    what = (f"{exp.config.name}: " if exp is not None else "") + \
        f"{n} run{'s' if n != 1 else ''}, " + \
        ("one at a time (tc profiles)" if paced else "queued at once")
    lines = [what]
    for req in plan.runs[:limit]:
        name, details = run_summary(req)
        lines.append(f"  {name}: {grid_text(req.topology)}")
        lines.append(f"    {details}")
    if n > limit:
        lines.append(f"  and {n - limit} more")
    return "\n".join(lines)


def run_summary(req: JobSubmit) -> tuple[str, str]:
    """The run's name, and "fellows · grid · steps · compression · dataset · schedule", then
    "torch transport" for a torch job (the default, shaped, goes unsaid)."""
    topo = req.topology
    parts = [f"{topo.fellows} fellows"]
    if topo.replicas > 1:
        parts.append(f"{topo.stages}x{topo.replicas}")
        if req.train is not None:  # (a smoke job has no sync to name)
            parts.append(req.train.sync.label)
    if req.training is not None:
        parts.append(f"{req.training.steps} steps")
    if req.model is not None:
        parts.append(req.model.compression)
    if (t := req.train) is not None:
        parts += [t.dataset, t.schedule]
        if t.transport != "shaped":
            parts.append(f"{t.transport} transport")
    return req.name, " · ".join(parts)


def run_body(body: dict[str, Any]) -> str:
    """A run as the preview shows it: what was picked; the leader fills in the defaults."""
    return jsonio.dumps(body, pretty=True).decode()


def default_sources(configs_dir: Path) -> list[LaunchSource]:
    return [ExperimentSource(configs_dir), ProfileSource(configs_dir)]
