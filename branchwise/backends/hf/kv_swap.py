"""`KVSwap`: where a preempted row's KV waits when recomputing it would not give it back (the
`SWAP` policy of `intake`: runs with an acceleration that changes KV)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.tree import KVTree

__all__ = ["KVSwap"]


class KVSwap:
    """Swapped rows' KV, outside the KV budget until they rejoin (the `SWAP` policy).

    Where it goes: from an accelerator, to host memory (the budget bounds the accelerator's); from
    a CPU, host memory is the budget's own, so to a temporary file (one per row, removed when the
    row comes back or the call ends): the bytes really leave the memory the budget bounds.
    `to_file` overrides the choice (the tests run both on a CPU).
    """

    def __init__(self, device: torch.device, to_file: bool | None = None) -> None:
        self.device = device
        self.to_file = device.type == "cpu" if to_file is None else to_file
        self.held: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]] | Path] = {}
        self.tokens: dict[int, int] = {}
        """KV tokens each swapped node holds (what its rejoining needs back)."""
        self.nbytes = 0
        """Bytes swapped out now."""
        self.segs: dict[int, Segment] = {}
        self._sizes: dict[int, int] = {}
        self._dir: Path | None = None

    def out(self, seg: Segment, tree: KVTree) -> int:
        """Move `seg`'s own KV out of the tree (its bytes leave the budget); returns the bytes."""
        if seg.keys is None or seg.values is None:
            return 0
        keys, values, size = seg.keys, seg.values, seg.kv_bytes
        if self.to_file:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="branchwise-kv-swap-"))
            path = self._dir / f"{seg.id}.pt"
            torch.save((keys, values), path)
            self.held[seg.id] = path
        else:
            self.held[seg.id] = ([k.to("cpu") for k in keys], [v.to("cpu") for v in values])
        self.tokens[seg.id] = seg.kv_tokens
        self.segs[seg.id] = seg
        self._sizes[seg.id] = size
        self.nbytes += size
        tree.set_kv(seg, None, None)
        return size

    def back(self, seg: Segment, tree: KVTree) -> None:
        """Put a swapped node's KV back into the tree (a no-op for a node not swapped)."""
        if seg.id not in self.held:
            return
        held = self._take(seg.id)
        if isinstance(held, Path):
            keys, values = torch.load(held, weights_only=True)
            held.unlink()
        else:
            keys = [k.to(self.device) for k in held[0]]
            values = [v.to(self.device) for v in held[1]]
        tree.set_kv(seg, keys, values)

    def forget(self, node: int) -> None:
        """Drop a swapped node's KV unread (its node was released: nothing will read it)."""
        held = self._take(node)
        if isinstance(held, Path):
            held.unlink(missing_ok=True)

    def _take(self, node: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | Path:
        """A swapped node's KV (or its file), no longer counted as swapped."""
        self.tokens.pop(node)
        self.segs.pop(node)
        self.nbytes -= self._sizes.pop(node)
        return self.held.pop(node)

    def close(self) -> None:
        """Remove the swap files (every row came back before: nothing is lost)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
