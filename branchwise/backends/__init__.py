"""Execution layer: the `Backend` protocol and its implementations (`hf`: local transformers + torch).

Backends never import `branchwise.strategies`; the reasoner translates plan nodes into backend ops.
"""

from branchwise.backends.base import Backend, DecodeParams, Generation, KVStats, NodeId, ShareMode

__all__ = ["Backend", "DecodeParams", "Generation", "KVStats", "NodeId", "ShareMode"]
