"""Where a model lives: the device new tensors must be created on (fedmosaic never uses a default one).

Adapters, routing, training and serving create tensors (weights, indices, masks, batches) next to the
model they feed. They ask the model, not a global setting, so the same code runs on the CPU and on a
GPU, and a model moved after loading is followed.
"""

from __future__ import annotations

import torch


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the CPU for a module holding neither."""
    for tensor in module.parameters():
        return tensor.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")
