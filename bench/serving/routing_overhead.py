"""FedDPA weighting cost per request (paper 000 section 4.3): sample or search S cached instances + mean.

An index of N=300 local-instance vectors of width 576 (SmolLM2's hidden size; a client's 300 training
instances in the FedDPA datasets), S=5. Cases: mode random / knn, search through faiss / numpy. The
prompt's own forward (the representation) is not included: it is one prefill the engine runs anyway
or shares. Prints one JSON object with microseconds per decision (median of repeats).
Usage: python -m bench.serving.routing_overhead [--n 300] [--dim 576] [--s 5] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from routing import EmbeddingIndex, FedDPARouter


def time_decisions(router: FedDPARouter, index: EmbeddingIndex, queries: torch.Tensor, repeats: int) -> float:
    """Median over ``repeats`` of the mean microseconds per ``router.decide`` call."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for q in queries:
            router.decide(q, index)
        runs.append((time.perf_counter() - t0) / len(queries) * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--s", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(args.n, args.dim)).astype(np.float32) + 0.3  # LLM states share a direction
    queries = torch.from_numpy(rng.normal(size=(args.requests, args.dim)).astype(np.float32) + 0.3)
    results: dict[str, object] = {"n": args.n, "dim": args.dim, "S": args.s, "requests": args.requests}
    for backend, use_faiss in (("faiss", True), ("numpy", False)):
        index = EmbeddingIndex(vectors, use_faiss=use_faiss)
        if index.uses_faiss is not use_faiss:
            results[f"{backend}_skipped"] = "faiss is not importable"
            continue
        for mode in ("random", "knn"):
            router = FedDPARouter(lambda_=1.0, S=args.s, mode=mode, seed=0)
            time_decisions(router, index, queries[:100], 1)  # warm-up
            results[f"us_per_decision_{mode}_{backend}"] = round(time_decisions(router, index, queries,
                                                                               args.repeats), 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
