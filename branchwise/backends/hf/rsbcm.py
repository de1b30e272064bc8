"""RSBCM (RKSC §2.4, Alg. 4, App. H): block-level KV eviction by ω = mass · score / (depth + 1).

Each live segment's physical KV is cut into blocks of `block_tokens`. A block's importance is the
attention mass its keys received (accumulated by the shared-prefix attention while tracking is on,
not the constant 1.0 of the public notebook) times its branch's score, divided by its depth in the
branch tree + 1, so deep, low-scoring, rarely attended blocks go first. Above `capacity_blocks`,
the lowest-ω blocks are evicted and their tensors really dropped; positions stay correct because
keys are stored post-RoPE and the backend tracks logical positions separately from the KV length.
The prompt (depth 0) is pinned by default: it is shared by every branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """One evictable block: physical token range [start, end) of a segment."""

    segment: int
    start: int
    end: int
    mass: float
    score: float
    depth: int

    @property
    def omega(self) -> float:
        return self.mass * self.score / (self.depth + 1)


def blocks_of(
    segment: int, mass: torch.Tensor | None, length: int, block_tokens: int, score: float, depth: int
) -> list[Block]:
    """Cut a segment of `length` physical tokens into blocks (the last one may be partial)."""
    out = []
    for start in range(0, length, block_tokens):
        end = min(start + block_tokens, length)
        block_mass = float(mass[start:end].sum()) if mass is not None else 0.0
        out.append(Block(segment, start, end, block_mass, score, depth))
    return out


def plan_evictions(blocks: Sequence[Block], capacity: int) -> list[Block]:
    """Alg. 4: while more than `capacity` blocks remain, evict the one with the smallest ω.

    Ties keep the earliest-listed block (deterministic).
    """
    excess = len(blocks) - capacity
    if excess <= 0:
        return []
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i].omega, -i))
    return [blocks[i] for i in order[:excess]]


def keep_mask(length: int, evicted: Sequence[Block], device: torch.device) -> torch.Tensor:
    """Boolean mask of physical positions that survive the evictions of one segment."""
    keep = torch.ones(length, dtype=torch.bool, device=device)
    for block in evicted:
        keep[block.start : block.end] = False
    return keep
