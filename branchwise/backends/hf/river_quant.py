"""Weight-only quantized copies of decoder layers: the layers River's exit river runs on.

Why its own module: the kernels, layouts and byte accounting are a subject of their own (and most of
the code); `river.py` only needs `build_river` and `resolve_kernel`. A quantized copy keeps its
backbone layer's `self_attn.layer_idx`, so its K/V lands in the backbone's cache slot.

Kernels (see `WeightOnlyLinear`; their speed is measured by `benchmarks/river.py`, not stated here):
- `weight_only` (what `auto` picks): weight-only quantization with bf16 activations, the paper's
  W8A16/W4A16. 8 bits = int8 with one scale per output row, 4 bits = group-wise asymmetric codes. On
  CPU 8 bits runs on branchwise's own kernel once it is built (`cpu_kernels.int8_linear`: float32
  activations, the codes widened as they stream; torch's bf16 one streamed them at half oneDNN's
  float32 speed on a CPU without native bf16), and both run on torch's fused kernels
  (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) otherwise, which
  beat the fp32 Linear at decode batch sizes (a few rows per call) and fall behind it on many rows
  (long prefills); where those cannot run (CUDA, odd shapes) the weight is dequantized per call and
  F.linear'd, which saves memory but costs time (an extra pass over the weight).
- `dynamic_int8`: torch's int8 dynamic-activation Linear (CPU, fp32 models only). The fastest at large
  batch and long prefills, but it quantizes activations too, and their outliers cost accuracy
  (next-token match ~0.95 vs ~0.995 for 8-bit weight-only), so it is used only when asked for.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.prepack import SiblingSlice, plain, sibling_groups, stacked

KERNELS = ("auto", "dynamic_int8", "weight_only", "torchao")


def torchao_available() -> bool:
    """Whether torchao (fused weight-only int4/int8 GPU kernels) can be imported."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


_INT4_CPU_GROUPS = (32, 64, 128, 256)  # the group sizes torch's fused CPU int4 kernel accepts
# `_weight_int8pack_mm`'s AVX2/AVX-512 bf16 kernel loads 16 activations / 16 codes per step with
# *aligned* vector loads and no tail loop: a row length that is not a multiple of 16, or an activation
# not 32-byte aligned, crashes the process (segfault, torch 2.13) instead of raising.
_INT8_CPU_K_MULTIPLE = 16
_BF16_ALIGN_BYTES = 32


def int4_cpu_kernel_ok(
    bits: int, group_size: int, in_features: int, out_features: int, device: torch.device
) -> bool:
    """Whether torch's fused CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) can run this Linear.

    Its constraints (checked on torch 2.13): group size 32/64/128/256 dividing in_features, and
    out_features divisible by 16. It is a private aten op, so its absence only disables the fast path.
    """
    return (
        bits == 4
        and device.type == "cpu"
        and group_size in _INT4_CPU_GROUPS
        and in_features % group_size == 0
        and out_features % 16 == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
    )


def int8_cpu_kernel_ok(bits: int, in_features: int, device: torch.device) -> bool:
    """Whether torch's fused CPU int8 weight-only kernel (`_weight_int8pack_mm`) can run this Linear.

    It takes int8 weights [out, in] with one scale per output row, and activations and scales of one
    dtype (fp32, fp16 or bf16 all accepted). Only bf16 is vectorized on x86 (fp32/fp16 take a scalar
    loop, far slower than the fp32 Linear), so the river always feeds it bf16; that
    vector kernel needs in_features % 16 == 0 (see `_INT8_CPU_K_MULTIPLE`). A private aten op: its
    absence only disables the fast path.
    """
    return (
        bits == 8
        and device.type == "cpu"
        and in_features % _INT8_CPU_K_MULTIPLE == 0
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    )


def _bf16_rows(x: Tensor, in_features: int) -> Tensor:
    """`x` as a contiguous, 32-byte aligned bf16 [rows, in_features] matrix for the fused kernels.

    Why the check: `.to(bfloat16)` copies fp32 inputs into a fresh (64-byte aligned) buffer, but a
    bf16 input is passed through as is, and it may be a view at an odd offset or with permuted
    strides, which the int8 kernel's aligned loads cannot take. Copying only then costs nothing in the
    common case.
    """
    flat = x.reshape(-1, in_features).to(torch.bfloat16)
    if flat.is_contiguous() and flat.data_ptr() % _BF16_ALIGN_BYTES == 0:
        return flat
    return flat.clone(memory_format=torch.contiguous_format)


