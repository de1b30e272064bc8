"""Token selection from logits: greedy, temperature and nucleus (top-p) sampling.

Why separate: the decode loop stays about KV and batching; what a "sample" is lives here, together
with the per-token statistics CGEE needs (top-1 probability and the chosen token's log-probability,
both at temperature 1, i.e. the model's own distribution).

A sample is drawn by inverting each row's cumulative distribution at one uniform number (`draw`),
not with `torch.multinomial`: on a CPU, multinomial draws one exponential variate per vocabulary
entry (its Gumbel-style kernel), which measured 9.5 ms per step for 8 rows of a 49,152-token
vocabulary on 2 cores, against 0.3 ms for the cumulative sum and one search: 5-8 % of a sampled
decode step of a small model. Both sample the same distribution, up to floating-point rounding.
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
        tokens = draw(probs, generator)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, top1, chosen


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [B, V] (non-negative, each row with a positive finite total; it
    need not sum to 1): the first index whose cumulative mass exceeds a uniform fraction of the
    row's total.

    The cumulative sum and the uniform number are float64 (float32 on MPS, which has no float64),
    so a token is taken with its probability up to that rounding, and a token of probability 0
    (masked by top-p or a grammar) never: its cumulative mass equals its predecessor's, which the
    strict search never stops at, and a search that rounding carries past the row's end is held
    at its last token of positive probability. A row whose total is not a positive finite number
    (NaN or infinite logits) is an error, as it is for `torch.multinomial`, rather than an index
    out of range (on CUDA, a device-side assert that would poison the process).
    """
    wide = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = probs.to(wide).cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError("cannot sample: a row's probabilities are NaN, infinite or all zero")
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=wide)
    tokens = torch.searchsorted(cdf, u * total, right=True).clamp_(max=probs.shape[-1] - 1)
    past = probs.gather(-1, tokens) <= 0  # only where rounding carried the search past the end
    if bool(past.any()):
        last = (probs > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)  # first index of the final count
        tokens = torch.where(past, last, tokens)
    return tokens.squeeze(-1)


NUCLEUS_CANDIDATES = 256
"""The most likely tokens `_nucleus` looks at first: where they hold top_p of every row's mass, the
nucleus lies among them, and it is found without sorting the vocabulary (on 2 CPU cores, sorting
8 rows of a 49,152-token vocabulary took 17 ms a step, 13 % of a sampled decode step of the
embedded model; their 256 most likely tokens 0.8 ms). A row whose nucleus is wider (a flat
distribution) sorts the whole vocabulary, as before; 0 always sorts (the baseline of
`benchmarks/sampling.py`)."""


def _nucleus(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always at least the top token)."""
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        return probs
    limit = top_p[:, None] if isinstance(top_p, torch.Tensor) else top_p
    if 0 < NUCLEUS_CANDIDATES < probs.shape[-1]:
        top, order = probs.topk(NUCLEUS_CANDIDATES, dim=-1)  # sorted, most likely first
        cumulative = top.cumsum(dim=-1)
        # a token after these is kept only if the mass before it is below top_p: none is
        if bool((cumulative[:, -1:] >= limit).all()):
            kept = top.masked_fill(cumulative - top >= limit, 0.0)
            return torch.zeros_like(probs).scatter_(-1, order, kept)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_p.cumsum(dim=-1)
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
    sampled = draw(probs, generator)
    return torch.where(greedy, tokens, sampled)
