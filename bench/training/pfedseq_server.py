"""pFedSeq server cost per round at the SmolLM2 adapter size: selective SSM vs the LSTM and MLP learners.

The adapter is SmolLM2-135M's LoRA (r 8 on q_proj and v_proj of all 30 layers, read from the model's
config on the meta device, no weights loaded), 8 clients, window L = 10. A round on the server is what
pFedSeq adds to FedAvg and what it does anyway: ``configure_round`` (global + calibration per client)
and ``aggregate`` (FedAvg by data size, one Adam step of the 30 per-layer learners on the previous
window with the updates as gradient proxy, then the learners' forward on the new window). The history
is pre-filled with L steps of synthetic updates (scale 1e-3, like LoRA updates) and W = 0, so every
timed round is a full steady-state round. Learners are timed interleaved (ssm, lstm, mlp, ssm, ...).
Threads default to 1: on this shared 2-core machine a second OpenMP thread spins against the other
processes and made the learners' small elementwise ops up to 50x slower. Prints one JSON object.
The learners run on ``--device`` (default: the ``FEDMOSAIC_DEVICE`` setting, auto = CUDA when present;
timings wait for the GPU) with ``--scan auto`` (mamba-ssm's kernel on CUDA when it imports) or ``torch``.
Usage: python -m bench.training.pfedseq_server [--device D] [--scan auto|torch|kernel] [--repeats 5] [--threads 1]
[--chunk 2048] [--learners ssm,lstm,mlp]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from adapters import LoraConfig
from adapters.targets import select
from models.settings import DEVICE_HELP, device_option, resolve_device
from training.algorithms.pfedseq.method import PFedSeqConfig, PFedSeqStrategy
from training.protocol import FitRes
from training.state import StateDict


def smollm2_lora_state(lora: LoraConfig) -> StateDict:
    """Zero LoRA tensors of every targeted Linear of SmolLM2 (shapes from its config, meta-device model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("smollm2"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state: StateDict = {}
    targets = set(select(model, [lora.target_modules]))  # PEFT's rules (adapters.targets)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name in targets:
            state[f"{name}.lora_A"] = torch.zeros(lora.r, module.in_features)
            state[f"{name}.lora_B"] = torch.zeros(module.out_features, lora.r)
    return state


def _updates(state: StateDict, clients: list[str], seed: int) -> list[FitRes]:
    gen = torch.Generator().manual_seed(seed)
    return [FitRes(c, {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in state.items()}, 300)
            for c in clients]


def _strategy(kind: str, state: StateDict, clients: list[str], window: int, chunk: int, device: torch.device,
              scan: str) -> PFedSeqStrategy:
    strategy = PFedSeqStrategy(PFedSeqConfig(warmup=0, window=window, learner=kind, chunk=chunk, scan=scan,
                                             server_device=str(device), clients=tuple(clients)), seed=0)
    strategy.aggregate(0, _updates(state, clients, 0), [], state)  # builds the layout and the learners
    gen = torch.Generator().manual_seed(1)
    n, d = len(clients), strategy.layout.size  # type: ignore[union-attr]
    strategy.history.steps = [(torch.randn(n, d, generator=gen) * 1e-3).to(device) for _ in range(window)]
    return strategy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # a wall-clock time must cover the GPU's queued work
        torch.cuda.synchronize(device)


def main() -> None:
    """Time every learner's server round, interleaved, and print the JSON report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--chunk", type=int, default=PFedSeqConfig.chunk)
    p.add_argument("--learners", default="ssm,lstm,mlp")
    p.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    p.add_argument("--scan", choices=["auto", "torch", "kernel"], default="auto", help="the SSM's selective scan")
    args = p.parse_args()
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.learners.split(",") if k.strip()]
    clients = [f"client{i}" for i in range(args.clients)]
    state = smollm2_lora_state(LoraConfig())
    strategies = {k: _strategy(k, state, clients, args.window, args.chunk, device, args.scan) for k in kinds}
    layout = strategies[kinds[0]].layout
    assert layout is not None
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    globals_ = {k: state for k in kinds}
    for rep in range(args.repeats + 1):  # the first pass warms up allocators and is dropped
        uploads = _updates(state, clients, 100 + rep)
        for kind in kinds:
            strategy = strategies[kind]
            _sync(device)
            began = time.perf_counter()
            strategy.configure_round(rep + 1, clients, globals_[kind])
            new = strategy.aggregate(rep + 1, uploads, [], globals_[kind])
            _sync(device)
            seconds = time.perf_counter() - began
            globals_[kind] = new if new is not None else globals_[kind]
            if rep > 0:
                samples[kind].append(seconds)
    per_kind = {k: {"seconds_per_round_median": round(statistics.median(v), 3),
                    "seconds_per_round_min": round(min(v), 3),
                    "learner_parameters_per_layer": sum(p.numel() for p in strategies[k].learners[0].parameters()),
                    "samples": [round(x, 3) for x in v]} for k, v in samples.items()}
    report = {
        "bench": "pfedseq_server",
        "adapter": {"model": "SmolLM2-135M-Instruct", "lora_r": LoraConfig().r,
                    "target_modules": list(LoraConfig().target_modules), "parameters": layout.size,
                    "learner_groups": len(layout.groups), "parameters_per_group": layout.groups[0][2]},
        "clients": args.clients, "window": args.window, "chunk": args.chunk, "repeats": args.repeats,
        "threads": args.threads, "device": str(device), "scan": args.scan,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "learners": per_kind,
    }
    if "ssm" in samples:
        base = statistics.median(samples["ssm"])
        report["ratio_to_ssm"] = {k: round(statistics.median(v) / base, 3) for k, v in samples.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
