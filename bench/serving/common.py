"""Shared by the serving benchmarks (``bench/serving/``): a FedDPA run built in memory, prompts, timing, and
a running server's engine figures read from its ``/metrics`` (:func:`step_totals`, :func:`step_figures`).

:func:`build_run` writes a run directory like a FedDPA-T training run: ``global`` and one ``local``
adapter per client (LoRA r=8 on q/v, random B so each adapter changes the outputs), and each client's
local-instance embeddings (last-token states with the global adapter on, as training writes them),
so ``<client>`` targets get instance-wise weights (paper 000 section 4.3). :func:`interleave` runs the
cases of a benchmark in rotating order, round after round, so slow drift of a shared machine hits
every case alike; figures are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from adapters import AdaptedModel, LoraConfig, inject, save_adapter
from models import LoadedModel
from models.settings import DTYPES
from routing.cache import EmbeddingIndex
from routing.embedding import embed_prompts

if TYPE_CHECKING:
    import httpx

REPO = Path(__file__).resolve().parents[2]  # the checkout: bench/serving/common.py

TOPICS = ["sorting words", "country capitals", "unit conversion", "arithmetic", "spelling", "antonyms",
          "dates", "colours", "animals", "planets", "rivers", "authors"]


def questions(n: int, offset: int = 0) -> list[str]:
    """``n`` distinct user questions (the text of a user turn)."""
    out = []
    for i in range(n):
        topic = TOPICS[(i + offset) % len(TOPICS)]
        out.append(f"Question {i + offset} about {topic}: give three short facts about {topic}, one per line.")
    return out


def prompts(tokenizer: object, n: int, offset: int = 0) -> list[str]:
    """``n`` distinct chat-templated prompts (a user turn each, :func:`questions`)."""
    return [str(tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))
        for text in questions(n, offset)]


def random_adapter(adapted: AdaptedModel, name: str, config: LoraConfig, seed: int, folder: Path,
                   scale: float = 0.02) -> None:
    """Add adapter ``name`` with a seeded random ``B`` (so it changes the outputs) and save it to ``folder``."""
    adapted.add_adapter(name, config, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    for _, layer in adapted.adapter_layers(name):
        adapter = layer.adapters[name]
        B = torch.randn(adapter.lora_B.shape, generator=gen) * scale  # (out, r): 0.02 is a visible but sane change
        layer.set_weights(name, adapter.lora_A.detach().clone(), B)
    save_adapter(adapted, name, folder)


def build_run(loaded: LoadedModel, root: Path, clients: int = 8, rank: int = 8, alpha: float = 0.5) -> Path:
    """Write a FedDPA-T-like run directory with ``clients`` clients; returns its path."""
    run = root / "run"
    adapted = inject(loaded.model)
    config = LoraConfig(r=rank, alpha=2.0 * rank, dropout=0.0)
    try:
        random_adapter(adapted, "global", config, 0, run / "adapters" / "global")
        for c in range(clients):
            random_adapter(adapted, f"l{c}", config, 1 + c, run / "adapters" / "clients" / f"c{c}" / "local")
        for c in range(clients):  # 8 local instances per client, embedded with the global adapter on
            vecs = embed_prompts(loaded.model, adapted, loaded.tokenizer, prompts(loaded.tokenizer, 8, 100 * c),
                                 ("global",), autocast=loaded.autocast)
            EmbeddingIndex(vecs).save(run / "adapters" / "clients" / f"c{c}")
    finally:
        adapted.remove()
    (run / "run.json").write_text(json.dumps({"method": "feddpa-t", "model": loaded.name, "inference_weight": alpha}))
    return run


def write_scale_run(loaded: LoadedModel, root: Path, clients: int, rank: int = 8, instances: int = 8,
                    seed: int = 0, alpha: float = 0.5) -> Path:
    """Write a FedDPA-T-like run with ``clients`` clients fast: random adapters, random unit embeddings.

    No forward pass: every client gets a PEFT folder (LoRA ``rank`` on q/v, seeded random A and small
    random B) and ``instances`` random unit vectors of the model's hidden width as its embedding
    index, valid files the server loads. For scale runs, not for answers worth reading.
    """
    from adapters.io import write_adapter_folder

    run = root / "run"
    adapted = inject(loaded.model)
    try:
        config = LoraConfig(r=rank, alpha=2.0 * rank, dropout=0.0)
        layers = adapted.target_layers(config)
        shapes = {path: (layer.in_features, layer.out_features) for path, layer in layers.items()}
        base_model = adapted.base_model_name
    finally:
        adapted.remove()
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    width = int(loaded.model.config.hidden_size)  # type: ignore[union-attr]

    def tensors() -> dict[str, torch.Tensor]:
        out = {}
        for path, (d_in, d_out) in shapes.items():
            out[f"{path}.lora_A"] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
            out[f"{path}.lora_B"] = torch.randn(d_out, rank, generator=gen) * 0.02
        return out

    write_adapter_folder(run / "adapters" / "global", config, tensors(), base_model)
    for c in range(clients):
        folder = run / "adapters" / "clients" / f"c{c}"
        write_adapter_folder(folder / "local", config, tensors(), base_model)
        vecs = rng.standard_normal((instances, width)).astype(np.float32)
        EmbeddingIndex(vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).save(folder)
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


def run_all(stack: object, jobs: Sequence[object]) -> None:
    """Run ``jobs`` through ``stack`` (a ``serving.stack.ServingStack``); raise unless each ran to its length.

    The benchmarks ask for exactly ``max_tokens`` tokens (eos ignored), so anything else (an error
    result, a refused job) would make the timing meaningless.
    """
    for outcome in stack.run(jobs):  # type: ignore[attr-defined]
        res = outcome.result
        if outcome.error is not None or res is None or res.finish_reason != "length":
            detail = outcome.error if outcome.error is not None else (res.error if res is not None else None)
            raise RuntimeError(f"job for {outcome.job.target!r} did not run to its length: {detail}")


def print_json(figures: dict[str, object]) -> None:
    """Print the benchmark's one JSON object (indented) on stdout."""
    print(json.dumps(figures, indent=2), flush=True)


