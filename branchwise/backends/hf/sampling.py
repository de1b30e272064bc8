"""Token selection from logits: greedy, temperature and nucleus (top-p) sampling.

Why separate: the decode loop stays about KV and batching; what a "sample" is lives here, together
with the per-token statistics CGEE needs (top-1 probability and the chosen token's log-probability,
both at temperature 1, i.e. the model's own distribution).
"""

from __future__ import annotations

import torch


def pick_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose one token per row.

    `allowed` (optional): the same logits with the tokens a row may not take at -inf (a grammar's
    mask); the choice is made from it, the statistics from `logits`, the model's own distribution.
    Returns `(tokens [B], top1_prob [B], chosen_logprob [B])`.
    """
    raw = logits.float()
    logp = torch.log_softmax(raw, dim=-1)
    top1 = logp.max(dim=-1).values.exp()
    logits = raw if allowed is None or allowed is logits else allowed.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cumulative = sorted_p.cumsum(dim=-1)
            # keep the smallest set whose mass reaches top_p (always at least the top token)
            drop = cumulative - sorted_p >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, top1, chosen
