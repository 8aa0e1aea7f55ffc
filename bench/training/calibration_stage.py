"""What FedDPA's calibration stage costs a client: its instance index at the end of training (issue 47).

For each of ``--clients`` clients of ``--data``, ``training.federation.personalize.save_instance_index`` is timed whole,
as a run's personalize stage calls it: the client's training prompts embedded with the global adapter on
(``routing.embedding.embed_prompts``), the calibration against the public background prompts, the index
files written. The background prompts' states are embedded once a run (``background_s``, timed apart
before the clients; they also warm the model up). The instance embeddings' matrix products are counted as
``bench/training/step_flops.py`` counts them, with the rate the stage reached: on a CPU, where the products set the
time, that rate against the device's GEMM peak says how much faster the stage can get with embeddings
equal to these.

``--check N`` compares the first N instances' saved vectors with each prompt embedded alone through the
whole causal LM (one forward a prompt, no padding, HF's ``hidden_states[-1]`` at its last token): the
largest absolute difference, and that difference over the largest entry.

The global adapter is random (seeded, its B nonzero so the adapter changes the states); speed does not
depend on its values. Prints one JSON object. Usage: ``python -m bench.training.calibration_stage [--model
smollm2|tiny|FOLDER] [--device D] [--dtype D] [--data feddpa1] [--clients 2] [--check 8] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.training.plain_peft import sync
from bench.training.step_flops import DecoderShape, embed_flops
from models import ModelError, load_base_model
from models.settings import DEVICE_HELP, DTYPES, device_option
from routing.cache import EmbeddingIndex
from training.data import ClientData, DataError, load_dataset
from training.federation.personalize import background_states, instance_prompts, save_instance_index
from training.local.runtime import Runtime, preset


def random_global(rt: Runtime, seed: int) -> None:
    """Install a seeded random ``global`` adapter with B nonzero (a fresh LoRA's B = 0 would change nothing)."""
    rt.set("global", rt.fresh("global", seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in rt.params("global").items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def alone(rt: Runtime, prompt: str) -> np.ndarray:
    """One prompt's last-token final-layer state, embedded by itself through the whole causal LM: (H,)."""
    ids = rt.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(rt.device)
    with torch.inference_mode(), rt.adapted.context.uniform(("global",), [1.0]), rt.loaded.autocast():
        out = rt.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0, -1].float().cpu().numpy()


def client_stage(rt: Runtime, client: ClientData, shape: DecoderShape, check: int) -> dict:
    """Time one client's ``save_instance_index``; count its embeddings' products; check ``check`` vectors."""
    prompts = instance_prompts(client, rt.tokenizer, rt.train.prompt_style)
    lengths = [len(ids) for ids in rt.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    flops = embed_flops(shape, lengths, rt.train.lora)
    with tempfile.TemporaryDirectory() as folder:
        sync(rt.device)
        start = time.perf_counter()
        save_instance_index(rt, client, Path(folder))
        sync(rt.device)
        seconds = time.perf_counter() - start
        vectors = EmbeddingIndex.load(Path(folder), use_faiss=False).raw
    row = {"client": client.client_id, "prompts": len(prompts), "tokens": sum(lengths),
           "longest": max(lengths), "stage_s": round(seconds, 2),
           "embed_gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
           "gflop_per_s": round(sum(flops.values()) / seconds / 1e9, 1)}
    if check:
        ref = np.stack([alone(rt, p) for p in prompts[:check]])  # (n, H)
        diff = float(np.abs(vectors[:check] - ref).max())
        row["check"] = {"prompts": len(ref), "max_abs_diff": diff,
                        "max_rel_diff": diff / float(np.abs(ref).max())}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model folder")
    parser.add_argument("--device", type=device_option, default=None, help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the device's")
    parser.add_argument("--data", default="feddpa1", help="feddpa1 (default), feddpa2, dolly or generated")
    parser.add_argument("--clients", type=int, default=2, help="clients timed, the data set's first ones")
    parser.add_argument("--check", type=int, default=8,
                        help="instances compared with one-prompt-at-a-time embeddings (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.clients < 1:
        parser.error(f"--clients must be >= 1, got {args.clients}")
    if args.check < 0:
        parser.error(f"--check must be >= 0, got {args.check}")
    try:
        clients = load_dataset(args.data).clients[:args.clients]
    except DataError as exc:
        parser.error(f"--data {args.data}: {exc}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        loaded = load_base_model(args.model, dtype=args.dtype, device=args.device)  # type: ignore[arg-type]
    except ModelError as exc:
        parser.error(f"--model: {exc}")
    rt = Runtime(loaded, preset("small"))
    random_global(rt, args.seed)
    shape = DecoderShape.of(loaded.model.config)
    start = time.perf_counter()
    background_states(rt)  # once a run, cached for every client's calibration; the model's first forwards
    background_s = time.perf_counter() - start
    rows = [client_stage(rt, c, shape, args.check) for c in clients]
    print(json.dumps({
        "benchmark": "bench.training.calibration_stage",
        "model": args.model,
        "data": args.data,
        "device": str(rt.device),
        "dtype": loaded.dtype,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "background_s": round(background_s, 2),
        "clients": rows,
        "mean_stage_s": round(sum(r["stage_s"] for r in rows) / len(rows), 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