def length_draw(mean: int, ratio: float, seed: int) -> Callable[[], int]:
    """Draws of ``max_tokens`` uniform in ``mean x [1 - ratio, 1 + ratio]`` (vLLM's range ratio), seeded."""
    rnd = random.Random(seed)
    low = max(1, round(mean * (1 - ratio)))
    high = max(low, round(mean * (1 + ratio)))
    return lambda: rnd.randint(low, high)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(values: list[float], digits: int = 4) -> float:
    """The median of ``values``, rounded."""
    return round(statistics.median(values), digits)


def percentile(values: Sequence[float], q: float, digits: int = 4) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return round(ordered[rank - 1], digits)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """``a / b`` rounded, None when either is missing or ``b`` is zero."""
    return round(a / b, digits) if a is not None and b else None


def parser(doc: str | None, model: str = "smollm2", rounds: int = 3) -> argparse.ArgumentParser:
    """The options every serving benchmark takes: ``--model``, ``--dtype``, ``--rounds``, ``--threads``.

    Args:
        doc: the script's module docstring (its first line is the description).
        model: default base model.
        rounds: default rounds of interleaved cases.
    """
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    p.add_argument("--model", default=model, help="base model: smollm2, tiny, or an HF folder")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: FEDMOSAIC_DTYPE")
    p.add_argument("--rounds", type=int, default=rounds, help="rounds of interleaved cases (medians over them)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's thread count from ``--threads`` (if given)."""
    if args.threads:
        torch.set_num_threads(args.threads)


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux ``/proc``; ``ru_maxrss`` elsewhere is a peak)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# --- a running server's engine figures (its /metrics), read before and after a load phase ---

COUNTERS = {"fedmosaic_engine_prefill_tokens": "prefill_tokens_computed",
            "fedmosaic_prefix_cache_reused_tokens": "prefix_tokens_reused",
            "fedmosaic_prefix_cache_hits": "prefix_hits"}


