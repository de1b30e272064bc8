"""Per-architecture differences in one small adapter.

Why: the backend runs the decoder layer loop itself (so accelerations can stop early, swap layers or
add steering vectors between layers), which means it touches the embedding, rotary, final norm and
head modules directly. Those names are the same across the Llama family; anything that is not gets
a clear error here instead of silently wrong numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from branchwise.backends.hf.prepack import PackedLinear

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class DecoderParts:
    """The modules the layer loop needs, plus the attention geometry."""

    embed: nn.Embedding
    layers: nn.ModuleList
    rotary: nn.Module
    norm: nn.Module
    head: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Return the pieces of a supported causal LM, or raise naming what is unsupported."""
    # a transformers config and decoder: attributes by architecture, which torch's typing cannot see
    config: Any = model.config
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"model_type={model_type!r} is not supported by the local backend; supported: {', '.join(SUPPORTED)}"
        )
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(
            f"{model_type} with use_sliding_window=True is not supported (the shared-prefix attention is full attention)"
        )
    base: Any = model.model
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return DecoderParts(
        embed=base.embed_tokens,
        layers=base.layers,
        rotary=base.rotary_emb,
        norm=base.norm,
        head=cast(nn.Module, model.lm_head),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
    )


def linear_params(module: nn.Module) -> int:
    """Weights of a linear layer, plain or packed (`prepack.PackedLinear`); 0 for anything else.

    Read from the shapes, never from `.weight`: a packed layer's weight is an unpacked copy."""
    if isinstance(module, nn.Linear | PackedLinear):
        return int(module.in_features) * int(module.out_features)
    return 0


def kv_bytes_per_token(parts: DecoderParts, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token over all layers."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return 2 * parts.n_layers * parts.n_kv_heads * parts.head_dim * itemsize
