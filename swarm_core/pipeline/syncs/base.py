"""The interface every sync algorithm implements (see the package's docstring)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from swarm_core.pipeline.transport import PeerLink

# What one synchronisation sent (bytes, headers included) and took (seconds); None: none ran.
Synced = tuple[int, float] | None


class GroupSync(abc.ABC):
    """A stage group's synchronisation, one member's side.

    Every operation that crosses the ring ends with the ring's confirmation, which also
    carries ``word`` (the membership this member proposes) and leaves ``heard`` (the one the
    group agreed on): see ``contract/membership.py``. An operation whose ring breaks raises
    ``RingBroken`` and changes nothing this member holds, so that the group can
    :meth:`commit` what it holds or do it again over a new ring.
    """

    word: float = 0.0
    heard: float = 0.0
    # Measured routing (swarm wiring, dp): this member's figure told at each confirmation
    # (None: it tells none) and every member's, by rank, once confirmed.
    own: float | None = None
    told: list[float] | None = None
    # Each replica's state (its optimiser's, this algorithm's) is its own, so a checkpoint
    # holds every member's; else the group's first member's stands for all.
    own_state: bool = False
    # Its ``after_backward`` writes its own direction into the gradients (DeMo's sign): the
    # stage clips the replica's own gradients before it, not the direction after.
    clips_first: bool = False

    @property
    @abc.abstractmethod
    def max_payload(self) -> int:
        """The largest frame payload its ring carries."""

    @abc.abstractmethod
    def expected_bytes(self) -> int:
        """Exactly what one synchronisation sends from this member, headers included."""

    def planned_bytes(self, step: int, last: bool, hold: bool) -> int:
        """Exactly what the synchronisation after 0-based step ``step`` sends from this
        member, where one runs (an algorithm whose operations differ says which it runs)."""
        return self.expected_bytes()

    @abc.abstractmethod
    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None:
        """The group's ring changed (a regroup, a joiner): its links and this member's rank."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Apply the result of the operation that broke, which this member holds."""

    def arm(self, step: int, timeout: float) -> None:
        """The next backward is the step's last (an algorithm may start sending)."""
        return None

    def after_backward(self, step: int, timeout: float) -> Synced:
        """Before the optimiser step: the gradients complete."""
        return None

    def collect_due(self, step: int, last: bool) -> bool:
        """Whether an operation begun at an earlier step lands after step ``step``."""
        return False

    @property
    def in_flight(self) -> int | None:
        """The step whose operation is still crossing (see :meth:`collect`)."""
        return None

    def collect(self, step: int, last: bool, timeout: float) -> Synced:
        """After the optimiser step: an operation begun earlier, waited for and applied."""
        return None

    def after_step(self, step: int, last: bool, timeout: float, hold: bool = False) -> Synced:
        """After the optimiser step of step ``step`` (``last``: the run's). ``hold``: the
        group must hold one set of weights after it (a checkpoint follows)."""
        return None

    def checkpoint_state(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """This algorithm's state by ``<parameter>.<field>`` (``names``: the trained
        parameters', in order), saved beside the optimiser's."""
        return {}

    def restore_state(self, names: Sequence[str], arrays: dict[str, np.ndarray]) -> None:
        """Take back what :meth:`checkpoint_state` saved (by parameter name)."""
        return None

    def divide_by(self, shares: int | None) -> None:
        """The group's sum divided by ``shares`` rather than by its members (a swarm
        layout's stage, ``pipeline/layout``: its cells together ran the job's ``shares``
        data shares, whatever their number). Only a mean of each step's gradients can."""
        if shares is not None:
            raise ValueError("a swarm layout's stages of unequal cells need sync.mode dp")

    def handoff(self) -> dict[str, np.ndarray]:
        """What a replica joining the group takes from its donor beside weights and
        optimiser state."""
        return {}

    def take_handoff(self, arrays: dict[str, np.ndarray]) -> None:
        """A joiner: install its donor's :meth:`handoff`."""
        return None

    def close(self) -> None:
        """Stop its threads."""
        return None
