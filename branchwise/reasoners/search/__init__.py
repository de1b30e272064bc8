"""Tree search: the pure algorithmic core (REBASE allocation, the ETS ILP, clustering, KV metric)
and, in `search.tree`, the selects that run it on a reasoner's branch tree.

The names exported here need no torch and no model (NumPy, SciPy and PuLP only), so the selection
logic is testable and reusable on its own. `search.tree` (`search_select`) wires it to a run's
leaves and backend; it is imported from its module, not from here, so that importing this package
never pulls in the run state or the backend protocol.
"""

from branchwise.reasoners.search.cluster import (
    DEFAULT_DISTANCE_THRESHOLD,
    CallableEmbedder,
    Embedder,
    MiniLMEmbedder,
    cluster_embeddings,
    cluster_texts,
    cosine_distance_matrix,
)
from branchwise.reasoners.search.ets import (
    DEFAULT_LAMBDA_B,
    DEFAULT_LAMBDA_D,
    DEFAULT_TIME_LIMIT_S,
    ETSProblem,
    ETSSelection,
    ETSStep,
    default_solver,
    ets_allocate,
    ets_select,
    ets_step,
)
from branchwise.reasoners.search.kv_metric import kv_cache_size, kv_size_per_step
from branchwise.reasoners.search.rebase import (
    DEFAULT_TEMPERATURE,
    next_width,
    rebase_allocation,
    rebase_weights,
)

__all__ = [
    "DEFAULT_DISTANCE_THRESHOLD",
    "DEFAULT_LAMBDA_B",
    "DEFAULT_LAMBDA_D",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TIME_LIMIT_S",
    "CallableEmbedder",
    "ETSProblem",
    "ETSSelection",
    "ETSStep",
    "Embedder",
    "MiniLMEmbedder",
    "cluster_embeddings",
    "cluster_texts",
    "cosine_distance_matrix",
    "default_solver",
    "ets_allocate",
    "ets_select",
    "ets_step",
    "kv_cache_size",
    "kv_size_per_step",
    "next_width",
    "rebase_allocation",
    "rebase_weights",
]
