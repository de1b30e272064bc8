"""Token selection from logits: greedy, temperature and nucleus (top-p) sampling.

Why separate: the decode loop stays about KV and batching; what a "sample" is lives here, together
with the per-token statistics CGEE needs (top-1 probability and the chosen token's log-probability,
both at temperature 1, i.e. the model's own distribution).
"""

from __future__ import annotations

import torch


def pick_tokens(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    generator: torch.Generator | None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose one token per row.

    `temperature` and `top_p` are one value for every row, or a tensor [B] of each row's (a batch
    of requests with their own decoding parameters; a row at temperature 0 is greedy).
    `allowed` (optional): the same logits with the tokens a row may not take at -inf (a grammar's
    mask); the choice is made from it, the statistics from `logits`, the model's own distribution.
    Returns `(tokens [B], top1_prob [B], chosen_logprob [B])`.
    """
    raw = logits.float()
    logp = torch.log_softmax(raw, dim=-1)
    top1 = logp.max(dim=-1).values.exp()
    logits = raw if allowed is None or allowed is logits else allowed.float()
    if isinstance(temperature, torch.Tensor):
        tokens = _sample_rows(logits, temperature, top_p, generator)
    elif temperature == 0.0:
        tokens = logits.argmax(dim=-1)
    else:
        assert not isinstance(top_p, torch.Tensor)
        probs = _nucleus(torch.softmax(logits / temperature, dim=-1), top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, top1, chosen


def _nucleus(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always at least the top token)."""
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_p.cumsum(dim=-1)
    limit = top_p[:, None] if isinstance(top_p, torch.Tensor) else top_p
    sorted_p = sorted_p.masked_fill(cumulative - sorted_p >= limit, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def _sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: float | torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Each row with its own temperature and top-p; greedy rows take their argmax."""
    greedy = temperature == 0.0
    tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return tokens
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    probs = _nucleus(torch.softmax(scaled, dim=-1), top_p)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(greedy, tokens, sampled)
