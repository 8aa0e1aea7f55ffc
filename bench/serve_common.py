"""Shared by the serving benchmarks (bench/serve_*.py): a FedDPA run built in memory, prompts, timing.

:func:`build_run` writes a run directory like a FedDPA-T training run: ``global`` and one ``local``
adapter per client (LoRA r=8 on q/v, random B so each adapter changes the outputs), and each client's
local-instance embeddings (last-token states with the global adapter on, as training writes them),
so ``<client>`` targets get instance-wise weights (paper 000 section 4.3). :func:`interleave` runs the
cases of a benchmark in rotating order, round after round, so slow drift of a shared machine hits
every case alike; figures are medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adapters import LoraConfig, inject, save_adapter
from models import LoadedModel
from routing.cache import EmbeddingIndex
from routing.embedding import embed_prompts

TOPICS = ["sorting words", "country capitals", "unit conversion", "arithmetic", "spelling", "antonyms",
          "dates", "colours", "animals", "planets", "rivers", "authors"]


def prompts(tokenizer: object, n: int, offset: int = 0) -> list[str]:
    """``n`` distinct chat-templated prompts (a user turn each)."""
    out = []
    for i in range(n):
        topic = TOPICS[(i + offset) % len(TOPICS)]
        text = f"Question {i + offset} about {topic}: give three short facts about {topic}, one per line."
        out.append(str(tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)))
    return out


def _random_adapter(adapted, name: str, config: LoraConfig, seed: int, folder: Path) -> None:
    adapted.add_adapter(name, config, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    for _, layer in adapted.adapter_layers(name):
        adapter = layer.adapters[name]
        B = torch.randn(adapter.lora_B.shape, generator=gen) * 0.02  # (out, r): a visible but sane change
        layer.set_weights(name, adapter.lora_A.detach().clone(), B)
    save_adapter(adapted, name, folder)


def build_run(loaded: LoadedModel, root: Path, clients: int = 8, rank: int = 8, alpha: float = 0.5) -> Path:
    """Write a FedDPA-T-like run directory with ``clients`` clients; returns its path."""
    run = root / "run"
    adapted = inject(loaded.model)
    config = LoraConfig(r=rank, alpha=2.0 * rank, dropout=0.0)
    try:
        _random_adapter(adapted, "global", config, 0, run / "adapters" / "global")
        for c in range(clients):
            _random_adapter(adapted, f"l{c}", config, 1 + c, run / "adapters" / "clients" / f"c{c}" / "local")
        for c in range(clients):  # 8 local instances per client, embedded with the global adapter on
            vecs = embed_prompts(loaded.model, adapted, loaded.tokenizer, prompts(loaded.tokenizer, 8, 100 * c),
                                 ("global",), autocast=loaded.autocast)
            EmbeddingIndex(vecs).save(run / "adapters" / "clients" / f"c{c}")
    finally:
        adapted.remove()
    (run / "run.json").write_text(json.dumps({"method": "feddpa-t", "model": loaded.name, "inference_weight": alpha}))
    return run


def interleave(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every case once per round, in an order rotated each round; returns each case's values."""
    names = list(cases)
    values: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            values[name].append(cases[name]())
            print(f"round {r + 1}/{rounds} {name}: {values[name][-1]:.4f}", file=sys.stderr, flush=True)
    return values


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)
