"""Greedy fidelity up to ties (`fidelity.py`): the criterion itself, and bf16 runs that meet it.

The fp32 tests elsewhere demand token equality. Here the lossless paths run in bf16 (on the CPU
too, so the number format the GPU uses is exercised on every machine), and must agree with the
baseline and with `model.generate()` up to near-ties of an independent judge.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.fidelity import default_rel_tol, greedy_agreement

GREEDY = DecodeParams(max_tokens=10, min_tokens=10)
PROMPTS = ["What is 12 + 7?", "Name three colours.", "Count to five:", "The quick brown fox"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _judge_logits(backend: HFBackend, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return backend.model(torch.tensor([ids], device=backend.device)).logits[0, -1].float()


def test_identical_rows_match(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)
    prompt = backend.encode(PROMPTS[0])
    ref = backend.hf_generate([prompt], 6, exact_length=True)
    verdict = greedy_agreement(backend.model, [prompt], ref, ref)
    assert verdict.identical and verdict.matches
    assert verdict.as_dict()["rows_differing"] == 0
    assert verdict.rel_tol == default_rel_tol(torch.float32)


def test_a_swapped_token_is_caught_and_its_margin_reported(tiny_llama_dir: Path) -> None:
    """A decode that takes the runner-up at step 3 is a real difference in fp32, not a tie."""
    backend = HFBackend(tiny_llama_dir)
    prompt = backend.encode(PROMPTS[1])
    ref = backend.hf_generate([prompt], 6, exact_length=True)[0]
    logits = _judge_logits(backend, prompt + ref[:3])
    runner_up = logits.topk(2).indices[1].item()
    cand = [*ref[:3], runner_up, *ref[4:]]
    verdict = greedy_agreement(backend.model, [prompt], [ref], [cand])
    row = verdict.rows[0]
    assert row.first_difference == 3 and not verdict.matches and not verdict.identical
    expected = (logits[ref[3]] - logits[runner_up]).item()
    assert row.margin == pytest.approx(expected, rel=1e-5) and row.margin > 0
    assert row.tolerance == pytest.approx(default_rel_tol(torch.float32) * logits.abs().max().item())
    # a tolerance as wide as the logits' scale calls the same difference a tie
    assert greedy_agreement(backend.model, [prompt], [ref], [cand], rel_tol=1.0).matches


def test_a_shorter_decode_never_matches(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)
    prompt = backend.encode(PROMPTS[2])
    ref = backend.hf_generate([prompt], 6, exact_length=True)[0]
    verdict = greedy_agreement(backend.model, [prompt], [ref], [ref[:4]], rel_tol=1.0)
    assert verdict.rows[0].first_difference == 4 and not verdict.matches
    with pytest.raises(ValueError, match="one entry per row"):
        greedy_agreement(backend.model, [prompt], [ref], [])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_exact_none_generate_match_up_to_ties(tiny_arch_dir: Path, device: str, branch_tokens) -> None:
    """bf16: share='exact' vs share='none' vs model.generate(), B=8 branches with unequal hints."""
    backend = HFBackend(tiny_arch_dir, dtype="bfloat16", device=device)
    for text in PROMPTS:
        prompt = backend.encode(text)
        hints = [backend.encode(" hint" * (i % 3)) for i in range(8)]
        prompts = [prompt + h for h in hints]
        exact = branch_tokens(backend, prompt, hints, "exact", GREEDY)
        none = branch_tokens(backend, prompt, hints, "none", GREEDY)
        generate = [backend.hf_generate([p], GREEDY.max_tokens, exact_length=True)[0] for p in prompts]
        for ref, cand in ((none, exact), (generate, exact), (generate, none)):
            verdict = greedy_agreement(backend.model, prompts, ref, cand)
            assert verdict.matches, verdict.as_dict()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_embedded_prefix_sharing_matches_up_to_ties(
    embedded_dir: Path, device: str, branch_tokens
) -> None:
    """The embedded model in bf16: 8 branches over a shared 200-token prefix, exact vs none vs generate."""
    backend = HFBackend(embedded_dir, dtype="bfloat16", device=device, cache_bytes=0)
    prompt = backend.encode("A farmer keeps careful records of every field and every harvest. " * 14)
    hints = [backend.encode(f" Hint {i}: think about field {i}.") for i in range(8)]
    prompts = [prompt + h for h in hints]
    exact = branch_tokens(backend, prompt, hints, "exact", GREEDY)
    none = branch_tokens(backend, prompt, hints, "none", GREEDY)
    generate = [backend.hf_generate([p], GREEDY.max_tokens, exact_length=True)[0] for p in prompts]
    for ref, cand in ((none, exact), (generate, exact)):
        verdict = greedy_agreement(backend.model, prompts, ref, cand)
        assert verdict.matches, verdict.as_dict()
