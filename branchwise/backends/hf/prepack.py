"""Linear layers with weights packed once for the CPU's matrix kernels (oneDNN).

Why: a decode step is a chain of small matrix-vector products over every weight of the model, so
on a CPU its speed is how fast the weights stream from memory. `torch.nn.functional.linear` on a
plain row-major weight reaches only part of that bandwidth for a few rows at a time (measured
on a 2-core AVX2 machine: 6-8 GB/s against 17 GB/s for a plain sum over the same bytes), because
the BLAS call re-derives its blocking every time and walks the weight in an order the prefetcher
does not follow well. oneDNN can reorder a weight once into the blocked layout its kernels
read best; the same products then run 1.3x faster at one row and 1.7-3x faster at 4-64 rows (what
batched branches and concurrent requests feed). vLLM's CPU backend does the same thing
(`onednn_mm` over prepacked weights).

The packing is done in place, on the model's own modules, so every path through the model —
branchwise's layer loop, `model.generate()` (the `hf_generate` baseline), an acceleration's
copy of a layer — computes the same products. Only CPU tensors of a dtype oneDNN supports here
are packed (float32; bfloat16 where the CPU has native bf16), and nothing on a GPU.

Siblings fed the same input are packed as one product (`FusedLinear`): a layer's query, key and
value projections, and its MLP's gate and up projections (`SIBLINGS`, the names transformers'
decoder families use; a model with other names keeps one product per layer). Each oneDNN call
has a fixed cost, and one wider product streams the same weights in fewer calls: a pass over
SmolLM2-135M's weights took 15.6 ms against 16.9 at one row, 16.4 against 18.5 at eight (2 cores,
float32, `benchmarks/linear_kernels.py`), the grouping vLLM's merged q/k/v and gate/up layers make.

Cost: a tied input embedding keeps its plain weight for the lookup while the LM head gets a packed
copy (`Prepacked.extra_bytes` says how much). Results differ from the unpacked products by
floating-point reassociation only (a different summation order), the same order of difference as
between batch sizes of the BLAS call.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "SIBLINGS",
    "FusedLinear",
    "PackedLinear",
    "Prepacked",
    "SharedProduct",
    "SiblingSlice",
    "packed_product",
    "plain",
    "prepack",
    "prepack_support",
    "sibling_groups",
    "stacked",
]

SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling linear layers that read the same input, packed as one product each."""


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("branchwise::packed_product", mutates_args=())
def packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """`x @ W.T + bias` over a oneDNN-packed `W`, as one opaque operation for `torch.compile`.

    Why: inductor lowers oneDNN's linear only over weights it packed itself (freezing, which keeps
    a packed copy of every weight per compiled graph) and fails on a weight packed before; called
    through this op, the compiled step calls the same kernel on the same packed weight, and fuses
    everything between the products."""
    return _product(x, packed, bias)


