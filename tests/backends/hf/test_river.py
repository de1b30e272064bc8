"""River-LLM pieces (branchwise.backends.hf.river) on tiny random models: quantized Linears, river
layer copies that keep their KV slot, the exit similarity and the fidelity measures.

Timings are deliberately absent: they belong in benchmarks, not in a test that must pass on any CI box.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.prepack import SiblingSlice
from branchwise.backends.hf.river import exit_fidelity, transition_similarity
from branchwise.backends.hf.river_quant import (
    RefinedHead,
    WeightOnlyLinear,
    build_river,
    int4_cpu_kernel_ok,
    int8_cpu_kernel_ok,
    quantize_head,
    quantize_layer,
    resolve_kernel,
    river_bytes,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]

CPU = torch.device("cpu")


def _linear(in_f: int, out_f: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    # a skewed, outlier-bearing weight, closer to a trained layer than a uniform init
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.5, 3.0, in_f))
        lin.weight[:, 3] += 0.4
    return lin


def _group_bound(lin: nn.Linear, q: WeightOnlyLinear) -> torch.Tensor:
    """Per-weight error bound: half the step of the weight's own group (+ fp32 rounding slack).

    At 8 bits the "group" is the whole row (group_size == in_features), so this is the row's step.
    """
    step = q.scale.float().repeat_interleave(q.group_size, dim=1)[:, : lin.in_features]
    return step / 2 + 1e-6 * lin.weight.abs().max()


def _expected_step(lin: nn.Linear, q: WeightOnlyLinear) -> torch.Tensor:
    """The step each scheme promises, [out, n_groups], rounded to the dtype `q` stores it in.

    8 bits: symmetric per row, max|w| / 127. 4 bits: asymmetric per group, (max − min) / 15.
    """
    w = lin.weight.detach().float()
    if q.bits == 8:
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        groups = w.view(lin.out_features, q.n_groups, q.group_size)
        step = (groups.amax(-1) - groups.amin(-1)) / 15
    return step.to(q.scale.dtype)


INT8_FUSED = int8_cpu_kernel_ok(8, 128, CPU)
needs_int8_kernel = pytest.mark.skipif(not INT8_FUSED, reason="torch lacks the fused CPU int8 kernel")


# --- WeightOnlyLinear -------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("fused", [False, None])
def test_weight_only_error_within_half_step(bits: int, fused: bool | None) -> None:
    lin = _linear(128, 64)
    q = WeightOnlyLinear.from_linear(lin, bits, 32, fused=fused)
    err = (q.dequantized_weight() - lin.weight).abs()
    assert (err <= _group_bound(lin, q)).all()
    # the step itself is what the bits promise: max|w|/127 per row (8), (max − min)/15 per group (4)
    assert q.scale.shape == ((64, 1) if bits == 8 else (64, 4))
    torch.testing.assert_close(q.scale, _expected_step(lin, q))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("fused", [False, None])
def test_weight_only_output_close_to_fp32(bits: int, fused: bool | None) -> None:
    lin = _linear(128, 64)
    q = WeightOnlyLinear.from_linear(lin, bits, 32, fused=fused)
    x = torch.randn(2, 5, 128)
    ref = lin(x)
    rel = ((q(x) - ref).norm() / ref.norm()).item()
    # Loose bounds from the half-step error: 8 bits ≈ 0.2 %, 4 bits ≈ 4 % relative on these weights
    # (plus bf16 activations on the fused path).
    assert rel < (0.01 if bits == 8 else 0.08)
    assert q(x).shape == ref.shape and q(x).dtype == ref.dtype


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_forward_matches_its_dequantized_weight(bits: int) -> None:
    """Plain layout: forward is exactly F.linear with the dequantized weight."""
    lin = _linear(96, 48)
    q = WeightOnlyLinear.from_linear(lin, bits, 32, fused=False)
    assert not q.fused
    x = torch.randn(3, 96)
    torch.testing.assert_close(q(x), nn.functional.linear(x, q.dequantized_weight(), lin.bias))


@pytest.mark.skipif(
    not int4_cpu_kernel_ok(4, 32, 128, 64, CPU), reason="torch lacks the fused CPU int4 kernel"
)
def test_fused_int4_layout_holds_the_same_codes_as_plain() -> None:
    lin = _linear(128, 64)
    fused = WeightOnlyLinear.from_linear(lin, 4, 32)
    plain = WeightOnlyLinear.from_linear(lin, 4, 32, fused=False)
    assert fused.fused and not plain.fused
    assert torch.equal(fused.codes(), plain.codes())
    x = torch.randn(4, 128)
    # the only difference is the bf16 activations (A16) of the fused kernel
    torch.testing.assert_close(fused(x), plain(x), atol=0.02, rtol=0.02)


def test_fused_required_but_impossible_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fused int4 CPU kernel"):
        WeightOnlyLinear.from_linear(_linear(100, 30), 4, 32, fused=True)
    # 100 input features: the int8 kernel's vector loop needs a multiple of 16
    with pytest.raises(ValueError, match=r"fused int8 CPU kernel.*in_features % 16"):
        WeightOnlyLinear.from_linear(_linear(100, 30), 8, 32, fused=True)


# --- fused int8 (W8A16) ------------------------------------------------------------------------


@needs_int8_kernel
def test_fused_int8_is_chosen_at_build_time_and_stores_plain_int8() -> None:
    lin = _linear(128, 64)
    fused = WeightOnlyLinear.from_linear(lin, 8, 32)
    plain = WeightOnlyLinear.from_linear(lin, 8, 32, fused=False)
    assert fused.fused and not plain.fused
    assert fused.qweight.dtype == plain.qweight.dtype == torch.int8
    assert fused.qweight.shape == (64, 128) and fused.scale.shape == (64, 1)
    assert fused.scale.dtype == torch.bfloat16  # what the kernel takes with bf16 activations
    assert plain.scale.dtype == torch.float32  # the plain path keeps the layer's dtype
    assert fused.offset is None and plain.offset is None  # symmetric: no zero point
    # codes are the nearest on each module's own grid: they differ only where the bf16-rounded scale
    # moves a weight across a rounding boundary, i.e. by at most one level
    assert (fused.codes().int() - plain.codes().int()).abs().max() <= 1
    assert int(fused.codes().abs().max()) == 127  # each row's largest weight uses the full range


@needs_int8_kernel
@pytest.mark.parametrize("shape", [(4, 128), (2, 3, 128), (1, 1, 128), (0, 128)])
def test_fused_int8_equals_linear_on_its_dequantized_weight(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tight: torch's fused kernel computes exactly F.linear(bf16(x), q·scale), up to its bf16 output.

    Both sides see the same bf16-rounded activations and the same dequantized weight (exact in fp32)
    and accumulate in fp32; the kernel then rounds to bf16, so they agree to one bf16 ulp (2^-8
    relative; rtol 2^-7 leaves room for a different fp32 summation order flipping a rounding).
    branchwise's own kernel is kept off here (it is what a layer uses once built: the next test).
    """
    monkeypatch.setattr(cpu_kernels, "int8_linear_ready", lambda: False)
    lin = _linear(128, 64)
    q = WeightOnlyLinear.from_linear(lin, 8, 32)
    x = torch.randn(*shape)
    w = q.dequantized_weight()
    assert w.dtype == torch.float32
    ref = nn.functional.linear(x.bfloat16().float(), w).bfloat16().float() + lin.bias
    out = q(x)
    assert out.shape == (*shape[:-1], 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)


