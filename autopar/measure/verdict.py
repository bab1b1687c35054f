"""Whether a distributed run trained like one process: the verdict of ``autopar verify``.

Both runs record, at every step, the loss, every parameter's gradient just before the optimizer
applies it, and every parameter just after (``Trace``). The verdict compares what a plan
changes — how gradients are computed, reduced and applied — and nothing else:

- gradient of each parameter at step k: ‖g − g_ref‖ / ‖g_ref‖ (a parameter the reference
  leaves without gradient must get none);
- each parameter after step k, against its own update: ‖p − p_ref‖ / ‖p_ref(k) − p_ref(k−1)‖,
  so a parameter that did not train, or trained half, cannot pass however small its update;
- the loss at step k: |l − l_ref| / |l_ref|.

Each error must stay within the bound of the arithmetic both sides ran in (``BOUNDS``). fp32
plans are checked in float64 (their math has no precision-specific path, and float64 makes the
rounding of re-associated reductions — ~1e-16 per operation — far smaller than any real defect:
a lost 1/m, a SUM for an average, a missing all-reduce all give errors of order 1); the bound is
√ε of float64, 1.5e-8, for gradients and parameters, and 1e-6 for the loss (a user's loss may
compute in float32: ``F.cross_entropy(logits.float(), …)`` rounds to 1.2e-7). Half-precision
plans are compared with a single process under autocast in the same dtype, within bounds
measured on the suite's models with margin (below). The first step and parameter past its bound
is named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

SQRT_EPS64 = math.sqrt(torch.finfo(torch.float64).eps)
"""1.5e-8: half of float64's digits."""

SQRT_EPS32 = math.sqrt(torch.finfo(torch.float32).eps)
"""3.5e-4: half of float32's digits."""

BOUNDS: dict[str, tuple[float, float, float]] = {
    "float64": (1e-6, SQRT_EPS64, SQRT_EPS64),
    # a model run in float64 that computes some of its ops in float32 on purpose (Gemma's norms:
    # ``x.float()``) rounds there at ε32 whatever the plan: √ε32 then bounds the same checks
    "float32": (1e-5, SQRT_EPS32, SQRT_EPS32),
    "bf16": (1e-2, 0.25, 0.5),
    "fp16": (1e-2, 0.25, 0.5),
}
"""Arithmetic → (loss, gradient, parameter) relative bounds. Half precision (FSDP2's bf16
parameters round whole layers, autocast only matmul inputs): the loss within 1% and each gradient
within 25% of its norm (measured on a default-initialised 4-block GPT under DDP, ZeRO-1, FSDP2,
TP2 and PP2, 3 AdamW steps: at most 1.9e-4 and 5.3e-2); a halved or doubled gradient exceeds it.
Parameters only have to move where the reference's do (see ``_Judge.param``)."""


class Trace(NamedTuple):
    """One run, step by step (parameters and gradients under the model's own names)."""

    losses: list[float]
    """Mean loss of each step."""
    state: dict[str, torch.Tensor]
    """The parameters after the last step."""
    grads: list[dict[str, torch.Tensor]]
    """Each step's gradients, as the optimizer applies them (unscaled)."""
    params: list[dict[str, torch.Tensor]]
    """The parameters after each step."""
    initial: dict[str, torch.Tensor]
    """The parameters before the first step."""
    norms: tuple[float, ...] = ()
    """Each step's whole-model gradient norm (before any clipping)."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """Distributed run against the single-process reference."""

    arithmetic: str
    """What both sides computed in: ``float64``, ``float32`` (float64 with float32 ops in the
    model itself), ``bf16`` or ``fp16``."""
    losses: list[float]
    reference_losses: list[float]
    max_loss_error: float
    """Largest relative loss difference over the steps."""
    max_grad_error: float
    """Largest relative gradient difference over steps and parameters."""
    max_param_error: float
    """Largest parameter difference relative to that parameter's update, over the steps."""
    worst_by_group: dict[str, float] = field(default_factory=dict)
    """Largest relative gradient error of each layer (``blocks.3``, ``wte``, …)."""
    first_failure: str | None = None
    """The first step and parameter past its bound, in words; None when it passed."""
    dropout: str | None = None
    """For a model that draws dropout masks: what was checked with them on (``with_dropout``)."""

    @property
    def bounds(self) -> tuple[float, float, float]:
        return BOUNDS[self.arithmetic]

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    def to_dict(self) -> dict[str, Any]:
        loss_b, grad_b, param_b = self.bounds
        return {
            "arithmetic": self.arithmetic,
            "losses": self.losses,
            "reference_losses": self.reference_losses,
            "max_loss_error": self.max_loss_error,
            "max_grad_error": self.max_grad_error,
            "max_param_error": self.max_param_error,
            "bounds": {"loss": loss_b, "grad": grad_b, "param": param_b},
            "worst_grad_error_by_layer": self.worst_by_group,
            "first_failure": self.first_failure,
            "dropout": self.dropout,
            "passed": self.passed,
        }


