"""Repository-wide pytest setup, loaded before any test module: Triton's CPU interpreter without a GPU.

Triton kernels run on CPU tensors only in Triton's interpreter, which has to be switched on
(TRITON_INTERPRET=1) before triton is first imported, and torch._dynamo (imported by transformers)
imports triton as soon as it is installed. So, when no CUDA GPU is present, the variable is set here
for the whole session (tests/serving/engine/kernels/test_kernels.py then runs serving.engine.kernels'
Triton kernels on CPU); with a GPU it is left alone, so tests/gpu runs the compiled kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