async def step_totals(client: httpx.AsyncClient) -> dict[str, tuple[float, float]]:
    """Per step kind (prefill, decode, mixed): the server's (step count, seconds) so far, from /metrics;
    under the names of ``COUNTERS`` its prompt-token counters as (value, 0); and under ``server_ttft`` the
    count and sum of its own time-to-first-token histogram (submission to first token, inside the engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        if family.name in COUNTERS:
            totals[COUNTERS[family.name]] = [sum(x.value for x in family.samples if x.name.endswith("_total")), 0.0]
        if family.name == "fedmosaic_time_to_first_token_seconds":
            cell = totals.setdefault("server_ttft", [0.0, 0.0])
            for sample in family.samples:
                slot = {"fedmosaic_time_to_first_token_seconds_count": 0,
                        "fedmosaic_time_to_first_token_seconds_sum": 1}.get(sample.name)
                if slot is not None:
                    cell[slot] += sample.value
        if family.name in ("fedmosaic_engine_step_cpu_seconds", "fedmosaic_engine_syncs"):  # host work per kind
            for sample in family.samples:
                if sample.name in ("fedmosaic_engine_step_cpu_seconds_sum", "fedmosaic_engine_syncs_total"):
                    cell = totals.setdefault(f"{sample.labels['kind']}_host", [0.0, 0.0])
                    cell[0 if sample.name.endswith("_total") else 1] = sample.value
        if family.name != "fedmosaic_engine_step_seconds":
            continue
        for sample in family.samples:
            slot = {"fedmosaic_engine_step_seconds_count": 0, "fedmosaic_engine_step_seconds_sum": 1}.get(sample.name)
            if slot is not None:
                totals.setdefault(sample.labels["kind"], [0.0, 0.0])[slot] = sample.value
    return {k: (v[0], v[1]) for k, v in totals.items()}


def step_figures(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                 wall: float) -> dict[str, object]:
    """Engine steps of the load phase per kind (how many, their mean, the share of the wall time, the engine
    thread's mean CPU time and host-device synchronisations per step) and the prompt tokens computed and
    reused meanwhile, and the mean time to first token the server measured."""
    out: dict[str, object] = {}
    for kind, (count, seconds) in sorted(after.items()):
        n, sec = count - before.get(kind, (0.0, 0.0))[0], seconds - before.get(kind, (0.0, 0.0))[1]
        if kind in COUNTERS.values():
            out[kind] = int(n)
        elif kind == "server_ttft":
            out["server_ttft_ms_mean"] = round(1e3 * sec / n, 1) if n else None
        elif kind.endswith("_host"):  # sorted after its kind: the engine thread's CPU time and syncs per step
            base = out.get(kind.removesuffix("_host"))
            if isinstance(base, dict) and base["steps"]:
                base["cpu_ms_mean"] = round(1e3 * sec / base["steps"], 1)
                base["syncs_per_step"] = round(n / base["steps"], 2)  # 0 unless the server counts them
        elif n:
            out[kind] = {"steps": int(n), "mean_ms": round(1e3 * sec / n, 1),
                         "share_of_wall": round(sec / wall, 3) if wall > 0 else None}
    return out


@contextmanager
def served(serve_args: Sequence[str], log: Path, env: dict[str, str] | None = None, threads: int | None = None,
           ready_s: float = 600) -> Iterator[str]:
    """``fedmosaic serve SERVE_ARGS`` (this checkout) on a free port until the block ends; yields its URL.

    Args:
        serve_args: the arguments after ``serve`` (``--port`` is added).
        log: the server's stdout and stderr go here; its tail is in the error when it fails.
        env: extra environment variables.
        threads: ``OMP_NUM_THREADS`` for the server (None: inherited).
        ready_s: seconds to wait for ``/health``.

    Raises:
        RuntimeError: the server exited or did not become ready in time.
    """
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "fedmosaic.cli", "serve", *serve_args, "--port", str(port)]
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    if threads:
        full_env["OMP_NUM_THREADS"] = str(threads)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
