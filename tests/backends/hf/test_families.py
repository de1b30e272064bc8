"""Model families beyond the Llama shape (`arch.py`): greedy tokens on the local backend equal
transformers' own `generate` with its eager attention, in fp32, shared prefix or not, through the
fixed-shape step and through the layer loop.

Each family is a random tiny model (2 layers, hidden 64) built here from transformers' config
class, with what sets the family apart switched on: sliding windows shorter than the decode
(local/global layers, per-layer rotary bases), soft-capping, QK-norm, (1 + w) norms, norms after
the sublayers, partial rotary, fused projections, parallel attention and MLP, multipliers, biases,
tied heads. Large initial weights keep greedy choices far from ties, so tokens must be equal.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from branchwise.backends import DecodeParams, Generation
from branchwise.backends.accel import Accel
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.arch import check_config
from branchwise.backends.hf.skipkv_steering import SteeringVector, steering_path

sys.path.insert(0, str(Path(__file__).parent))
from test_composition import check_acting, check_lossless, largest

NEW = 16
GREEDY = DecodeParams(max_tokens=NEW, min_tokens=NEW)
PROMPTS = ["What is 12 + 7?", "Count to five: one, two,"]
HINTS = ["", " Think.", " The answer is"]
WINDOW = 8
"""Sliding windows shorter than prompt + decode, so the window is crossed in every test."""

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"attention_bias": True},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": WINDOW},
    "gemma": {"head_dim": 16},
    "gemma2": {
        "head_dim": 16,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 12,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        },
        "final_logit_softcapping": 30.0,
    },
    "phi3": {"sliding_window": None},
    "phi": {"qk_layernorm": True},
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 6.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.05,
        "logits_scaling": 4.0,
        "attention_bias": True,
    },
    "stablelm": {"use_qkv_bias": True, "qk_layernorm": True, "use_parallel_residual": True},
    "starcoder2": {"sliding_window": WINDOW, "tie_word_embeddings": True},
    "cohere": {"use_qk_norm": True, "logit_scale": 0.5, "tie_word_embeddings": True},
    "gpt_neox": {"use_parallel_residual": True, "attention_bias": True, "num_key_value_heads": None},
}
MORE_FAMILIES: dict[str, dict[str, Any]] = {
    "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    "smollm3": {"no_rope_layers": [1, 0]},
    "granitemoe": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "embedding_multiplier": 6.0,
        "logits_scaling": 4.0,
    },
    "olmo": {},
    "exaone4": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "glm": {"head_dim": 16},
    "helium": {"head_dim": 16},
    "cohere2": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "logit_scale": 0.5,
    },
    "arcee": {},
    "seed_oss": {"head_dim": 16},
    "ernie4_5": {"head_dim": 16},
    "apertus": {},
}
"""Breadth beyond the features above (mixtures of experts, layers without rotary, more local/global
layouts): the same test, marked slow to keep the default run short."""
CONFIGS = {**FAMILIES, **MORE_FAMILIES}


def tiny_family(model_type: str, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A random tiny fp32 model of `model_type` with its distinguishing features on."""
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{"num_key_value_heads": 2, **CONFIGS[model_type]},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        None,
    )
    return model


