"""Weights packed for the CPU's kernels (`prepack.py`): same products, same greedy tokens, and every
reader of a layer's weight (quantization, head cost, vocabulary size) still sees the plain one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.arch import linear_params
from branchwise.backends.hf.prepack import FusedLinear, PackedLinear, plain, prepack, prepack_support

pytestmark = pytest.mark.skipif(
    prepack_support(torch.device("cpu"), torch.float32) is not None,
    reason=f"no oneDNN packing here: {prepack_support(torch.device('cpu'), torch.float32)}",
)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_the_linear_product(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (7, 48), (2, 3, 48)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight.detach())
    assert linear_params(packed) == linear_params(linear) == 48 * 80


def test_copies_share_the_packed_weight_and_plain_gives_a_linear_back() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    want = block(x)
    block[0], block[2] = PackedLinear(block[0]), PackedLinear(block[2])
    clone = copy.deepcopy(block)
    assert clone[0].packed is block[0].packed and clone[0] is not block[0]
    flat = plain(block)
    assert flat is not block and all(type(flat[i]) is nn.Linear for i in (0, 2))
    assert isinstance(block[0], PackedLinear)  # the original is left packed
    torch.testing.assert_close(flat(x), want, rtol=1e-5, atol=1e-5)
    unpacked = nn.Sequential(nn.Linear(2, 2))
    assert plain(unpacked) is unpacked  # nothing packed: no copy


@pytest.mark.parametrize("bias", [False, True])
def test_siblings_packed_as_one_product_give_each_its_own(bias: bool) -> None:
    """Sibling layers packed as one product (`FusedLinear`): each gives its own layer's output
    whichever sibling reads an input first, a sibling called alone or on another input computes
    it anew, the product is computed once per input (not once per sibling), and each reads back
    its own weight, bias and plain `nn.Linear`."""
    from branchwise.backends.hf import prepack as prepack_module

    torch.manual_seed(0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (
        nn.Linear(24, 24, bias=bias),
        nn.Linear(24, 8, bias=bias),
        nn.Linear(24, 8, bias=bias),
    )
    plain_linears = copy.deepcopy(attn)
    layers = nn.ModuleList([attn])
    model = nn.Module()
    model.layers = layers
    done = prepack(model, layers)
    assert done.fused == 3 and all(
        isinstance(getattr(attn, n), FusedLinear) for n in ("q_proj", "k_proj", "v_proj")
    )
    calls = 0
    real = prepack_module._apply

    def counted(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real(*args)  # type: ignore[arg-type]

    x, other = torch.randn(3, 24), torch.randn(2, 5, 24)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepack_module, "_apply", counted)
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
            calls = 0
            for name in order:
                torch.testing.assert_close(
                    getattr(attn, name)(x), getattr(plain_linears, name)(x), rtol=1e-5, atol=1e-5
                )
            assert calls == 1
        calls = 0
        torch.testing.assert_close(attn.k_proj(other), plain_linears.k_proj(other), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.k_proj(x), plain_linears.k_proj(x), rtol=1e-5, atol=1e-5)
        assert calls == 2  # alone, and on another input: computed anew each time
    for name in ("q_proj", "k_proj", "v_proj"):
        fused, linear = getattr(attn, name), getattr(plain_linears, name)
        assert torch.equal(fused.weight, linear.weight.detach())
        assert (fused.bias is None) == (not bias) and (
            not bias or torch.equal(fused.bias, linear.bias.detach())
        )
        back = plain(fused)
        assert type(back) is nn.Linear and torch.equal(back.weight, linear.weight.detach())
        assert linear_params(fused) == linear_params(linear)


def test_support_names_why_not() -> None:
    assert "device" in (prepack_support(torch.device("meta"), torch.float32) or "")
    assert "device cuda" in (prepack_support(torch.device("cuda"), torch.float32) or "")
    assert "float16" in (prepack_support(torch.device("cpu"), torch.float16) or "")


def test_prepack_packs_every_layer_linear_and_the_head(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    layers = model.model.layers
    done = prepack(model, layers)
    assert done.active and done.modules == 7 * len(layers) + 1
    assert done.fused == 5 * len(layers)  # q, k, v as one product; gate, up as another
    assert all(isinstance(layer.self_attn.k_proj, FusedLinear) for layer in layers)
    assert done.extra_bytes == 0  # untied head: packed in place, nothing duplicated
    assert isinstance(model.lm_head, PackedLinear)
    assert not any(type(m) is nn.Linear for m in model.modules())


def test_a_tied_head_keeps_the_embedding_and_counts_its_copy(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    model.lm_head.weight = model.get_input_embeddings().weight  # tie them
    done = prepack(model, model.model.layers)
    embed = model.get_input_embeddings().weight
    assert done.extra_bytes == embed.numel() * embed.element_size()
    assert torch.equal(model.lm_head.weight, embed.detach())


def test_greedy_tokens_and_generate_match_the_unpacked_model(tiny_arch_dir: Path) -> None:
    # on the CPU whatever `--backend-device` says: packing is for the CPU's kernels only (elsewhere
    # the backend leaves the weights alone and says why; `test_support_names_why_not`)
    plain_backend = HFBackend(str(tiny_arch_dir), device="cpu", prepack=False, cache_bytes=0)
    packed_backend = HFBackend(str(tiny_arch_dir), device="cpu", cache_bytes=0)
    assert packed_backend.prepacked.active and not plain_backend.prepacked.active
    assert plain_backend.prepacked.reason == "prepack=False"
    prompts = [plain_backend.encode(t) for t in ("What is 12 + 7?", "Name three colours, please.")]
    params = DecodeParams(max_tokens=16, min_tokens=16)
    got = {}
    for name, backend in (("plain", plain_backend), ("packed", packed_backend)):
        roots = [backend.prefill(p) for p in prompts]
        kids = backend.fork(roots[0], 3) + roots[1:]
        got[name] = [g.token_ids for g in backend.extend(kids, params)]
        got[name + "_generate"] = backend.hf_generate(prompts, 16, exact_length=True)
    assert got["packed"] == got["plain"]
    assert got["packed_generate"] == got["plain_generate"]
