"""Published closed forms for GPT-style decoders, used to cross-check captured graphs.

Notation (shared/REFERENCES.md): B batch (sequences), s sequence length,
h hidden size, l layers, a attention heads, V vocabulary.
"""

from __future__ import annotations


def gpt_param_count(*, l: int, h: int, V: int, s: int) -> float:  # noqa: E741
    """P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)).

    Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21, Eq. 2. Counts QKV/projection/MLP
    weights and biases and both LayerNorms per layer, token and position
    embeddings (output layer tied); omits the final LayerNorm (2h).
    """
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def gpt_model_flops(*, B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Model FLOPs of one training step (forward + backward, no recomputation).

    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)); Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", 2022, Eq. 7 (the
    PaLM MFU convention). Forward per layer: 24·B·s·h² for the four GEMMs
    plus 4·B·s²·h for QKᵀ and attention·V; the logit layer 2·B·s·h·V;
    backward twice the forward.
    """
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def gpt_hardware_flops_full_recompute(*, B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Hardware FLOPs of one step with full activation recomputation (4 forwards' worth).

    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)); Narayanan et al. SC'21, Eq. 3.
    """
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def layer_activation_bytes(*, s: int, b: int, h: int, a: int) -> float:
    """Bytes one transformer layer saves for backward, 16-bit activations, no parallelism.

    s·b·h·(34 + 5·a·s/h); Korthikanti et al. 2022, Eq. 1. Of the 34·s·b·h,
    2·s·b·h are the two dropout masks (1 byte per element); 5·a·s²·b is
    the attention score matrix, its softmax and dropout (none of which a
    flash-attention kernel keeps; it keeps a log-sum-exp of 4·a·s·b bytes).
    """
    return s * b * h * (34 + 5 * a * s / h)


def layer_activation_bytes_flash_no_dropout(*, s: int, b: int, h: int, a: int) -> float:
    """Korthikanti's Eq. 1 for a layer with no dropout and a flash-attention kernel.

    32·s·b·h + 4·a·s·b bytes (16-bit activations): Eq. 1's 34·s·b·h less the
    two 1-byte dropout masks (−2·s·b·h); the 5·a·s²·b of scores, softmax and
    attention dropout are replaced by the kernel's fp32 log-sum-exp per head
    and position (4·a·s·b). Q, K, V (6·s·b·h) and the attention output that
    feeds the projection (2·s·b·h) are kept as in Eq. 1. Derived from
    Korthikanti et al. 2022 §4.1 and Dao et al. 2022 (FlashAttention, §3.1).
    """
    return 32 * s * b * h + 4 * a * s * b
