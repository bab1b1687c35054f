"""autopar: a compiler that makes large-model training parallel by itself.

The pipeline, one package per stage (``docs/architecture.md``): ``graph`` captures the model,
``cost_models`` price choices, ``planner`` solves for a ``Plan``, ``passes`` rewrite the graph
by it, ``runtime`` trains it on torch.distributed, ``measure`` profiles, calibrates and
verifies, ``cli`` is the command line. ``api`` puts planner and runtime together.
"""

from autopar.api import parallelize, plan
from autopar.cluster import Cluster, DeviceSpec, LinkSpec
from autopar.errors import AutoparError, CaptureError, ClusterSpecError, InfeasibleError, ModelSpecError
from autopar.graph import CapturedModel, capture
from autopar.monitor import Metrics
from autopar.plan import Plan
from autopar.request import Constraints, PlanRequest
from autopar.runtime import ParallelModel, init_distributed
from autopar.runtime.checkpointer import Checkpointer
from autopar.runtime.data import GlobalBatches
from autopar.runtime.integrity import BrokenCheckpointError
from autopar.zoo.spec import meta_parameters

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "BrokenCheckpointError",
    "CaptureError",
    "CapturedModel",
    "Checkpointer",
    "Cluster",
    "ClusterSpecError",
    "Constraints",
    "DeviceSpec",
    "GlobalBatches",
    "InfeasibleError",
    "LinkSpec",
    "Metrics",
    "ModelSpecError",
    "ParallelModel",
    "Plan",
    "PlanRequest",
    "capture",
    "init_distributed",
    "meta_parameters",
    "parallelize",
    "plan",
]