@needs_int8_kernel
@pytest.mark.parametrize("shape", [(4, 128), (2, 3, 128), (1, 1, 128), (0, 128), (9, 144)])
def test_own_int8_kernel_equals_linear_in_float32(shape: tuple[int, ...]) -> None:
    """Once built, a fused 8-bit layer runs branchwise's kernel on float32 activations: F.linear(x,
    q·scale) in float32 (the same products, another summation order), with no bf16 rounding. The
    op itself takes any width (13: a tail past its vectors of 8) and says what does not match."""
    if (reason := cpu_kernels.build()) is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {reason}")
    if not cpu_kernels.int8_linear_ready():
        pytest.skip("the int8 kernel is vectorized for AVX2 and AVX-512 only")
    lin = _linear(shape[-1], 64)
    q = WeightOnlyLinear.from_linear(lin, 8, 32)
    x = torch.randn(*shape)
    ref = nn.functional.linear(x, q.dequantized_weight()) + lin.bias
    out = q(x)
    assert out.shape == (*shape[:-1], 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="x has 7 columns"):
        cpu_kernels.int8_linear(torch.randn(2, 7), q.qweight, q.scale_f32)
    codes = torch.randint(-127, 128, (5, 13), dtype=torch.int8)
    scale, x13 = torch.rand(5), torch.randn(6, 13)
    torch.testing.assert_close(
        cpu_kernels.int8_linear(x13, codes, scale),
        x13 @ (codes.float() * scale[:, None]).T,
        rtol=1e-5,
        atol=1e-5,
    )