GRAD_FLOOR, UPDATE_FLOOR = 1e-6, 0.1
"""A parameter's gradient (update) is measured against at least this share of the model's
root-mean-square one, scaled to the parameter's size: a gradient that is rounding noise (a key
bias's: softmax ignores it, so its true gradient is 0), and the noise-sized Adam step it makes,
are compared with the model's scale instead of with themselves."""


def relative(diff: torch.Tensor, scale: torch.Tensor, floor: float = 0.0) -> float:
    """‖diff‖ / max(‖scale‖, floor) in float64; 0 when both vanish, ∞ when only the scale does."""
    d, s = float(diff.double().norm()), max(float(scale.double().norm()), floor)
    if s == 0.0:
        return 0.0 if d == 0.0 else math.inf
    return d / s


def _rms(tensors: list[torch.Tensor]) -> float:
    """Root mean square over the elements of ``tensors``."""
    count = sum(t.numel() for t in tensors)
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors) / max(count, 1))


def _group(name: str) -> str:
    """The layer a parameter belongs to: its path up to the first number (``blocks.3``), else
    its first component."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


class _Judge:
    """Running maxima and the first failure, in step order."""

    def __init__(self, arithmetic: str) -> None:
        self.arithmetic = arithmetic
        self.loss_b, self.grad_b, self.param_b = BOUNDS[arithmetic]
        self.worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        self.by_group: dict[str, float] = {}
        self.first: str | None = None

    def check(self, kind: str, err: float, bound: float, where: str) -> None:
        self.worst[kind] = max(self.worst[kind], err)
        if err > bound and self.first is None:
            self.first = f"{where} differs by {err:.1e} (bound {bound:.1e})"

    def step(self, k: int, ref: Trace, got: dict[str, Any]) -> None:
        """Step k: gradients first (they name the parameter a defect reaches), then parameters,
        then the loss."""
        before = ref.params[k - 1] if k else ref.initial
        rms = _rms(list(ref.grads[k].values()))
        for name, g_ref in ref.grads[k].items():
            g = got["grads"][k].get(name)
            if g is None:
                self.first = self.first or f"step {k}: the run has no gradient for {name!r}"
                continue
            err = relative(g - g_ref, g_ref, GRAD_FLOOR * rms * math.sqrt(g_ref.numel()))
            self.by_group[_group(name)] = max(self.by_group.get(_group(name), 0.0), err)
            self.check("grad", err, self.grad_b, f"step {k}: the gradient of {name!r} (relative to its norm)")
        updates = {n: ref.params[k][n] - before[n] for n in ref.grads[k]}  # parameters, not buffers
        rms = _rms(list(updates.values()))
        for name, ref_update in updates.items():
            p = got["params"][k].get(name)
            if p is not None:  # (a missing one is named above)
                floor = UPDATE_FLOOR * rms * math.sqrt(ref_update.numel())
                self.param(k, name, p - before[name], ref_update, floor)
        norms = got.get("grad_norms", [])
        if k < len(norms) and k < len(ref.norms) and math.isfinite(norms[k]):  # (fp16: an overflow)
            err = abs(norms[k] - ref.norms[k]) / max(ref.norms[k], 1e-30)
            self.check("grad", err, self.grad_b, f"step {k}: the gradient norm ({norms[k]:.6g})")
        ref_loss, loss = ref.losses[k], got["losses"][k]
        self.check(
            "loss", abs(loss - ref_loss) / max(abs(ref_loss), 1e-30), self.loss_b, f"step {k}: the loss"
        )

    def param(self, k: int, name: str, update: torch.Tensor, ref_update: torch.Tensor, floor: float) -> None:
        """float64: the step's difference relative to the reference's update. Half precision: only
        that the parameter moved where the reference's did (an Adam-style step normalises each
        element, so rounding in a near-zero gradient — a key bias's, whose true gradient is 0 —
        becomes a ±lr move of either sign: the gradients are what is compared there)."""
        if self.arithmetic in ("float64", "float32"):
            err = relative(update - ref_update, ref_update, floor)
            self.check(
                "param", err, self.param_b, f"step {k}: {name!r} after the step (relative to its update)"
            )
            return
        frozen = float(update.double().norm()) == 0.0 < float(ref_update.double().norm())
        self.check(
            "param", 1.0 if frozen else 0.0, self.param_b, f"step {k}: {name!r} did not move; its update"
        )


def judge(reference: Trace, result: dict[str, Any], arithmetic: str) -> Verdict:
    """The verdict on ``result`` (a distributed run's ``losses``, ``grads`` and ``params`` per
    step) against ``reference``, within the bounds of ``arithmetic``."""
    j = _Judge(arithmetic)
    missing = sorted(set(reference.state) - set(result["params"][-1]))
    if missing:
        j.first = f"the distributed run returned no {missing[0]!r}"
    for k in range(len(reference.losses)):
        j.step(k, reference, result)
    j.first = j.first or run_failure(result)
    return Verdict(
        arithmetic=arithmetic,
        losses=list(result["losses"]),
        reference_losses=list(reference.losses),
        max_loss_error=j.worst["loss"],
        max_grad_error=j.worst["grad"],
        max_param_error=j.worst["param"],
        worst_by_group=dict(sorted(j.by_group.items())),
        first_failure=j.first,
    )


def run_failure(result: dict[str, Any]) -> str | None:
    """What a run fails without a reference: replicas that drifted apart, a checkpoint that does
    not round-trip."""
    if result.get("replicas"):
        return (
            f"{result['replicas']!r} differs between the ranks that hold copies of it after the run "
            "(their replicated computation diverged: different dropout masks, or an update on some only)"
        )
    if not result.get("checkpoint_exact", True) and not _compiled_round_trip(result):
        return (
            "the checkpoint does not round-trip: saved with DCP and loaded into a fresh placement of the "
            "plan, its weights or its next step differ"
        )
    return None


COMPILED_STEP_GAP = 1e-4
"""The most a compiled plan's next step may differ after a checkpoint round trip: the fresh
placement runs its own compiled kernels (bit-exact state, last-bit differences in the step,
which Adam turns into up to lr-sized moves of near-zero weights; measured 1.8e-5 in fp32)."""


def _compiled_round_trip(result: dict[str, Any]) -> bool:
    """A compiled plan's round trip: the state came back exactly and the next step is within
    ``COMPILED_STEP_GAP``."""
    return bool(
        result.get("checkpoint_compiled")
        and result.get("checkpoint_state_exact")
        and result.get("checkpoint_step_gap", math.inf) <= COMPILED_STEP_GAP
    )


def as_trace(result: dict[str, Any], initial: dict[str, torch.Tensor]) -> Trace:
    """A distributed run's record as a ``Trace`` (that started from ``initial``), to judge another
    run against it."""
    return Trace(result["losses"], result["state"], result["grads"], result["params"], initial)


def with_dropout(off: Verdict, on: dict[str, Any], twin: Trace | None) -> Verdict:
    """The verdict on a model that draws dropout masks. No single-process run draws the masks a
    plan draws (its ranks split the batch, the heads and the sequence), so ``off`` compared the plan
    with the reference with dropout off (both in eval mode) — every reduction the plan changes is
    there. With dropout on, ``on`` (the plan's run) must keep its replicas equal (a TP group draws the
    same masks for replicated activations: ``judge`` names a drifting parameter) and finite losses;
    and where the plan recomputes, ``twin`` (the same plan without recompute, the same seeds) must
    match it within the bounds: recomputation must replay the forward's masks."""
    failure = off.first_failure
    if not all(math.isfinite(x) for x in on["losses"]):
        failure = failure or f"with dropout on, the losses are not finite: {on['losses']}"
    note = "compared with dropout off (eval mode); with it on, checked that replicas stay equal"
    if twin is None:
        alone = run_failure(on)
        failure = failure or (f"with dropout on, {alone}" if alone else None)
        return replace(off, first_failure=failure, dropout=note)
    recomputed = judge(twin, on, off.arithmetic)
    if not recomputed.passed:
        failure = (
            failure
            or f"with dropout on, recompute does not replay the forward's masks: {recomputed.first_failure}"
        )
    note += (
        " and that recompute replays the forward's masks (largest gradient difference to the same "
        f"plan without recompute: {recomputed.max_grad_error:.1e})"
    )
    return replace(off, first_failure=failure, dropout=note)


__all__ = ["BOUNDS", "Trace", "Verdict", "as_trace", "judge", "relative", "run_failure", "with_dropout"]
