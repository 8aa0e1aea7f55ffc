"""What one federated round costs: FedIT against a plain PEFT loop, and FedDPA-T against FedIT.

Three timings over the same clients, examples, batch order, steps and compute dtype:

* ``plain_peft_s``: a hand-written PEFT + PyTorch loop (``peft.get_peft_model``, AdamW, linear decay,
  gradient accumulation, autocast) training each client's copy of one LoRA, then a FedAvg of the
  copies: the least a FedIT round can cost with off-the-shelf tools.
* ``fedit_round_s``: one FedIT round through our protocol (``Strategy.configure_round``,
  ``ClientAlgorithm.fit`` per client, ``Strategy.aggregate``) on the multi-adapter layer.
* ``feddpa_t_round_s``: one FedDPA-T round from round 1 on (paper 000 section 4.2): each client trains
  its local adapter beside the frozen global, then the global alone, so about twice FedIT's work.

Each loop's training tokens per second (the real tokens of the examples its steps drew, padding not
counted) and its loss (each client's mean step loss, as ``TrainResult.loss``) are reported too: FedIT's and
the plain loop's losses agree up to float order when LoRA dropout is off (``--lora-dropout 0``, the
default here; with dropout on, the two layers draw different masks). ``--data feddpa1`` trains on FedDPA
dataset 1's clients (``FEDMOSAIC_DATA_DIR``, the real spread of lengths) instead of the generated suite.
``--random smollm2|llama7b`` builds a random bf16 model of SmolLM2's or LLaMA-7B's shape on the device
instead of loading weights (for a GPU machine that has SmolLM2's tokenizer but not its weights; speed does
not depend on the values; the vocabulary widens to the tokenizer's 49,152 ids).
``--profile FILE`` runs one more FedDPA-T round under the torch profiler, writes its Chrome trace to FILE
and prints the top operators to stderr.

Prints one JSON object with the times and the ``fedit_over_plain`` and ``feddpa_t_over_fedit`` ratios,
each the minimum over ``--repeats`` interleaved runs (the least disturbed by other work on a shared
CPU), and the 1-minute load average to judge that. Both loops run on ``--device`` (default: the
``FEDMOSAIC_DEVICE`` setting, auto = CUDA when present) in the device's default dtype (``--dtype``
overrides; bf16 on CUDA), and every timing waits for the device. Usage: ``python bench/train_round.py
[--model smollm2|tiny|FOLDER] [--random smollm2|llama7b] [--device auto|cpu|cuda|cuda:N] [--dtype D]
[--data generated|feddpa1] [--clients 3] [--steps 3] [--batch 4] [--micro-batch 4] [--cutoff N]
[--lora-dropout 0] [--repeats 1] [--threads N] [--profile FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from adapters.io import peft_key
from models import LoadedModel, load_base_model
from models.loaded import frozen
from models.settings import DEVICE_HELP, DTYPES, device_option, resolve_device
from training.aggregate import weighted_average
from training.algorithms import get_method
from training.data import Example, collate, generate_suite, load_dataset
from training.protocol import ClientContext, derive_seed
from training.runtime import Runtime, TrainConfig, preset


def _load(model: str, device: str | None, dtype: str | None, random: str | None = None) -> LoadedModel:
    if random is None:
        return load_base_model(model, dtype=dtype, device=device)  # type: ignore[arg-type]
    # A random bf16 model of a named shape, built on the device; the tokenizer is --model's (a folder
    # with tokenizer.json) or the prepared SmolLM2's, and its ids widen the vocabulary where needed.
    from gpu_decode import random_llama, tokenizer_for

    if dtype not in (None, "bfloat16"):
        raise SystemExit(f"--random builds a bfloat16 model; --dtype {dtype} does not apply")
    tokenizer = tokenizer_for(model if Path(model).is_dir() else None)
    model_obj = random_llama(random, 4096, resolve_device(device), vocab_size=len(tokenizer))  # type: ignore[arg-type]
    return frozen(model_obj, tokenizer, f"random-{random}", "bfloat16")


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


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock time covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def protocol_round(method: str, runtime: Runtime, clients: Sequence, round_idx: int, seed: int
                   ) -> tuple[float, list[float]]:
    """Seconds for one round of ``method`` through the strategy/client protocol (no disk IO), each client's loss."""
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
    return time.perf_counter() - start, [float(r.metrics["loss"]) for r in results]


def drawn_tokens(examples: Sequence[Example], train: TrainConfig, seed: int) -> int:
    """Real tokens (no padding) of the examples a local run with ``seed`` draws: the trainer's shuffle replayed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total = train.max_steps or math.ceil(len(examples) / train.batch_size) * train.local_epochs
    order: list[int] = []
    tokens = 0
    for _ in range(total):
        if len(order) < train.batch_size:
            order += torch.randperm(len(examples), generator=gen, device="cpu").tolist()
        idx, order = order[: train.batch_size], order[train.batch_size:]
        tokens += sum(len(examples[i].input_ids) for i in idx)
    return tokens


def peft_model(loaded: LoadedModel, train: TrainConfig) -> torch.nn.Module:
    """The base model wrapped by PEFT with the same LoRA settings as ours."""
    from peft import LoraConfig, get_peft_model

    lora = train.lora
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(loaded.model, cfg)


def plain_peft_round(model: torch.nn.Module, loaded: LoadedModel, examples: dict[str, list[Example]],
                     train: TrainConfig, seed: int, start_state: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
    """Seconds for the same FedIT round written directly against PEFT and PyTorch, each client's mean step loss.

    ``start_state`` is FedIT's initial global adapter (our keys), so both loops train from the same LoRA.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    pad, device = loaded.tokenizer.pad_token_id, loaded.device  # type: ignore[attr-defined]
    _sync(device)
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
    _sync(device)
    return time.perf_counter() - start, [float(v) for v in losses]


