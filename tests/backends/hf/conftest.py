"""Fixtures the local backend's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.skipkv_steering import SteeringVector, steering_path


@pytest.fixture(scope="module")
def steered_backend(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HFBackend]:
    """The tiny Llama, with a steering vector saved where a run looks for the model's own (SkipKV's
    examples steer with it), in a cache of the module's own; its step mode put back after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        model = HFBackend(tiny_model_dir("llama"))
        d = model.parts.embed.embedding_dim
        vector = SteeringVector(layer=1, vector=torch.full((d,), 0.05), n_exec=2, n_nonexec=1, model="tiny")
        vector.save(steering_path(model.model_name))
        yield model
        model.decode_step = "auto"
