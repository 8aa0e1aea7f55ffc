"""The CPU attention's price for greedy reproducibility: the batch-invariant attention against fused SDPA.

``serving.engine.kernels.reference`` used to run the CPU attention as PyTorch's fused SDPA over every row's
cache up to the longest row: its reductions follow that length and the chunk's query count, so one token
rounded differently cold, after a cached prefix, in chunks or beside other rows. It now runs
``invariant_attention`` (key blocks from position 0, fixed-length products, block partials added in order).
The former SDPA formulation is written out below as the baseline. Cases interleaved round by round,
medians reported:
  1. one layer at SmolLM2's geometry (9 query heads, 3 KV heads, dim 64) in the cache dtype of ``--dtype``:
     a decode step of ``--rows`` rows of 60-160 cached positions, and one ``--prompt``-token prefill chunk;
     milliseconds of each, and the decode's largest error against a float64 attention;
  2. the engine on the bare base model: ``--rows`` greedy requests (distinct chat prompts) of ``--tokens``
     tokens, prefill and decode, with the baseline patched in and as shipped: seconds.
Prints one JSON object with both and their ratios (> 1: the shipped code is slower).
Usage: python -m bench.serving.invariant_attention [--rows 16] [--tokens 16] [--prompt 512] [--rounds 3]
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.serving.common import apply_threads, interleave, median, parser, print_json, prompts, ratio
from models import load_base_model
from serving.engine import Engine, EngineConfig
from serving.engine.kernels import reference
from serving.engine.request import GenerationRequest
from serving.engine.sampling import SamplingParams

SHIPPED = (reference.decode_attention, reference.prefill_attention)


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The former CPU decode attention: fused SDPA over the rows up to the longest, a head's G queries folded."""
    b, hq, d = q.shape
    hkv, length = k_cache.shape[1], int(lengths.max())
    valid = torch.arange(length)[None, :] < lengths.clamp(min=1)[:, None]  # (B, L)
    k, v = k_cache[:, :, :length].index_select(0, slots), v_cache[:, :, :length].index_select(0, slots)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d).to(k.dtype), k, v,
                                             attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(b, hq, d).to(q.dtype)


def sdpa_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 starts: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The former CPU prefill attention: fused SDPA with a causal mask over the rows up to the longest."""
    t, length = q.shape[1], int(lengths.max())
    k, v = k_cache[:, :, :length].index_select(0, slots), v_cache[:, :, :length].index_select(0, slots)
    key_pos = torch.arange(length)
    query_pos = starts[:, None] + torch.arange(t)[None, :]  # (B, T)
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos < lengths.clamp(min=1)[:, None])[:, None]
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.to(k.dtype).transpose(1, 2), k, v, attn_mask=allowed[:, None],
                                             scale=scale, enable_gqa=True)
    return out.transpose(1, 2).to(q.dtype)


def use_sdpa(on: bool) -> None:
    """Patch the former SDPA attention into the reference module (the dispatcher calls it there), or restore."""
    decode, prefill = (sdpa_decode, sdpa_prefill) if on else SHIPPED
    reference.decode_attention, reference.prefill_attention = decode, prefill


def layer_ms(rows: int, prompt: int, dtype: torch.dtype, repeats: int = 10) -> dict[str, float]:
    """Milliseconds of one layer's decode and prefill attention, SDPA and shipped, at SmolLM2's geometry."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, lmax = 9, 3, 64, max(256, prompt)
    k = torch.randn(rows + 1, hkv, lmax, d, generator=gen).to(dtype)
    v = torch.randn(rows + 1, hkv, lmax, d, generator=gen).to(dtype)
    slots = torch.randperm(rows, generator=gen)
    lengths = torch.randint(60, 160, (rows,), generator=gen)
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    chunk = torch.randn(1, prompt, hq, d, generator=gen).to(dtype)
    one, zero, full = torch.tensor([rows]), torch.tensor([0]), torch.tensor([prompt])
    exact = torch.stack([
        torch.softmax(torch.einsum("hd,hld->hl", q[b].double(),
                                   k[s, :, :n].double().repeat_interleave(hq // hkv, 0)) * d ** -0.5, -1)
        .unsqueeze(-1).mul(v[s, :, :n].double().repeat_interleave(hq // hkv, 0)).sum(1)
        for b, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True))])
    cases = {"sdpa": (sdpa_decode, sdpa_prefill), "shipped": SHIPPED}
    out: dict[str, float] = {}
    for name, (dec, pre) in cases.items():
        out[f"decode_max_error_{name}"] = (dec(q, k, v, slots, lengths, d ** -0.5).double() - exact).abs().max().item()
        for label, call in (("decode", lambda: dec(q, k, v, slots, lengths, d ** -0.5)),  # noqa: B023
                            ("prefill", lambda: pre(chunk, k, v, one, zero, full, d ** -0.5))):  # noqa: B023
            call()
            t0 = time.perf_counter()
            for _ in range(repeats):
                call()
            out[f"{label}_ms_{name}"] = round(1e3 * (time.perf_counter() - t0) / repeats, 3)
    return out


def main() -> None:
    """Measure both, print the JSON figures."""
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=16, help="requests decoding together")
    p.add_argument("--tokens", type=int, default=16, help="tokens decoded per request")
    p.add_argument("--prompt", type=int, default=512, help="tokens of the prefill chunk timed per layer")
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    cache = torch.bfloat16 if loaded.dtype in ("bfloat16", "autocast-bf16") else torch.float32
    layer = layer_ms(args.rows, args.prompt, cache)
    engine = Engine(loaded, None, EngineConfig(max_batch_size=args.rows, prefix_cache_slots=0))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    requests = [GenerationRequest(prompt=t, sampling=params) for t in prompts(loaded.tokenizer, args.rows)]
    engine.generate(requests[:2])  # warm-up

    def run(baseline: bool) -> float:
        use_sdpa(baseline)
        try:
            t0 = time.perf_counter()
            engine.generate(requests)
            return time.perf_counter() - t0
        finally:
            use_sdpa(False)

    seconds = interleave({"sdpa": lambda: run(True), "shipped": lambda: run(False)}, args.rounds)
    engine_s = {k: median(v) for k, v in seconds.items()}
    print_json({"model": args.model, "dtype": loaded.dtype, "rows": args.rows, "tokens": args.tokens,
                "threads": torch.get_num_threads(), "layer_attention": layer,
                "ratio_layer_decode_shipped_to_sdpa": ratio(layer["decode_ms_shipped"], layer["decode_ms_sdpa"]),
                "ratio_layer_prefill_shipped_to_sdpa": ratio(layer["prefill_ms_shipped"], layer["prefill_ms_sdpa"]),
                "engine_seconds": engine_s, "ratio_engine_shipped_to_sdpa": ratio(engine_s["shipped"],
                                                                                  engine_s["sdpa"])})


if __name__ == "__main__":
    main()
