"""NVIDIA GPU generations, named from a device's name: what NCCL's tuning constants and the fitted
matmul efficiencies are kept per (``cost_models.nccl``, ``cluster`` presets)."""

from __future__ import annotations

ARCHS = ("volta", "ampere", "hopper", "blackwell")
"""NCCL's compute-capability classes: 7.x, 8.x, 9.x, 10.x and later."""

_ARCH_BY_NAME = (
    ("volta", ("V100",)),
    ("ampere", ("A100", "A800", "A10", "A30", "A40", "L40", "L4")),  # compute capability 8.x
    ("hopper", ("H100", "H800", "H200", "H20", "GH200")),
    ("blackwell", ("B100", "B200", "GB200", "B300", "GB300")),
)


def arch_of(device_name: str) -> str | None:
    """The NVIDIA generation named in a device name (``A100-SXM4-80GB`` → ``ampere``), or None
    for a device NCCL's tuning model does not describe (a CPU rank, another vendor)."""
    upper = device_name.upper()
    found = None
    for arch, names in _ARCH_BY_NAME:  # later generations' names win (GH200 over H20)
        if any(n in upper for n in names):
            found = arch
    return found


__all__ = ["ARCHS", "arch_of"]