def generate(model: PreTrainedModel, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after `ids` and each one's log-probability."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            top_p=None,
            top_k=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    eos = model.generation_config.eos_token_id
    logprobs = []
    for step, token in zip(out.logits, tokens, strict=True):
        logits = step[0].float().clone()
        logits[eos] = float("-inf")  # as `min_tokens` takes the end of text out of the choice
        logprobs.append(torch.log_softmax(logits, -1)[token].item())
    return tokens, logprobs


def branches(backend: HFBackend, prompt: list[int], hints: list[list[int]], share: str) -> list[Generation]:
    """Fork `prompt` into one branch per hint under `share`, append the hints, decode greedily."""
    root = backend.prefill(prompt)
    kids = backend.fork(root, len(hints), share=share)
    backend.release([root])
    backend.append(kids, hints)
    gens = backend.extend(kids, GREEDY)
    backend.release(kids)
    return gens


@pytest.mark.parametrize(
    "model_type", [*FAMILIES, *(pytest.param(t, marks=pytest.mark.slow) for t in MORE_FAMILIES)]
)
def test_family_greedy_equals_generate(model_type: str, tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    """share='exact' == share='none' == generate (eager attention), 3 branches per prompt, on the
    fixed-shape step and on the layer loop: the same tokens, and each token's log-probability to
    fp32 rounding (what catches a window or a soft-cap left out where the tokens happen to agree)."""
    model = tiny_family(model_type, tiny_tokenizer)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    backend = HFBackend.from_model(model, tiny_tokenizer, cache_bytes=0)
    for text in PROMPTS:
        prompt = backend.encode(text)
        hints = [backend.encode(h) if h else [] for h in HINTS]
        expected = [generate(reference, prompt + h) for h in hints]
        for step, share in (("eager", "exact"), ("eager", "none"), ("layers", "exact")):
            backend.decode_step = step  # type: ignore[assignment]
            for gen, (tokens, logprobs) in zip(
                branches(backend, prompt, hints, share), expected, strict=True
            ):
                assert gen.token_ids == tokens, f"{model_type}: share={share}, decode_step={step}"
                assert gen.logprobs == pytest.approx(logprobs, abs=1e-4), f"{model_type}: {share}, {step}"


REFUSED = [
    ("bloom", {}, "attention interface"),
    ("falcon", {"alibi": True}, "config.alibi"),
    ("gpt2", {}, "rope_parameters"),
    ("t5", {}, "is_encoder_decoder"),
    ("llama", {"attention_chunk_size": 64}, "config.attention_chunk_size"),
    ("deepseek_v3", {}, "config.kv_lora_rank"),
    ("gpt_oss", {}, "attention sinks"),
]


@pytest.mark.parametrize(("model_type", "fields", "named"), REFUSED)
def test_unsupported_attention_is_refused_from_the_config_alone(
    model_type: str, fields: dict[str, Any], named: str, tmp_path: Path
) -> None:
    """A folder with a config and no weights: the error names what is missing, so it came before
    any weight was read (there is none to read)."""
    AutoConfig.for_model(model_type, **fields).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(named)):
        HFBackend(tmp_path, device="cpu")
    with pytest.raises(ValueError, match=re.escape(named)):
        check_config(AutoConfig.from_pretrained(tmp_path))


def test_a_layer_wanting_inputs_the_loop_lacks_is_refused(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    """A decoder layer that requires more than hidden states and rotary tables is refused when the
    model is described, naming the argument (never run without it)."""
    model = tiny_family("llama", tiny_tokenizer)
    layer = model.model.layers[0]
    forward = layer.forward

    def wanting(hidden_states: torch.Tensor, per_layer_input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return forward(hidden_states, **kwargs)

    layer.forward = wanting
    with pytest.raises(ValueError, match="per_layer_input"):
        HFBackend.from_model(model, tiny_tokenizer)


@pytest.mark.parametrize(
    "model_type", ["gemma3_text", *(pytest.param(t, marks=pytest.mark.slow) for t in ("granite", "phi"))]
)
def test_family_runs_every_acceleration(
    model_type: str, tiny_tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each largest allowed set of accelerations keeps greedy tokens where its settings are
    lossless (RSBCM reading the weights of soft-capped and windowed layers too), and acts where
    they are not (self-consistency and beam search). Gemma 3's sliding window cannot follow KV an
    acceleration evicted: a run that would need it is refused saying so."""
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path))
    model = tiny_family(model_type, tiny_tokenizer)
    model.config._name_or_path = f"tiny-{model_type}"
    backend = HFBackend.from_model(model, tiny_tokenizer, cache_bytes=0)
    d = backend.parts.embed.embedding_dim
    vector = SteeringVector(layer=1, vector=torch.full((d,), 0.05), n_exec=2, n_nonexec=1, model="tiny")
    vector.save(steering_path(backend.model_name))
    refused = 0
    for names in largest(Accel):
        check_lossless(backend, Accel, names)
        try:
            check_acting(backend, Accel, names)
        except ValueError as exc:  # only a window over evicted KV, and only where there is a window
            assert backend.parts.sliding_window is not None and "sliding-window attention over" in str(exc)
            refused += 1
    assert refused == 0 or model_type == "gemma3_text"
