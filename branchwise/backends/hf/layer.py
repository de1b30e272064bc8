"""One decoder layer of the supported architectures, computed without transformers' module plumbing.

Why: at one or a few rows per step a CPU decode step is, besides its linear products, a few hundred
small tensor operations per layer, and each costs its dispatch more than its arithmetic. The
transformers layer adds to the arithmetic five module calls with their hook machinery, keyword
plumbing through deprecation wrappers, a lookup of the attention function and an RMSNorm of eight
operations. `forward` below does the same arithmetic in the same order (the linear layers are still
the model's own modules, packed or quantized as they are), with the norm as one fused operation that
rounds identically: outputs are bitwise equal to the transformers layer's (the tests check every
supported architecture). Measured on a 2-core CPU: B=1 decode ~7 % faster, B=8 ~4 %.

It runs only where it is the same computation by construction: a layer of the four classes below,
whose norms are the classes below, on a CPU (a GPU's fused norm kernel may round differently, and
nothing here has been measured on one), and with no forward hook on the layer or any module in it
and no global module hook (a hook someone registered must run: such a layer takes the transformers
path). `Lean` decides once per forward; everything else runs the layer module itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from branchwise.backends.hf.attention import AttentionContext

LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer"})
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama-family RMSNorm (statistics in float32, weight applied in the input's dtype)
    as one fused operation."""
    y = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` [B, H, q, D] with cos/sin [B, 1, q, D], as transformers computes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def forward(
    layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
) -> torch.Tensor:
    """The layer's output for hidden states `x` [B, q, d] (see the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    b, q, _ = x.shape
    heads = (b, q, -1, attn.head_dim)
    h = rms_norm(layer.input_layernorm, x)
    query = attn.q_proj(h).view(heads)
    key = attn.k_proj(h).view(heads)
    if hasattr(attn, "q_norm"):  # Qwen3: an RMSNorm over each head before the rotary embedding
        query, key = rms_norm(attn.q_norm, query), rms_norm(attn.k_norm, key)
    value = attn.v_proj(h).view(heads).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    query, key = rotate(query.transpose(1, 2), cos, sin), rotate(key.transpose(1, 2), cos, sin)
    out = ctx.attend(attn.layer_idx, query, key, value, attn.scaling)
    x = x + attn.o_proj(out.reshape(b, q, -1))
    h = rms_norm(layer.post_attention_layernorm, x)
    return x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))


def _norms(layer: Any) -> Iterable[nn.Module]:
    attn = layer.self_attn
    yield layer.input_layernorm
    yield layer.post_attention_layernorm
    if hasattr(attn, "q_norm"):
        yield attn.q_norm
        yield attn.k_norm


class Lean:
    """Which layers `forward` may compute (see the module docstring); built once per model."""

    def __init__(self, layers: Iterable[nn.Module], device: torch.device) -> None:
        self.enabled = True
        """False runs every layer through transformers (what `benchmarks/decode.py` compares with)."""
        self.modules: dict[int, list[nn.Module]] = {}
        """Per eligible layer (by id): every module in it, whose hooks are checked per forward."""
        if device.type != "cpu":
            return
        for layer in layers:
            if type(layer).__name__ in LAYERS and all(type(n).__name__ in NORMS for n in _norms(layer)):
                self.modules[id(layer)] = list(layer.modules())

    def layers(self) -> set[int]:
        """Ids of the layers `forward` computes now: eligible ones with no hook in them."""
        if (
            not self.enabled
            or torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks
            or torch_module._global_forward_hooks_always_called
        ):
            return set()
        return {
            key
            for key, modules in self.modules.items()
            if not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
        }
