"""autopar: a compiler that makes large-model training parallel by itself."""

from torch import nn

from autopar.cluster import Cluster, DeviceSpec, LinkSpec
from autopar.errors import AutoparError, CaptureError, ClusterSpecError, ModelSpecError
from autopar.graph import CapturedModel, capture
from autopar.models import meta_parameters
from autopar.plan import Plan
from autopar.planner import Constraints, InfeasibleError
from autopar.runtime import ParallelModel, init_distributed, parallelize

__version__ = "0.1.0"


def plan(
    model: str | nn.Module,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    constraints: Constraints | None = None,
    top_k: int = 5,
    time_limit_s: float = 10.0,
) -> Plan:
    """The fastest predicted plan for ``model`` (a module or a MODEL spec) on ``cluster``.

    Raises ``InfeasibleError`` when nothing fits (the message says what would).
    """
    from autopar.costing import profile_fn
    from autopar.planner import make_plan

    name = model if isinstance(model, str) else type(model).__name__
    result = make_plan(
        name,
        profile_fn(model, dtype=dtype, seq=seq_len),
        cluster,
        global_batch=global_batch,
        seq=seq_len,
        dtype=dtype,
        constraints=constraints or Constraints(),
        top_k=top_k,
        time_limit_s=time_limit_s,
    )
    return result.plan


__all__ = [
    "AutoparError",
    "CaptureError",
    "CapturedModel",
    "Cluster",
    "ClusterSpecError",
    "Constraints",
    "DeviceSpec",
    "InfeasibleError",
    "LinkSpec",
    "ModelSpecError",
    "ParallelModel",
    "Plan",
    "capture",
    "init_distributed",
    "meta_parameters",
    "parallelize",
    "plan",
]
