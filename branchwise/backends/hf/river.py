"""River-LLM (§4): token-level early exit onto a KV-shared "exit river" of weight-quantized layers.

Why a river instead of skipping layers: in a decoder-only model a token that skips layers leaves no
K/V in them, and every later token attends to that gap (River-LLM §3.2, "KV cache absence"). The
river keeps a quantized copy of every layer a token may skip; an exited token still runs those
copies, and because each copy keeps its backbone layer's `self_attn.layer_idx`, the registered
attention function writes its K/V into the backbone's own cache slot. The cache stays complete and
close to what the backbone would have written (the paper measures value cosine > 0.97), while the
exited token pays only for the cheaper quantized layers.

The exit test (§4.2) is the state-transition similarity cos(layer input, layer output): a layer that
barely changes the residual stream says the token is "easy". It is checked for the whole batch, so a
batched forward leaves the backbone only when every row passes; prefill averages it over each row's
fed tokens (sequence level), decode sees one token per row (token level).

This module holds the pieces; the backend's layer loop (`HFBackend._forward`) decides when to switch.
Kernels (measured on SmolLM2-135M shapes, 1 CPU thread, decode B=1/8):
- `dynamic_int8`: torch's int8 dynamic-activation Linear with per-channel weight scales; 2.7-5.7×
  faster than fp32 on the MLP, so `auto` picks it for 8 bits on CPU.
- `weight_only`: the paper's W4A16 scheme, group-wise asymmetric codes. At 4 bits on CPU it runs on
  torch's fused int4 kernel (bf16 activations, i.e. literally A16) and is faster than fp32;
  otherwise it dequantizes per call and F.linear's the result, which saves memory but costs time
  (≈15× slower than fp32 on CPU; on CUDA it is an extra pass over the weight).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from branchwise.backends.accel import RiverConfig
    from branchwise.backends.hf.arch import DecoderParts

KERNELS = ("auto", "dynamic_int8", "weight_only")


_INT4_CPU_GROUPS = (32, 64, 128, 256)  # the group sizes torch's fused CPU int4 kernel accepts


def int4_cpu_kernel_ok(bits: int, group_size: int, in_features: int, out_features: int, device: torch.device) -> bool:
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


class WeightOnlyLinear(nn.Module):
    """A Linear whose weight is stored group-wise quantized (4 or 8 bits), for the exit river.

    Scheme: asymmetric, w ≈ offset + q·scale with q ∈ [0, 2^bits − 1] per group of `group_size`
    consecutive input weights of one output row (the HQQ/AWQ convention the paper's river uses).
    Why asymmetric: a group's [min, max] maps onto all 2^bits levels, so the rounding error is at
    most scale/2 with scale = (max − min)/(2^bits − 1). A symmetric grid has to cover
    [−max|w|, max|w|] with an odd number of levels, which at 4 bits means a step up to ~2.1× larger
    for a skewed group; the price is one extra value per group (the offset): at 4 bits and group
    64, 4 bytes (fp32) next to 32 bytes of codes, half that in bf16.

    Storage: `qweight` uint8 (two 4-bit codes per byte at 4 bits), `scale`/`offset` [out, n_groups]
    in the layer's dtype (the activation dtype, so dequantizing needs no extra casts), `bias` as in
    the original. `in_features` not divisible by `group_size` is padded by repeating each row's last
    weight, which never widens the last group's [min, max]; padding is dropped on dequantization.

    Two layouts of `qweight`, chosen by `from_linear`:
    - plain ([out, in_padded·bits/8], low nibble first): forward dequantizes the whole weight and
      calls F.linear. Portable, but on CPU ≈15× slower than the fp32 Linear it replaces.
    - fused (`fused=True`; 4 bits on CPU where `int4_cpu_kernel_ok`): torch's int4 pack layout,
      which depends on the CPU's vector width, so it is built on the machine that runs it and never
      meant to be saved or moved to another device. Forward runs `_weight_int4pack_mm_for_cpu` with
      bf16 activations (the paper's W4A16: weights 4-bit, activations 16-bit), ≈2.5× faster than
      fp32; the bf16 cast adds ~0.4 % relative error next to the 4-bit weights' ~13 %.
    """

    qweight: Tensor
    scale: Tensor
    offset: Tensor
    scale_zeros: Tensor

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
        self.group_size = group_size
        self.n_groups = math.ceil(in_features / group_size)
        self.fused = False
        padded = self.n_groups * group_size
        packed = padded if bits == 8 else (padded + 1) // 2
        self.register_buffer("qweight", torch.zeros(out_features, packed, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.zeros(out_features, self.n_groups, dtype=dtype, device=device))
        self.register_buffer("offset", torch.zeros(out_features, self.n_groups, dtype=dtype, device=device))
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

        `fused`: None = use the fused CPU int4 kernel where `int4_cpu_kernel_ok`; True = require it
        (ValueError if it cannot run); False = plain layout.
        """
        weight = linear.weight.detach()
        out_f, in_f = weight.shape
        dtype, device = weight.dtype, weight.device
        can_fuse = int4_cpu_kernel_ok(bits, group_size, in_f, out_f, device)
        if fused and not can_fuse:
            raise ValueError(
                f"the fused int4 CPU kernel cannot run a {in_f}->{out_f} Linear with bits={bits}, "
                f"group_size={group_size} on {device} (needs bits=4, CPU, group_size in "
                f"{_INT4_CPU_GROUPS} dividing in_features, out_features % 16 == 0)"
            )
        mod = cls(in_f, out_f, bits, group_size, linear.bias is not None, dtype=dtype, device=device)
        qmax = (1 << bits) - 1
        w = weight.float()
        pad = mod.n_groups * group_size - in_f
        if pad:
            w = torch.cat([w, w[:, -1:].expand(out_f, pad)], dim=1)
        groups = w.view(out_f, mod.n_groups, group_size)
        lo = groups.amin(-1)
        hi = groups.amax(-1)
        # Round scale/offset to the storage dtype *before* computing the codes, so the codes are
        # the nearest ones for the grid that dequantization will actually use (keeps the error
        # within scale/2 also when metadata is bf16/fp16).
        scale = ((hi - lo) / qmax).to(dtype)
        offset = lo.to(dtype)
        step = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # constant group: q=0
        codes = ((groups - offset.float()[..., None]) / step).round_().clamp_(0, qmax).to(torch.uint8)
        codes = codes.view(out_f, -1)
        mod.scale.copy_(scale)
        mod.offset.copy_(offset)
        if linear.bias is not None and mod.bias is not None:
            mod.bias.data.copy_(linear.bias.detach())
        if can_fuse and fused is not False:
            mod.fused = True
            mod.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            # The kernel dequantizes as (q − 8)·s + z, so z = offset + 8·scale; [n_groups, out, 2].
            sz = torch.stack([scale.float(), offset.float() + 8 * scale.float()], dim=-1)
            mod.register_buffer("scale_zeros", sz.transpose(0, 1).to(torch.bfloat16).contiguous())
            return mod
        if bits == 4:
            if codes.shape[1] % 2:
                codes = F.pad(codes, (0, 1))
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        mod.qweight.copy_(codes)
        return mod

    def codes(self) -> Tensor:
        """The unpacked integer codes, uint8 [out, n_groups·group_size]."""
        if self.fused:
            return self._fused_codes()
        if self.bits == 8:
            return self.qweight
        low = self.qweight & 0x0F
        high = self.qweight >> 4
        return torch.stack([low, high], dim=-1).view(self.out_features, -1)[:, : self.n_groups * self.group_size]

    def _fused_codes(self) -> Tensor:
        """Read the codes back out of the opaque fused layout by running the kernel on identity rows
        with scale 1 and zero 8, which yields q exactly (integers ≤ 15 are exact in bf16).

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
            blocks.append(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, unit))
        return torch.cat(blocks).t().round().to(torch.uint8).contiguous()

    def dequantized_weight(self) -> Tensor:
        """offset + q·scale as a dense [out, in] weight in the metadata dtype."""
        dtype = self.scale.dtype
        q = self.codes().to(dtype).view(self.out_features, self.n_groups, self.group_size)
        w = torch.addcmul(self.offset[..., None], q, self.scale[..., None])
        return w.view(self.out_features, -1)[:, : self.in_features]

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias
        if self.fused:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scale_zeros)
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
    """`auto` → `dynamic_int8` for 8 bits on CPU with fp32 layers, else `weight_only`.

    Why: torch's dynamic int8 Linear is the only CPU kernel here that beats fp32, but it exists
    only for CPU, only at 8 bits, and only takes fp32 activations; everything else (4 bits, CUDA,
    bf16/fp16 models) gets the portable group-wise weight-only kernel. `dtype` None = assume fp32.
    """
    if cfg_kernel not in KERNELS:
        raise ValueError(f"kernel={cfg_kernel!r} is not one of {', '.join(map(repr, KERNELS))}")
    if cfg_kernel != "auto":
        return cfg_kernel
    fp32 = dtype is None or dtype == torch.float32
    return "dynamic_int8" if bits == 8 and device.type == "cpu" and fp32 else "weight_only"


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


def quantize_layer(layer: nn.Module, bits: int, group_size: int, kernel: str, device: torch.device) -> nn.Module:
    """A copy of `layer` with every `nn.Linear` quantized; everything else (norms, `layer_idx`) as is.

    The original is never modified. Norms and any other non-Linear module keep the model dtype: they
    are a negligible share of the weights, and quantizing them would only add error.
    """
    dtype = next(layer.parameters()).dtype
    kernel = resolve_kernel(kernel, bits, device, dtype)
    if kernel == "dynamic_int8":
        _check_dynamic_int8(layer, bits, device)
        river = copy.deepcopy(layer)
        # torch.ao.quantization is deprecated in favour of torchao (not a dependency here) but still
        # the only int8 CPU Linear in torch; its deprecation warnings are expected, so silence them
        # here only, not for the user's own uses of the API.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.ao")
            warnings.filterwarnings("ignore", message=r".*quantize_per_(tensor|channel).*deprecated")
            warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated")
            # Per-channel (one scale per output row) instead of the default per-tensor scale: same
            # speed, about half the error (SmolLM2 MLP output: 3.7 % vs 7.5 % relative).
            spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
            torch.ao.quantization.quantize_dynamic(river, spec, dtype=torch.qint8, inplace=True)
        return river
    replacements = {
        id(mod): WeightOnlyLinear.from_linear(mod, bits, group_size)
        for mod in layer.modules()
        if isinstance(mod, nn.Linear)
    }
    # Seeding deepcopy's memo with the quantized modules makes the copy use them in place of the
    # Linears, so the full-precision weights are never duplicated (a throwaway fp copy of a layer
    # would be ~0.9 GB of GPU memory for an 8B model).
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


def transition_similarity(h_in: Tensor, h_out: Tensor, counts: Tensor) -> Tensor:
    """Per row: mean over its first `counts[b]` tokens of cos(h_in, h_out), in float32; [B].

    `h_in`/`h_out` [B, q, d]. Positions at or past `counts[b]` are padding and ignored. A row with
    no fed tokens gets +1.0, so it never holds back the batch's exit (it has nothing to compute).
    """
    cos = F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)  # [B, q]
    q = cos.shape[1]
    counts = counts.to(cos.device)
    mask = torch.arange(q, device=cos.device)[None, :] < counts[:, None]
    total = (cos * mask).sum(-1)
    mean = total / counts.clamp_min(1).to(cos.dtype)
    return torch.where(counts > 0, mean, torch.ones_like(mean))


def exit_fidelity(backbone_logits: Tensor, river_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: (next-token match, KL(backbone ‖ river)) — the paper's Fig. 7 measures.

    KL is taken in float32 with the backbone as the reference distribution, i.e. how much the river's
    distribution loses relative to the one it replaces; clamped at 0 against rounding.
    """
    match = backbone_logits.argmax(-1) == river_logits.argmax(-1)
    log_p = torch.log_softmax(backbone_logits.float(), dim=-1)
    log_q = torch.log_softmax(river_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    return match, kl


def _dynamic_linear_bytes(mod: nn.Module) -> int:
    """Bytes of a torch dynamic-quantized Linear: int8 weight, its scales/zero points, and the bias.

    Its weight lives in an opaque packed-params object that `parameters()`/`buffers()` do not see;
    `_weight_bias()` unpacks it, so count 1 byte per int8 element plus the quantization metadata.
    """
    weight, bias = mod._weight_bias()
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
    """Bytes held by the river's layers: parameters, buffers (packed weights included) and torch's
    dynamic int8 packed weights."""
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


@dataclass
class RiverPath:
    """The river built for one backend and config, and the exit test the layer loop asks.

    `cfg` may be swapped for one with the same weight fields (`same_weights`) without rebuilding:
    the threshold, prefill and audit switches are read on every forward.
    """

    parts: DecoderParts
    cfg: RiverConfig
    device: torch.device
    layers: list[nn.Module | None] = field(init=False)
    kernel: str = field(init=False)
    nbytes: int = field(init=False)
    build_s: float = field(init=False)

    def __post_init__(self) -> None:
        dtype = next(self.parts.layers.parameters()).dtype
        self.kernel = resolve_kernel(self.cfg.kernel, self.cfg.bits, self.device, dtype)
        start = time.perf_counter()
        self.layers = build_river(
            self.parts.layers, self.cfg.entry_layer, self.cfg.bits, self.cfg.group_size, self.kernel, self.device
        )
        self.build_s = time.perf_counter() - start
        self.nbytes = river_bytes(self.layers)

    def same_weights(self, cfg: RiverConfig) -> bool:
        """Whether `cfg` would build the same river (so switching to it needs no rebuild)."""
        dtype = next(self.parts.layers.parameters()).dtype
        kernel = resolve_kernel(cfg.kernel, cfg.bits, self.device, dtype)
        same = (cfg.entry_layer, cfg.bits, kernel) == (self.cfg.entry_layer, self.cfg.bits, self.kernel)
        # the group size only shapes the weight-only kernel; dynamic int8 is per output channel
        return same and (kernel == "dynamic_int8" or cfg.group_size == self.cfg.group_size)

    def may_exit(self, index: int) -> bool:
        """Whether the batch may leave the backbone after layer `index` (a river follows it)."""
        return self.cfg.entry_layer <= index < len(self.layers) - 1

    def passes(self, h_in: Tensor, h_out: Tensor, counts: Tensor) -> bool:
        """The exit rule (§4.2): every row's transition similarity reaches the threshold."""
        return bool((transition_similarity(h_in, h_out, counts) >= self.cfg.threshold).all())