def _clients(data: str, seed: int, n_train: int, count: int) -> list:
    if data == "generated":
        return list(generate_suite(seed=seed, n_train=n_train, n_test=1).clients[:count])
    return list(load_dataset(data).clients[:count])


def _profile(runtime: Runtime, clients: Sequence, seed: int, path: str) -> None:
    """One FedDPA-T round under the torch profiler: a Chrome trace in ``path``, the top operators on stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runtime.device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        protocol_round("feddpa-t", runtime, clients, 1, seed)
    prof.export_chrome_trace(path)
    key = "self_cuda_time_total" if runtime.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model folder")
    parser.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    parser.add_argument("--random", choices=("smollm2", "llama7b"), default=None,
                        help="a random bf16 model of this shape built on the device instead of --model's weights "
                             "(the tokenizer comes from --model's folder or the prepared SmolLM2)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the device's (bf16 on CUDA)")
    parser.add_argument("--data", default="generated",
                        help="generated (the project's suite, default) or feddpa1/feddpa2/dolly (FEDMOSAIC_DATA_DIR)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per client per phase")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--cutoff", type=int, default=None,
                        help="token cutoff (default 128 on generated data, the small preset's on benchmark data)")
    parser.add_argument("--lora-dropout", type=float, default=0.0,
                        help="LoRA dropout of both loops (0: their losses agree up to float order)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="also profile one FedDPA-T round: Chrome trace to FILE, top operators to stderr")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 keeps the ratios stable when another job shares the CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cutoff = args.cutoff or (128 if args.data == "generated" else None)
    train = preset("small", batch_size=args.batch, micro_batch_size=args.micro_batch, max_steps=args.steps,
                   cutoff_len=cutoff, lr=3e-4)
    train = dataclasses.replace(train, lora=dataclasses.replace(train.lora, dropout=args.lora_dropout))
    clients = _clients(args.data, args.seed, max(args.batch * 2, 8), args.clients)
    ours = Runtime(_load(args.model, args.device, args.dtype, args.random), train)
    examples = {c.client_id: ours.examples(c) for c in clients}
    # Warm-up: first forward/backward pays one-off allocation and kernel selection costs.
    protocol_round("fedit", ours, clients[:1], 0, args.seed)
    # a second copy: our injection wraps the first model's Linears
    plain_loaded = as_transformers_loads_it(_load(args.model, args.device, args.dtype, args.random))
    plain_model = peft_model(plain_loaded, train)
    fedit = get_method("fedit")
    start_state = fedit.strategy({**fedit.defaults, "seed": args.seed}).initial_state(ours)
    plain_peft_round(plain_model, plain_loaded, dict(list(examples.items())[:1]), train, args.seed, start_state)
    runs: dict[str, Callable[[], tuple[float, list[float]]]] = {
        "fedit": lambda: protocol_round("fedit", ours, clients, 0, args.seed),
        "feddpa_t": lambda: protocol_round("feddpa-t", ours, clients, 1, args.seed),
        "plain": lambda: plain_peft_round(plain_model, plain_loaded, examples, train, args.seed, start_state),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so that load drifting on a shared CPU hits every variant
        for name, fn in runs.items():
            seconds, losses[name] = fn()
            times[name].append(seconds)
    fedit, feddpa_t, plain = (min(times[k]) for k in ("fedit", "feddpa_t", "plain"))
    # tokens each round trains on: FedIT and the plain loop one pass per client, FedDPA-T two (local, global)
    global_tokens = sum(drawn_tokens(examples[c.client_id], train, derive_seed(args.seed, 0, c.client_id, "global"))
                        for c in clients)
    dpa_tokens = sum(drawn_tokens(examples[c.client_id], train, derive_seed(args.seed, 1, c.client_id, phase))
                     for c in clients for phase in ("local", "global"))
    if args.profile:
        _profile(ours, clients, args.seed, args.profile)
    lengths = [len(e.input_ids) for exs in examples.values() for e in exs]
    print(json.dumps({
        "benchmark": "train_round",
        "model": f"random {args.random}-shaped" if args.random else args.model,
        "parameters": sum(p.numel() for p in ours.loaded.model.parameters()),
        "data": args.data,
        "device": str(ours.device),
        "gpu": torch.cuda.get_device_name(ours.device) if ours.device.type == "cuda" else None,
        "dtype": ours.loaded.dtype,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "clients": len(clients),
        "steps_per_phase": args.steps,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "cutoff": train.cutoff_len,
        "lora_dropout": args.lora_dropout,
        "mean_tokens_per_example": round(sum(lengths) / len(lengths), 1),
        "plain_peft_s": round(plain, 3),
        "fedit_round_s": round(fedit, 3),
        "feddpa_t_round_s": round(feddpa_t, 3),
        "fedit_over_plain": round(fedit / plain, 3),
        "feddpa_t_over_fedit": round(feddpa_t / fedit, 3),
        "plain_tokens_per_s": round(global_tokens / plain, 1),
        "fedit_tokens_per_s": round(global_tokens / fedit, 1),
        "feddpa_t_tokens_per_s": round(dpa_tokens / feddpa_t, 1),
        "plain_loss": [round(v, 6) for v in losses["plain"]],
        "fedit_loss": [round(v, 6) for v in losses["fedit"]],
        "loss_max_abs_diff": round(max(abs(a - b) for a, b in zip(losses["plain"], losses["fedit"], strict=True)), 7),
        "repeats": args.repeats,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
