"""RNG state of this process (python, numpy, torch CPU and CUDA) as JSON, for exact resume.

Every global rank saves its own state (dropout masks and augmentations differ per rank); a resume
at the same world size restores rank r's state on rank r.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    version, python_state, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)  # legacy (the default): a tuple
    assert isinstance(numpy_state, tuple)
    kind, keys, position, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": [version, list(python_state), gauss],
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": [],
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [_b64(s.cpu()) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(_tensor(state["torch_cpu"]))
    if state["torch_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["torch_cuda"]])
