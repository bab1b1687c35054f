"""Capture: closed-form checks, spliced graph == full trace, hard-to-trace models, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopar import CaptureError, capture
from autopar.cost_models import closed_forms
from autopar.graph.annotate import annotate_costs
from autopar.graph.layers import group_layers
from autopar.graph.trace import export_graph
from autopar.zoo import GPT, GPTConfig, Llama, LlamaConfig, build


@pytest.fixture(scope="module")
def gpt3() -> object:
    return capture(build("gpt3-175b"), batch=1, seq=2048)


def test_gpt3_175b_parameters_within_half_percent(gpt3) -> None:
    expected = closed_forms.gpt_param_count(l=96, h=12288, V=51200, s=2048)
    assert gpt3.total_params == pytest.approx(expected, rel=0.005)
    assert sum(layer.params for layer in gpt3.layers) == gpt3.total_params  # tied weight once


def test_gpt3_175b_step_flops_within_two_percent(gpt3) -> None:
    expected = closed_forms.gpt_model_flops(B=1, s=2048, l=96, h=12288, V=51200)
    assert gpt3.step_flops == pytest.approx(expected, rel=0.02)


def test_gpt3_175b_saved_bytes_per_layer(gpt3) -> None:
    block = gpt3.layer_types()["Block"]
    s, b, h, a = 2048, 1, 12288, 96
    # Korthikanti Eq. 1 assumes dropout (two 1-byte masks, 2sbh) and materialised attention
    # scores (5as²b). Our GPT has no dropout and uses SDPA, whose flash kernel keeps q, k, v,
    # the output and a fp32 log-sum-exp instead: 32sbh + 4asb. Both omit the LayerNorms'
    # fp32 per-token statistics (mean, rstd: at most 2 norms × 2 × 4 bytes per token).
    ln_stats = 2 * 2 * 4 * s * b
    flash = closed_forms.layer_activation_bytes_flash_no_dropout(s=s, b=b, h=h, a=a)
    assert flash <= block.saved_bytes <= flash + ln_stats
    korthikanti = closed_forms.layer_activation_bytes(s=s, b=b, h=h, a=a)
    adjusted = korthikanti - 2 * s * b * h - 5 * a * s * s * b + 4 * a * s * b
    assert adjusted <= block.saved_bytes <= adjusted + ln_stats
    assert block.count == 96 and len(gpt3.layer_types()) == 3
    assert gpt3.traced_blocks == 3


def test_node_annotations(gpt3) -> None:
    nodes = list(gpt3.gm.graph.nodes)
    for key in (
        "shape",
        "dtype",
        "fwd_flops",
        "bwd_flops",
        "saved_bytes",
        "param_bytes",
        "module",
        "layer",
        "layer_type",
    ):
        assert all(f"autopar.{key}" in n.meta for n in nodes if n.op != "output"), key
    linears = [
        n for n in nodes if "linear" in str(n.target) and n.meta["autopar.module"] == "blocks.5.attn.c_attn"
    ]
    assert len(linears) == 1
    n = linears[0]
    assert n.meta["autopar.shape"] == (1, 2048, 3 * 12288)
    assert n.meta["autopar.fwd_flops"] == 2 * 2048 * 12288 * 3 * 12288
    assert n.meta["autopar.bwd_flops"] == 2 * n.meta["autopar.fwd_flops"]
    assert n.meta["autopar.layer"] == 6 and n.meta["autopar.layer_type"] == "Block"
    weights = [m for m in nodes if m.op == "get_attr" and m.target == "blocks.95.mlp.c_fc.weight"]
    assert weights[0].meta["autopar.param_bytes"] == 4 * 12288 * 12288 * 2


def _small_gpt(n_layer: int = 6) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=96, block_size=32))


def test_spliced_graph_equals_full_trace_and_model() -> None:
    model = _small_gpt()
    idx = torch.randint(0, 96, (2, 32))
    spliced = capture(model, batch=2, seq=32)
    assert spliced.traced_blocks == 3
    full_gm = annotate_costs(export_graph(model, (idx,), {}))
    full_layers = group_layers(full_gm, "blocks")
    assert [(x.name, x.type, x.params, x.fwd_flops, x.bwd_flops, x.saved_bytes) for x in spliced.layers] == [
        (x.name, x.type, x.params, x.fwd_flops, x.bwd_flops, x.saved_bytes) for x in full_layers
    ]
    assert len(spliced.gm.graph.nodes) == len(full_gm.graph.nodes)
    with torch.no_grad():
        assert torch.equal(spliced.gm(idx), model(idx))  # runs on the model's own weights
    used = {n.target for n in spliced.gm.graph.nodes if n.op == "get_attr"}
    assert {id(model.get_parameter(str(t))) for t in used} == {id(p) for p in model.parameters()}


class MathAttentionLM(nn.Module):
    """A GPT with explicit attention (matmul + softmax): every FLOP is a matmul PyTorch counts."""

    def __init__(self, n_layer: int = 5, h: int = 32, heads: int = 4, V: int = 50, T: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(V, h)
        self.qkv = nn.ModuleList([nn.Linear(h, 3 * h) for _ in range(n_layer)])
        self.out = nn.Linear(h, V)
        # buffer sliced by the input length: symbolic_trace can't do this
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.emb(idx)
        for qkv in self.qkv:
            q, k, v = qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
            x = x + (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.out(x)


def test_step_flops_match_pytorch_flop_counter_on_real_backward() -> None:
    torch.manual_seed(0)
    model = MathAttentionLM()
    idx = torch.randint(0, 50, (2, 16))
    cap = capture(model, batch=2, seq=16)
    with FlopCounterMode(display=False) as counter:
        model(idx).sum().backward()
    assert cap.step_flops == counter.get_total_flops()
    with torch.no_grad():
        assert torch.equal(cap.gm(idx), model(idx))


class OnesMaskLM(nn.Module):
    """Builds its causal mask with torch.ones(T, T) from the input shape."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        mask = torch.tril(torch.ones(T, T, device=idx.device))
        x = self.emb(idx)
        for blk in self.blocks:
            x = x + mask @ blk(x)
        return x


