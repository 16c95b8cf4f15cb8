"""What the launcher can launch (no Textual): sources of job bodies, expanded into a plan.

A *source* turns the launcher's choices into a :class:`LaunchPlan`: the ``JobSubmit`` bodies it
would send, in order, or the first error that stops it. The launcher screen previews a plan
and submits its runs one by one; it knows nothing else about the source. Today's source pairs a
model profile (``exp/configs/model/*.json``) with a training profile
(``exp/configs/training/*.json``); a sweep loader plugs in as another :class:`LaunchSource`
whose ``plan`` expands one sweep config into many runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import attrs

from swarm_core import jsonio
from swarm_core.config import ModelConfig, TrainingConfig
from swarm_core.protocol import JobSubmit
from swarm_core.schema import SchemaError, structure


@attrs.define
class LaunchChoice:
    """What the person picked. Sources read the fields they need."""

    model: str | None = None  # a path relative to the configs directory
    training: str | None = None
    fellows: str = "2"
    steps: str = ""  # empty: as the profile says
    name: str = ""  # empty: the model profile's name


@attrs.define
class LaunchPlan:
    runs: list[JobSubmit] = attrs.field(factory=list)
    bodies: list[dict[str, Any]] = attrs.field(factory=list)  # each run as written (preview)
    error: str | None = None  # the first problem, one line
    field: str | None = None  # its JSON path when there is one
    notes: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)


class LaunchSource(Protocol):
    key: str
    label: str

    def models(self) -> list[str]: ...

    def trainings(self) -> list[str]: ...

    def plan(self, choice: LaunchChoice) -> LaunchPlan: ...


def default_configs_dir() -> Path:
    """``exp/configs`` under the working directory, else the one beside this checkout."""
    here = Path.cwd() / "exp" / "configs"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / "exp" / "configs"


class ProfileSource:
    """One train job from a model profile, a training profile and a fellow count."""

    key = "profiles"
    label = "model + training profile"

    def __init__(self, configs_dir: Path) -> None:
        self.configs_dir = configs_dir

    def _list(self, sub: str) -> list[str]:
        folder = self.configs_dir / sub
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(self.configs_dir).as_posix()
                      for p in folder.glob("*.json") if p.is_file())

    def models(self) -> list[str]:
        return self._list("model")

    def trainings(self) -> list[str]:
        return self._list("training")

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

    def plan(self, choice: LaunchChoice) -> LaunchPlan:
        try:
            model = self._load(choice.model, "model")
            training = self._load(choice.training, "training")
            fellows = _int(choice.fellows, "fellows", "$.topology.fellows")
            if choice.steps.strip():
                training["steps"] = _int(choice.steps, "steps", "$.training.steps")
            name = choice.name.strip() or str(model.get("name") or "job")
            body = {"name": name, "kind": "train", "topology": {"fellows": fellows},
                    "model": model, "training": training}
            req = structure(body, JobSubmit)
            # What the leader checks too; catching it here makes the preview say so at once.
            structure(req.model, ModelConfig, "$.model")
            structure(req.training, TrainingConfig, "$.training")
        except SchemaError as exc:
            return LaunchPlan(error=exc.message, field=exc.field)
        return LaunchPlan(runs=[req], bodies=[body],
                          notes=["checked locally; the leader checks again"])


def _int(text: str, label: str, field: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise SchemaError(f"{label}: {text.strip()!r} is not a whole number", field) from None


def run_summary(req: JobSubmit) -> str:
    m, t = req.model, req.training
    parts = [req.name, f"{req.topology.fellows} fellows"]
    if "steps" in t:
        parts.append(f"{t['steps']} steps")
    for key in ("compression", "dataset", "schedule"):
        value = m.get(key) if key in m else t.get(key)
        if value:
            parts.append(str(value))
    return " · ".join(parts)


def run_body(body: dict[str, Any]) -> str:
    """A run as the preview shows it: what was picked; the leader fills in the defaults."""
    return jsonio.dumps(body, pretty=True).decode()


SOURCES: dict[str, type] = {ProfileSource.key: ProfileSource}
