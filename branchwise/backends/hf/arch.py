"""A decoder described from its loaded modules and config, whatever its family.

Why: the backend runs the decoder's layer loop itself (so accelerations can stop early, swap
layers or add steering vectors between layers), which means it does what the model's own forward
does outside its layers: the embedding, the rotary tables, the final norm, the head and whatever
the family does to the logits. Inside a layer everything stays transformers' code (norms before or
after, QK-norm, fused or parallel projections, biases, partial rotary, multipliers), with the
attention function registered in `attention.py` doing the attending: the layer passes it the
window, soft-cap and scale the family asks for.

So a family is described by what its modules and config say, not by a list of names:
- the layers are the base model's `ModuleList` of `num_hidden_layers` modules; the final norm is
  the base model's norm by any of the names transformers uses (`FINAL_NORMS`);
- rotary tables come from the base model's rotary module, one per layer type where it takes a
  `layer_type` (local and global layers with their own bases, e.g. Gemma 3's
  `rope_local_base_freq`);
- what the family's forward does outside its layers is read from config fields (`embedding_multiplier`,
  `logits_scaling`, `logit_scale`, `final_logit_softcapping`); a scaled embedding (Gemma's sqrt of
  the hidden size) is the embedding module's own.

What the backend cannot honour exactly is refused from the config alone, before any weights load
(`check_config`): attention that does not go through transformers' attention interface (ALiBi
models among them), ALiBi or chunked attention fields, cross-attention, encoder-decoders, positions
that are not rotary, and forward-level fields this description does not apply (`REFUSED_FIELDS`).
A model whose layers want more than hidden states and rotary tables is refused when described.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from branchwise.backends.hf.prepack import PackedLinear

FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f")
"""Names transformers' decoders give the norm after their last layer."""
LAYER_ARGS = frozenset({"hidden_states", "attention_mask", "position_ids", "position_embeddings"})
"""What the layer loop passes a decoder layer (besides keyword arguments it forwards to attention)."""

LAYER_CONTEXT: ContextVar[object | None] = ContextVar("branchwise_layer_context", default=None)
"""The attention context of the layer the backend's loop runs now (`DecoderParts.run_layer`); None
outside it (`model.generate()` attends as transformers does)."""

REFUSED_FIELDS: dict[str, str] = {
    "alibi": "ALiBi position biases",
    "use_alibi": "ALiBi position biases",
    "attention_chunk_size": "chunked (local block) attention",
    "add_cross_attention": "cross-attention",
    "cross_attention_layers": "cross-attention",
    "scale_emb": "an embedding scale applied in the model's forward",
    "dim_model_base": "a hidden-state scale before the head",
    "kv_lora_rank": "multi-head latent attention (keys and values of other widths than the heads)",
}
"""Config fields that change attention or the forward outside the layers in a way the backend does
not reproduce: a truthy value is refused, naming the field and what it asks for."""


REFUSED_TYPES: dict[str, str] = {
    "gpt_oss": "attention sinks (a learned sink logit per head, passed as s_aux)"
}
"""Families whose attention adds what no config field names: refused by `model_type`."""


