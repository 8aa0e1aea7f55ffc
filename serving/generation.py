"""Static-batch generation with HF ``generate`` over the adapter context: the beam-search path.

Greedy and sampled decoding go through the continuous-batching engine (:mod:`serving.engine`, via
:mod:`serving.stack`); the engine does not do beam search, so ``fedmosaic eval --num-beams N`` (N > 1,
the FedDPA reference used 4) and ``fedmosaic generate`` use this module: prompts are left-padded into
batches, each row gets its adapter weights (``(B, K)`` over named adapters) through the model's
:class:`~adapters.AdapterContext`, and HF ``generate`` decodes (the layers repeat each row's weights for
beams). :func:`generate_target` serves a *target name* exactly as the engine would: routed targets
(FedDPA instance-wise weights, paper 000 section 4.3) get their per-row weights from the same routing
hook, run on each prompt's own prefill with the plan's prefill weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from adapters import AdaptedModel, module_device
from adapters.context import weight_matrix
from serving.errors import InvalidRequest
from serving.targets import TargetPlan

if TYPE_CHECKING:
    from serving.stack import ServingStack

# Plan modes whose weights are one (K,) row per request: what HF generate's per-row context can apply.
ROW_MODES = ("base", "adapter", "feddpa", "mixture")


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings.

    Attributes:
        max_new_tokens: generated tokens per prompt at most.
        num_beams: 1 is greedy (the default of our protocol); the FedDPA reference used 4.
        batch_size: prompts per forward batch.
    """

    max_new_tokens: int = 64
    num_beams: int = 1
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_beams", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerationConfig.{name} must be a positive integer, got {value!r}")


def generate(
    adapted: AdaptedModel | None,
    model: torch.nn.Module,
    tokenizer: object,
    prompts: Sequence[str],
    names: Sequence[str] = (),
    weights: torch.Tensor | Sequence[Sequence[float]] | None = None,
    config: GenerationConfig = GenerationConfig(),
    autocast: object | None = None,
) -> list[str]:
    """Generate a completion for every prompt, row ``i`` with adapter weights ``weights[i]``.

    Args:
        adapted: the injected model (None for a bare base model).
        model: the HF causal LM (``adapted.model`` when injected).
        tokenizer: its tokenizer (a pad token is required).
        prompts: already-templated prompt strings.
        names: adapter names, K of them; empty for the base model.
        weights: ``(len(prompts), K)``; one row ``(K,)`` applies to all prompts; None with no names.
        config: decoding settings.
        autocast: a context-manager factory for the compute dtype (e.g. ``LoadedModel.autocast``).

    Returns:
        The decoded completions (prompt excluded, special tokens removed, stripped).
    """
    if names and adapted is None:
        raise ValueError("adapter names were given but the model has no adapters injected")
    device = module_device(model)
    w = _weights(names, weights, len(prompts)).to(device)
    outputs: list[str] = []
    side = tokenizer.padding_side  # type: ignore[attr-defined]
    tokenizer.padding_side = "left"  # type: ignore[attr-defined]
    try:
        for start in range(0, len(prompts), config.batch_size):
            batch = list(prompts[start:start + config.batch_size])
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)  # type: ignore[operator]
            enc = {k: v.to(device) for k, v in enc.items()}  # the tokenizer gives CPU tensors
            kwargs = dict(
                max_new_tokens=config.max_new_tokens,
                num_beams=config.num_beams,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
                eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
            )
            with torch.inference_mode(), (autocast() if callable(autocast) else _null()):
                if adapted is not None and names:
                    with adapted.context.use(tuple(names), w[start:start + len(batch)]):
                        out = model.generate(**enc, **kwargs)  # type: ignore[operator]
                else:
                    out = model.generate(**enc, **kwargs)  # type: ignore[operator]
            new = out[:, enc["input_ids"].shape[1]:]
            outputs.extend(t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True))  # type: ignore[attr-defined]
    finally:
        tokenizer.padding_side = side  # type: ignore[attr-defined]
    return outputs


def _weights(names: Sequence[str], weights: object, n: int) -> torch.Tensor:
    if not names:
        return torch.zeros(n, 0, device="cpu")  # validated on the host, moved by the caller
    if weights is None:
        raise ValueError(f"weights are required for adapters {list(names)}")
    if isinstance(weights, torch.Tensor):
        w = weights
    else:  # rows of weights over the same names: the one builder (adapters.context.weight_matrix)
        rows = [list(r) for r in weights] if weights and isinstance(weights[0], Sequence) else [list(weights)]  # type: ignore[index, arg-type]
        w = weight_matrix([(tuple(names), r) for r in rows])[1] if all(len(r) == len(names) for r in rows) \
            else torch.tensor(rows, dtype=torch.float32)
    if w.dim() == 1:
        w = w.unsqueeze(0)
    if w.shape[0] == 1 and n != 1:
        w = w.expand(n, -1)
    if w.dim() != 2 or w.shape != (n, len(names)):
        raise ValueError(f"weights must have shape ({n}, {len(names)}), got {tuple(w.shape)}")
    return w


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
            ids = loaded.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            ids = ids.to(device)
            with stack.adapted.context.use(tuple(internal), first), loaded.autocast():
                out = loaded.model(input_ids=ids, output_hidden_states=True, logits_to_keep=1)  # type: ignore[operator]
            hidden = out.hidden_states[-1]  # (1, T, H): one prompt, no padding
            state = hidden[0].float().mean(dim=0) if plan.pooling == "mean" else hidden[0, -1].float()  # (H,)
            weights, info = plan.weight_fn(state, ids[0].tolist())
            rows.append((tuple(float(w) for w in weights), dict(info)))
    return rows


def generate_target(stack: ServingStack, target: str, prompts: Sequence[str],
                    config: GenerationConfig = GenerationConfig()) -> list[TargetCompletion]:
    """Generate for every prompt with the served ``target`` (beam search when ``config.num_beams > 1``).

    Raises:
        ModelNotFound: ``target`` is not served by ``stack``.
        InvalidRequest: the target is not served with one weight row per request (e.g. token routing),
            which HF generate cannot apply; use the engine (``num_beams=1``).
    """
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


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