def test_models_symbolic_trace_cannot_handle_are_captured() -> None:
    model = OnesMaskLM()
    with pytest.raises(Exception):  # noqa: B017 - the reason we don't use symbolic_trace
        torch.fx.symbolic_trace(model)
    idx = torch.randint(0, 40, (3, 7))
    cap = capture(model, batch=3, seq=7)
    with torch.no_grad():
        assert torch.equal(cap.gm(idx), model(idx))
    assert [layer.name for layer in cap.layers] == ["embed", "blocks.0", "blocks.1", "head"]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.gate = Gate()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gate(self.emb(idx))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python branch on a tensor value
            return x * 2
        return x


def test_uncapturable_model_gets_a_clear_error() -> None:
    with torch.device("meta"):
        model = Branchy()
    with pytest.raises(CaptureError) as info:
        capture(model, batch=1, seq=4)
    msg = str(info.value)
    assert "module 'gate' (Gate)" in msg
    assert "test_capture.py:" in msg and "if x.sum() > 0" in msg
    assert "torch.where" in msg
    assert "\n" not in msg


def test_identical_blocks_share_a_layer_type_and_llama_on_meta() -> None:
    cfg = LlamaConfig(n_layer=7, dim=64, n_head=8, n_kv_head=2, ffn_dim=96, vocab_size=128, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(cfg)
    cap = capture(model, batch=2, seq=48)
    types = cap.layer_types()
    assert list(types) == ["embed", "TransformerBlock", "head"]
    assert types["TransformerBlock"].count == 7
    assert cap.total_params == sum(p.numel() for p in model.parameters())
    # every block's FLOPs: 2·tokens·(params of the block) + attention 4·B·s²·dim
    tokens = 2 * 48
    block_params = types["TransformerBlock"].params - 2 * 64  # RMSNorm weights do no matmul
    assert types["TransformerBlock"].fwd_flops == 2 * tokens * block_params + 4 * 2 * 48 * 48 * 64


@pytest.mark.parametrize("name", ["gpt2", "megatron-1t", "llama3-405b", "mixtral-8x7b"])
def test_zoo_models_capture_on_meta(name: str) -> None:
    model = build(name)
    cap = capture(model, batch=1, seq=128)
    blocks = [layer for layer in cap.layers if layer.name not in ("embed", "head")]
    assert len(blocks) == len(next(m for m in model.modules() if isinstance(m, nn.ModuleList)))
    assert len(cap.layer_types()) == 3
    assert cap.total_params == sum(layer.params for layer in cap.layers)
    # 6·tokens·(parameters a token passes through) (Kaplan et al. 2020), plus attention
    params = model.named_parameters(remove_duplicate=False)  # a tied lm_head counts here
    active = sum(p.numel() for n, p in params if not n.startswith(("wte", "wpe", "tok_emb")))
    if name.startswith("mixtral"):  # top-2 of 8 experts: 3/4 of expert weights idle per token
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        active -= experts * 3 // 4
    assert 6 * 128 * active <= cap.step_flops <= 1.1 * 6 * 128 * active


def test_causal_attention_kernel_flops_are_about_half() -> None:
    """A causal flash kernel computes the key blocks on and below the diagonal: (s + 1)/(2s) of
    the s² products (FlashAttention-2 §3.1.1), which time is priced from; model FLOPs (MFU's
    convention) keep the full count. An explicit mask is applied to every score: no saving."""
    from autopar.zoo import GPT, GPTConfig

    aten = torch.ops.aten
    for attention, share in (("sdpa", (16 + 1) / (2 * 16)), ("math", 1.0)):
        with torch.device("meta"):
            model = GPT(
                GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, attention=attention)
            )
        cap = capture(model, batch=2, seq=16)
        core = [
            n
            for n in cap.gm.graph.nodes
            if n.target in (aten.scaled_dot_product_attention.default, aten.matmul.default)
            and n.meta.get("autopar.layer") == 1
        ]
        assert core
        for n in core:
            assert n.meta["autopar.kernel_flops"] == round(n.meta["autopar.fwd_flops"] * share)
    linear = next(n for n in cap.gm.graph.nodes if n.target == aten.linear.default)
    assert linear.meta["autopar.kernel_flops"] == linear.meta["autopar.fwd_flops"]


