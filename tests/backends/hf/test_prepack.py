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
from branchwise.backends.hf.prepack import PackedLinear, plain, prepack, prepack_support

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


def test_support_names_why_not() -> None:
    assert "device" in (prepack_support(torch.device("meta"), torch.float32) or "")
    assert "device cuda" in (prepack_support(torch.device("cuda"), torch.float32) or "")
    assert "float16" in (prepack_support(torch.device("cpu"), torch.float16) or "")


def test_prepack_packs_every_layer_linear_and_the_head(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    layers = model.model.layers
    done = prepack(model, layers)
    assert done.active and done.modules == 7 * len(layers) + 1
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