def check_config(config: Any, cls: Any = None) -> None:
    """Refuse, from the config alone (before any weights load), a model whose computation the
    backend cannot reproduce exactly; the error names the missing piece and the config field.
    `cls` is the model's class where it is known (else transformers' causal LM class of the config)."""
    model_type = getattr(config, "model_type", "?")
    prefix = f"model_type={model_type!r} cannot run on the local backend:"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{prefix} an encoder-decoder (config.is_encoder_decoder=True); only decoder-only models run"
        )
    if model_type in REFUSED_TYPES:
        raise ValueError(f"{prefix} {REFUSED_TYPES[model_type]} is not supported")
    for name, what in REFUSED_FIELDS.items():
        if getattr(config, name, None):
            raise ValueError(f"{prefix} {what} (config.{name}={getattr(config, name)!r}) is not supported")
    if getattr(config, "position_embedding_type", "rotary") not in ("rotary", "rope"):
        raise ValueError(
            f"{prefix} position_embedding_type={config.position_embedding_type!r}; only rotary positions run"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = cls or MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise ValueError(
            f"{prefix} transformers has no causal LM class for its config ({type(config).__name__})"
        )
    # transformers' own check (its modeling source calls the attention interface); the backend's
    # KV layout lives behind that interface, so attention written inline is never reached
    if not cls._can_set_attn_implementation():
        raise ValueError(
            f"{prefix} its attention ({cls.__name__}) does not go through transformers' attention interface "
            "(e.g. ALiBi or attention written inline), so the backend's shared-prefix attention cannot run it"
        )

    if getattr(config, "rope_parameters", None) is None:
        raise ValueError(
            f"{prefix} its positions are not rotary (config.rope_parameters is None: learned or absolute "
            "position embeddings added in the model's forward are not supported)"
        )


@dataclass
class Rope:
    """The rotary tables of one forward: `(cos, sin)` per layer type (None: one table for all)."""

    pos: torch.Tensor
    tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]]

    def select(self, keep: torch.Tensor) -> Rope:
        """The tables of rows `keep` only (rows left the batch between layers)."""
        return Rope(self.pos[keep], {k: (c[keep], s[keep]) for k, (c, s) in self.tables.items()})


@dataclass(frozen=True)
class Rotary:
    """The model's rotary module, asked once per layer type that has a table of its own."""

    module: nn.Module
    kinds: tuple[str | None, ...]
    """The layer types with a table of their own ((None,): one table for every layer)."""

    def __call__(self, h: torch.Tensor, pos: torch.Tensor) -> Rope:
        if self.kinds == (None,):
            return Rope(pos, {None: self.module(h, pos)})
        return Rope(pos, {kind: self.module(h, pos, kind) for kind in self.kinds})


