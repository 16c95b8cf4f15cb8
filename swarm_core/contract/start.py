"""The START a stage receives: its job, its place in the placement, the job key and attempt.

The leader builds these with :func:`stage_starts` (one per stage; a fellow with several device
slots gets one for each) and the fellow structures the signal's payload back into a
:class:`StageStart` once, where it arrives. Tests build theirs through the same function.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.job import (
    JobKind,
    JobSubmit,
    SmokeTraining,
    Topology,
    kind_parts,
    register_kind_hooks,
)
from swarm_core.contract.placement import FellowSlots, Placement, StagePlacement, plan
from swarm_core.protocol import split_host_port
from swarm_core.schema import FieldError, checking, converter, lenient_converter


@attrs.define
class StageStart:
    """Run stage ``stage`` of job ``job_id`` (attempt ``attempt``, from ``resume_step``)."""

    job_id: str
    kind: JobKind
    name: str
    stage: int
    num_stages: int
    placement: Placement
    key: str  # the data plane admits only connections that present it
    model: ModelConfig | None = None
    training: TrainingConfig | SmokeTraining | None = None
    attempt: int = 0
    resume_step: int = 0

    def __attrs_post_init__(self) -> None:
        self.model, self.training = kind_parts(self.kind, self.model, self.training)
        if not checking():
            return
        n = len(self.placement.stages)
        if not 0 <= self.stage < n:
            raise FieldError(f"stage {self.stage} of a {n}-stage placement", "stage")
        if self.num_stages != n:
            raise FieldError(f"{self.num_stages} stages, the placement lists {n}", "num_stages")
        down = self.placement.downstream(self.stage)
        if self.kind == "train" and down is not None and (
                down.data_addr is None or split_host_port(down.data_addr) is None):
            raise FieldError(f"stage {down.stage} has no data address to dial: "
                             f"{down.data_addr!r}", "placement")
        if self.attempt < 0 or self.resume_step < 0:
            raise FieldError("attempt and resume_step must be >= 0", "attempt")

    @property
    def mine(self) -> StagePlacement:
        return self.placement.stages[self.stage]

    @property
    def downstream_addr(self) -> str | None:
        down = self.placement.downstream(self.stage)
        return None if down is None else down.data_addr

    @property
    def local_up(self) -> bool:
        """The stage upstream runs in this same fellow (another device slot)."""
        return self.placement.same_fellow(self.mine, self.placement.upstream(self.stage))

    @property
    def local_down(self) -> bool:
        return self.placement.same_fellow(self.mine, self.placement.downstream(self.stage))

    @property
    def train(self) -> TrainingConfig | None:
        return self.training if isinstance(self.training, TrainingConfig) else None


for _conv in (converter, lenient_converter):
    register_kind_hooks(StageStart, _conv)


def stage_starts(job_id: str, spec: JobSubmit, placement: Placement, key: str, *,
                 attempt: int = 0, resume_step: int = 0) -> list[StageStart]:
    """The START of every stage of a placed job, by stage."""
    return [StageStart(job_id=job_id, kind=spec.kind, name=spec.name, stage=s.stage,
                       num_stages=placement.num_stages, placement=placement, key=key,
                       model=spec.model, training=spec.training, attempt=attempt,
                       resume_step=resume_step)
            for s in placement.stages]


def chain_starts(model: ModelConfig, training: TrainingConfig, addrs: Sequence[str | None],
                 devices: Sequence[str] | None = None, *, job_id: str = "job-local",
                 key: str = "k" * 32, weights: Sequence[float] | None = None
                 ) -> list[StageStart]:
    """The STARTs of a train job whose stage s runs on fellow s, listening at ``addrs[s]`` on
    ``devices[s]``: planned and built by the leader's own code (for a pipeline run without a
    leader, and for tests). Layers split equally unless ``weights`` say otherwise."""
    devs = list(devices or ["cpu"] * len(addrs))
    fellows = [FellowSlots(s, f"fellow-{s}", [dev], addr)
               for s, (addr, dev) in enumerate(zip(addrs, devs, strict=True))]
    spec = JobSubmit(name=job_id, kind="train", model=model, training=training,
                     topology=Topology(fellows=len(addrs)))
    placement = plan(fellows, len(addrs), model.n_layers, weights)
    return stage_starts(job_id, spec, placement, key)