def test_hugging_face_moe_captures_on_meta_with_its_routed_experts_flops() -> None:
    """Mixtral and Qwen2-MoE as shipped (Hugging Face's grouped experts: ``torch._grouped_mm``,
    its token counts by an integer ``histc`` when traced on the meta device): captured, each
    token's k experts priced 2·(H·2I + I·H) FLOPs apiece."""
    from autopar.zoo import hf

    for name, experts_ffn in (("mixtral", 128), ("qwen2-moe", 32)):
        with torch.device("meta"):
            model = hf.family(name, seq=16).to(torch.bfloat16)
        cap = capture(model, batch=2, seq=16)
        grouped = [
            n.meta["autopar.fwd_flops"]
            for n in cap.gm.graph.nodes
            if n.target is torch.ops.aten._grouped_mm.default and n.meta.get("autopar.layer") == 1
        ]
        tokens, k, h = 2 * 16, 2, 64
        assert sum(grouped) == 2 * tokens * k * (h * 2 * experts_ffn + experts_ffn * h), name


def test_a_graph_its_fake_cpu_kernels_refuse_is_one_line() -> None:
    """An operator that traces on the meta device but fails on the fake CPU tensors costs are
    priced with: a CaptureError naming the node."""

    @torch.library.custom_op("autopar_test::meta_only", mutates_args=())
    def meta_only(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @meta_only.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            raise RuntimeError("meta_only has no CPU kernel\nsecond line")
        return torch.empty_like(x)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.w = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w(meta_only(self.e(x)))

    with torch.device("meta"):
        model = M()
    with pytest.raises(CaptureError, match=r"pricing its graph failed at %meta_only.*no CPU kernel") as e:
        capture(model, batch=1, seq=4)
    assert "\n" not in str(e.value)


class NoGradScaleLM(nn.Module):
    """Computes a scale of its stream under ``torch.no_grad()`` (as PhiMoE's router does), in
    each block: the captured graph must compute it and pass no gradient back through it."""

    def __init__(self, autocast: bool = False) -> None:
        super().__init__()
        self.autocast = autocast
        self.emb = nn.Embedding(40, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.scales = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk, scale in zip(self.blocks, self.scales, strict=True):
            if self.autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    s = scale(x)
            else:
                with torch.no_grad():
                    s = torch.sigmoid(scale(x))  # a float tensor leaving the region
            x = x + blk(x) * s
        return x


def test_no_grad_regions_are_inlined_and_pass_no_gradient() -> None:
    torch.manual_seed(0)
    model = NoGradScaleLM().double()
    idx = torch.randint(0, 40, (3, 7))
    cap = capture(model, batch=3, seq=7)
    assert not any("wrap_with" in str(n.target) for n in cap.gm.graph.nodes)
    ours = cap.gm(idx)
    ours.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    theirs = model(idx)
    theirs.square().sum().backward()
    assert torch.equal(ours, theirs)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(grads)
    assert not any(name.startswith("scales.") for name in grads)  # no gradient through the region
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12)


def test_an_autocast_region_is_refused_in_one_line() -> None:
    with pytest.raises(CaptureError, match=r"torch\.autocast") as info:
        capture(NoGradScaleLM(autocast=True), batch=1, seq=4)
    assert "\n" not in str(info.value)
