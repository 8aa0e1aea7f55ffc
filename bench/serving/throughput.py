"""Serving throughput on SmolLM2: 8 concurrent requests from 8 clients with FedDPA, against baselines.

Eight chat requests, each from a different client of a FedDPA-T-like run (global + 8 local LoRAs,
r=8 on q/v; :mod:`bench.serving.common`), each decoding exactly ``--tokens`` tokens (eos ignored).
Cases, interleaved round by round, medians reported:
  engine_feddpa       the continuous-batching engine, 8 ``<client>`` targets with instance-wise
                      FedDPA weights (paper 000 section 4.3), one batch mixing all 8 clients; the
                      exact rule (the default): each prompt is prefilled again with its routed weights
  engine_feddpa_once  the same with ``--feddpa-prefill once`` (one prefill, routing only the decoded
                      tokens; not exact, documented beside the option)
  engine_base         the same 8 prompts on the bare base model, one batch
  hf_generate_batch   the baseline: the same 8 prompts on a separate copy of the bare base model (no
                      adapter layers), one left-padded ``model.generate`` call, eos ignored through
                      ``min_new_tokens``, greedy, the same dtype and autocast
  engine_feddpa_seq   the engine, the 8 FedDPA requests one after another (no batching)
  peft_sequential     HF PEFT holding each client's (1 - a, a) mixture as one adapter (the exact
                      rank-concatenated export), ``set_adapter`` per request, ``generate`` one by one
Every call of a case gets prompts not seen before (``Fresh``), so the engine's prefix cache reuses only
what a server would: the chat template and system prompt, never a whole repeated prompt.
Then time to first token (TTFT) of one new request: on an idle engine, and while 7 other clients'
requests are decoding, each with its first token out (this thread drives the engine as a server's engine
thread; the new request comes from another thread and is prefilled between steps; the clock starts
before its submit).
Prints one JSON object: aggregate decode tokens/s (tokens of all 8 requests / wall time), ratios
(``ratio_engine_base_to_hf_generate_batch`` >= 1.2, ``ratio_feddpa_to_base`` >= 0.90 and
``ratio_feddpa_to_peft_sequential`` >= 5 are issue 14's targets), TTFT.
Usage: python -m bench.serving.throughput [--tokens 32] [--rounds 3] [--model smollm2] [--dtype ...] [--threads 2]
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from adapters.export import export_mixture
from bench.serving.common import apply_threads, build_run, interleave, median, parser, prompts, ratio, run_all, timed
from models import LoadedModel, load_base_model
from serving.engine import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.stack import Job, ServingStack, StackConfig, build_stack

CLIENTS = 8


class Fresh:
    """Chat prompts never sent before, so no case finds its prompts whole in the engine's prefix cache
    (``serving.engine.prefix_cache``; a server sees new questions after the same chat template and system
    prompt); ``engine_base`` and ``hf_generate_batch`` share one set per round (the same 8 prompts)."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer, self.offset = tokenizer, 0
        self.rounds: dict[int, list[str]] = {}

    def batch(self, n: int = CLIENTS) -> list[str]:
        """``n`` prompts not handed out before."""
        self.offset += n
        return prompts(self.tokenizer, n, 1000 + self.offset - n)

    def one(self) -> str:
        """One prompt not handed out before."""
        return self.batch(1)[0]

    def shared(self, r: int) -> list[str]:
        """Round ``r``'s prompts of the cases that compare on the same prompts."""
        if r not in self.rounds:
            self.rounds[r] = self.batch()
        return self.rounds[r]


def run_jobs(stack: ServingStack, jobs: list[Job]) -> float:
    """Wall seconds to finish ``jobs`` together (continuous batching); raises if one fails."""
    return timed(lambda: run_all(stack, jobs))


def peft_model(model_name: str, dtype: str | None, folders: list[Path]) -> tuple[LoadedModel, torch.nn.Module]:
    """A separate copy of the base model with every client's mixture as a named PEFT adapter."""
    from peft import PeftModel

    loaded = load_base_model(model_name, dtype=dtype)  # type: ignore[arg-type]
    model = PeftModel.from_pretrained(loaded.model, str(folders[0]), adapter_name="c0")
    for c, folder in enumerate(folders[1:], 1):
        model.load_adapter(str(folder), adapter_name=f"c{c}")
    model.eval()
    return loaded, model


def peft_sequential(loaded: LoadedModel, model: torch.nn.Module, texts: list[str], tokens: int) -> float:
    """Seconds to answer ``texts`` one by one, switching to each client's PEFT adapter first."""

    def go() -> None:
        for c, text in enumerate(texts):
            model.set_adapter(f"c{c}")
            ids = loaded.tokenizer(text, return_tensors="pt", add_special_tokens=False)
            with torch.inference_mode(), loaded.autocast():
                model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                               pad_token_id=loaded.tokenizer.pad_token_id)

    return timed(go)


def hf_generate_batch(loaded: LoadedModel, texts: list[str], tokens: int) -> float:
    """Seconds for one left-padded ``generate`` over all ``texts`` on the bare base model (greedy, eos ignored)."""
    tok = loaded.tokenizer
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        ids = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = side

    def go() -> None:
        with torch.inference_mode(), loaded.autocast():
            out = loaded.model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                        pad_token_id=tok.pad_token_id)
        assert out.shape == (len(texts), ids["input_ids"].shape[1] + tokens), out.shape

    return timed(go)


