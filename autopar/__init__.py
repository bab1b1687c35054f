"""autopar: a compiler that makes large-model training parallel by itself."""

from autopar.cluster import Cluster, DeviceSpec, LinkSpec
from autopar.errors import AutoparError, CaptureError, ClusterSpecError, ModelSpecError
from autopar.graph import CapturedModel, capture

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "CaptureError",
    "CapturedModel",
    "Cluster",
    "ClusterSpecError",
    "DeviceSpec",
    "LinkSpec",
    "ModelSpecError",
    "capture",
]