class WeightOnlyLinear(nn.Module):
    """A Linear whose weight is stored quantized (8 or 4 bits), for the exit river.

    8 bits: symmetric, one scale per output row (per-channel), w ≈ q·scale with q ∈ [−127, 127] int8,
    scale = max|w_row| / 127; `group_size` is ignored (set to in_features, one group per row). Why
    per-row and symmetric: 255 levels already leave a half-step error of ~0.4 % of the row's largest
    weight, so groups and offsets would buy little, while this is exactly the layout of torch's fused
    int8 kernel (one int8 matrix, one scale vector) and measured lossless enough for the river
    (SmolLM2-135M: next-token match 0.995, KL 0.0013 against the backbone).

    4 bits: group-wise asymmetric, w ≈ offset + q·scale with q ∈ [0, 15] per group of `group_size`
    consecutive input weights of one output row (the HQQ/AWQ convention the paper's river uses).
    Why asymmetric: a group's [min, max] maps onto all 16 levels, so the rounding error is at most
    scale/2 with scale = (max − min)/15. A symmetric grid has to cover [−max|w|, max|w|] with an odd
    number of levels, which at 4 bits means a step up to ~2.1× larger for a skewed group; the price
    is one extra value per group (the offset): at group 64, 4 bytes (fp32) next to 32 bytes of codes.
    `group_size` ≥ `in_features` means one group per row. An `in_features` not divisible by
    `group_size` is padded by repeating each row's last weight, which never widens the last group's
    [min, max]; the padding is dropped on dequantization.

    Storage: `qweight` (int8 [out, in] at 8 bits; uint8 with two codes per byte, low nibble first,
    at 4 bits), `scale` [out, n_groups], `offset` [out, n_groups] (4 bits only; None at 8 bits),
    `bias` as in the original. Metadata is in the layer's dtype (the activation dtype, so
    dequantizing needs no extra casts), except on the fused 8-bit path (bf16, what its kernel takes).

    Two execution paths, chosen once by `from_linear` and reported by `fused`:
    - plain: forward dequantizes the whole weight and calls F.linear. Portable (any device, any
      dtype), but on CPU slower than the fp32 Linear it replaces.
    - fused (`fused=True`; CPU where `int8_cpu_kernel_ok` / `int4_cpu_kernel_ok`): torch's weight-only
      kernels with bf16 activations (the paper's W8A16 / W4A16). 8 bits: `_weight_int8pack_mm` on the
      plain int8 layout with bf16 row scales. 4 bits: `_weight_int4pack_mm_for_cpu` on torch's int4
      pack layout, which depends on the CPU's vector width, so it is built on the machine that runs it
      and never meant to be saved or moved to another device. Both beat fp32 at decode (a few rows)
      but are GEMV-shaped: on many rows (long prefills) they fall behind fp32. The bf16 activations
      and outputs add ~0.3 % relative
      error, next to the 8-bit weights' ~0.9 % (4 bits: ~13 % on a trained bf16/fp32 weight).
    """

    qweight: Tensor
    scale: Tensor
    offset: Tensor | None
    scale_zeros: Tensor
    scale_f32: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits={bits} is not supported; allowed: 4, 8")
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        # 8 bits is per output row by design; at 4 bits a group cannot span more than a row: larger
        # sizes mean per-output-channel, not a row padded out to the group size.
        self.group_size = group_size = in_features if bits == 8 else min(group_size, in_features)
        self.n_groups = math.ceil(in_features / group_size)
        self.fused = False
        if bits == 8:
            qweight = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
            offset = None
        else:
            packed = (self.n_groups * group_size + 1) // 2
            qweight = torch.zeros(out_features, packed, dtype=torch.uint8, device=device)
            offset = torch.zeros(out_features, self.n_groups, dtype=dtype, device=device)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", torch.zeros(out_features, self.n_groups, dtype=dtype, device=device))
        self.register_buffer("offset", offset)
        # A Parameter (like nn.Linear's) so that `.to(dtype)` and state_dict treat it the same way.
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int, group_size: int, fused: bool | None = None
    ) -> WeightOnlyLinear:
        """Quantize `linear`'s weight (the original is only read, never modified).

        `fused`: None = use torch's fused CPU kernel where it can run (`int8_cpu_kernel_ok` at 8 bits,
        `int4_cpu_kernel_ok` at 4); True = require it (ValueError if it cannot run); False = plain
        layout. Decided here, once, so that a module's speed and numerics never change per call.
        """
        weight = linear.weight.detach()
        out_f, in_f = weight.shape
        dtype, device = weight.dtype, weight.device
        if bits == 8:
            can_fuse = int8_cpu_kernel_ok(bits, in_f, device)
            needs = f"needs CPU, in_features % {_INT8_CPU_K_MULTIPLE} == 0, torch's _weight_int8pack_mm"
        else:
            group_size = min(group_size, in_f)  # as in __init__: at most one group per row
            can_fuse = int4_cpu_kernel_ok(bits, group_size, in_f, out_f, device)
            needs = (
                f"needs bits=4, CPU, group_size in {_INT4_CPU_GROUPS} dividing in_features, "
                "out_features % 16 == 0"
            )
        if fused and not can_fuse:
            raise ValueError(
                f"the fused int{bits} CPU kernel cannot run a {in_f}->{out_f} Linear with bits={bits}, "
                f"group_size={group_size} on {device} ({needs})"
            )
        use_fused = can_fuse and fused is not False
        mod = cls(in_f, out_f, bits, group_size, linear.bias is not None, dtype=dtype, device=device)
        if linear.bias is not None and mod.bias is not None:
            mod.bias.data.copy_(linear.bias.detach())
        if bits == 8:
            mod._quantize_int8(weight, use_fused)
        else:
            mod._quantize_int4(weight, use_fused)
        return mod

    def _quantize_int8(self, weight: Tensor, fused: bool) -> None:
        """Symmetric per-row int8 codes; bf16 scales on the fused path (its kernel's dtype)."""
        scale_dtype = torch.bfloat16 if fused else self.scale.dtype
        absmax = weight.float().abs().amax(dim=1, keepdim=True)
        # Round the scale to its storage dtype *before* computing the codes, so they are the nearest
        # ones on the grid the kernel will use. The row maximum may then land a hair past 127·scale
        # (bf16 rounds by ≤ 2^-9 relative); clamping it costs ≤ 0.25 step, still within half a step.
        scale = (absmax / 127).to(scale_dtype)
        step = scale.float().clamp_min(torch.finfo(torch.float32).tiny)  # all-zero row: q = 0
        codes = (weight.float() / step).round_().clamp_(-127, 127).to(torch.int8)
        self.qweight.copy_(codes)
        self.scale = scale.contiguous()
        self.fused = fused
        if fused:  # the same values in float32, for branchwise's own kernel (`cpu_kernels.int8_linear`)
            self.register_buffer("scale_f32", scale.view(-1).float(), persistent=False)

    def _quantize_int4(self, weight: Tensor, fused: bool) -> None:
        """Group-wise asymmetric 4-bit codes, in torch's int4 pack layout when `fused`."""
        out_f, in_f = weight.shape
        group_size, dtype = self.group_size, self.scale.dtype
        w = weight.float()
        pad = self.n_groups * group_size - in_f
        if pad:
            w = torch.cat([w, w[:, -1:].expand(out_f, pad)], dim=1)
        groups = w.view(out_f, self.n_groups, group_size)
        lo = groups.amin(-1)
        hi = groups.amax(-1)
        # Round scale/offset to the storage dtype *before* computing the codes, so the codes are
        # the nearest ones for the grid that dequantization will actually use (keeps the error
        # within scale/2 also when metadata is bf16/fp16).
        scale = ((hi - lo) / 15).to(dtype)
        offset = lo.to(dtype)
        step = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # constant group: q=0
        codes = ((groups - offset.float()[..., None]) / step).round_().clamp_(0, 15).to(torch.uint8)
        codes = codes.view(out_f, -1)
        self.scale.copy_(scale)
        assert self.offset is not None  # registered for 4 bits
        self.offset.copy_(offset)
        if fused:
            self.fused = True
            self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            # The kernel dequantizes as (q − 8)·s + z, so z = offset + 8·scale; [n_groups, out, 2].
            sz = torch.stack([scale.float(), offset.float() + 8 * scale.float()], dim=-1)
            self.register_buffer("scale_zeros", sz.transpose(0, 1).to(torch.bfloat16).contiguous())
            return
        if codes.shape[1] % 2:
            codes = F.pad(codes, (0, 1))
        self.qweight.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))

    def codes(self) -> Tensor:
        """The unpacked integer codes: int8 [out, in] at 8 bits, uint8 [out, n_groups·group_size] at 4."""
        if self.bits == 8:
            return self.qweight
        if self.fused:
            return self._fused_codes()
        low = self.qweight & 0x0F
        high = self.qweight >> 4
        return torch.stack([low, high], dim=-1).view(self.out_features, -1)[
            :, : self.n_groups * self.group_size
        ]

    def _fused_codes(self) -> Tensor:
        """Read the 4-bit codes back out of the opaque int4 pack layout by running the kernel on
        identity rows with scale 1 and zero 8, which yields q exactly (integers ≤ 15 are exact in bf16).

        Costs in_features²·out_features multiply-adds: for tests and diagnostics, not the hot path.
        """
        k = self.in_features
        unit = torch.empty_like(self.scale_zeros)
        unit[..., 0], unit[..., 1] = 1.0, 8.0
        blocks = []
        for start in range(0, k, 512):
            rows = min(512, k - start)
            eye = torch.zeros(rows, k, dtype=torch.bfloat16, device=self.qweight.device)
            eye[torch.arange(rows), torch.arange(start, start + rows)] = 1.0
            blocks.append(
                torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, unit)
            )
        return torch.cat(blocks).t().round().to(torch.uint8).contiguous()

    def dequantized_weight(self) -> Tensor:
        """The dense [out, in] weight the codes stand for.

        In the metadata dtype, except on the fused 8-bit path: its scales are bf16 (for the kernel),
        and q·scale (7 + 8 significant bits) is exact only in float32, so it is returned in float32.
        """
        if self.bits == 8:
            dtype = torch.float32 if self.fused else self.scale.dtype
            return self.qweight.to(dtype) * self.scale.to(dtype)
        assert self.offset is not None  # registered for 4 bits
        dtype = self.scale.dtype
        q = self.codes().to(dtype).view(self.out_features, self.n_groups, self.group_size)
        w = torch.addcmul(self.offset[..., None], q, self.scale[..., None])
        return w.view(self.out_features, -1)[:, : self.in_features]

    def forward(self, x: Tensor) -> Tensor:
        bias: Tensor | None = self.bias
        if self.fused:
            if self.bits == 8 and x.dtype == torch.float32 and cpu_kernels.int8_linear_ready():
                y = cpu_kernels.int8_linear(x.reshape(-1, self.in_features), self.qweight, self.scale_f32)
                y = y.view(*x.shape[:-1], self.out_features)
                return y if bias is None else y + bias
            flat = _bf16_rows(x, self.in_features)
            if self.bits == 8:
                y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale.view(-1))
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    flat, self.qweight, self.group_size, self.scale_zeros
                )
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias.to(x.dtype)
        # Dequantize on every call: keeping a dense copy would forfeit the memory saving, which is
        # the one benefit this layout has everywhere (its speed depends on the device).
        w = self.dequantized_weight()
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        return F.linear(x, w, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}, fused={self.fused}"
        )


