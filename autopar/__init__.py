"""autopar: a compiler that makes large-model training parallel by itself.

The pipeline, one package per stage (``docs/architecture.md``): ``graph`` captures the model,
``cost_models`` price choices, ``planner`` solves for a ``Plan``, ``passes`` rewrite the graph
by it, ``runtime`` trains it on torch.distributed, ``measure`` profiles, calibrates and
verifies, ``cli`` is the command line. ``api`` puts planner and runtime together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import autopar.plan as _plan_module  # noqa: F401  bound first: ``plan`` below is the function, not this module
from autopar.lazy import lazy_attributes

if TYPE_CHECKING:
    from autopar.adapt import AdaptConfig, Adaptive
    from autopar.api import parallelize, plan
    from autopar.cluster import Cluster, DeviceSpec, LinkSpec
    from autopar.errors import AutoparError, CaptureError, ClusterSpecError, InfeasibleError, ModelSpecError
    from autopar.graph import CapturedModel, capture
    from autopar.groups import MixedCluster
    from autopar.monitor import Metrics
    from autopar.plan import Plan
    from autopar.request import Constraints, PlanRequest
    from autopar.runtime import ParallelModel, init_distributed
    from autopar.runtime.checkpointer import Checkpointer
    from autopar.runtime.data import GlobalBatches
    from autopar.runtime.integrity import BrokenCheckpointError
    from autopar.zoo.spec import meta_parameters

_HOME = {
    "AdaptConfig": "autopar.adapt",
    "Adaptive": "autopar.adapt",
    "Cluster": "autopar.cluster",
    "DeviceSpec": "autopar.cluster",
    "LinkSpec": "autopar.cluster",
    "AutoparError": "autopar.errors",
    "CaptureError": "autopar.errors",
    "ClusterSpecError": "autopar.errors",
    "InfeasibleError": "autopar.errors",
    "ModelSpecError": "autopar.errors",
    "CapturedModel": "autopar.graph",
    "capture": "autopar.graph",
    "MixedCluster": "autopar.groups",
    "Metrics": "autopar.monitor",
    "Plan": "autopar.plan",
    "Constraints": "autopar.request",
    "PlanRequest": "autopar.request",
    "ParallelModel": "autopar.runtime",
    "init_distributed": "autopar.runtime",
    "Checkpointer": "autopar.runtime.checkpointer",
    "GlobalBatches": "autopar.runtime.data",
    "BrokenCheckpointError": "autopar.runtime.integrity",
    "meta_parameters": "autopar.zoo.spec",
}
"""Each public name → the module that defines it, imported on first use (PEP 562): the
command line plans from a warm capture cache without importing torch."""


if not TYPE_CHECKING:

    def plan(*args: Any, **kwargs: Any) -> Any:
        """``autopar.api.plan`` (imported on the first call: it needs torch)."""
        from autopar.api import plan as plan_

        return plan_(*args, **kwargs)

    def parallelize(*args: Any, **kwargs: Any) -> Any:
        """``autopar.api.parallelize`` (imported on the first call: it needs torch)."""
        from autopar.api import parallelize as parallelize_

        return parallelize_(*args, **kwargs)


__getattr__ = lazy_attributes(__name__, _HOME)


__version__ = "0.1.0"

__all__ = [
    "AdaptConfig",
    "Adaptive",
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
    "MixedCluster",
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
