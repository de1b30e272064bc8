"""`layer.forward` computes a decoder layer bitwise as transformers does, for every supported
architecture, and yields to the transformers layer wherever someone hooked a module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend, layer
from branchwise.backends.hf.arch import decoder_parts
from branchwise.backends.hf.attention import register

MODELS: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny(arch: str, dtype: torch.dtype = torch.float32, vocab: int = 97) -> Any:
    config_cls, model_cls = MODELS[arch]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    if arch == "qwen2":  # q/k/v biases: make them nonzero so they count
        config.attention_bias = True
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.set_attn_implementation(register())
    return model


class Causal:
    """A minimal attention context: plain causal attention over this forward's own keys."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_forward_is_bitwise_the_transformers_layer(arch: str, dtype: torch.dtype) -> None:
    model = tiny(arch, dtype)
    parts = decoder_parts(model)
    assert layer.Lean(parts.layers, torch.device("cpu")).layers() == {id(b) for b in parts.layers}
    torch.manual_seed(1)
    for rows, q in ((1, 1), (3, 1), (2, 7)):
        x = torch.randn(rows, q, 64, dtype=dtype)
        pos = torch.arange(q)[None].expand(rows, q) + 5
        cos, sin = parts.rotary(x, pos)
        with torch.inference_mode():
            for block in parts.layers:
                theirs = block(x, position_ids=pos, position_embeddings=(cos, sin), bw_ctx=Causal())
                ours = layer.forward(block, x, cos, sin, Causal())
                assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (arch, rows, q)


def test_only_the_supported_layers_on_a_cpu_are_eligible() -> None:
    model = tiny("llama")
    parts = decoder_parts(model)
    assert layer.Lean(parts.layers, torch.device("meta")).layers() == set()  # not a CPU
    assert layer.Lean([parts.embed, parts.norm], torch.device("cpu")).layers() == set()  # not a layer


def test_a_hooked_module_takes_the_transformers_path_and_its_hook_runs(
    tiny_llama: tuple[Any, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny_llama
    backend = HFBackend.from_model(model, tokenizer, cache_bytes=0)
    lean = backend.engine.runner.lean
    first = backend.parts.layers[0]
    assert id(first) in lean.layers()
    params = DecodeParams(max_tokens=6, temperature=0.0)
    prompt = tokenizer.encode("The answer is")
    plain = backend.extend([backend.prefill(prompt)], params)[0].token_ids

    calls: list[int] = []
    handle = first.mlp.register_forward_hook(lambda *_: calls.append(1))
    try:
        assert id(first) not in lean.layers() and id(backend.parts.layers[1]) in lean.layers()
        hooked = backend.extend([backend.prefill(prompt)], params)[0].token_ids
    finally:
        handle.remove()
    assert calls and hooked == plain  # the hook ran on every forward, and nothing else changed
    assert id(first) in lean.layers()

    glob = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        assert lean.layers() == set()  # a global module hook sees every module: nothing is lean
    finally:
        glob.remove()
