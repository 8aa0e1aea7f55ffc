"""How well FedDPA's instance-wise weight tells a client's own task from the others (issue 19).

Embeds, with SmolLM2 (and a run's global adapter with ``--run``, else the bare model), each client's
training prompts, split by a seeded permutation into its index (``--train``) and a validation part
(``--val``), and the public background prompts (:mod:`routing.background`), all in the ``alpaca_short``
template. No test example is read: the rules are compared on the validation prompts, a client's own
against every other client's (issue 45: the calibrated rule's constants had been chosen on ``test[:40]``).
Then, for every client and each rule, the local weight ``a`` of every validation prompt through
:class:`routing.FedDPARouter`: ``paper`` (``lambda * mean cosine`` of S=5 random instances),
``calibrated`` (the Mahalanobis score mapped by the client's calibration, built here exactly as
training builds it, its constants chosen on the index's own folds), ``centroid`` (the calibrated rule
with the centred-cosine score of format-1 calibrations) and ``fixed`` (lambda). Reports per rule the
mean and median ``a`` on the client's own task and on the other tasks, the AUC of own vs other (1 =
always apart) and the routing time per request (the decision alone; the prefill it follows is timed
too, for scale). Prints one JSON object.

Usage: python -m bench.training.feddpa_weighting --data feddpa1 [--run RUN_DIR] [--train 240] [--val 60]
       [--embeddings cache.npz]   (reuses the embeddings of an earlier call with the same settings)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from routing import EmbeddingIndex, FedDPARouter
from routing.calibration import calibrate

LAMBDA = 0.5
SPLIT_SEED = 0


def split_training(dataset: Any, n_train: int, n_val: int, seed: int = SPLIT_SEED) -> dict[str, tuple[list, list]]:
    """Each client's training records as ``(index, validation)``: disjoint, by a seeded permutation.

    Only ``dataset.clients[*].train`` is read; the test sets are never touched.
    """
    out: dict[str, tuple[list, list]] = {}
    for c in dataset.clients:
        records = list(c.train)
        order = np.random.default_rng(seed).permutation(len(records))
        val = [records[i] for i in order[:n_val]]
        index = [records[i] for i in order[n_val:n_val + n_train]]
        if len(index) < 2 or not val:
            raise SystemExit(f"client {c.client_id} has {len(records)} training examples: too few for "
                             f"--val {n_val} and an index of at least 2")
        out[c.client_id] = (index, val)
    return out


def embed(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Embed index / validation / background prompts; arrays keyed ``train/<client>``, ``val/<client>``, ``bg``."""
    from adapters import inject, load_adapter
    from models import load_base_model
    from routing.embedding import embed_prompts
    from training.data import PromptConfig, load_dataset, prompt_texts
    from training.federation.personalize import background_prompts

    ds = load_dataset(args.data)
    lm = load_base_model("smollm2")
    adapted = inject(lm.model, ("q_proj", "v_proj"))
    names: tuple[str, ...] = ()
    if args.run:
        load_adapter(adapted, Path(args.run) / "adapters" / "global", "global", check_base=False)
        names = ("global",)
    cfg = PromptConfig("alpaca_short")

    def run(prompts: list[str]) -> np.ndarray:
        return embed_prompts(lm.model, adapted, lm.tokenizer, prompts, names, autocast=lm.autocast)

    out: dict[str, np.ndarray] = {}
    splits = split_training(ds, args.train, args.val)
    for c in ds.clients:
        index, val = splits[c.client_id]
        out[f"train/{c.client_id}"] = run(prompt_texts(index, lm.tokenizer, cfg))
        out[f"val/{c.client_id}"] = run(prompt_texts(val, lm.tokenizer, cfg))
        out[f"task/{c.client_id}"] = np.array([c.task])
    out["bg"] = run(background_prompts(lm.tokenizer, "alpaca_short"))
    prompt = prompt_texts(list(ds.clients[0].train)[:1], lm.tokenizer, cfg)
    began = time.perf_counter()
    for _ in range(5):
        run(prompt)
    out["prefill_s"] = np.array([(time.perf_counter() - began) / 5])
    return out


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(own > other) + half the ties."""
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


def measure(data: dict[str, np.ndarray]) -> dict[str, object]:
    """Per-rule weight statistics (own vs other tasks) and routing time per request."""
    clients = sorted(k.split("/", 1)[1] for k in data if k.startswith("train/"))
    if any(k.startswith("test/") for k in data):
        raise SystemExit("these embeddings hold test prompts (an --embeddings cache from before issue 45): re-embed")
    tests = {str(data[f"task/{c}"][0]): data[f"val/{c}"] for c in clients}  # validation prompts by task
    calibrated = FedDPARouter(lambda_=LAMBDA, weighting="calibrated")
    rules = {"paper": (FedDPARouter(lambda_=LAMBDA, S=5, seed=0), "mahalanobis"),
             "calibrated": (calibrated, "mahalanobis"), "centroid": (calibrated, "centroid")}
    result: dict[str, dict[str, list[float]]] = {r: {"own": [], "other": [], "auc": []} for r in rules}
    timing: dict[str, list[float]] = {r: [] for r in rules}
    attach: list[float] = []
    per_client: dict[str, dict[str, dict[str, float]]] = {}
    for c in clients:
        own_task = str(data[f"task/{c}"][0])
        cals = {s: calibrate(data[f"train/{c}"], data["bg"], statistic=s) for s in ("mahalanobis", "centroid")}
        indexes = {"centroid": EmbeddingIndex(data[f"train/{c}"], calibration=cals["centroid"])}
        began = time.perf_counter()  # loading a client: faiss index and, now, the Gaussian's fit
        indexes["mahalanobis"] = EmbeddingIndex(data[f"train/{c}"], calibration=cals["mahalanobis"])
        attach.append(time.perf_counter() - began)
        for name, (router, statistic) in rules.items():
            index = indexes[statistic]
            began = time.perf_counter()
            a = {t: np.array([router.decide(q, index, client=c).info["a"] for q in qs]) for t, qs in tests.items()}
            timing[name].append((time.perf_counter() - began) / sum(len(q) for q in tests.values()))
            own = a[own_task]
            other = np.concatenate([v for t, v in a.items() if t != own_task])
            result[name]["own"].extend(own.tolist())
            result[name]["other"].extend(other.tolist())
            result[name]["auc"].append(auc(own, other))
            per_client.setdefault(c, {})[name] = {"own": float(own.mean()), "other": float(other.mean())}
    summary: dict[str, object] = {}
    for name, r in result.items():
        own, other = np.array(r["own"]), np.array(r["other"])
        summary[name] = {"own_mean": float(own.mean()), "own_median": float(np.median(own)),
                         "other_mean": float(other.mean()), "other_median": float(np.median(other)),
                         "other_p90": float(np.quantile(other, 0.9)), "own_p10": float(np.quantile(own, 0.1)),
                         "other_nonzero": float((other > 0).mean()),
                         "auc_mean": float(np.mean(r["auc"])), "auc_min": float(np.min(r["auc"])),
                         "route_us_per_request": 1e6 * float(np.median(timing[name]))}
    summary["fixed"] = {"own_mean": LAMBDA, "other_mean": LAMBDA, "auc_mean": 0.5, "route_us_per_request": 0.0}
    summary["index_attach_ms_median"] = 1e3 * float(np.median(attach))
    summary["per_client"] = per_client
    if "prefill_s" in data:
        summary["prompt_forward_ms"] = 1e3 * float(data["prefill_s"][0])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="feddpa1")
    parser.add_argument("--run", default=None, help="a run directory whose global adapter is on while embedding")
    parser.add_argument("--train", type=int, default=240,
                        help="training prompts per client in its index (training indexes all of them)")
    parser.add_argument("--val", type=int, default=60,
                        help="training prompts per client held out of its index and scored (never test prompts)")
    parser.add_argument("--embeddings", default=None, help="npz cache of the embeddings (read if present)")
    args = parser.parse_args()
    cache = Path(args.embeddings) if args.embeddings else None
    if cache is not None and cache.is_file():
        data = dict(np.load(cache))
    else:
        data = embed(args)
        if cache is not None:
            np.savez(cache, **data)
    print(json.dumps({"data": args.data, "run": args.run, "lambda": LAMBDA, **measure(data)}, indent=1))


if __name__ == "__main__":
    main()
