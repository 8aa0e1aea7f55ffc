"""What one federated round costs: FedIT against a plain PEFT loop, and FedDPA-T against FedIT.

Timings over the same clients, examples, batch order, steps and compute dtype:

* ``plain_peft_s``: a hand-written PEFT + PyTorch loop (``peft.get_peft_model``, AdamW, linear decay,
  gradient accumulation, autocast) training each client's copy of one LoRA, then a FedAvg of the
  copies: the least a FedIT round can cost with off-the-shelf tools (``bench/training/plain_peft.py``).
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
``--compile [MODE]`` runs our rounds with the base model's decoder layers compiled (``TrainConfig.compile``,
``torch.compile`` mode ``default`` or the one named); ``--compile-plain`` compiles the plain loop's layers
too (its PEFT LoRA layers break the graph where they read their Python state). The warm-up then also runs
a FedDPA-T round, so each variant's compilation stays out of the timings (``warmup_s`` reports it).
``--profile FILE`` runs one more FedDPA-T round under the torch profiler, writes its Chrome trace to FILE
and prints the top operators to stderr (on a GPU twice: by device time, then by host time).

``padded_tokens`` counts what each loop's forwards compute (ours groups a step's rows by length, the plain
loop pads each micro-batch to its longest). FedDPA-T's local phase draws other examples than its global
phase (which draws FedIT's), so ``feddpa_t_over_fedit`` moves with their lengths;
``feddpa_t_over_fedit_equal_work`` scales FedDPA-T's time per padded token to twice FedIT's padded tokens
(attention's cost, quadratic in length, is the part this leaves out). ``feddpa_t_over_two_fedit_rounds``
times FedIT's rounds 0 and 1 back to back, a window as long as FedDPA-T's round (a minimum over short
windows dodges more of a shared machine's swings than one over long ones); with ``--train-examples`` equal
to steps x batch every phase trains on the same examples, so it compares the same work (target <= 1.05,
the issue's 2.1x over two). ``times_s`` lists every repeat.

``matmul_gflop`` counts what FedIT's and the plain loop's matrix products compute (``bench/training/step_flops.py``:
linears, head and LoRA forward and backward, attention apart), ``matmul_gflop_per_s`` the rate each loop
reached, and ``plain_over_fedit_matmul_flops`` their ratio: on a device where the products set the time
(a CPU), the most FedIT can gain over the plain loop by computing less (compare ``1 / fedit_over_plain``).

Prints one JSON object with the times and the ``fedit_over_plain`` and ``feddpa_t_over_fedit`` ratios,
each the minimum over ``--repeats`` interleaved runs (the least disturbed by other work on a shared
CPU), and the 1-minute load average to judge that. Both loops run on ``--device`` (default: the
``FEDMOSAIC_DEVICE`` setting, auto = CUDA when present) in the device's default dtype (``--dtype``
overrides; bf16 on CUDA), and every timing waits for the device. Usage: ``python -m bench.training.round
[--model smollm2|tiny|FOLDER] [--random smollm2|llama7b] [--device auto|cpu|cuda|cuda:N] [--dtype D]
[--data generated|feddpa1] [--clients 3] [--steps 3] [--train-examples N] [--batch 4] [--micro-batch 4] [--cutoff N]
[--lora-dropout 0] [--repeats 1] [--threads N] [--compile [MODE]] [--compile-plain] [--profile FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import operator
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.training.plain_peft import as_transformers_loads_it, peft_model, plain_peft_round, sync
from bench.training.step_flops import DecoderShape, step_flops
from models import LoadedModel, ModelError, load_base_model
from models.loaded import COMPILE_MODES, compile_decoder_layers, frozen
from models.settings import DEVICE_HELP, DTYPES, device_option, resolve_device
from training.algorithms import get_method
from training.data import Example, generate_suite, load_dataset
from training.local.micro_batches import packs, step_batches
from training.local.runtime import Runtime, TrainConfig, preset
from training.local.train import step_draws
from training.protocol import ClientContext
from training.state import derive_seed


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


def protocol_round(method: str, runtime: Runtime, clients: Sequence, round_idx: int, seed: int
                   ) -> tuple[float, list[float]]:
    """Seconds for one round of ``method`` through the strategy/client protocol (no disk IO), each client's loss."""
    m = get_method(method)
    opts = {**m.defaults, "seed": seed}
    strategy, client = m.strategy(opts), m.client(opts)
    state = strategy.initial_state(runtime)
    private: dict[str, dict] = {}
    sync(runtime.device)
    start = time.perf_counter()
    ins = strategy.configure_round(round_idx, [c.client_id for c in clients], state)
    results = [client.fit(ins[c.client_id], ClientContext(c.client_id, c, runtime, private.setdefault(c.client_id, {}),
                                                          seed)) for c in clients]
    strategy.aggregate(round_idx, results, [], state)
    sync(runtime.device)
    return time.perf_counter() - start, [float(r.metrics["loss"]) for r in results]


