"""The local HuggingFace backend: own decode and layer loops over a shared KV branch tree."""

from branchwise.backends.hf.backend import SHARE_MODES, HFBackend
from branchwise.backends.hf.embedded import EMBEDDED_MODEL, EmbeddedModelMissing, embedded_model_dir

__all__ = ["EMBEDDED_MODEL", "SHARE_MODES", "EmbeddedModelMissing", "HFBackend", "embedded_model_dir"]
