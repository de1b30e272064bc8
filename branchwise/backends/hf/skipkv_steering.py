"""SkipKV's steering (the SkipKV paper, §4.2): the vector v = mean(exec) − mean(non-exec) hidden
states, where a model's vector is saved, and the adaptive strength α0 + γ·N_nonexec.

Why its own module: a steering vector is built once per model (`reasoners/steering.py`, offline)
and read by the plug-in (`skipkv.py`) at run time; neither needs the eviction scores, and the
vector's file format is a contract of its own (`weights_only` loading, the fields it must hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from branchwise.backends.hf.model_files import model_file


# ---------------------------------------------------------------------------------------------- steering
@dataclass
class SteeringVector:
    """SkipKV §4.2: v = mean(execution) − mean(non-execution) hidden states at one layer's input.

    Adding +α·v at delimiter tokens pushes the next thought toward execution (away from reflection
    and transitions). Built once per model, so it is saved next to the other per-model caches.
    """

    layer: int
    vector: torch.Tensor
    n_exec: int
    n_nonexec: int
    model: str

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "layer": self.layer,
                "vector": self.vector.detach().to("cpu", torch.float32).contiguous(),
                "n_exec": self.n_exec,
                "n_nonexec": self.n_nonexec,
                "model": self.model,
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> SteeringVector:
        """Load a saved vector; `weights_only=True` so a cache file cannot run code on load."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        fields = ("layer", "vector", "n_exec", "n_nonexec", "model")
        if not isinstance(data, dict) or any(f not in data for f in fields):
            raise ValueError(f"{path} is not a saved steering vector (needs fields {', '.join(fields)})")
        if not isinstance(data["vector"], torch.Tensor) or data["vector"].dim() != 1:
            raise ValueError(f"{path}: vector must be a 1-D tensor")
        return cls(
            layer=int(data["layer"]),
            vector=data["vector"],
            n_exec=int(data["n_exec"]),
            n_nonexec=int(data["n_nonexec"]),
            model=str(data["model"]),
        )


def steering_vector(exec_states: torch.Tensor, nonexec_states: torch.Tensor) -> torch.Tensor:
    """mean(exec_states) − mean(nonexec_states) over rows ([n, d] each) → [d] float32."""
    for name, states in (("exec_states", exec_states), ("nonexec_states", nonexec_states)):
        if states.dim() != 2:
            raise ValueError(f"{name} must be [n, d], got {list(states.shape)}")
        if states.shape[0] == 0:
            raise ValueError(f"{name} is empty: need at least one hidden state of that kind of thought")
    if exec_states.shape[1] != nonexec_states.shape[1]:
        raise ValueError(
            f"hidden sizes differ: exec {exec_states.shape[1]}, non-exec {nonexec_states.shape[1]}"
        )
    return exec_states.float().mean(dim=0) - nonexec_states.float().mean(dim=0).to(exec_states.device)


def steering_path(model_name: str) -> Path:
    """Where a model's steering vector lives: `<cache>/steering/<model>.pt`."""
    return model_file("steering", model_name, "pt")


def steering_strength(alpha0: float, gamma: float, n_nonexec: int) -> float:
    """α_t = α0 + γ·N_nonexec (§4.2): steer harder the more the row has already hesitated."""
    return alpha0 + gamma * n_nonexec