def two_rounds(runtime: Runtime, clients: Sequence, seed: int) -> tuple[float, list[float]]:
    """Seconds for FedIT's rounds 0 and 1 back to back (round 1 draws FedDPA-T's global-phase examples)."""
    first, _ = protocol_round("fedit", runtime, clients, 0, seed)
    second, losses = protocol_round("fedit", runtime, clients, 1, seed)
    return first + second, losses


@dataclasses.dataclass(frozen=True)
class Work:
    """What a loop's forwards compute: real and padded tokens, and matmul FLOPs (``bench/training/step_flops.py``)."""

    tokens: int
    padded: int
    flops: dict[str, int]

    def __add__(self, other: Work) -> Work:
        return Work(self.tokens + other.tokens, self.padded + other.padded,
                    {k: v + other.flops[k] for k, v in self.flops.items()})


def drawn_work(examples: Sequence[Example], train: TrainConfig, seed: int, pad_id: int, shape: DecoderShape,
               device: torch.device, by_length: bool = True, packed: bool = False) -> Work:
    """The work of the examples a local run with ``seed`` draws: the trainer's shuffle and its micro-batches
    replayed (:func:`training.local.micro_batches.step_batches`). ``by_length``: our loss's (length-grouped
    micro-batches, or with ``packed`` the plain split packed, the head on the labelled positions); False:
    the plain loop's (the plain split in draw order, the head on every position)."""
    total = train.max_steps or math.ceil(len(examples) / train.batch_size) * train.local_epochs
    draws = step_draws(len(examples), train.batch_size, seed)
    tokens, batches = 0, []
    for _ in range(total):
        idx = next(draws)
        tokens += sum(len(examples[i].input_ids) for i in idx)
        batches += step_batches([examples[i] for i in idx], train.micro_batch_size, pad_id, device, by_length,
                                packed=packed and by_length)
    padded = sum(int(b["input_ids"].numel()) for b in batches)
    return Work(tokens, padded, step_flops(shape, batches, train.lora, "labelled" if by_length else "all"))


def _clients(data: str, seed: int, n_train: int, count: int, keep: int | None = None) -> list:
    if data == "generated":
        clients = list(generate_suite(seed=seed, n_train=n_train, n_test=1).clients[:count])
    else:
        clients = list(load_dataset(data).clients[:count])
    if keep is None:
        return clients
    # a seeded subset of each client's examples: with keep = steps x batch every phase trains on all of them
    gen = torch.Generator().manual_seed(seed)
    return [dataclasses.replace(c, train=tuple(c.train[i] for i in sorted(
        torch.randperm(len(c.train), generator=gen)[:keep].tolist()))) for c in clients]


