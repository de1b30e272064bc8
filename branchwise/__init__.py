"""branchwise: multi-branch LLM reasoning as declarative strategy graphs on a KV-sharing backend.

Heavy names (`Reasoner`, `HFBackend`) load lazily so that `import branchwise.strategies` never pulls
in torch: strategies can be written and validated on machines without a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["HFBackend", "Reasoner", "__version__"]

if TYPE_CHECKING:
    from branchwise.backends.hf import HFBackend
    from branchwise.reasoners import Reasoner


def __getattr__(name: str) -> Any:
    if name == "Reasoner":
        from branchwise.reasoners import Reasoner

        return Reasoner
    if name == "HFBackend":
        from branchwise.backends.hf import HFBackend

        return HFBackend
    raise AttributeError(f"module 'branchwise' has no attribute {name!r}")
