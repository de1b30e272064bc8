"""ASKS (RKSC §2.2, Eq. 2, Alg. 2): let a branch with a differently phrased prompt reuse the root's KV.

ASKS generalises token-exact prefix reuse: a branch whose prompt differs from the root's may still
reuse the root's whole KV when its hidden states stay close to the root's. The gate compares, layer
by layer, the state at the last token of the branch's *divergent part* with the root's state at the
last token of *its* divergent part (both computed over the exact common prefix), weighted with
w_l ∝ exp(α·l/L) so later, more task-specific layers count more (Eq. 2). A branch that passes reads
the root's KV (and effectively sees the root's phrasing: lossy, so runs report agreement with
`share="none"`); one that fails keeps the exact KV its gate pass already computed — no work is lost.

It acts at one moment only: when `fork_prompts` meets prompts that diverge from the root's path
(`on_fork_prompts`). The KV probe, which decides whether sharing pays at all, is `probe.py`.
"""

from __future__ import annotations

import torch

from branchwise.backends.accel import ASKSConfig
from branchwise.backends.hf.hooks import Acceleration, HiddenCapture, Host, Setup
from branchwise.backends.hf.segment import Segment, common_prefix


def layer_weights(n_layers: int, alpha: float) -> torch.Tensor:
    """w_l = exp(α·l/L) / Σ_l' exp(α·l'/L), l = 1..L (Eq. 2)."""
    scores = torch.tensor([alpha * layer / n_layers for layer in range(1, n_layers + 1)], dtype=torch.float64)
    return torch.softmax(scores, dim=0)


def similarity(branch: torch.Tensor, root: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """σ_b of Eq. 2. `branch` [L, B, H], `root` [L, H] pre-normalised to unit length; returns [B]."""
    unit = torch.nn.functional.normalize(branch.double(), dim=-1)
    cos = (unit * root.double()[:, None, :]).sum(-1)  # [L, B]
    return (weights[:, None] * cos).sum(0)


class ASKS(Acceleration):
    """The similarity gate of Alg. 2, run in one batched pass when a fork meets divergent prompts.

    Statistics: `asks_exact` (prompts that extend the root's path), `asks_reused`, `asks_rejected`,
    `asks_sigma_sum`.
    """

    name = "asks"
    config = ASKSConfig

    def __init__(self, cfg: ASKSConfig) -> None:
        self.cfg = cfg

    @classmethod
    def build(cls, cfg: ASKSConfig, setup: Setup) -> ASKS:
        return cls(cfg)

    def on_fork_prompts(
        self,
        host: Host,
        root: Segment,
        path: list[int],
        prompts: list[list[int]],
        divergent: list[tuple[int, int, int]],
    ) -> dict[int, int]:
        """Gate each divergent prompt: branch divergent parts and the root's, over the exact common
        prefix, in one forward; a prompt whose Eq. 2 similarity passes τ reads the root's whole KV,
        one that fails keeps the exact KV its gate pass computed (no work is lost)."""
        exact = sum(common_prefix(path, p) == len(path) for p in prompts)
        if exact:
            host.stats.bump("asks_exact", exact)
        if not divergent:
            return {}
        probes: list[Segment] = []
        refs: dict[tuple[int, int], Segment] = {}
        for i, k, m in divergent:
            # the exact common prefix, or less where it ends inside lossy KV (both sides then compute
            # the same tokens from j on, so the gate still compares states over one exact prefix)
            base, j = host.prefix_node(root, k) if k else (None, 0)
            probes.append(
                host.tree.add(base, base is not None, list(prompts[i][j : len(prompts[i]) - m]), host.ledger)
            )
            if (k, m) not in refs:
                refs[(k, m)] = host.tree.add(
                    base, base is not None, list(path[j : len(path) - m]), host.ledger
                )
        capture = HiddenCapture()
        host.compute(probes + list(refs.values()), [capture])
        states = capture.stacked()  # [L, rows, H]
        weights = layer_weights(host.parts.n_layers, self.cfg.alpha).to(states.device)
        ref_index = {key: len(probes) + j for j, key in enumerate(refs)}
        out: dict[int, int] = {}
        for row, ((i, k, m), seg) in enumerate(zip(divergent, probes, strict=True)):
            root_state = torch.nn.functional.normalize(states[:, ref_index[(k, m)]].double(), dim=-1)
            sigma = float(similarity(states[:, row][:, None], root_state, weights)[0])
            host.stats.bump("asks_sigma_sum", sigma)
            if sigma >= self.cfg.tau:
                out[i] = host.share_child(root, [], len(path))
                host.free(seg)
                host.stats.bump("asks_reused")
            else:
                seg.tokens.extend(prompts[i][len(prompts[i]) - m :] if m else [])
                host.tree.adopt(root, seg)
                out[i] = seg.id
                host.stats.bump("asks_rejected")
        for ref in refs.values():
            host.free(ref)
        return out
