"""The local training loop shared by every method: adapters to train, adapters mixed in, the data.

The settings are the method's regime (:mod:`training.local.regime`) under the run's budget: a new optimizer every
local run (FedDPA: AdamW, lr 3e-4, linear decay, no warm-up, as the reference's HF Trainer, docs/methods.md 2.3;
FedAMoLE: Adam, constant inside the run, lr decayed x0.99 per round), ``local_epochs`` passes (or
``max_steps``), ``batch_size`` per step built from ``micro_batch_size`` forwards with gradient accumulation,
loss only on response tokens (the LM head runs on those positions alone, :mod:`training.local.lm_forward`). A
loss marked :func:`length_grouped` runs each step as length-grouped forwards that keep every token's weight,
or on the CPU as the plain split's micro-batches packed without padding (:mod:`training.local.micro_batches`,
:mod:`training.local.packing`). A loss with a term over the whole logical batch (FedOA's feature distance,
FedMCP's CKA) implements :class:`BatchLoss`: it sees every micro-batch of a step before the first one is
differentiated, so its value and gradients do not depend on ``micro_batch_size``. Every random
choice (shuffling, dropout) comes from the given seed, so a run resumed from a checkpoint repeats the
uninterrupted run exactly. The forward uses the runtime's adapter context: ``names``/``weights`` say
which adapters are on, ``trainable`` which of them get gradients (FedDPA-T's frozen global).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from training.data import Example
from training.local.lm_forward import lm_forward
from training.local.micro_batches import packs, step_batches
from training.local.packing import batch_rows
from training.local.regime import run_steps, schedule_factor
from training.local.runtime import PRESETS, Runtime, TrainConfig, preset

# TrainConfig and its presets live with the runtime (which owns the adapters' LoRA config); they are
# re-exported here because this is where a method author looks for the training settings.
__all__ = ["PRESETS", "BatchLoss", "LossFn", "TrainConfig", "TrainResult", "length_grouped", "lm_loss", "preset",
           "train_adapters"]

# (runtime, batch, names, weights (B, K)) -> (loss, extra scalar metrics); the default is the LM loss.
LossFn = Callable[
    [Runtime, dict[str, torch.Tensor], Sequence[str], torch.Tensor], tuple[torch.Tensor, dict[str, float]]
]


@runtime_checkable
class BatchLoss(Protocol):
    """A loss that needs the whole logical batch: told about a step's micro-batches before they are run."""

    def begin_step(self, runtime: Runtime, batches: Sequence[dict[str, torch.Tensor]], names: Sequence[str],
                   weights: torch.Tensor) -> None:
        """Called once per optimizer step with its collated micro-batches and the adapters' (1, K) weight row.

        The loss sets the adapter context for its own forwards (one per micro-batch: rows differ).
        """

    def __call__(self, runtime: Runtime, batch: dict[str, torch.Tensor], names: Sequence[str],
                 weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class TrainResult:
    """What a local run reports: mean loss, steps taken, examples seen, extra metric means."""

    loss: float
    steps: int
    examples: int
    extra: dict[str, float]

    def metrics(self) -> dict[str, float]:
        """Flat dict for FitRes.metrics."""
        return {"loss": self.loss, "steps": float(self.steps), **self.extra}


def length_grouped(loss_fn: LossFn) -> LossFn:
    """Mark ``loss_fn`` as one whose step loss is the same for any grouping of the step's examples.

    Its LM terms go through :func:`training.local.lm_forward.lm_forward` (which reads a batch's ``loss_weight``)
    and its other terms are per-step (a proximal term, a :class:`BatchLoss`'s whole-batch term), so the
    trainer may run the step as length-grouped micro-batches (:mod:`training.local.micro_batches`), or as packed
    rows whose states are (1, N, H) (:mod:`training.local.packing`; ``padded_states`` gives them one row per
    example). A class says the same with a ``length_grouped = True`` attribute.
    """
    loss_fn.length_grouped = True  # type: ignore[attr-defined]  # a function attribute: train_adapters getattr()s it
    return loss_fn


@length_grouped
def lm_loss(runtime: Runtime, batch: dict[str, torch.Tensor], names: Sequence[str],
            weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The causal-LM loss (shifted cross-entropy over response tokens) with the given adapters on."""
    del names, weights  # already set on the context by the caller
    out = lm_forward(runtime.model, batch)
    assert out.loss is not None
    return out.loss, {}


def _optimizer(runtime: Runtime, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    cfg = runtime.train
    # One fused kernel over the many small LoRA tensors (120 for SmolLM2's q,v): the per-tensor loop costs
    # about 4x as much on a CPU (bench/training/HISTORY.md); same update up to float reassociation.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, fused=fused)
    return torch.optim.SGD(params, lr=lr)


def step_draws(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """The example indices of each optimizer step of a local run over ``n`` examples, endlessly.

    Epochs of a shuffle seeded with ``seed`` (a CPU generator: the same order on every device), cut
    ``batch_size`` at a time; a step may take the end of one epoch and the start of the next.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order += torch.randperm(n, generator=gen, device="cpu").tolist()
        idx, order = order[:batch_size], order[batch_size:]
        yield idx


def train_adapters(
    runtime: Runtime,
    examples: Sequence[Example],
    trainable: Sequence[str],
    names: Sequence[str],
    weights: Sequence[float],
    seed: int,
    loss_fn: LossFn = lm_loss,
    desc: str = "train",
    extra_params: Sequence[torch.nn.Parameter] = (),
    round_idx: int = 0,
) -> TrainResult:
    """Train ``trainable`` adapters on ``examples`` with adapters ``names`` mixed at ``weights``.

    Args:
        runtime: the shared model and settings.
        examples: tokenized local examples.
        trainable: adapters whose A and B get gradients; the others in ``names`` are detached.
        names: adapters on in the forward (K of them).
        weights: their weights (K,), the same for every row.
        seed: shuffling and dropout seed (derive it from (run seed, round, client)).
        loss_fn: the objective; the default is the LM loss.
        desc: progress-bar label.
        extra_params: further parameters to optimise (e.g. AMoLE token projections).
        round_idx: the round, for the regime's per-round learning-rate decay (-1: a final fine-tune, round 0's).
    """
    cfg = runtime.train
    if not examples:
        raise ValueError("cannot train on zero examples")
    torch.manual_seed(seed)  # dropout masks: the default generator of the model's device (CUDA's is seeded too)
    draws = step_draws(len(examples), cfg.batch_size, seed)
    total = run_steps(len(examples), cfg.batch_size, cfg.local_epochs, cfg.max_steps)
    adapted = runtime.adapted
    adapted.set_trainable(trainable)
    params = adapted.parameters_of(trainable) + list(extra_params)
    opt = _optimizer(runtime, params, cfg.round_lr(round_idx))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(cfg.schedule, s, total))
    pad, device = runtime.tokenizer.pad_token_id, runtime.device
    if len(weights) != len(names) or not all(math.isfinite(float(x)) for x in weights):
        raise ValueError(f"weights must be {len(names)} finite numbers for adapters {tuple(names)}, got {weights}")
    row = [float(x) for x in weights]
    w_row = torch.tensor([row], dtype=torch.float32, device=device).reshape(1, len(names))
    in_forward = tuple(t for t in trainable if t in names)  # AMoLE routes inside the loss instead
    grouped = bool(getattr(loss_fn, "length_grouped", False))
    batch_loss = loss_fn if isinstance(loss_fn, BatchLoss) else None
    packed = grouped and packs(device, runtime.model)
    losses: list[torch.Tensor] = []  # per step, on the device; read one step late so a GPU never idles
    extras: dict[str, list[float]] = {}
    runtime.model.train()
    bar = tqdm(total=total, desc=desc, leave=False, unit="step")
    try:
        for _ in range(total):
            idx = next(draws)
            opt.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64, device=device)
            batches = step_batches([examples[i] for i in idx], cfg.micro_batch_size, pad, device, grouped,
                                   more_forwards=batch_loss is None, packed=packed)
            if batch_loss is not None:
                with runtime.loaded.autocast():
                    batch_loss.begin_step(runtime, batches, names, w_row)
            for batch in batches:
                rows = batch_rows(batch)
                w = w_row.expand(batch["input_ids"].shape[0], -1)  # (B, K): one row for a packed batch
                # the row on the host (adapters.context.uniform): no device sync, no graph break when compiled
                with adapted.context.uniform(tuple(names), row, trainable=in_forward), runtime.loaded.autocast():
                    loss, extra = loss_fn(runtime, batch, names, w)
                (loss * (rows / len(idx))).backward()
                step_loss += loss.detach().double() * (rows / len(idx))
                for k, v in extra.items():
                    extras.setdefault(k, []).append(v)
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            sched.step()
            losses.append(step_loss)
            if len(losses) > 1:  # the previous step's loss: waiting for it leaves this step queued on a GPU
                bar.set_postfix(loss=f"{float(losses[-2]):.3f}")
            bar.update(1)
    finally:
        bar.close()
        opt.zero_grad(set_to_none=True)  # no stale gradients linger on shared adapters between clients
        runtime.model.eval()
        adapted.set_trainable(())
        for layer in adapted.layers.values():
            layer.invalidate_cache()
    values = torch.stack(losses).tolist()
    return TrainResult(loss=sum(values) / len(values), steps=total, examples=len(examples),
                       extra={k: sum(v) / len(v) for k, v in extras.items()})