def ttft(stack: ServingStack, text: str, load: list[Job]) -> float:
    """Seconds from submitting one request to its first streamed text, with ``load`` decoding meanwhile.

    This thread drives the engine, as a server's engine thread does (the only long-lived thread running
    torch's parallel work: a second one, like this thread after loading, halves a CPU engine's speed,
    see ``serving.api.app.in_own_thread``); the request comes from another thread, as from the API.
    """
    engine = stack.engine
    background = [stack.submit(job) for job in load]
    seconds: list[float] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            for b in background:  # every one decoding (its first token out), not just admitted: their
                next(iter(b.handle.stream()))  # prefill would otherwise count in the new request's TTFT
            t0 = time.perf_counter()  # submitting counts: a lease that waited for the step in flight is TTFT too
            sub = stack.submit(Job("c7", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), text))
            next(iter(sub.handle.stream()))
            seconds.append(time.perf_counter() - t0)
            if (res := sub.handle.result()).finish_reason != "length":
                raise RuntimeError(f"the TTFT request failed: {res.error}")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the driving thread
            errors.append(exc)

    thread = threading.Thread(target=client, name="ttft-client")
    thread.start()
    try:
        while thread.is_alive():
            if not engine.step():
                time.sleep(0.001)
    finally:
        for b in background:
            b.handle.cancel()
        while engine.step():
            pass
        thread.join()
    if errors:
        raise errors[0]
    return seconds[0]


def main() -> None:
    """Build the run, interleave the cases, print the JSON figures."""
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per request")
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(loaded, Path(tmp))
        stack = build_stack(StackConfig(model=args.model, run_dir=run, engine=EngineConfig(max_batch_size=CLIENTS)),
                            loaded=loaded)
        fresh = Fresh(loaded.tokenizer)
        texts = fresh.batch()
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

        def feddpa(exact: bool = True) -> list[Job]:
            return [Job(f"c{c}", params, t, exact_prefill=exact) for c, t in enumerate(fresh.batch())]

        # each client's mixture at its fixed weight, exported exactly as one PEFT adapter of rank r_g + r_l
        folders = []
        alpha = float(stack.info["alpha"])
        for c in range(CLIENTS):
            lease = stack.pool.acquire(("global", f"c{c}:local"))
            g, loc = lease.names
            folders.append(export_mixture(stack.adapted, [(g, 1 - alpha), (loc, alpha)], Path(tmp) / "peft" / f"c{c}"))
            lease.release()
        ploaded, pmodel = peft_model(args.model, args.dtype, folders)
        bare = load_base_model(args.model, dtype=args.dtype)  # a third copy: no adapter layers at all
        run_jobs(stack, feddpa()[:2])  # warm-up
        hf_generate_batch(bare, texts, 2)
        base_round = iter(range(args.rounds))
        hf_round = iter(range(args.rounds))
        seconds = interleave({
            "engine_feddpa": lambda: run_jobs(stack, feddpa()),
            "engine_feddpa_once": lambda: run_jobs(stack, feddpa(exact=False)),
            "engine_base": lambda: run_jobs(stack, [Job(stack.base_name, params, t)
                                                    for t in fresh.shared(next(base_round))]),
            "hf_generate_batch": lambda: hf_generate_batch(bare, fresh.shared(next(hf_round)), args.tokens),
            "engine_feddpa_seq": lambda: sum(run_jobs(stack, [j]) for j in feddpa()),
            "peft_sequential": lambda: peft_sequential(ploaded, pmodel, fresh.batch(), args.tokens),
        }, args.rounds)
        total = CLIENTS * args.tokens
        tps = {k: round(total / median(v), 1) for k, v in seconds.items()}
        endless = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        ttfts = interleave({"idle": lambda: ttft(stack, fresh.one(), []),
                            "under_load_7": lambda: ttft(stack, fresh.one(), [Job(f"c{c}", endless, t) for c, t in
                                                                              enumerate(fresh.batch(CLIENTS - 1))])},
                           args.rounds)
    print(json.dumps({
        "model": args.model, "dtype": loaded.dtype, "threads": torch.get_num_threads(), "clients": CLIENTS,
        "runner": "fused" if stack.engine.executor.fast is not None else "hf",
        "tokens_per_request": args.tokens, "rounds": args.rounds, "feddpa_routing": stack.routing,
        "decode_tokens_per_s": tps,
        "wall_s_median": {k: median(v) for k, v in seconds.items()},
        "ratio_engine_base_to_hf_generate_batch": ratio(tps["engine_base"], tps["hf_generate_batch"]),
        "ratio_feddpa_to_base": ratio(tps["engine_feddpa"], tps["engine_base"]),
        "ratio_feddpa_once_to_base": ratio(tps["engine_feddpa_once"], tps["engine_base"]),
        "ratio_feddpa_to_peft_sequential": ratio(tps["engine_feddpa"], tps["peft_sequential"]),
        "ratio_feddpa_batched_to_sequential": ratio(tps["engine_feddpa"], tps["engine_feddpa_seq"]),
        "ttft_ms_median": {k: round(1e3 * median(v), 1) for k, v in ttfts.items()},
        "ttft_ratio_load_to_idle": ratio(median(ttfts["under_load_7"]), median(ttfts["idle"])),
    }, indent=2))


if __name__ == "__main__":
    main()
