"""The layer loop: one forward of a batch through the decoder, with hook points between layers.

Why our own loop instead of `model(...)`: accelerations act between layers — a verify pass stops
at an early layer (CGEE), a token leaves the backbone for quantized layers (River), a steering
vector is added to one layer's input (SkipKV) — and between tokens. Raising exceptions out of
forward hooks would be the alternative; owning the loop (embedding, rotary, layers, final norm,
head) keeps it plain: the loop below runs the layers and calls whichever hooks are registered.

KV goes through the attention function registered in `attention.py`: every layer writes its K/V
into the batch's tails and reads the shared segments, so the runner itself never touches KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.hooks import Acceleration, Forward, overrides


class Runner:
    """Pushes token feeds through the decoder for every row of a batch context."""

    def __init__(self, parts: DecoderParts, pad_id: int, device: torch.device) -> None:
        self.parts = parts
        self.pad_id = pad_id
        self.device = device

    @torch.inference_mode()
    def forward(
        self,
        ctx: BatchContext,
        feeds: Sequence[Sequence[int]],
        hooks: Sequence[Acceleration] = (),
        observers: Sequence[Acceleration] = (),
    ) -> torch.Tensor:
        """Push `feeds[b]` (0+ tokens) through the model for every row; logits after each row's last one.

        `hooks` (the session's accelerations) and `observers` (per-call watchers, e.g. a verify pass)
        are called around each layer. A hook's `Exit` drops rows from the batch for the remaining
        layers with their own logits, so `ctx` must not be captured after such a forward.
        """
        parts = self.parts
        b = len(feeds)
        counts = [len(f) for f in feeds]
        q = max(max(counts), 1)
        ids = torch.full((b, q), self.pad_id, dtype=torch.long)
        for i, f in enumerate(feeds):
            if f:
                ids[i, : len(f)] = torch.tensor(list(f), dtype=torch.long)
        ids = ids.to(self.device)
        ctx.begin(q)
        # logical positions: evicted KV leaves the tail shorter than the token path
        assert ctx.pos_next is not None
        pos = ctx.pos_next[:, None] + torch.arange(q, device=self.device)[None, :]
        h = parts.embed(ids)
        rope = [parts.rotary(h, pos)]  # rebound when rows exit

        def run_layer(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return parts.run_layer(block, x, rope[0], ctx)

        fwd = Forward(
            ids=ids,
            counts=counts,
            n_fed=torch.tensor(counts, device=self.device),
            pos=pos,
            last=torch.tensor([max(c, 1) - 1 for c in counts], device=self.device),
            rows=torch.arange(b, device=self.device),  # original row of each active batch position
            layers=list(parts.layers),
            parts=parts,
            run_layer=run_layer,
            observed=bool(observers),
        )
        every = [*hooks, *observers]
        for hook in overrides(every, "begin_forward"):
            hook.begin_forward(fwd)
        before = overrides(every, "before_layer")
        after = overrides(every, "after_layer")
        logits: torch.Tensor | None = None
        for index in range(parts.n_layers):
            if ctx.steer is not None and index == ctx.steer.layer:
                h = ctx.steer.add(h, fwd.rows)
            for hook in before:
                h = hook.before_layer(fwd, index, h)
            h_in = h
            h = run_layer(fwd.layers[index], h)
            for hook in after:
                exit_ = hook.after_layer(fwd, index, h_in, h)
                if exit_ is None:
                    continue
                if logits is None:
                    logits = exit_.logits.new_zeros(b, exit_.logits.shape[-1])
                logits[fwd.rows[exit_.rows]] = exit_.logits[exit_.rows]
                keep = (~exit_.rows).nonzero().squeeze(-1)
                ctx.select_rows(keep, {int(old): new for new, old in enumerate(keep.tolist())})
                h, h_in = h[keep], h_in[keep]
                rope[0] = rope[0].select(keep)
                fwd.pos, fwd.last, fwd.rows = rope[0].pos, fwd.last[keep], fwd.rows[keep]
            if fwd.rows.numel() == 0:
                break
        if len(fwd.rows):
            h_last = parts.norm(fwd.last_states(h))
            ctx.last_hidden = h_last
            final = parts.logits(h_last, fwd.head)
            if logits is None:
                logits = final
            else:
                logits[fwd.rows] = final.to(logits.dtype)
        for hook in overrides(every, "after_forward"):
            hook.after_forward(fwd, logits)
        advance = fwd.n_fed[fwd.rows]
        ctx.lens = ctx.lens + advance
        assert ctx.pos_next is not None
        ctx.pos_next = ctx.pos_next + advance
        assert logits is not None
        return logits