def _profile(runtime: Runtime, clients: Sequence, seed: int, path: str) -> None:
    """One FedDPA-T round under the torch profiler: a Chrome trace in ``path``, the top operators on stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runtime.device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        protocol_round("feddpa-t", runtime, clients, 1, seed)
    prof.export_chrome_trace(path)
    # on a GPU both views: what the device spent, and what the host spent launching it (a host-bound step)
    keys = ["self_cpu_time_total"]
    if runtime.device.type == "cuda":
        keys.insert(0, "self_cuda_time_total")
    for key in keys:
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
    parser.add_argument("--train-examples", type=int, default=None,
                        help="keep this many of each client's examples (a seeded subset; steps x batch: every "
                             "phase of every loop trains on the same examples, so FedDPA-T does exactly twice "
                             "FedIT's work up to how the examples fall into steps)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--cutoff", type=int, default=None,
                        help="token cutoff (default 128 on generated data, the small preset's on benchmark data)")
    parser.add_argument("--lora-dropout", type=float, default=0.0,
                        help="LoRA dropout of both loops (0: their losses agree up to float order)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="also profile one FedDPA-T round: Chrome trace to FILE, top operators to stderr")
    parser.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                        metavar="MODE", help="compile our decoder layers (a torch.compile mode, default: default)")
    parser.add_argument("--compile-plain", action="store_true", help="with --compile: the plain loop's layers too")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 keeps the ratios stable when another job shares the CPU)")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.train_examples is not None and args.train_examples < 1:
        parser.error(f"--train-examples must be >= 1, got {args.train_examples}")
    if args.compile_plain and args.compile is None:
        parser.error("--compile-plain compiles the plain loop like ours: give --compile too")

    cutoff = args.cutoff or (128 if args.data == "generated" else None)
    train = preset("small", batch_size=args.batch, micro_batch_size=args.micro_batch, max_steps=args.steps,
                   cutoff_len=cutoff, lr=3e-4)
    train = dataclasses.replace(train, lora=dataclasses.replace(train.lora, dropout=args.lora_dropout),
                                compile=args.compile)
    clients = _clients(args.data, args.seed, max(args.batch * 2, 8), args.clients, args.train_examples)
    try:
        ours = Runtime(_load(args.model, args.device, args.dtype, args.random), train)
    except ModelError as exc:
        parser.error(f"--model: {exc}")
    examples = {c.client_id: ours.examples(c) for c in clients}
    # Warm-up: first forward/backward pays one-off allocation and kernel selection costs (and compilation:
    # FedDPA-T's two-adapter forwards are variants of their own).
    warm_start = time.perf_counter()
    protocol_round("fedit", ours, clients[:1], 0, args.seed)
    if args.compile:
        protocol_round("feddpa-t", ours, clients[:1], 1, args.seed)
    warmup_s = {"ours": time.perf_counter() - warm_start}
    # a second copy: our injection wraps the first model's Linears
    plain_loaded = as_transformers_loads_it(_load(args.model, args.device, args.dtype, args.random))
    plain_model = peft_model(plain_loaded, train)
    if args.compile_plain:
        compile_decoder_layers(plain_loaded.model, args.compile)
    warm_start = time.perf_counter()
    fedit = get_method("fedit")
    start_state = fedit.strategy({**fedit.defaults, "seed": args.seed}).initial_state(ours)
    plain_peft_round(plain_model, plain_loaded, dict(list(examples.items())[:1]), train, args.seed, start_state)
    warmup_s["plain"] = time.perf_counter() - warm_start
    runs: dict[str, Callable[[], tuple[float, list[float]]]] = {
        "fedit": lambda: protocol_round("fedit", ours, clients, 0, args.seed),
        "feddpa_t": lambda: protocol_round("feddpa-t", ours, clients, 1, args.seed),
        "fedit_twice": lambda: two_rounds(ours, clients, args.seed),
        "plain": lambda: plain_peft_round(plain_model, plain_loaded, examples, train, args.seed, start_state),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so that load drifting on a shared CPU hits every variant
        for name, fn in runs.items():
            seconds, losses[name] = fn()
            times[name].append(seconds)
    fedit, feddpa_t, plain, twice = (min(times[k]) for k in ("fedit", "feddpa_t", "plain", "fedit_twice"))
    # what each round trains on: FedIT and the plain loop one pass per client, FedDPA-T two (local, global);
    # (real, padded) tokens, the padded ones what the forwards compute (length-grouped in ours)
    shape = DecoderShape.of(ours.loaded.model.config)

    def work(round_idx: int, phase: str, by_length: bool = True) -> Work:
        seeds = [derive_seed(args.seed, round_idx, c.client_id, phase) for c in clients]
        return functools.reduce(operator.add, (
            drawn_work(examples[c.client_id], train, seed, ours.tokenizer.pad_token_id, shape, ours.device, by_length,
                       packed=packs(ours.device, ours.model))
            for c, seed in zip(clients, seeds, strict=True)))

    fedit_work, plain_work = work(0, "global"), work(0, "global", by_length=False)
    local_work, global_work = work(1, "local"), work(1, "global")
    dpa_work = local_work + global_work
    if args.profile:
        _profile(ours, clients, args.seed, args.profile)
    lengths = [len(e.input_ids) for exs in examples.values() for e in exs]
    print(json.dumps({
        "benchmark": "bench.training.round",
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
        "train_examples_per_client": min(len(c.train) for c in clients),
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "cutoff": train.cutoff_len,
        "lora_dropout": args.lora_dropout,
        "compile": args.compile,
        "compile_plain": args.compile_plain,
        "warmup_s": {k: round(v, 1) for k, v in warmup_s.items()},
        "mean_tokens_per_example": round(sum(lengths) / len(lengths), 1),
        "plain_peft_s": round(plain, 3),
        "fedit_round_s": round(fedit, 3),
        "feddpa_t_round_s": round(feddpa_t, 3),
        "fedit_over_plain": round(fedit / plain, 3),
        "feddpa_t_over_fedit": round(feddpa_t / fedit, 3),
        # FedDPA-T's local phase draws other examples than its global phase (FedIT's work): its round's
        # time per padded token, over FedIT's, times two (the same work in each phase)
        "feddpa_t_over_fedit_equal_work": round(2 * (feddpa_t / dpa_work.padded) / (fedit / fedit_work.padded), 3),
        # the same window length as FedDPA-T's round, so the same exposure to a shared machine's swings
        "feddpa_t_over_two_fedit_rounds": round(feddpa_t / twice, 3),
        "times_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "padded_tokens": {"plain": plain_work.padded, "fedit": fedit_work.padded,
                          "feddpa_t_local": local_work.padded, "feddpa_t_global": global_work.padded},
        "plain_tokens_per_s": round(fedit_work.tokens / plain, 1),
        "fedit_tokens_per_s": round(fedit_work.tokens / fedit, 1),
        "feddpa_t_tokens_per_s": round(dpa_work.tokens / feddpa_t, 1),
        # what each loop's matmuls compute, and at what rate: where they set the time, the plain loop's
        # FLOPs over ours bound what FedIT can gain (1 / fedit_over_plain)
        "matmul_gflop": {name: {k: round(v / 1e9, 1) for k, v in w.flops.items()}
                         for name, w in (("plain", plain_work), ("fedit", fedit_work))},
        "plain_over_fedit_matmul_flops": round(sum(plain_work.flops.values()) / sum(fedit_work.flops.values()), 3),
        "matmul_gflop_per_s": {"plain": round(sum(plain_work.flops.values()) / plain / 1e9, 1),
                               "fedit": round(sum(fedit_work.flops.values()) / fedit / 1e9, 1)},
        "plain_loss": [round(v, 6) for v in losses["plain"]],
        "fedit_loss": [round(v, 6) for v in losses["fedit"]],
        "loss_max_abs_diff": round(max(abs(a - b) for a, b in zip(losses["plain"], losses["fedit"], strict=True)), 7),
        "repeats": args.repeats,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
