"""GPU decode throughput against HF ``generate`` and the memory-bandwidth bound (issue 22).

Random-weight models of two real geometries in bf16 on CUDA: SmolLM2-135M (30 layers, hidden 576,
GQA 9/3, tied 49k vocabulary) and LLaMA-7B (32 layers, hidden 4096, 32 heads, 32k vocabulary), the
tokenizer of SmolLM2 (its ids cover both vocabularies). LoRA r=8 on q/v: a ``global`` adapter and 8
clients' ``local`` adapters. For 1, 8 and 64 concurrent requests of ``--prompt`` random prompt tokens
decoding ``--tokens`` tokens each (greedy, eos ignored), cases interleaved round by round:

  hf_generate        HF ``generate`` on the same prompts as one static batch (bare base model)
  hf_static          the same with ``cache_implementation="static"``, which on CUDA compiles the forward
                     (transformers' own fast path); its first call per batch size compiles and is
                     reported apart (``hf_static_first_call_s``), the rounds time the compiled calls
  engine_base        the engine (fused runner, CUDA graphs), bare base model
  engine_one_mix     every row the same FedDPA mixture (0.5 global + 0.5 one client's local)
  engine_8_clients   row i the mixture of client i mod 8 (9 adapters in one batch)

tokens/s count every generated token over the wall time of the whole batch (prefill included);
``decode_step_ms`` is the median engine step once every row is decoding. The bound: the bytes a
decode step must read (every weight once, the LM head included, the adapters' slot stacks in use,
and each row's K/V at the batch's mean length) over the device's measured copy bandwidth (bytes read
plus written by a 1 GiB device-to-device copy per second). Prints one JSON object.

Usage: python -m bench.serving.gpu_decode [--models smollm2,llama7b] [--requests 1,8,64] [--tokens 64]
       [--prompt 32] [--rounds 3] [--tokenizer DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from adapters import AdaptedModel, LoraConfig, inject
from models import LoadedModel
from serving.engine import Engine, EngineConfig
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams

GEOMETRIES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    rms_norm_eps=1e-5),
    "llama7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0,
                    rms_norm_eps=1e-5),
}
CLIENTS = 8


DEVICE = torch.device("cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``gib`` GiB (median of 20)."""
    src = torch.empty(int(gib * 2**29), dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    return nbytes / statistics.median(times[3:])


def tokenizer_for(folder: str | None) -> object:
    from transformers import AutoTokenizer

    candidates = [folder] if folder else []
    candidates.append(str(Path.home() / ".cache" / "fedmosaic" / "smollm2-135m-instruct"))
    for path in candidates:
        if path and (Path(path) / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(path)
    raise SystemExit("no SmolLM2 tokenizer: pass --tokenizer DIR (a folder with tokenizer.json)")


def random_llama(geometry: str, max_len: int, device: torch.device, vocab_size: int | None = None,
                 seed: int = 0) -> torch.nn.Module:
    """A frozen random bf16 Llama of ``geometry`` built on ``device`` (no weights on disk, no host copy).

    ``vocab_size`` widens the vocabulary to a tokenizer's (SmolLM2's 49,152 ids on LLaMA-7B's 32,000).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**GEOMETRIES[geometry], **({"vocab_size": vocab_size} if vocab_size else {})}
    config = LlamaConfig(**shape, max_position_embeddings=max(max_len, 2048), bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def build(geometry: str, tokenizer: object, max_len: int) -> tuple[LoadedModel, AdaptedModel]:
    """A random bf16 model of ``geometry`` on CUDA with a global and 8 local random LoRA adapters."""
    model = random_llama(geometry, max_len, DEVICE)
    adapted = inject(model, ("q_proj", "v_proj"))
    gen = torch.Generator().manual_seed(1)
    for name in ["global"] + [f"local{c}" for c in range(CLIENTS)]:
        adapted.add_adapter(name, LoraConfig(r=8, alpha=16.0, dropout=0.0))
        for _, layer in adapted.adapter_layers(name):
            a = layer.adapters[name]
            layer.set_weights(name, (torch.randn(a.lora_A.shape, generator=gen) / 64).to(DEVICE),
                              (torch.randn(a.lora_B.shape, generator=gen) / 64).to(DEVICE))
    return LoadedModel(model=model, tokenizer=tokenizer, name=geometry, dtype="bfloat16"), adapted


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the base weights one decode step reads: every matrix once; an untied input embedding
    is left out (a step gathers only its rows), a tied one counts once (the LM head reads it whole)."""
    embed = model.get_input_embeddings().weight  # type: ignore[operator]
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    total = 0
    for name, p in model.named_parameters():  # tied parameters are listed once
        if "lora_" in name or (p is embed and p is not head):
            continue
        total += p.numel() * p.element_size()
    return total


def step_bound(loaded: LoadedModel, engine: Engine, rows: int, mean_len: float, adapters: int, bw: float) -> float:
    """Seconds a decode step needs at least: bytes read (weights, the adapters in use, the rows' K/V) / bandwidth."""
    kv = engine.kv
    per_position = 2 * kv.num_layers * kv.kv_heads * kv.head_dim * kv.k[0].element_size()
    lora = 0
    fast = engine.executor.fast
    if fast is not None and fast.slots is not None and adapters:
        for per in fast.slots.stacks:
            for A, Bt in per.values():
                used = adapters * A.shape[0] // fast.slots.capacity  # the adapters' rows of the stacks
                lora += used * (A.shape[1] + Bt.shape[1]) * A.element_size()
    return (weight_bytes(loaded.model) + lora + rows * mean_len * per_position) / bw


def requests(prompts: list[list[int]], tokens: int, case: str, alpha: float = 0.5) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out = []
    for i, ids in enumerate(prompts):
        names: tuple[str, ...] = ()
        weights: tuple[float, ...] = ()
        if case == "engine_one_mix":
            names, weights = ("global", "local0"), (1 - alpha, alpha)
        elif case == "engine_8_clients":
            names, weights = ("global", f"local{i % CLIENTS}"), (1 - alpha, alpha)
        out.append(GenerationRequest(prompt_ids=tuple(ids), sampling=params, adapter_names=names,
                                     adapter_weights=weights))
    return out


def run_engine(engine: Engine, reqs: list[GenerationRequest]) -> tuple[float, list[float]]:
    """Wall seconds for the batch and the durations of the steps where every row was decoding."""
    sync()
    t0 = time.perf_counter()
    handles = [engine.submit(r) for r in reqs]
    steps = []
    while not all(h.done for h in handles):
        prefilling = any(s.phase != "decode" for s in engine._active) or engine.stats().waiting
        s0 = time.perf_counter()
        engine.step()
        if not prefilling and all(not h.done for h in handles):
            steps.append(time.perf_counter() - s0)
    sync()
    return time.perf_counter() - t0, steps


def run_hf(loaded: LoadedModel, prompts: list[list[int]], tokens: int, static: bool = False) -> float:
    """Wall seconds of one HF ``generate`` over ``prompts`` (``static``: a static cache, compiled on CUDA)."""
    ids = torch.tensor(prompts, device=DEVICE)
    extra = {"cache_implementation": "static"} if static else {}
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,  # type: ignore[operator]
                              min_new_tokens=tokens, do_sample=False, pad_token_id=2, **extra)
    sync()
    return time.perf_counter() - t0


def bench_model(geometry: str, tokenizer: object, args: argparse.Namespace, bw: float) -> dict[str, object]:
    max_len = args.prompt + args.tokens + 8
    loaded, adapted = build(geometry, tokenizer, max_len)
    top = max(args.requests)
    engine = Engine(loaded, adapted, EngineConfig(max_batch_size=top, max_model_len=max_len, max_prefill_tokens=16384,
                                                  lora_slots=16, max_lora_rank=8, max_waiting=4 * top))
    gen = torch.Generator().manual_seed(7)
    vocab = int(loaded.model.config.vocab_size)  # type: ignore[union-attr]
    report: dict[str, object] = {"params_gb": round(weight_bytes(loaded.model) / 1e9, 3),
                                 "graphs": engine.executor.graphs is not None}
    cases = ["hf_generate", "hf_static", "engine_base", "engine_one_mix", "engine_8_clients"]
    engine_cases = [c for c in cases if c.startswith("engine_")]
    for rows in args.requests:
        prompts = torch.randint(100, vocab, (rows, args.prompt), generator=gen).tolist()
        for case in engine_cases:  # warm-up: captures this bucket's graphs
            run_engine(engine, requests(prompts, 4, case))
        run_hf(loaded, prompts, 2)
        first_static = run_hf(loaded, prompts, args.tokens, static=True)  # compiles for this batch size
        walls: dict[str, list[float]] = {c: [] for c in cases}
        steps: dict[str, list[float]] = {c: [] for c in engine_cases}
        for r in range(args.rounds):
            for case in cases[r % len(cases):] + cases[: r % len(cases)]:
                if case.startswith("hf_"):
                    walls[case].append(run_hf(loaded, prompts, args.tokens, static=case == "hf_static"))
                else:
                    wall, st = run_engine(engine, requests(prompts, args.tokens, case))
                    walls[case].append(wall)
                    steps[case] += st
                print(f"{geometry} x{rows} round {r + 1} {case}: {walls[case][-1]:.3f} s", file=sys.stderr, flush=True)
        total = rows * args.tokens
        tps = {c: round(total / statistics.median(v), 1) for c, v in walls.items()}
        step_ms = {c: round(1e3 * statistics.median(v), 3) for c, v in steps.items() if v}
        mean_len = args.prompt + args.tokens / 2
        bound = {c: round(1e3 * step_bound(loaded, engine, rows, mean_len, lora, bw), 3)
                 for c, lora in (("engine_base", 0), ("engine_one_mix", 2), ("engine_8_clients", CLIENTS + 1))}
        report[f"requests_{rows}"] = {
            "tokens_per_s": tps, "decode_step_ms": step_ms, "bound_step_ms": bound,
            "bound_tokens_per_s": round(rows / (bound["engine_base"] / 1e3), 1),
            "fraction_of_bound": {c: round(bound[c] / step_ms[c], 3) for c in bound if c in step_ms},
            "engine_base_over_hf_generate": round(tps["engine_base"] / tps["hf_generate"], 3),
            "engine_base_over_hf_static": round(tps["engine_base"] / tps["hf_static"], 3),
            "hf_static_first_call_s": round(first_static, 3),
            "hf_static_compiled": DEVICE.type == "cuda",  # transformers compiles a static-cache forward on CUDA
            "clients8_over_engine_base": round(tps["engine_8_clients"] / tps["engine_base"], 3),
            "clients8_step_over_base_step": round(step_ms["engine_base"] / step_ms["engine_8_clients"], 3)
            if "engine_8_clients" in step_ms and "engine_base" in step_ms else None,
        }
    report["graph_buckets"] = sorted(engine.executor.graphs.graphs) if engine.executor.graphs else []
    del engine, loaded, adapted
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,llama7b")
    parser.add_argument("--requests", default="1,8,64")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="folder with SmolLM2's tokenizer.json")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    args = parser.parse_args()
    args.requests = [int(x) for x in args.requests.split(",")]
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/serving/gpu_decode.py needs a CUDA device (or --device cpu for a smoke run)")
    tokenizer = tokenizer_for(args.tokenizer)
    bw = copy_bandwidth(1.0 if DEVICE.type == "cuda" else 0.125)
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    out: dict[str, object] = {"device": name, "torch": torch.__version__,
                              "copy_bandwidth_gb_s": round(bw / 1e9, 1), "prompt_tokens": args.prompt,
                              "tokens_per_request": args.tokens, "rounds": args.rounds}
    for geometry in args.models.split(","):
        out[geometry] = bench_model(geometry, tokenizer, args, bw)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2))
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
