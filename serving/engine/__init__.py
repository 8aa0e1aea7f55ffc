"""The engine: continuous batching over one frozen base model with per-row adapter weights.

It imports only :mod:`adapters`, :mod:`models`, serving's bottom modules (:mod:`serving.errors`) and
routing's error types (a failing router fails its request with the right status);
everything above it (the pool, the composition, the edges) talks to it through these names.
"""

from serving.engine.config import EngineConfig
from serving.engine.engine import Engine, EngineStats, StepReport
from serving.engine.request import GenerationRequest, GenerationResult, RequestHandle, WeightFn
from serving.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "GenerationRequest", "GenerationResult", "RequestHandle",
           "SamplingParams", "StepReport", "WeightFn"]
