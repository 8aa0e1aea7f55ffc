"""Static-batch generation with HF ``generate`` over the adapter context: the beam-search path.

Greedy and sampled decoding go through the continuous-batching engine (:mod:`serving.engine`, via
:mod:`serving.stack`); the engine does not do beam search, so ``fedmosaic eval --num-beams N`` (N > 1,
the FedDPA reference used 4) and ``fedmosaic generate`` use this module: :func:`generate` (from
``adapters/generation.py``, re-exported here) left-pads prompts into batches, gives each row its adapter
weights through the model's :class:`~adapters.AdapterContext` and lets HF ``generate`` decode (the
layers repeat each row's weights for beams). :func:`generate_target` serves a *target name* exactly as
the engine would: routed targets (FedDPA instance-wise weights, paper 000 section 4.3) get their per-row
weights from the same routing hook, run on each prompt's own prefill with the plan's prefill weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from adapters.generation import GenerationConfig, generate
from serving.errors import InvalidRequest
from serving.targets import TargetPlan

if TYPE_CHECKING:
    from serving.stack import ServingStack

__all__ = ["ROW_MODES", "GenerationConfig", "TargetCompletion", "generate", "generate_target", "plan_weights"]

# Plan modes whose weights are one (K,) row per request: what HF generate's per-row context can apply.
ROW_MODES = ("base", "adapter", "feddpa", "mixture")


@dataclass(frozen=True)
class TargetCompletion:
    """One completion of :func:`generate_target` and the weights it was decoded with."""

    text: str
    weights: dict[str, float] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)


def plan_weights(stack: ServingStack, plan: TargetPlan, internal: Sequence[str], prompts: Sequence[str]
                 ) -> list[tuple[tuple[float, ...], Mapping[str, Any]]]:
    """Per-prompt ``(weights (K,), info)`` of ``plan``: its fixed weights, or its routing hook's.

    A routed plan is run as the engine runs it: each prompt is prefilled alone with the plan's
    ``prefill_weights`` and the final-layer state of its last token (or their mean, ``plan.pooling``)
    goes to ``weight_fn`` with the prompt's ids.

    Args:
        stack: the serving stack whose model runs the prefills.
        plan: a resolved target.
        internal: the leased (internal) adapter names of ``plan.names``.
        prompts: templated prompts.
    """
    if plan.weight_fn is None:
        return [(tuple(plan.weights), dict(plan.info or {})) for _ in prompts]
    loaded = stack.loaded
    device = loaded.device
    first = torch.tensor([plan.prefill_weights if plan.prefill_weights is not None else plan.weights],
                         device=device)  # (1, K)
    rows: list[tuple[tuple[float, ...], Mapping[str, Any]]] = []
    with torch.inference_mode(), stack.engine.model_lock:
        for prompt in prompts:
            ids = loaded.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            ids = ids.to(device)
            with stack.adapted.context.use(tuple(internal), first), loaded.autocast():
                out = loaded.model(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1]  # (1, T, H): one prompt, no padding
            state = hidden[0].float().mean(dim=0) if plan.pooling == "mean" else hidden[0, -1].float()  # (H,)
            weights, info = plan.weight_fn(state, ids[0].tolist())
            rows.append((tuple(float(w) for w in weights), dict(info)))
    return rows


def generate_target(stack: ServingStack, target: str, prompts: Sequence[str],
                    config: GenerationConfig | None = None) -> list[TargetCompletion]:
    """Generate for every prompt with the served ``target`` (beam search when ``config.num_beams > 1``).

    Raises:
        ModelNotFound: ``target`` is not served by ``stack``.
        InvalidRequest: the target is not served with one weight row per request (e.g. token routing),
            which HF generate cannot apply; use the engine (``num_beams=1``).
    """
    config = config or GenerationConfig()
    plan = stack.plan(target)
    if plan.mode not in ROW_MODES:
        raise InvalidRequest(f"target {target!r} is served in mode {plan.mode!r}; beam search supports "
                             f"{ROW_MODES} only: decode it with the engine (num_beams=1)", param="model")
    lease = stack.lease(plan)
    internal = lease.names if lease is not None else ()
    try:
        rows = plan_weights(stack, plan, internal, prompts)
        weights = [list(w) for w, _ in rows] if internal else None
        with stack.engine.model_lock:
            texts = generate(stack.adapted, stack.loaded.model, stack.loaded.tokenizer, prompts, internal, weights,
                             config, autocast=stack.loaded.autocast)
    finally:
        if lease is not None:
            lease.release()
    return [TargetCompletion(text, dict(zip(plan.names, w, strict=True)), info)
            for text, (w, info) in zip(texts, rows, strict=True)]