@dataclass(frozen=True)
class DecoderParts:
    """The modules the layer loop needs, the attention geometry, and what the family's forward
    does around its layers (see the module docstring)."""

    embed: nn.Embedding
    layers: nn.ModuleList
    rotary: Rotary
    norm: nn.Module
    head: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str | None, ...] = ()
    """Each layer's rotary table (its layer type where types have their own; else None)."""
    logit_scale: float = 1.0
    """What the logits are multiplied by (Granite's 1 / `logits_scaling`, Cohere's `logit_scale`)."""
    logit_softcap: float | None = None
    """`cap * tanh(logits / cap)` after the scale (Gemma 2 and 3's `final_logit_softcapping`)."""
    keywords_dropped: bool = False
    """Whether the layers call their attention without the keywords they were given (StableLM's):
    the attention context then travels in `LAYER_CONTEXT` (`keywords_dropped_by`)."""
    sliding_window: int | None = None
    """The config's sliding window (layers pass theirs to attention; past it, the fixed-shape step
    attends those layers through `attention.exact_attention`)."""
    _kind_of: dict[int, str | None] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def kind(self, block: nn.Module) -> str | None:
        """The rotary table of `block`: a backbone layer, or a copy of one (River's quantized
        layers) found by the `layer_idx` its attention keeps."""
        if len(self.rotary.kinds) == 1:
            return self.rotary.kinds[0]
        key = id(block)
        if key not in self._kind_of:
            index = next(i for m in block.modules() if isinstance(i := getattr(m, "layer_idx", None), int))
            self._kind_of[key] = self.layer_kinds[index]
        return self._kind_of[key]

    def run_layer(self, block: nn.Module, h: torch.Tensor, rope: Rope, ctx: object) -> torch.Tensor:
        """`block` over hidden states `h`, attending through `ctx` (`attention.AttentionContext`):
        passed as a keyword the layer hands on to its attention, or, for layers that hand their
        attention none (`keywords_dropped`), held in `LAYER_CONTEXT` while the layer runs."""
        kwargs = {
            "position_ids": rope.pos,
            "position_embeddings": rope.tables[self.kind(block)],
            "bw_ctx": ctx,
        }
        if not self.keywords_dropped:
            out = block(h, attention_mask=None, **kwargs)
        elif torch.compiler.is_compiling():  # a context variable is not traceable: the step runs uncompiled
            raise RuntimeError(
                f"{type(block).__name__} hands its attention no keywords: a compiled step cannot reach the batch's KV"
            )
        else:
            token = LAYER_CONTEXT.set(ctx)
            try:
                out = block(h, attention_mask=None, **kwargs)
            finally:
                LAYER_CONTEXT.reset(token)
        return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)

    def logits(
        self, normed: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Logits from final-norm hidden states, by `head` (None: the model's), scaled and
        soft-capped as the family's forward does."""
        return self.finish((head or self.head)(normed))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """What the family's forward does to the head's output (`logit_scale`, `logit_softcap`)."""
        if self.logit_scale != 1.0:
            out = out * self.logit_scale
        if self.logit_softcap is not None:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out


class ScaledEmbedding(nn.Embedding):
    """An embedding whose output the family's forward multiplies (Granite's `embedding_multiplier`),
    sharing the model's weight so the parts read what the model holds."""

    def __init__(self, inner: nn.Embedding, scale: float) -> None:
        super().__init__(inner.num_embeddings, inner.embedding_dim, inner.padding_idx, _weight=inner.weight)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


def _layers(base: nn.Module, n_layers: int) -> nn.ModuleList:
    for child in base.children():
        if isinstance(child, nn.ModuleList) and len(child) == n_layers:
            return child
    raise ValueError(
        f"{type(base).__name__} has no ModuleList of {n_layers} decoder layers (config.num_hidden_layers)"
    )


def _check_layer(block: nn.Module) -> None:
    """A layer must take what the loop gives it: hidden states and rotary tables (anything else it
    requires, e.g. per-layer inputs computed in the model's forward, the loop does not have)."""
    params = inspect.signature(block.forward).parameters.values()
    missing = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in LAYER_ARGS
    ]
    if missing or "position_embeddings" not in {p.name for p in params}:
        raise ValueError(
            f"{type(block).__name__} wants {', '.join(missing) or 'no rotary tables'}: the backend's layer "
            "loop passes hidden states and rotary tables only"
        )


def keywords_dropped_by(block: nn.Module) -> bool:
    """Whether a layer's forward takes keywords but never hands them on (its source names
    `**kwargs` once: in its signature). Read from the source, as transformers itself decides
    whether a model's attention can be swapped; a layer whose source cannot be read is taken to
    drop them (the context variable reaches its attention either way)."""
    try:
        source = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return True
    return source.count("**kwargs") < 2


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Describe a causal LM from its modules and config, or raise naming what is unsupported."""
    # a transformers config and decoder: attributes by architecture, which torch's typing cannot see
    config: Any = model.config
    check_config(config, type(model))
    loaded: Any = model
    base: Any = loaded.base_model
    layers = _layers(base, config.num_hidden_layers)
    _check_layer(layers[0])
    norm = next(
        (getattr(base, n) for n in FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module)), None
    )
    rotary = getattr(base, "rotary_emb", None)
    if norm is None or rotary is None:
        missing = (
            "a final norm (" + ", ".join(FINAL_NORMS) + ")"
            if norm is None
            else "a rotary module (rotary_emb)"
        )
        raise ValueError(f"{type(base).__name__} has no {missing}")
    types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * len(layers))
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    kinds: tuple[str | None, ...] = tuple(sorted(set(types))) if per_type else (None,)
    embed = loaded.get_input_embeddings()
    multiplier = float(getattr(config, "embedding_multiplier", None) or 1.0)
    if multiplier != 1.0:
        embed = ScaledEmbedding(embed, multiplier)
    scale = float(getattr(config, "logit_scale", None) or 1.0) / float(
        getattr(config, "logits_scaling", None) or 1.0
    )
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return DecoderParts(
        embed=embed,
        layers=layers,
        rotary=Rotary(rotary, kinds),
        norm=norm,
        head=cast(nn.Module, loaded.get_output_embeddings()),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        layer_kinds=types if per_type else (None,) * len(layers),
        logit_scale=scale,
        logit_softcap=getattr(config, "final_logit_softcapping", None),
        keywords_dropped=keywords_dropped_by(layers[0]),
        sliding_window=getattr(config, "sliding_window", None),
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