def resolve_kernel(cfg_kernel: str, bits: int, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """`auto` → `torchao` on CUDA when torchao is installed (its fused weight-only int4/int8
    kernels), else `weight_only`; explicit kernels as given.

    Why never `dynamic_int8` for `auto`: it quantizes the activations too (per token, int8), and
    activation outliers make that lossy (SmolLM2-135M river: next-token match ~0.95, against ~0.995
    for 8-bit weight-only), while the weight-only kernel runs on torch's fused W8A16/W4A16 CPU
    kernels and is faster than fp32 at decode batch sizes. On CUDA without torchao, `weight_only`
    dequantizes per call (`RiverPath.execution` says "dequantize": memory saved, no speed-up).
    """
    del dtype  # kept for callers: a kernel's availability may depend on it
    if cfg_kernel not in KERNELS:
        raise ValueError(f"kernel={cfg_kernel!r} is not one of {', '.join(map(repr, KERNELS))}")
    if cfg_kernel != "auto":
        return cfg_kernel
    return "torchao" if device.type == "cuda" and torchao_available() else "weight_only"


def _torchao_quantize(module: nn.Module, bits: int, group_size: int) -> nn.Module:
    """A copy of `module` with torchao's fused weight-only int4 (W4A16) or int8 (W8A16) Linears."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    out = copy.deepcopy(module)
    quantize_(out, Int4WeightOnlyConfig(group_size=group_size) if bits == 4 else Int8WeightOnlyConfig())
    return out


def _check_dynamic_int8(layer: nn.Module, bits: int, device: torch.device) -> None:
    """Raise before anything is copied or moved: fail fast with the option to change."""
    if device.type != "cpu":
        raise ValueError(
            f"kernel='dynamic_int8' runs on CPU only, but the model is on {device}; "
            "use kernel='weight_only' (or 'auto')"
        )
    if bits != 8:
        raise ValueError(f"kernel='dynamic_int8' is 8-bit only, got bits={bits}; use kernel='weight_only'")
    dtypes = {p.dtype for p in layer.parameters()}
    if dtypes - {torch.float32}:
        names = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(
            f"kernel='dynamic_int8' needs an fp32 model (torch's int8 dynamic Linear takes fp32 inputs), "
            f"got {names}; load with dtype='float32' or use kernel='weight_only'"
        )


def quantize_layer(
    layer: nn.Module, bits: int, group_size: int, kernel: str, device: torch.device
) -> nn.Module:
    """A copy of `layer` with every `nn.Linear` quantized; everything else (norms, `layer_idx`) as is.

    The original is never modified. Norms and any other non-Linear module keep the model dtype: they
    are a negligible share of the weights, and quantizing them would only add error.
    """
    dtype = next(layer.parameters()).dtype
    kernel = resolve_kernel(kernel, bits, device, dtype)
    layer = plain(layer)  # weights packed for the CPU's kernels (`prepack.py`) are read back plain
    if kernel == "torchao":
        return _torchao_quantize(layer, bits, group_size)
    if kernel == "dynamic_int8":
        _check_dynamic_int8(layer, bits, device)
        river = copy.deepcopy(layer)
        # torch.ao.quantization is deprecated in favour of torchao (not a dependency here) but still
        # the only int8 CPU Linear in torch; its deprecation warnings are expected, so silence them
        # here only, not for the user's own uses of the API.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*quantize_per_(tensor|channel).*deprecated")
            warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated")
            # Per-channel (one scale per output row) instead of the default per-tensor scale: same
            # speed, about half the error (a SmolLM2 MLP on random inputs: 3.7 % vs 7.5 % relative).
            spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
            torch.ao.quantization.quantize_dynamic(river, spec, dtype=torch.qint8, inplace=True)
        return river
    # Siblings fed one input (q/k/v, gate/up) become one quantized product, as the backbone's are
    # one packed product: one kernel call and one cast to and from bf16 per group, not per layer
    # (one row per output, so the codes and scales are the separate layers' own).
    replacements: dict[int, nn.Module] = {}
    for parent in layer.modules():
        for _, group in sibling_groups(parent):
            whole = WeightOnlyLinear.from_linear(stacked(group), bits, group_size)
            replacements.update(zip(map(id, group), SiblingSlice.group(whole, group), strict=True))
    for mod in layer.modules():
        if isinstance(mod, nn.Linear) and id(mod) not in replacements:
            replacements[id(mod)] = WeightOnlyLinear.from_linear(mod, bits, group_size)
    # Seeding deepcopy's memo with the quantized modules makes the copy use them in place of the
    # Linears, so the full-precision weights are never duplicated (a throwaway fp copy of a layer
    # would be ~0.4 GB of GPU memory for a bf16 8B model).
    memo: dict[int, object] = dict(replacements)
    return copy.deepcopy(layer, memo)


def build_river(
    layers: nn.ModuleList,
    entry_layer: int,
    bits: int,
    group_size: int,
    kernel: str,
    device: torch.device,
) -> list[nn.Module | None]:
    """Index i → the quantized copy of layer i for i > `entry_layer`, None for i ≤ `entry_layer`.

    Why only after the entry layer: a token can leave the backbone at the earliest after layer
    `entry_layer`, so only the layers behind it are ever run on the river. The last layer cannot be
    an exit point (nothing would be left to skip), hence entry_layer ≤ n_layers − 2.
    """
    n = len(layers)
    if not 0 <= entry_layer <= n - 2:
        raise ValueError(
            f"entry_layer={entry_layer} is out of range for a {n}-layer model: allowed 0..{n - 2} "
            "(an exit needs at least one layer after it)"
        )
    river: list[nn.Module | None] = [None] * n
    for i in range(entry_layer + 1, n):
        copy_i = quantize_layer(layers[i], bits, group_size, kernel, device)
        attn_idx = getattr(getattr(layers[i], "self_attn", None), "layer_idx", None)
        copy_idx = getattr(getattr(copy_i, "self_attn", None), "layer_idx", None)
        if attn_idx != copy_idx:  # the KV-sharing contract; a broken copy would corrupt another slot
            raise RuntimeError(f"river layer {i}: self_attn.layer_idx {copy_idx} != backbone's {attn_idx}")
        river[i] = copy_i.eval()
    return river


class RefinedHead(nn.Module):
    """A quantized LM head whose `top_k` highest logits per row are recomputed from the exact head.

    Why: the head's error goes straight into the logits, and the next token is decided among a few
    top candidates. The quantized head (the full vocabulary read at low bit width) picks them; their
    logits are then recomputed from the backbone's head rows (k rows, a gather), so the top of the
    distribution is the backbone's given the same hidden state, whenever its true top token is among
    the k. The other logits stay quantized. The backbone's head is only read, not owned: it is no
    submodule, so it is neither counted in the river's bytes nor duplicated (a tied embedding stays
    tied).
    """

    def __init__(self, quantized: nn.Module, exact: nn.Linear, top_k: int) -> None:
        super().__init__()
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1")
        self.quantized = quantized
        self._exact = (exact,)  # a tuple keeps nn.Module from registering it as a submodule
        self.top_k = min(top_k, exact.out_features)

    @property
    def fused(self) -> bool:
        """Whether the quantized head runs on a fused kernel (see `WeightOnlyLinear.fused`)."""
        return bool(getattr(self.quantized, "fused", False))

    def forward(self, x: Tensor) -> Tensor:
        exact = self._exact[0]
        y = self.quantized(x)
        idx = y.topk(self.top_k, dim=-1).indices  # [..., k]
        rows = exact.weight[idx]  # [..., k, d], in the backbone's dtype
        z = (rows @ x.to(rows.dtype).unsqueeze(-1)).squeeze(-1)
        if exact.bias is not None:
            z = z + exact.bias[idx]
        return y.scatter(-1, idx, z.to(y.dtype))

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"


def quantize_head(
    head: nn.Module,
    bits: int,
    group_size: int,
    kernel: str,
    device: torch.device,
    refine_top_k: int | None = None,
) -> nn.Module | None:
    """The LM head as a weight-only quantized Linear for the river, or None (keep the backbone's).

    Why: after an exit the fp32 head (vocab × hidden: 49k × 576 on the embedded model, 113 MB read
    per decode step) costs more than all the river layers together. Quantized only where a fused
    kernel runs it (a dequantize-per-call head would be slower than the fp one); the head is only
    read, so a head tied to the embeddings stays intact. `refine_top_k`: wrap the quantized head in
    a `RefinedHead` that recomputes that many top logits per row from `head`.
    """
    head = plain(head)
    if not isinstance(head, nn.Linear):
        return None
    if kernel == "torchao":
        quantized: nn.Module = _torchao_quantize(head, bits, group_size)
    elif kernel != "weight_only":
        return None
    else:
        out_f, in_f = head.weight.shape
        fused = (
            int8_cpu_kernel_ok(bits, in_f, device)
            if bits == 8
            else int4_cpu_kernel_ok(bits, min(group_size, in_f), in_f, out_f, device)
        )
        if not fused:
            return None
        quantized = WeightOnlyLinear.from_linear(head, bits, group_size, fused=True).eval()
    return quantized if refine_top_k is None else RefinedHead(quantized, head, refine_top_k).eval()


def _dynamic_linear_bytes(mod: nn.Module) -> int:
    """Bytes of a torch dynamic-quantized Linear: int8 weight, its scales/zero points, and the bias.

    Its weight lives in an opaque packed-params object that `parameters()`/`buffers()` do not see;
    `_weight_bias()` unpacks it, so count 1 byte per int8 element plus the quantization metadata.
    """
    weight, bias = cast(Any, mod)._weight_bias()  # a method of torch's quantized Linear, not nn.Module's
    total = weight.numel() * weight.element_size()
    if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        scales = weight.q_per_channel_scales()
        zeros = weight.q_per_channel_zero_points()
        total += scales.numel() * scales.element_size() + zeros.numel() * zeros.element_size()
    else:
        total += 8 + 8  # one double scale, one int64 zero point
    if bias is not None:
        total += bias.numel() * bias.element_size()
    return total


def river_bytes(river: list[nn.Module | None]) -> int:
    """Bytes held by the river's layers (and head): parameters, buffers (packed weights included)
    and torch's dynamic int8 packed weights."""
    total = 0
    for layer in river:
        if layer is None:
            continue
        for mod in layer.modules():
            if isinstance(mod, torch.ao.nn.quantized.dynamic.Linear):
                # (its `_packed_params` child holds the same weight: it is skipped below, as it has
                # neither parameters nor buffers)
                total += _dynamic_linear_bytes(mod)
                continue
            for tensor in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)):
                total += tensor.numel() * tensor.element_size()
    return total
