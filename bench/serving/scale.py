"""Scale: one FedDPA run with 1,000 clients served with the default pool size; cold vs warm, bounded memory.

Writes a run directory with ``--clients`` clients (:func:`bench.serving.common.write_scale_run`: random LoRA
r=8 q/v adapters and random unit embeddings of the model's width, valid files the server loads), builds
the serving stack in-process (``serving.stack.build_stack``, default ``max_loras`` and index cache),
and measures, interleaved pair by pair (the order alternates), the wall time of one ``<client>``
request (chat prompt, greedy, ``--tokens`` tokens, instance-wise FedDPA weights):

  cold   a client never served before: its local adapter and its embedding index are read from disk
  warm   one of ``--warm`` clients served every pair (adapter loaded, index cached)

Then every client is touched once (a 1-token request) and memory is read: RSS, loaded adapters,
adapters in the model, cached indexes; RSS is also read after the first tenth of the clients, so
growth with the number of clients shows. Issue 14's target: cold <= 1.3 x warm, and the counts
bounded by ``max_loras`` and the cache capacity. Also reported: the server start-up (registering the
run) and what a cold request's disk reads cost alone (an adapter activation, an index load).
Prints one JSON object. Usage: python -m bench.serving.scale [--clients 1000] [--model tiny] [--pairs 100]
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

from bench.serving.common import (
    apply_threads,
    median,
    parser,
    print_json,
    prompts,
    ratio,
    rss_mb,
    run_all,
    timed,
    write_scale_run,
)
from models import load_base_model
from serving.engine.sampling import SamplingParams
from serving.stack import Job, ServingStack, StackConfig, build_stack


def request(stack: ServingStack, client: str, text: str, tokens: int) -> float:
    """Seconds one ``<client>`` request takes end to end (resolve, lease, route, prefill, decode)."""
    job = Job(client, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), text)
    return timed(lambda: run_all(stack, [job]))


def counts(stack: ServingStack) -> dict[str, int]:
    """Loaded adapters (pool), adapters in the model (current and still-leased versions), cached indexes."""
    router = stack.resolver.router
    cache = getattr(router, "cache", None)
    return {"pool_loaded": stack.pool.loaded_count(), "model_adapters": len(stack.adapted.configs),
            "indexes_cached": len(cache) if cache is not None else -1,
            "index_cache_capacity": getattr(cache, "capacity", -1)}


def main() -> None:
    """Write the run, serve it, interleave cold and warm requests, touch every client, print JSON."""
    p = parser(__doc__, model="tiny")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--pairs", type=int, default=100, help="cold/warm request pairs (medians over them)")
    p.add_argument("--warm", type=int, default=4, help="clients kept warm")
    p.add_argument("--tokens", type=int, default=16, help="tokens decoded per measured request")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    rss_model = rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = write_scale_run(loaded, Path(tmp), args.clients, seed=args.seed)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stack = build_stack(StackConfig(model=args.model, run_dir=run), loaded=loaded)
        startup_s = time.perf_counter() - t0
        after_start = {**counts(stack), "rss_mb": rss_mb()}
        text = prompts(loaded.tokenizer, 1)[0]
        clients = [f"c{i}" for i in range(args.clients)]
        warm, cold = clients[: args.warm], clients[args.warm:]
        random.Random(args.seed).shuffle(cold)
        pairs = max(1, min(args.pairs, len(cold) // 2))  # as many cold clients again for the parts below
        for c in warm:
            request(stack, c, text, args.tokens)
        seconds: dict[str, list[float]] = {"cold": [], "warm": []}
        for i in range(pairs):
            order = [("cold", cold[i]), ("warm", warm[i % len(warm)])]
            for kind, client in order if i % 2 == 0 else order[::-1]:
                seconds[kind].append(request(stack, client, text, args.tokens))
        # a cold request's disk reads alone, on clients not touched yet
        spare = cold[pairs: 2 * pairs]
        pool, cache = stack.pool, getattr(stack.resolver.router, "cache", None)
        adapter_s = [timed(lambda c=c: pool.acquire([f"{c}:local"]).release()) for c in spare]
        index_s = [timed(lambda c=c: cache.get(c, 0)) for c in spare] if cache is not None else []
        touched = set(warm) | set(cold[: 2 * pairs])
        tenth = max(args.clients // 10, len(touched))
        rss_tenth = None
        for c in clients:
            if c not in touched:
                request(stack, c, text, 1)
                touched.add(c)
            if len(touched) >= tenth and rss_tenth is None:
                rss_tenth = rss_mb()
        after_all = {**counts(stack), "rss_mb": rss_mb(), "clients_touched": len(touched)}
    cold_ms, warm_ms = 1e3 * median(seconds["cold"], 6), 1e3 * median(seconds["warm"], 6)
    print_json({
        "model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(),
        "clients": args.clients, "pairs": pairs, "warm_clients": args.warm, "tokens_per_request": args.tokens,
        "max_loras": stack.config.max_loras, "routing": stack.routing,
        "write_run_s": round(write_s, 2), "startup_s": round(startup_s, 2),
        "request_ms_median": {"cold": round(cold_ms, 2), "warm": round(warm_ms, 2)},
        "ratio_cold_to_warm": ratio(cold_ms, warm_ms),
        "cold_parts_ms_median": {"adapter_activation": round(1e3 * median(adapter_s, 6), 2),
                                 "index_load": round(1e3 * median(index_s, 6), 2) if index_s else None},
        "memory": {"rss_mb_model_only": rss_model, "after_startup": after_start,
                   f"rss_mb_after_{tenth}_clients": rss_tenth, "after_all_clients": after_all},
    })


if __name__ == "__main__":
    main()