@needs_int8_kernel
def test_fused_int8_error_against_fp32_is_within_the_per_row_bound() -> None:
    """Element-wise bound on |fused(x) − Linear(x)| that follows from the per-row scale.

    |w − q·s_i| ≤ s_i/2 for every weight of row i, so the weight error alone moves output i by at
    most s_i/2 · ‖x‖₁. The bf16 activations (|x̃ − x| ≤ 2^-9|x|) add at most 2^-9 · Σ_j |ŵ_ij x_j|, and
    the bf16 output rounding 2^-9 |y|. Each bf16 term is doubled for slack (the dequantized weight ŵ
    differs from w, fp32 summation order); the bound is deterministic, not statistical.
    """
    lin = _linear(128, 64)
    q = WeightOnlyLinear.from_linear(lin, 8, 32)
    x = torch.randn(16, 128) * torch.linspace(0.1, 4.0, 128)  # uneven activations, like real ones
    x[:, 7] *= 20  # and an activation outlier, which is what makes dynamic int8 lossy
    ref = lin(x)
    s = q.scale.float().view(1, -1)
    abs_wx = x.abs() @ q.dequantized_weight().abs().t()
    bound = s / 2 * x.abs().sum(-1, keepdim=True) + 2**-8 * abs_wx + 2**-8 * ref.abs() + 1e-5
    err = (q(x) - ref).abs()
    assert (err <= bound).all()
    # and it is a useful bound here, not a vacuous one: the relative error stays well under 1 %
    assert ((q(x) - ref).norm() / ref.norm()) < 0.01


@needs_int8_kernel
def test_fused_int8_takes_bf16_inputs_at_any_offset_and_stride() -> None:
    """The kernel's vector loads need 32-byte aligned, contiguous rows (misaligned → segfault), so
    odd views are copied before the call; a bf16 model's views reach it without a dtype copy."""
    lin = _linear(128, 64).to(torch.bfloat16)
    q = WeightOnlyLinear.from_linear(lin, 8, 32)
    assert q.fused and q.scale.dtype == torch.bfloat16
    base = torch.randn(3 * 128 + 1, dtype=torch.bfloat16)
    x = base[1:].view(3, 128)  # 2 bytes past an aligned start
    assert x.data_ptr() % 32 != 0
    expected = q(x.clone())
    assert q(x).dtype == torch.bfloat16
    torch.testing.assert_close(q(x), expected, rtol=0, atol=0)
    xt = torch.randn(128, 3, dtype=torch.bfloat16).t()  # permuted strides
    torch.testing.assert_close(q(xt), q(xt.contiguous()), rtol=0, atol=0)
    x32 = torch.randn(128, 5).t()  # fp32, permuted: .to(bf16) would keep the strides
    torch.testing.assert_close(q(x32), q(x32.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, None])
def test_packed_storage_is_really_smaller(fused: bool | None) -> None:
    lin = _linear(256, 64)
    q8 = WeightOnlyLinear.from_linear(lin, 8, 64, fused=fused)
    q4 = WeightOnlyLinear.from_linear(lin, 4, 64, fused=fused)
    assert q8.qweight.dtype == torch.int8 and q4.qweight.dtype == torch.uint8
    assert q8.qweight.numel() == lin.weight.numel()  # one byte per weight
    assert q4.qweight.numel() * 2 == q8.qweight.numel()  # two 4-bit codes per byte
    fp_bytes = lin.weight.numel() * 4
    assert river_bytes([nn.Sequential(q8)]) < fp_bytes / 3
    assert river_bytes([nn.Sequential(q4)]) < fp_bytes / 5


