"""Which storage order of the weight matrices makes a decode step's GEMMs fastest here.

Takes the base model's own matrices (every decoder layer's q/k/v, o, gate/up and down, fused as the
fused runner fuses them, and the LM head) and times one pass over all of them, as a forward step
does, for N rows (1, 8 and 16 decode rows, 64, and a 392-token prefill), with each matrix stored

  row_major    (out, in) contiguous, as transformers loads it: ``F.linear(x, W)`` is ``x @ W^T``
  in_major     (in, out) contiguous (the fused runner's order on CPU in float32,
               ``serving/engine/runner/layout.py``): ``F.linear(x, W)`` with W its transposed view

and the head computed as ``F.linear`` or as ``(W @ h^T)^T`` (what the runner does in in_major mode,
the head staying row-major because the embedding shares it). In bfloat16, where torch has oneDNN's
packed linear on this CPU, one more case:

  packed       oneDNN's blocked form, head included (the runner's own copies under autocast-bf16,
               ``serving.engine.runner.layout.packed_copy``)

Cases interleaved, medians, one JSON object with milliseconds per case and the speed-ups of in_major
and packed over row_major measured in this run.
Usage: python -m bench.serving.gemm_layout [--model smollm2] [--dtype float32|bfloat16] [--rounds 5]
"""

from __future__ import annotations

import torch

from bench.serving.common import apply_threads, interleave, median, parser, print_json, ratio, timed
from models import load_base_model
from serving.engine.runner.layout import linear, packed_copy, packs

ROWS = (1, 8, 16, 64, 392)


def matrices(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every decoder layer's fused q/k/v, o, fused gate/up and down matrix, row-major (out, in)."""
    out = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        a, m = layer.self_attn, layer.mlp
        out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
    return [w.detach().to(dtype).contiguous() for w in out]


def step(mats: list[torch.Tensor], head: torch.Tensor, x: torch.Tensor, head_mm: bool) -> None:
    """One pass over every matrix with inputs of the right width, then the head (plain or packed matrices)."""
    for w in mats:
        linear(x if w.shape[1] == x.shape[1] else torch.ones(x.shape[0], w.shape[1], dtype=x.dtype), w, None)
    if head_mm:
        torch.mm(head, x.t())
    else:
        linear(x, head, None)


def main() -> None:
    """Time each storage order for each row count, interleaved; print the JSON figures."""
    p = parser(__doc__, rounds=5)
    args = p.parse_args()
    apply_threads(args)
    loaded = load_base_model(args.model, dtype=args.dtype)
    dtype = next(loaded.model.parameters()).dtype
    with torch.inference_mode():
        row_major = matrices(loaded.model, dtype)
        in_major = [w.t().contiguous().t() for w in row_major]
        head = loaded.model.lm_head.weight.detach().to(dtype).contiguous()
        packed = [packed_copy(w, dtype) for w in [*row_major, head]] if packs(head.device, dtype) else None
        hidden = head.shape[1]
        figures: dict[str, dict[str, float | None]] = {}
        for n in ROWS:
            x = torch.randn(n, hidden, dtype=dtype, generator=torch.Generator().manual_seed(n))
            cases = {
                "row_major": lambda x=x: timed(lambda: step(row_major, head, x, False)),
                "in_major": lambda x=x: timed(lambda: step(in_major, head, x, True)),
                "in_major_head_linear": lambda x=x: timed(lambda: step(in_major, head, x, False)),
            }
            if packed is not None:
                cases["packed"] = lambda x=x: timed(lambda: step(packed[:-1], packed[-1], x, False))
            for fn in cases.values():
                fn()  # warm-up
            seconds = interleave(cases, args.rounds)
            ms = {k: round(1000 * median(v), 2) for k, v in seconds.items()}
            figures[f"rows_{n}"] = {**ms, "speedup_in_major": ratio(ms["row_major"], ms["in_major"])}
            if packed is not None:
                figures[f"rows_{n}"]["speedup_packed"] = ratio(ms["row_major"], ms["packed"])
    mb = (sum(w.numel() for w in row_major) + head.numel()) * head.element_size() / 2**20
    print_json({"model": args.model, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                "matrices_mib": round(mb, 1), "ms_per_step": figures})


if __name__ == "__main__":
    main()
