"""The plain PEFT + PyTorch loop that ``bench/training/round.py`` times FedIT against: what a FedIT round costs
with off-the-shelf tools (``peft.get_peft_model``, AdamW, linear decay, gradient accumulation, autocast),
on the same clients, examples, batch order and steps as our protocol's round."""

from __future__ import annotations

import math
import time

import torch

from adapters.io import peft_key
from models import LoadedModel
from training.data import Example, collate
from training.federation.aggregate import weighted_average
from training.local.runtime import TrainConfig
from training.state import derive_seed


def as_transformers_loads_it(loaded: LoadedModel) -> LoadedModel:
    """The plain loop's model as ``from_pretrained`` gives it: float32 weights, cast by autocast on every call.

    ``load_base_model`` stores an ``autocast-bf16`` model's linear weights in bfloat16 once
    (:func:`models.loaded.store_linear_bf16`); the values autocast computes with are the same either way,
    so the two loops' losses still agree, and the plain loop pays the per-call casts a user's loop pays.
    """
    for module in loaded.model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16 and loaded.dtype != "bfloat16":
            module.weight = torch.nn.Parameter(module.weight.detach().float(), requires_grad=False)
    return loaded


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock time covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peft_model(loaded: LoadedModel, train: TrainConfig) -> torch.nn.Module:
    """The base model wrapped by PEFT with the same LoRA settings as ours."""
    from peft import LoraConfig, get_peft_model

    lora = train.lora
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=lora.target_modules if isinstance(lora.target_modules, str)
                     else list(lora.target_modules), task_type="CAUSAL_LM")  # a regex or all-linear as given
    return get_peft_model(loaded.model, cfg)


def plain_peft_round(model: torch.nn.Module, loaded: LoadedModel, examples: dict[str, list[Example]],
                     train: TrainConfig, seed: int, start_state: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
    """Seconds for the same FedIT round written directly against PEFT and PyTorch, each client's mean step loss.

    ``start_state`` is FedIT's initial global adapter (our keys), so both loops train from the same LoRA.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    pad, device = loaded.tokenizer.pad_token_id, loaded.device  # type: ignore[attr-defined]
    sync(device)
    start = time.perf_counter()
    received = {peft_key(*k.rsplit(".", 1)): v.to(device) for k, v in start_state.items()}
    uploads = []
    losses: list[torch.Tensor] = []
    for cid, exs in examples.items():
        set_peft_model_state_dict(model, received)
        torch.manual_seed(derive_seed(seed, 0, cid, "global"))
        gen = torch.Generator().manual_seed(derive_seed(seed, 0, cid, "global"))
        total = train.max_steps or math.ceil(len(exs) / train.batch_size) * train.local_epochs
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s, total=total: max(0.0, 1.0 - s / total))
        model.train()
        order: list[int] = []
        step_losses = []
        for _ in range(total):
            if len(order) < train.batch_size:
                order += torch.randperm(len(exs), generator=gen).tolist()
            idx, order = order[: train.batch_size], order[train.batch_size:]
            opt.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64, device=device)
            for s in range(0, len(idx), train.micro_batch_size):
                batch = collate([exs[i] for i in idx[s:s + train.micro_batch_size]], pad_id=pad, device=device)
                with loaded.autocast():
                    loss = model(**batch).loss
                (loss * (len(batch["input_ids"]) / len(idx))).backward()
                step_loss += loss.detach().double() * (len(batch["input_ids"]) / len(idx))
            step_losses.append(step_loss)
            opt.step()
            sched.step()
        model.eval()
        losses.append(torch.stack(step_losses).mean())
        uploads.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()})
    weighted_average(uploads, [1.0] * len(uploads))
    sync(device)
    return time.perf_counter() - start, [float(v) for v in losses]
