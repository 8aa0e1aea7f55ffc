"""What one federated round costs: FedIT against a plain PEFT loop, and FedDPA-T against FedIT.

Three timings over the same clients, examples, batch order, steps and compute dtype:

* ``plain_peft_s``: a hand-written PEFT + PyTorch loop (``peft.get_peft_model``, AdamW, linear decay,
  gradient accumulation, autocast) training each client's copy of one LoRA, then a FedAvg of the
  copies: the least a FedIT round can cost with off-the-shelf tools.
* ``fedit_round_s``: one FedIT round through our protocol (``Strategy.configure_round``,
  ``ClientAlgorithm.fit`` per client, ``Strategy.aggregate``) on the multi-adapter layer.
* ``feddpa_t_round_s``: one FedDPA-T round from round 1 on (paper 000 section 4.2): each client trains
  its local adapter beside the frozen global, then the global alone, so about twice FedIT's work.

Prints one JSON object with the times and the ``fedit_over_plain`` and ``feddpa_t_over_fedit`` ratios,
each the minimum over ``--repeats`` interleaved runs (the least disturbed by other work on a shared
CPU), and the 1-minute load average to judge that. Both loops run on ``--device`` (default: the
``FEDMOSAIC_DEVICE`` setting, auto = CUDA when present) in the device's default dtype (``--dtype``
overrides; bf16 on CUDA), and every timing waits for the device. Usage: ``python bench/train_round.py
[--model smollm2|tiny|FOLDER] [--device auto|cpu|cuda|cuda:N] [--dtype D] [--clients 3] [--steps 3]
[--batch 4] [--micro-batch 4] [--cutoff 128] [--repeats 1] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence

import torch

from models import LoadedModel, load_base_model
from models.settings import DEVICE_HELP, DTYPES, device_option
from training.aggregate import weighted_average
from training.algorithms import get_method
from training.data import Example, collate, generate_suite
from training.protocol import ClientContext, derive_seed
from training.runtime import Runtime, TrainConfig, preset


def _load(model: str, device: str | None, dtype: str | None) -> LoadedModel:
    return load_base_model(model, dtype=dtype, device=device)  # type: ignore[arg-type]


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock time covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def protocol_round(method: str, runtime: Runtime, clients: Sequence, round_idx: int, seed: int) -> float:
    """Seconds for one round of ``method`` through the strategy/client protocol (no disk IO)."""
    m = get_method(method)
    opts = {**m.defaults, "seed": seed}
    strategy, client = m.strategy(opts), m.client(opts)
    state = strategy.initial_state(runtime)
    private: dict[str, dict] = {}
    _sync(runtime.device)
    start = time.perf_counter()
    ins = strategy.configure_round(round_idx, [c.client_id for c in clients], state)
    results = [client.fit(ins[c.client_id], ClientContext(c.client_id, c, runtime, private.setdefault(c.client_id, {}),
                                                          seed)) for c in clients]
    strategy.aggregate(round_idx, results, [], state)
    _sync(runtime.device)
    return time.perf_counter() - start


def peft_model(loaded: LoadedModel, train: TrainConfig) -> torch.nn.Module:
    """The base model wrapped by PEFT with the same LoRA settings as ours."""
    from peft import LoraConfig, get_peft_model

    lora = train.lora
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(loaded.model, cfg)


def plain_peft_round(model: torch.nn.Module, loaded: LoadedModel, examples: dict[str, list[Example]],
                     train: TrainConfig, seed: int) -> float:
    """Seconds for the same FedIT round written directly against PEFT and PyTorch."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    pad, device = loaded.tokenizer.pad_token_id, loaded.device  # type: ignore[attr-defined]
    _sync(device)
    start = time.perf_counter()
    received = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    uploads = []
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
        for _ in range(total):
            if len(order) < train.batch_size:
                order += torch.randperm(len(exs), generator=gen).tolist()
            idx, order = order[: train.batch_size], order[train.batch_size:]
            opt.zero_grad(set_to_none=True)
            for s in range(0, len(idx), train.micro_batch_size):
                batch = collate([exs[i] for i in idx[s:s + train.micro_batch_size]], pad_id=pad, device=device)
                with loaded.autocast():
                    loss = model(**batch).loss
                (loss * (len(batch["input_ids"]) / len(idx))).backward()
            opt.step()
            sched.step()
        model.eval()
        uploads.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()})
    weighted_average(uploads, [1.0] * len(uploads))
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model folder")
    parser.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the device's (bf16 on CUDA)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per client per phase")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--cutoff", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 keeps the ratios stable when another job shares the CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    train = preset("small", batch_size=args.batch, micro_batch_size=args.micro_batch, max_steps=args.steps,
                   cutoff_len=args.cutoff, lr=3e-4)
    data = generate_suite(seed=args.seed, n_train=max(args.batch * 2, 8), n_test=1)
    clients = list(data.clients[: args.clients])
    ours = Runtime(_load(args.model, args.device, args.dtype), train)
    examples = {c.client_id: ours.examples(c) for c in clients}
    # Warm-up: first forward/backward pays one-off allocation and kernel selection costs.
    protocol_round("fedit", ours, clients[:1], 0, args.seed)
    # a second copy: our injection wraps the first model's Linears
    plain_loaded = _load(args.model, args.device, args.dtype)
    plain_model = peft_model(plain_loaded, train)
    plain_peft_round(plain_model, plain_loaded, dict(list(examples.items())[:1]), train, args.seed)
    runs: dict[str, Callable[[], float]] = {
        "fedit": lambda: protocol_round("fedit", ours, clients, 0, args.seed),
        "feddpa_t": lambda: protocol_round("feddpa-t", ours, clients, 1, args.seed),
        "plain": lambda: plain_peft_round(plain_model, plain_loaded, examples, train, args.seed),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved, so that load drifting on a shared CPU hits every variant
        for name, fn in runs.items():
            times[name].append(fn())
    fedit, feddpa_t, plain = (min(times[k]) for k in ("fedit", "feddpa_t", "plain"))
    lengths = [len(e.input_ids) for exs in examples.values() for e in exs]
    print(json.dumps({
        "benchmark": "train_round",
        "model": args.model,
        "device": str(ours.device),
        "gpu": torch.cuda.get_device_name(ours.device) if ours.device.type == "cuda" else None,
        "dtype": ours.loaded.dtype,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "clients": len(clients),
        "steps_per_phase": args.steps,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "cutoff": args.cutoff,
        "mean_tokens_per_example": round(sum(lengths) / len(lengths), 1),
        "plain_peft_s": round(plain, 3),
        "fedit_round_s": round(fedit, 3),
        "feddpa_t_round_s": round(feddpa_t, 3),
        "fedit_over_plain": round(fedit / plain, 3),
        "feddpa_t_over_fedit": round(feddpa_t / fedit, 3),
        "repeats": args.repeats,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