def test_group_size_not_dividing_in_features_is_padded() -> None:
    bits = 4
    lin = _linear(100, 30)  # 100 = 3·32 + 4: the last group holds 4 real weights
    q = WeightOnlyLinear.from_linear(lin, bits, 32)
    assert q.n_groups == 4 and not q.fused
    w = q.dequantized_weight()
    assert w.shape == lin.weight.shape
    assert ((w - lin.weight).abs() <= _group_bound(lin, q)).all()
    x = torch.randn(2, 100)
    assert q(x).shape == (2, 30)
    # padding repeats each row's last weight, so it never widens the last group's range
    tail = lin.weight.detach()[:, 96:]
    torch.testing.assert_close(q.scale[:, -1], (tail.amax(1) - tail.amin(1)) / (2**bits - 1))


def test_group_larger_than_the_row_means_per_channel() -> None:
    lin = _linear(100, 30)
    q = WeightOnlyLinear.from_linear(lin, 4, 8192)
    assert (q.group_size, q.n_groups) == (100, 1)
    assert q.qweight.numel() * 2 == lin.weight.numel()  # no padding out to 8192
    row = lin.weight.detach()
    torch.testing.assert_close(q.scale[:, 0], (row.amax(1) - row.amin(1)) / 15)


@pytest.mark.parametrize("group_size", [8, 32, 100, 8192])
def test_8_bit_ignores_group_size(group_size: int) -> None:
    """8 bits is always one symmetric scale per row, whatever group size the config carries."""
    lin = _linear(100, 30)  # 100 % 16 != 0: plain path, on any machine
    q = WeightOnlyLinear.from_linear(lin, 8, group_size)
    assert (q.group_size, q.n_groups, q.fused) == (100, 1, False)
    assert q.qweight.shape == (30, 100) and q.scale.shape == (30, 1) and q.offset is None
    torch.testing.assert_close(q.scale, _expected_step(lin, q))
    assert ((q.dequantized_weight() - lin.weight).abs() <= _group_bound(lin, q)).all()


def test_constant_group_is_exact() -> None:
    lin = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.25)
    q = WeightOnlyLinear.from_linear(lin, 4, 32, fused=False)
    assert torch.equal(q.dequantized_weight(), lin.weight.detach())


@pytest.mark.parametrize("fused", [False, None])
def test_8_bit_zero_row_and_row_maximum_are_exact(fused: bool | None) -> None:
    """A zero row gets scale 0 and codes 0 (no division by zero); a row's largest |w| maps to ±127
    exactly when the scale is exact, which it is for max|w| = 127·2^-k."""
    lin = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight.uniform_(-0.49, 0.49)
        lin.weight[0] = 0.0
        lin.weight[1, 5] = -0.5 * 127 / 128  # |w| max of row 1: scale 2^-8, exact in bf16 too
    q = WeightOnlyLinear.from_linear(lin, 8, 32, fused=fused)
    w = q.dequantized_weight()
    assert torch.equal(w[0], torch.zeros(64)) and not torch.isnan(w).any()
    assert int(q.codes()[1, 5]) == -127 and float(w[1, 5]) == float(lin.weight.detach()[1, 5])


def test_bad_bits_rejected() -> None:
    with pytest.raises(ValueError, match="bits=3"):
        WeightOnlyLinear.from_linear(_linear(64, 16), 3, 32)


def test_bf16_metadata_follows_the_layer_dtype() -> None:
    lin = _linear(64, 32).to(torch.bfloat16)
    q = WeightOnlyLinear.from_linear(lin, 4, 32, fused=False)
    assert q.scale.dtype == q.offset.dtype == torch.bfloat16
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert q(x).dtype == torch.bfloat16
    # half a step plus bf16 rounding of the weight itself (|w| ≤ ~2, 2^-8 relative)
    err = (q.dequantized_weight().float() - lin.weight.float()).abs()
    assert (err <= q.scale.float().repeat_interleave(32, 1) / 2 + lin.weight.float().abs() * 2**-7).all()


# --- kernels, quantize_layer, build_river ------------------------------------------------------


