"""``fedmosaic quickstart``: the README's first command, end to end on the embedded defaults.

Today it prepares the embedded SmolLM2 (once), builds a client's adapter pair in memory, and answers a
prompt three ways with per-row adapter weights in one batch: the base model, the global adapter, and a
FedDPA-style mixture. Later stages (federated training on the generated task suite, serving, the demo)
plug in here as they land.
"""

from __future__ import annotations

import argparse
import time

import torch


def add_quickstart_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic quickstart``."""
    parser = sub.add_parser("quickstart", help="prepare the embedded model and run the main job end to end")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local HF model folder")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    return parser


def run_quickstart(args: argparse.Namespace) -> int:
    """Prepare the model and generate with per-row adapter weights; prints what it did."""
    from adapters import LoraConfig, inject
    from fedmosaic.models import load_base_model
    from serving.generation import GenerationConfig, generate

    start = time.perf_counter()
    loaded = load_base_model(args.model)
    print(f"[quickstart] base model {loaded.name} ready ({loaded.dtype}) in {time.perf_counter() - start:.1f} s")
    adapted = inject(loaded.model)
    adapted.add_adapter("global", LoraConfig(), seed=0)
    adapted.add_adapter("local", LoraConfig(), seed=1)
    gen = torch.Generator().manual_seed(0)
    for _, layer in adapted.adapter_layers("local"):
        b = layer.adapters["local"].lora_B
        with torch.no_grad():
            b.copy_(torch.randn(b.shape, generator=gen) * 1e-3)  # a small untrained perturbation
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
    )
    rows = {"base": [0.0, 0.0], "global": [1.0, 0.0], "global+local (0.5, 0.5)": [0.5, 0.5]}
    answers = generate(adapted, loaded.model, tok, [prompt] * len(rows), ("global", "local"),
                       list(rows.values()), GenerationConfig(max_new_tokens=args.max_new_tokens),
                       autocast=loaded.autocast)
    for label, answer in zip(rows, answers, strict=True):
        print(f"[quickstart] {label:>24}: {answer}")
    print(f"[quickstart] done in {time.perf_counter() - start:.1f} s")
    return 0
