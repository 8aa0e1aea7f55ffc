"""Load: N concurrent streaming HTTP clients against a real ``fedmosaic serve``, one adapter reloaded every 2 s.

Builds a FedDPA-T-like run (:func:`bench.serving.common.build_run`: global + ``--run-clients`` local adapters
with each client's embedding index) plus versions of a runtime adapter ``hot`` (A: a copy of ``c0:local``;
B: another random adapter),
starts ``python -m fedmosaic.cli serve RUN`` as a subprocess (this checkout first on ``PYTHONPATH``) and
drives it with httpx:

1. reference answers: the probe prompt sent to ``hot`` (greedy) with version A loaded, then each
   candidate B, then A again (the two must differ, A must repeat, and each answer must be the same
   alone, in a small batch, beside a crowd the size of the load and arriving while it decodes, or the
   check below could not see anything or would see bf16 batch noise: :mod:`bench.serving.load_probe`);
2. idle: one client alone sends ``--idle-requests`` requests one after another (the idle TTFT);
3. load: ``--clients`` streaming clients (starting evenly spread over ``--ramp`` s, as load tools ramp
   users up) for ``--duration`` s, each request for one of the run's ``<client>`` targets
   (instance-wise FedDPA weights) in turn with a question not asked before (the server's prefix cache
   reuses the chat template and system prompt, never a whole prompt), and every
   ``--probe-every``-th request of each client (staggered across clients, so probes run from the
   first requests on) the probe to
   ``hot``; meanwhile ``hot`` is reloaded every ``--reload-every`` s
   through ``POST /v1/load_lora_adapter`` (``load_inplace``: a new version), alternately from the folders
   of versions B and A. With ``--max-tokens-range-ratio r`` each request's ``max_tokens`` is drawn from
   ``max_tokens x [1 - r, 1 + r]`` (seeded per client): with equal lengths the clients admitted in one step
   finish in one step and come back as a herd, a synchronisation real traffic does not have.

Wrong versions: the pool leases a request's adapter versions when it is submitted, which happens
between sending the request and receiving the response headers. For each probe, the versions that
could have been current in that window are known from the reload log (each reload's send and answer
times); the probe's greedy text must equal the reference answer of one of them. A request decoded
with a replaced version's weights (or a mixture of two versions) answers differently and is counted.

Prints one JSON object: failures, wrong versions, p50/p99 time to first token (first content delta)
and total latency under load, aggregate completion tokens/s, the idle p50 TTFT of the same server and
the ratio (issue 14's target: 0 failures, 0 wrong versions, load p50 TTFT <= 3 x idle). The TTFT and
latency percentiles are given twice: over every request, and in ``steady`` over the requests sent after
``--warmup`` s (the first requests of all clients arrive together and queue behind each other's
prefill: that start-up burst is reported, the ratio is taken in the steady state after it). The
server's own step counts and mean step times of the load phase (per kind, from its /metrics) say
where the time went, with the prompt tokens its prefill passes computed and those it reused from cached
prefixes.
Usage: python -m bench.serving.load [--model tiny] [--clients 64] [--duration 120] [--max-batch-size 64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.serving.common import (
    build_run,
    length_draw,
    median,
    parser,
    percentile,
    print_json,
    questions,
    ratio,
    served,
    step_figures,
    step_totals,
)
from bench.serving.load_probe import HOT, Reply, Timeline, references, reload, stream, write_versions
from models import load_base_model


@contextmanager
def server(run: Path, args: argparse.Namespace, log: Path) -> Iterator[str]:
    """Run ``fedmosaic serve run`` (this checkout) on a free port until the block ends; yields its URL."""
    serve_args = [str(run), "--model", args.model, "--max-batch-size", str(args.max_batch_size),
                  "--max-model-len", str(args.max_model_len), "--runtime-lora"]
    serve_args += [*(["--dtype", args.dtype] if args.dtype else []),
                   *(["--device", args.device] if args.device else [])]
    serve_args += [*(["--count-syncs"] if args.count_syncs else []),
                   *(["--profile", str(Path(args.profile).resolve())] if args.profile else [])]
    with served(serve_args, log, {"FEDMOSAIC_SERVE_MAX_WAITING": str(max(256, 2 * args.clients))},
                args.threads) as url:
        yield url



async def scenario(url: str, args: argparse.Namespace, texts: list[str], probe: str, folders: dict[str, Path]) -> dict:
    """References, idle requests, then the load with reloads; returns the figures."""
    a = args  # short: used on most lines below
    limits = httpx.Limits(max_connections=a.clients + 8, max_keepalive_connections=a.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        company = [(f"c{c}", texts[c % len(texts)]) for c in range(min(8, a.run_clients))]
        crowd = [(f"c{c % a.run_clients}", q) for c, q in  # as many as the load decodes at once
                 enumerate(questions(min(a.clients, a.max_batch_size) - 1, 10_000))]
        ref = await references(client, t0, probe, folders, a.probe_tokens, company, crowd)
        targets = [f"c{c}" for c in range(a.run_clients)]
        asked = itertools.count(len(texts))  # each request a question not asked before (no whole-prompt reuse)
        idle = [await stream(client, t0, targets[i % len(targets)], questions(1, next(asked))[0], a.max_tokens)
                for i in range(a.idle_requests)]
        timeline = Timeline("A")
        replies: list[Reply] = []
        steps_before = await step_totals(client)
        start = time.perf_counter() - t0
        stop = start + a.duration

        async def user(u: int) -> None:
            draw = length_draw(a.max_tokens, a.max_tokens_range_ratio, seed=u)  # the same lengths run to run
            await asyncio.sleep(a.ramp * u / max(1, a.clients))
            n = 0
            while time.perf_counter() - t0 < stop:
                n += 1
                if (n + u) % a.probe_every == 0:  # staggered: every client probes within its first k requests
                    replies.append(await stream(client, t0, HOT, probe, a.probe_tokens, probe=True))
                else:
                    k = u + n
                    replies.append(await stream(client, t0, targets[k % len(targets)], questions(1, next(asked))[0],
                                                draw()))

        async def reloader() -> None:
            i = 0
            while time.perf_counter() - t0 < stop:
                await asyncio.sleep(a.reload_every)
                label = "B" if i % 2 == 0 else "A"
                timeline.reloads.append(await reload(client, t0, label, folders[label]))
                i += 1

        await asyncio.gather(reloader(), *(user(u) for u in range(a.clients)))
        wall = max(r.end or 0.0 for r in replies) - start
        steps = step_figures(steps_before, await step_totals(client), wall)
    return {"refs": ref, "idle": idle, "replies": replies, "timeline": timeline, "wall": wall, "start": start,
            "steps": steps}


def figures(out: dict) -> dict[str, object]:
    """The JSON figures of one scenario."""
    replies: list[Reply] = out["replies"]
    timeline: Timeline = out["timeline"]
    ok = [r for r in replies if r.error is None]
    wrong = []
    for r in ok:
        if not r.probe:
            continue
        allowed = timeline.allowed(r.sent, r.headers if r.headers is not None else r.end or r.sent)
        if r.text not in {out["refs"][label] for label in allowed}:
            seen = [label for label, text in out["refs"].items() if text == r.text]
            wrong.append({"sent_s": round(r.sent, 3), "allowed": sorted(allowed), "matches": seen, "text": r.text})
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    latency = [r.end - r.sent for r in ok if r.end is not None]
    steady = [r for r in ok if r.sent >= out["start"] + out["warmup"]]
    steady_ttft = [r.first - r.sent for r in steady if r.first is not None]
    steady_latency = [r.end - r.sent for r in steady if r.end is not None]
    idle_ttft = [r.first - r.sent for r in out["idle"] if r.error is None and r.first is not None]
    reload_ms = [1e3 * (x.done - x.sent) for x in timeline.reloads]
    ms = 1e3
    p50 = percentile(ttft, 50)
    idle_p50 = median(idle_ttft) if idle_ttft else None
    return {
        "requests": len(replies), "completed": len(ok), "failures": len(replies) - len(ok),
        "failure_examples": sorted({r.error for r in replies if r.error})[:5],
        "probes_checked": sum(r.probe for r in ok), "wrong_versions": len(wrong), "wrong_examples": wrong[:5],
        "reloads": len(timeline.reloads), "reload_failures": sum(not x.ok for x in timeline.reloads),
        "reload_ms_median": round(median(reload_ms), 1) if reload_ms else None,
        "ttft_ms": {"p50": round(ms * p50, 1) if p50 is not None else None,
                    "p99": round(ms * (percentile(ttft, 99) or 0), 1)},
        "latency_ms": {"p50": round(ms * (percentile(latency, 50) or 0), 1),
                       "p99": round(ms * (percentile(latency, 99) or 0), 1)},
        "completion_tokens_per_s": round(sum(r.tokens for r in ok) / out["wall"], 1) if out["wall"] > 0 else None,
        "idle_ttft_ms_p50": round(ms * idle_p50, 1) if idle_p50 is not None else None,
        "idle_latency_ms_p50": round(ms * median([r.end - r.sent for r in out["idle"] if r.end]), 1),
        "ratio_ttft_load_to_idle": ratio(p50, idle_p50),
        "steady": {"warmup_s": out["warmup"], "requests": len(steady),
                   "ttft_ms": {"p50": round(ms * (percentile(steady_ttft, 50) or 0), 1),
                               "p99": round(ms * (percentile(steady_ttft, 99) or 0), 1)},
                   "latency_ms": {"p50": round(ms * (percentile(steady_latency, 50) or 0), 1)},
                   "ratio_ttft_load_to_idle": ratio(percentile(steady_ttft, 50), idle_p50)},
        "engine_steps_under_load": out["steps"],
        "probe_answers": out["refs"],
    }


def prepare(args: argparse.Namespace, root: Path) -> tuple[Path, dict[str, Path], list[str], str, str]:
    """Write the run and the versions of the hot adapter; returns (run, folders, questions, probe, dtype)."""
    loaded = load_base_model(args.model, dtype=args.dtype)
    run = build_run(loaded, root, clients=args.run_clients)
    return run, write_versions(loaded, run), questions(12), "Name three colours, one per line.", loaded.dtype


def main() -> None:
    """Prepare the run, start the server, run the scenario, print the JSON figures."""
    p = parser(__doc__, model="smollm2", rounds=1)
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--ramp", type=float, default=5.0, help="seconds over which the clients start")
    p.add_argument("--warmup", type=float, default=40.0,
                   help="seconds after the load starts before requests count as steady state")
    p.add_argument("--run-clients", type=int, default=8, help="FedDPA clients in the served run")
    p.add_argument("--max-batch-size", type=int, default=64, help="the server's KV slots (fedmosaic serve's option)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the load's requests")
    p.add_argument("--device", default=None, help="the server's --device (default: its own, auto)")
    p.add_argument("--count-syncs", action="store_true",
                   help="the server counts host-device synchronisations per step (reported per step kind)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="the server writes a torch profiler trace of 16 engine steps into DIR")
    p.add_argument("--max-tokens-range-ratio", type=float, default=0.0,
                   help="each load request's max_tokens drawn uniformly from max_tokens x [1 - r, 1 + r] "
                        "(vLLM's --random-range-ratio); 0: all equal, so clients admitted together finish together")
    p.add_argument("--probe-tokens", type=int, default=12, help="max_tokens of the version probes")
    p.add_argument("--probe-every", type=int, default=4, help="every k-th request of a client is a probe")
    p.add_argument("--reload-every", type=float, default=2.0, help="seconds between reloads of the hot adapter")
    p.add_argument("--idle-requests", type=int, default=8)
    args = p.parse_args()
    if not 0 <= args.max_tokens_range_ratio < 1:
        p.error(f"--max-tokens-range-ratio must be in [0, 1), got {args.max_tokens_range_ratio}")
    with tempfile.TemporaryDirectory() as tmp:
        run, folders, texts, probe, dtype = prepare(args, Path(tmp))
        with server(run, args, Path(tmp) / "server.log") as url:
            out = asyncio.run(scenario(url, args, texts, probe, folders))
    out["warmup"] = args.warmup
    print_json({"model": args.model, "dtype": dtype, "clients": args.clients, "duration_s": args.duration,
                "ramp_s": args.ramp, "server_max_batch_size": args.max_batch_size, "max_tokens": args.max_tokens,
                "max_tokens_range_ratio": args.max_tokens_range_ratio, "run_clients": args.run_clients,
                "reload_every_s": args.reload_every, **figures(out)})


if __name__ == "__main__":
    main()