def test_resolve_kernel() -> None:
    # auto never picks the lossy dynamic int8 kernel, not even for 8-bit fp32 on CPU
    assert resolve_kernel("auto", 8, CPU) == "weight_only"
    assert resolve_kernel("auto", 8, CPU, torch.float32) == "weight_only"
    assert resolve_kernel("auto", 4, CPU) == "weight_only"
    assert resolve_kernel("auto", 8, torch.device("cuda")) == "weight_only"
    assert resolve_kernel("auto", 8, CPU, torch.bfloat16) == "weight_only"
    assert resolve_kernel("weight_only", 8, CPU) == "weight_only"
    assert resolve_kernel("dynamic_int8", 8, CPU) == "dynamic_int8"  # still there when asked for
    with pytest.raises(ValueError, match="kernel='int3'"):
        resolve_kernel("int3", 8, CPU)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


@pytest.mark.parametrize("kernel,bits", [("dynamic_int8", 8), ("weight_only", 8), ("weight_only", 4)])
def test_quantize_layer_replaces_linears_and_keeps_the_original(
    tiny_arch_dir: Path, kernel: str, bits: int
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dir, dtype=torch.float32).eval()
    layer = _decoder_layers(model)[1]
    before = {name: (p, p.detach().clone()) for name, p in layer.named_parameters()}
    linears_before = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecation noise is silenced inside, nothing leaks
        river = quantize_layer(layer, bits, 32, kernel, CPU)
    assert river is not layer
    assert river.self_attn.layer_idx == layer.self_attn.layer_idx == 1
    assert not any(isinstance(m, nn.Linear) for m in river.modules())
    # the original: same Linear objects, same Parameter objects, same values
    for name, mod in layer.named_modules():
        if name in linears_before:
            assert mod is linears_before[name]
    for name, p in layer.named_parameters():
        obj, value = before[name]
        assert p is obj and torch.equal(p, value)
    # norms stay full precision and are copies, not shared
    assert river.input_layernorm.weight.dtype == torch.float32
    assert river.input_layernorm.weight is not layer.input_layernorm.weight
    # the quantized MLP still computes nearly the same thing
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.inference_mode():
        ref, out = layer.mlp(x), river.mlp(x)
    assert ((out - ref).norm() / ref.norm()) < 0.15


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_siblings_are_one_product_with_the_separate_layers_codes(
    tiny_arch_dir: Path, bits: int
) -> None:
    """q/k/v and gate/up of a river layer are slices of one quantized product (one kernel call per
    group): each slice gives what its own layer, quantized alone, gives (one scale per output row
    or group, so stacking the rows changes no code), and the shared product is counted once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dir, dtype=torch.float32).eval()
    layer = _decoder_layers(model)[1]
    river = quantize_layer(layer, bits, 32, "weight_only", CPU)
    attn, mlp = river.self_attn, river.mlp
    assert all(isinstance(getattr(attn, n), SiblingSlice) for n in ("q_proj", "k_proj", "v_proj"))
    assert attn.q_proj.whole is attn.v_proj.whole and mlp.gate_proj.whole is mlp.up_proj.whole
    assert isinstance(attn.o_proj, WeightOnlyLinear) and isinstance(mlp.down_proj, WeightOnlyLinear)
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.inference_mode():
        for module, name in ((layer.self_attn, "k_proj"), (layer.mlp, "up_proj")):
            alone = WeightOnlyLinear.from_linear(getattr(module, name), bits, 32)
            sliced = getattr(attn if name == "k_proj" else mlp, name)
            torch.testing.assert_close(sliced(x), alone(x), rtol=1e-4, atol=1e-5)
    wholes = [m for m in river.modules() if isinstance(m, WeightOnlyLinear)]  # each module once
    assert len(wholes) == 4  # q/k/v, o, gate/up, down
    if bits == 8:  # one code per weight of the layer, none counted twice
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        assert sum(m.qweight.numel() for m in wholes) == sum(m.weight.numel() for m in linears)


def test_dynamic_int8_on_cuda_is_a_clear_error(tiny_llama: Tiny) -> None:
    """Checked before anything is copied or moved, so a fake CUDA device needs no GPU."""
    model, _ = tiny_llama
    layer = _decoder_layers(model)[0]
    with pytest.raises(ValueError, match=r"dynamic_int8.*CPU only.*weight_only"):
        quantize_layer(layer, 8, 32, "dynamic_int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="8-bit only"):
        quantize_layer(layer, 4, 32, "dynamic_int8", CPU)
    with pytest.raises(ValueError, match="fp32 model"):
        quantize_layer(layer.to(torch.bfloat16), 8, 32, "dynamic_int8", CPU)


@pytest.mark.parametrize("kernel", ["auto", "weight_only"])
def test_build_river_copies_only_the_layers_after_the_entry(tiny_llama: Tiny, kernel: str) -> None:
    model, _ = tiny_llama
    layers = _decoder_layers(model)
    river = build_river(layers, 0, 8, 32, kernel, CPU)
    assert len(river) == len(layers) == 3
    assert river[0] is None
    for i in (1, 2):
        layer_i = river[i]
        assert layer_i is not None and layer_i is not layers[i]
        assert layer_i.self_attn.layer_idx == i
    assert build_river(layers, 1, 8, 32, kernel, CPU)[:2] == [None, None]
    fp_bytes = sum(p.numel() * p.element_size() for i in (1, 2) for p in layers[i].parameters())
    assert 0 < river_bytes(river) < fp_bytes / 2


@pytest.mark.parametrize("entry", [-1, 2, 5])
def test_build_river_bad_entry_layer_names_field_and_range(tiny_llama: Tiny, entry: int) -> None:
    model, _ = tiny_llama
    with pytest.raises(ValueError, match=rf"entry_layer={entry}.*allowed 0\.\.1"):
        build_river(_decoder_layers(model), entry, 8, 32, "weight_only", CPU)


def test_river_bytes_counts_dynamic_int8_packed_weights() -> None:
    seq = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32))
    q = quantize_layer(seq, 8, 32, "dynamic_int8", CPU)
    # int8 weight + fp32 bias + per-channel scale (float64) and zero point (int64) + LayerNorm
    expected = 64 * 32 + 32 * 4 + 32 * (8 + 8) + 2 * 32 * 4
    assert river_bytes([None, q]) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_on_cuda_matches_cpu(bits: int) -> None:
    lin = _linear(128, 64)
    cpu_q = WeightOnlyLinear.from_linear(lin, bits, 32, fused=False)
    gpu_q = WeightOnlyLinear.from_linear(lin.cuda(), bits, 32)
    assert not gpu_q.fused  # the fused kernels are CPU-only: CUDA gets the plain path
    torch.testing.assert_close(gpu_q.dequantized_weight().cpu(), cpu_q.dequantized_weight())
    x = torch.randn(3, 128)
    torch.testing.assert_close(gpu_q(x.cuda()).cpu(), cpu_q(x), rtol=1e-4, atol=1e-4)


# --- exit similarity and fidelity --------------------------------------------------------------


def test_transition_similarity_identical_and_orthogonal() -> None:
    h = torch.randn(2, 3, 8)
    torch.testing.assert_close(transition_similarity(h, h, torch.tensor([3, 2])), torch.ones(2))
    a = torch.zeros(1, 1, 4)
    b = torch.zeros(1, 1, 4)
    a[..., 0], b[..., 1] = 1.0, 2.0
    torch.testing.assert_close(transition_similarity(a, b, torch.tensor([1])), torch.zeros(1))


def test_transition_similarity_ignores_padding_and_empty_rows() -> None:
    h_in = torch.randn(3, 4, 16)
    h_out = h_in.clone()
    h_out[0, 2:] = -h_in[0, 2:]  # padding of row 0 (counts 2) is anti-aligned: must not count
    h_out[1, 1] = -h_in[1, 1]  # a real token of row 1: cos −1, so the mean over 2 tokens is 0
    h_out[2] = torch.randn(4, 16)  # row 2 fed nothing
    sim = transition_similarity(h_in, h_out, torch.tensor([2, 2, 0]))
    torch.testing.assert_close(sim, torch.tensor([1.0, 0.0, 1.0]))


def test_transition_similarity_is_float32_for_bf16_states() -> None:
    h = torch.randn(2, 1, 8, dtype=torch.bfloat16)
    out = transition_similarity(h, h * 2, torch.tensor([1, 1]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.ones(2), atol=1e-3, rtol=0)


def test_exit_fidelity() -> None:
    logits = torch.randn(4, 50)
    match, kl = exit_fidelity(logits, logits.clone())
    assert match.dtype == torch.bool and match.all()
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl, torch.zeros(4))
    other = logits.clone()
    other[0] = -other[0]  # row 0's argmax becomes its old argmin
    match, kl = exit_fidelity(logits, other)
    assert match.tolist() == [False, True, True, True]
    assert kl[0] > 0.1 and torch.all(kl[1:] == 0)
    # KL(p‖q) by hand for row 0
    p = torch.softmax(logits[0], -1)
    expected = (p * (torch.log(p) - torch.log_softmax(other[0], -1))).sum()
    assert math.isclose(float(kl[0]), float(expected), rel_tol=1e-4)


# --- the river's LM head ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_refined_head_gives_the_backbone_heads_top_logits(bits: int, bias: bool) -> None:
    """The top-k logits are the full-precision head's, the rest the quantized head's."""
    lin = _linear(128, 512, bias=bias)
    quantized = quantize_head(lin, bits, 64, "weight_only", CPU)
    refined = quantize_head(lin, bits, 64, "weight_only", CPU, refine_top_k=8)
    if quantized is None:
        pytest.skip("torch lacks the fused CPU kernel for this head")
    assert isinstance(refined, RefinedHead) and refined.fused
    torch.manual_seed(1)
    x = torch.randn(2, 3, 128)  # [batch, tokens, hidden]: any leading shape
    with torch.no_grad():
        want, approx, got = lin(x), quantized(x), refined(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    top = approx.topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), atol=1e-5, rtol=1e-5)
    rest = torch.ones_like(got, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(got[rest], approx[rest])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the backbone's head is read, never copied or counted
    assert river_bytes([refined]) == river_bytes([quantized])
    assert not any(p is lin.weight for p in refined.parameters())


def test_refined_head_k_beyond_the_vocabulary_is_the_full_head() -> None:
    lin = _linear(64, 32, bias=False)
    refined = quantize_head(lin, 8, 64, "weight_only", CPU, refine_top_k=100)
    if refined is None:
        pytest.skip("torch lacks the fused CPU int8 kernel")
    assert isinstance(refined, RefinedHead) and refined.top_k == 32
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(refined(x), lin(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="top_k=0"):
        RefinedHead(refined.quantized, lin, 0)


# --- RiverPath (what the backend's layer loop asks) --------------------------------------------


def test_river_path_exit_rule_and_rebuild_check(tiny_llama: Tiny) -> None:
    from branchwise.backends.accel import RiverConfig
    from branchwise.backends.hf.arch import decoder_parts
    from branchwise.backends.hf.river import RiverPath

    model, _ = tiny_llama
    cfg = RiverConfig(entry_layer=0, threshold=0.5, group_size=32)
    path = RiverPath(decoder_parts(model), cfg, CPU)
    assert path.kernel == "weight_only"  # auto never picks dynamic_int8
    assert [path.may_exit(i) for i in range(3)] == [True, True, False]  # never after the last layer
    assert path.layers[0] is None and path.layers[2] is not None
    assert path.nbytes == river_bytes([*path.layers, path.head]) > river_bytes(path.layers) > 0  # head too
    assert isinstance(path.head, RefinedHead)  # the default head: quantized, top logits recomputed
    assert path.head.fused  # the LM head runs quantized after an exit
    h = torch.randn(2, 3, 64)
    assert path.passes(h, h + 0.01, torch.tensor([3, 1]))
    assert not path.passes(h, -h, torch.tensor([3, 1]))
    assert path.passes(h, -h, torch.tensor([0, 0]))  # nothing fed: nothing blocks
    assert path.same_weights(cfg.model_copy(update={"threshold": 0.9, "audit": True}))
    # 8 bits is per row: the group size does not change the weights, the kernel does
    assert path.same_weights(cfg.model_copy(update={"group_size": 64, "kernel": "weight_only"}))
    assert not path.same_weights(cfg.model_copy(update={"kernel": "dynamic_int8"}))
    assert not path.same_weights(cfg.model_copy(update={"entry_layer": 1}))
    assert not path.same_weights(cfg.model_copy(update={"bits": 4}))
    path4 = RiverPath(decoder_parts(model), cfg.model_copy(update={"bits": 4}), CPU)
    assert not path4.same_weights(path4.cfg.model_copy(update={"group_size": 64}))
    # the head is part of the build; the top-k only where the head is refined
    assert not path.same_weights(cfg.model_copy(update={"head": "quantized"}))
    assert not path.same_weights(cfg.model_copy(update={"head_top_k": 4}))
    quantized = cfg.model_copy(update={"head": "quantized"})
    assert RiverPath(decoder_parts(model), quantized, CPU).same_weights(
        quantized.model_copy(update={"head_top_k": 4})
    )


@pytest.mark.parametrize("head", ["refined", "quantized", "backbone"])
def test_river_path_head_follows_the_config(tiny_llama: Tiny, head: str) -> None:
    """'backbone' builds no head (the forward keeps the model's fp32 one); the others a fused copy."""
    from branchwise.backends.accel import RiverConfig
    from branchwise.backends.hf.arch import decoder_parts
    from branchwise.backends.hf.river import RiverPath

    model, _ = tiny_llama
    path = RiverPath(decoder_parts(model), RiverConfig(entry_layer=0, head=head), CPU)  # type: ignore[arg-type]
    if head == "backbone":
        assert path.head is None
        assert path.nbytes == river_bytes(path.layers)
    else:
        assert path.head is not None and path.head.fused
        assert isinstance(path.head, RefinedHead) == (head == "refined")
        # the refined head reads the backbone's head, it does not hold a copy of it
        assert (
            path.nbytes
            == river_bytes([*path.layers, path.head])
            < river_bytes(path.layers) + sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
        )


@pytest.mark.parametrize(
    ("update", "field", "allowed"),
    [
        ({"head": "fp16"}, "head", "'refined', 'quantized' or 'backbone'"),
        ({"head_top_k": 0}, "head_top_k", "greater than or equal to 1"),
        ({"head_top_k": 4097}, "head_top_k", "less than or equal to 4096"),
    ],
)
def test_river_config_head_fields_are_validated(update: dict[str, object], field: str, allowed: str) -> None:
    from pydantic import ValidationError

    from branchwise.backends.accel import RiverConfig

    with pytest.raises(ValidationError) as err:
        RiverConfig(**update)  # type: ignore[arg-type]
    (error,) = err.value.errors()
    assert error["loc"] == (field,)
    assert field in str(err.value) and allowed in str(err.value)


def test_auto_kernel_picks_torchao_on_cuda_only_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from branchwise.backends.hf import river_quant

    cuda = torch.device("cuda")
    monkeypatch.setattr(river_quant, "torchao_available", lambda: True)
    assert river_quant.resolve_kernel("auto", 4, cuda) == "torchao"
    assert river_quant.resolve_kernel("auto", 4, CPU) == "weight_only"  # CPU: torch's fused kernels
    monkeypatch.setattr(river_quant, "torchao_available", lambda: False)
    assert river_quant.resolve_kernel("auto", 8, cuda) == "weight_only"  # reported as "dequantize"


def test_river_build_is_cached_and_reports_execution(tiny_llama_dir) -> None:
    """Built once per backend and weight config: a second run reuses it (accel_builds 0)."""
    from branchwise.backends.accel import Accel, RiverConfig
    from branchwise.backends.hf import HFBackend
    from branchwise.backends.hf.river import River
    from branchwise.backends.hf.river_quant import torchao_available
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import self_consistency

    backend = HFBackend(tiny_llama_dir)
    accel = Accel(river=RiverConfig(threshold=0.5, entry_layer=0))
    reasoner = Reasoner(self_consistency(n=2, max_tokens=3, seed=0), backend=backend, accel=accel)
    first, second = reasoner.run("1 + 1?"), reasoner.run("2 + 2?")
    assert first.kv_stats["accel_builds"] == 1 and second.kv_stats["accel_builds"] == 0
    assert first.kv_stats["river_build_s"] == second.kv_stats["river_build_s"] > 0  # the one build's cost
    backend.accel = accel
    plugin = backend.acceleration(River)
    # torch's fused CPU kernels on the CPU; on CUDA torchao's, or "dequantize" without it
    cuda = "torchao" if torchao_available() else "dequantize"
    assert plugin is not None and plugin.path.execution == ("fused" if backend.device.type == "cpu" else cuda)
