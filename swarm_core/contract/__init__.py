"""The job contract: what is submitted, what a stage is told, what comes back.

Torch-free, so the leader (which runs on login nodes) plans and checks jobs with it; the
fellow, the CLI, the console and the run artifacts all read the same classes.
"""

from swarm_core.contract.fellow_log import (
    DEFAULT_LOG_LINES,
    MAX_LOG_LINES,
    FellowLog,
    FellowLogTail,
)
from swarm_core.contract.heartbeat import CellRef, Heartbeat, UnreportedFinal
from swarm_core.contract.job import (
    JOB_ORDERS,
    MAX_JOB_PAGE,
    JobInfo,
    JobKind,
    JobList,
    JobSubmit,
    LinkChange,
    Replacement,
    Restart,
    ShardReceipt,
    SmokeTraining,
    Topology,
    link_changes_in_all,
)
from swarm_core.contract.membership import (
    MembershipChange,
    MembersSignal,
    RegroupAnswer,
    RegroupConflict,
    RegroupOrder,
    RegroupReport,
    regroup_orders,
)
from swarm_core.contract.metrics import (
    CodecErrors,
    JobMetrics,
    JobStatusBatch,
    JobStatusUpdate,
    ProgressList,
    ProgressRecord,
    StageMetrics,
    perplexity,
    step_wait_share,
)
from swarm_core.contract.placement import (
    FellowSlots,
    LayerRange,
    Placement,
    PlacementError,
    StagePlacement,
    plan,
    split_layers,
    stage_of_label,
)
from swarm_core.contract.start import StageStart, chain_starts, stage_starts

__all__ = [
    "DEFAULT_LOG_LINES",
    "JOB_ORDERS",
    "MAX_JOB_PAGE",
    "MAX_LOG_LINES",
    "CellRef",
    "CodecErrors",
    "FellowLog",
    "FellowLogTail",
    "FellowSlots",
    "Heartbeat",
    "JobInfo",
    "JobKind",
    "JobList",
    "JobMetrics",
    "JobStatusBatch",
    "JobStatusUpdate",
    "JobSubmit",
    "LayerRange",
    "LinkChange",
    "MembersSignal",
    "MembershipChange",
    "Placement",
    "PlacementError",
    "ProgressList",
    "ProgressRecord",
    "RegroupAnswer",
    "RegroupConflict",
    "RegroupOrder",
    "RegroupReport",
    "Replacement",
    "Restart",
    "ShardReceipt",
    "SmokeTraining",
    "StageMetrics",
    "StagePlacement",
    "StageStart",
    "Topology",
    "UnreportedFinal",
    "chain_starts",
    "link_changes_in_all",
    "perplexity",
    "plan",
    "regroup_orders",
    "split_layers",
    "stage_of_label",
    "stage_starts",
    "step_wait_share"
]