@packed_product.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _apply(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
) -> torch.Tensor:
    flat = x.reshape(-1, in_features)
    if torch.compiler.is_compiling():
        out = packed_product(flat, packed, bias, out_features)
    else:  # eagerly the op itself: a custom op's dispatch costs ~10 us a call, ~2 ms a step
        out = _product(flat, packed, bias)
    return out.reshape(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear`'s product over a weight reordered once for oneDNN (see the module docstring).

    `weight` is still readable (an unpacked copy, made on each access): code that inspects or
    quantizes a layer at setup keeps working; nothing on the hot path reads it.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(x, self.packed, self.bias, self.in_features, self.out_features)

    def unpacked(self) -> nn.Linear:
        """A plain `nn.Linear` with the same weight (for code that needs one, e.g. quantization)."""
        weight = self.weight
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, dtype=weight.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        # the packed weight is never written after packing (and oneDNN's opaque tensors cannot be
        # deep-copied): copies share it, as they would share a frozen buffer
        clone = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(clone)
        clone.in_features, clone.out_features = self.in_features, self.out_features
        clone.packed = self.packed
        clone.bias = copy.deepcopy(self.bias, memo)
        return clone

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


_PENDING: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
"""Each sibling group's last input, its product and how many siblings have yet to take their part,
by the group's id: one dict for the process, empty between forwards, rather than state on each
group, which a compiled step would re-write attribute by attribute after every call (measured:
5 ms a step for 60 groups). A forward that raised between siblings leaves its entry (two
activations, never the group and its weights) until the group's next input replaces it."""


class SharedProduct:
    """The product of sibling layers fed the same input, computed once per input by `compute`.

    The siblings read the same tensor object one after another (`self.q_proj(h)`, `self.k_proj(h)`,
    ...): the first computes the whole product and each later one takes it; any other call computes
    it anew, so a sibling called alone is never wrong."""

    def __init__(self, count: int, compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.count = count
        self.compute = compute

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole product for `x`, computed once per input, whichever sibling asks first."""
        key = id(self)
        held = _PENDING.get(key)
        if held is not None and held[0] is x:
            if held[2] == 1:  # the last sibling: hold nothing between forwards
                del _PENDING[key]
            else:
                _PENDING[key] = (x, held[1], held[2] - 1)
            return held[1]
        out = self.compute(x)
        _PENDING[key] = (x, out, self.count - 1)
        return out


class _Siblings(SharedProduct):
    """The packed product of sibling layers (`FusedLinear`)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        whole = stacked(linears)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(whole.weight, None)
        self.bias = None if whole.bias is None else whole.bias.detach()
        self.in_features = whole.in_features
        self.out_features = whole.out_features
        super().__init__(len(linears), self._packed_product)

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(x, self.packed, self.bias, self.in_features, self.out_features)


class FusedLinear(PackedLinear):
    """One of sibling linear layers packed as one product (see the module docstring): its output is
    its slice of the product, which the first sibling to read an input computes for all of them."""

    def __init__(self, siblings: _Siblings, start: int, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.siblings = siblings
        self.start = start

    @property
    def bias(self) -> torch.Tensor | None:  # type: ignore[override]
        b = self.siblings.bias
        return None if b is None else b[self.start : self.start + self.out_features]

    @property
    def weight(self) -> torch.Tensor:
        return self.siblings.packed.to_dense()[self.start : self.start + self.out_features]

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features * self.siblings.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.siblings.product(x)[..., self.start : self.start + self.out_features]

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedLinear:
        # copies share the siblings' packed product (see PackedLinear.__deepcopy__); the input
        # check keeps a copy's calls apart from the original's
        clone = FusedLinear.__new__(FusedLinear)
        nn.Module.__init__(clone)
        clone.in_features, clone.out_features = self.in_features, self.out_features
        clone.siblings, clone.start = self.siblings, self.start
        return clone

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused with {self.siblings.count - 1} siblings"


class SiblingSlice(nn.Module):
    """One sibling's columns of the product its group computes once per input, where one module
    (`whole`: a quantized copy of the group's stacked weights, say) computes the whole product."""

    def __init__(self, whole: nn.Module, shared: SharedProduct, start: int, linear: nn.Linear) -> None:
        super().__init__()
        self.whole = whole  # a submodule of every slice: `modules()` yields it once
        self.shared = shared
        self.start = start
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    @classmethod
    def group(cls, whole: nn.Module, linears: list[nn.Linear]) -> list[SiblingSlice]:
        """The slices of `whole`, a module computing `linears`' stacked product, one per linear."""
        shared = SharedProduct(len(linears), whole)
        starts = itertools.accumulate((m.out_features for m in linears[:-1]), initial=0)
        return [cls(whole, shared, start, m) for start, m in zip(starts, linears, strict=True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.product(x)[..., self.start : self.start + self.out_features]


def stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One `nn.Linear` whose weight (and bias) are `linears`' stacked along the outputs: the whole
    product of siblings, for a kernel or quantizer that should see it as one matrix."""
    first = linears[0]
    out = sum(m.out_features for m in linears)
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        linear = nn.Linear(first.in_features, out, bias=first.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if first.bias is not None:
            bias = torch.cat([cast(torch.Tensor, m.bias).detach() for m in linears])
            linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def sibling_groups(parent: nn.Module) -> Iterator[tuple[tuple[str, ...], list[nn.Linear]]]:
    """Each complete group of `SIBLINGS` among `parent`'s plain linear children that can be one
    product (the same input width, dtype and bias presence): its names and its layers."""
    for names in SIBLINGS:
        linears = [getattr(parent, name, None) for name in names]
        if not all(type(m) is nn.Linear for m in linears):
            continue
        group = cast("list[nn.Linear]", linears)
        first = group[0]
        if all(
            m.in_features == first.in_features
            and m.weight.dtype == first.weight.dtype
            and (m.bias is None) == (first.bias is None)
            for m in group
        ):
            yield names, group


def _fuse_siblings(parent: nn.Module) -> int:
    """Replace each group of `sibling_groups` by `FusedLinear`s; returns how many layers were replaced."""
    replaced = 0
    for names, group in list(sibling_groups(parent)):
        siblings = _Siblings(group)
        start = 0
        for name, linear in zip(names, group, strict=True):
            setattr(parent, name, FusedLinear(siblings, start, linear))
            start += linear.out_features
        replaced += len(group)
    return replaced


@dataclass(frozen=True)
class Prepacked:
    """What `prepack` did: how many layers it packed, the memory it added, or why it did nothing."""

    modules: int = 0
    fused: int = 0
    """Of `modules`, those packed with their siblings as one product (`FusedLinear`)."""
    extra_bytes: int = 0
    reason: str | None = None
    """Why nothing was packed (None when something was)."""

    @property
    def active(self) -> bool:
        return self.modules > 0


def prepack_support(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights on `device` in `dtype` cannot be packed here (None: they can)."""
    if device.type != "cpu":
        return f"device {device.type}: packing is for CPU matrix kernels"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return f"dtype {dtype}: oneDNN packs float32 here (bfloat16 only on CPUs with native bf16)"


def prepack(model: nn.Module, layers: nn.ModuleList, head_name: str = "lm_head") -> Prepacked:
    """Replace every `nn.Linear` in `layers` and the LM head (`model.<head_name>`) by a
    `PackedLinear`, in place. Returns what was done; packs nothing where `prepack_support` says no."""
    param = next(model.parameters())
    reason = prepack_support(param.device, param.dtype)
    if reason is not None:
        return Prepacked(reason=reason)
    count = fused = 0
    for layer in layers:
        for parent in list(layer.modules()):
            fused += _fuse_siblings(parent)
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear(child))
                    count += 1
    extra = 0
    head = getattr(model, head_name, None)
    if type(head) is nn.Linear:
        # a model with an `lm_head` is a transformers one: nn.Module's type lacks its accessors
        embed = cast("PreTrainedModel", model).get_input_embeddings()
        tied = embed is not None and getattr(embed, "weight", None) is head.weight
        packed = PackedLinear(head)
        setattr(model, head_name, packed)
        count += 1
        if tied:  # the embedding keeps the plain weight for its lookup; the head has its own copy
            extra = packed.nbytes
    return Prepacked(modules=count + fused, fused=fused, extra_bytes=extra)


def plain(module: nn.Module) -> nn.Module:
    """`module` itself if nothing in it is packed, else a copy with every `PackedLinear` as a plain
    `nn.Linear` (for an acceleration that quantizes its own copy of a layer or of the head)."""
    if isinstance(module, PackedLinear):
        return module.unpacked()
    memo: dict[int, Any] = {id(m): m.unpacked() for m in module.modules() if isinstance(m, PackedLinear)}
    return copy.deepcopy(module, memo) if memo else module
