"""The matmul FLOPs a training step's forwards and backwards compute: what sets its time on a GEMM-bound device.

``bench/training/round.py`` times FedIT against a plain PEFT loop; this counts what each has to compute, so the
ratio of the counts is the most one loop can gain over the other where matrix products set the time (a
CPU: ``aten::mm`` is 50-80 % of a profiled step). Counted per micro-batch of B rows padded to T tokens (a
packed one, ``training.local.packing``: its N real tokens, attention over its examples padded to the longest),
for a Llama-style decoder whose base weights are frozen and whose LoRA (issue 47's loops) trains:

* the frozen linears: the forward, and in the backward only the input gradient (a frozen weight takes no
  weight gradient), which the first layer skips where its input needs none (the embeddings are frozen);
* the LM head on the positions it runs on: ours gathers the labelled ones first (``training.local.lm_forward``),
  a plain ``model(**batch).loss`` takes every position;
* LoRA's two small matrices: forward, input gradient (where needed) and both weight gradients;
* attention's two products (scores and their mix of values), dense over T x T, forward and backward
  (torch's ``FlopCounterMode`` does not see the CPU's fused attention kernel, so it is counted apart).

:func:`embed_flops` counts the calibration stage's instance embeddings the same way (forward only, the
decoder without its head, length-sorted batches as ``routing.embedding.embed_prompts`` forms them).

``tests/bench/training/test_round.py`` checks the linear counts against ``FlopCounterMode`` on the
trainer's and the plain loop's real forwards, ``tests/bench/training/test_calibration_stage.py`` on
``embed_prompts``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from adapters import LoraConfig
from adapters.targets import matches
from training.data import IGNORE
from training.local.packing import PACK_KEY

HeadRows = Literal["labelled", "all"]
# a decoder layer's linears, each with the linears whose output its input depends on within the layer: q, k
# and v read the layer's input, o attention's output, gate and up the residual after it, down their product
ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UPSTREAM = {"q_proj": (), "k_proj": (), "v_proj": (), "o_proj": ORDER[:3], "gate_proj": ORDER[:4],
            "up_proj": ORDER[:4], "down_proj": ORDER[:6]}

@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The matmul shapes of a Llama-style causal LM (grouped-query attention, gated MLP)."""

    hidden: int
    layers: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> DecoderShape:
        """The shape of an HF Llama-style ``config`` (``head_dim`` defaults to hidden / heads, as HF's)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads * head_dim,
                   kv_heads * head_dim, config.intermediate_size, config.vocab_size)

    def dims(self) -> dict[str, tuple[int, int]]:
        """Each layer linear's (in, out) features."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _adapted(lora: LoraConfig) -> set[str]:
    # a decoder layer's module names the targets match (PEFT's rules, adapters.targets), as layer 0's paths
    if lora.target_modules == "all-linear":
        return set(ORDER)
    return {name for name in ORDER if matches(lora.target_modules, f"model.layers.0.{_block(name)}.{name}")}


def _block(name: str) -> str:
    return "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _first_layer_needs_input_grad(adapted: set[str]) -> dict[str, bool]:
    """Whether layer 0's linear gets an input gradient: only where something trainable feeds its input (the
    embeddings are frozen)."""
    return {name: any(u in adapted for u in UPSTREAM[name]) for name in ORDER}


def step_flops(shape: DecoderShape, batches: Iterable[dict[str, torch.Tensor]], lora: LoraConfig,
               head: HeadRows) -> dict[str, int]:
    """Matmul FLOPs (2 per multiply-add) of training forward and backward over collated ``batches``.

    Args:
        shape: the model's shapes.
        batches: collated micro-batches (``input_ids`` (B, T), ``labels`` (B, T)) or packed ones
            (``input_ids`` and ``targets`` (1, N), their ``pack`` saying where the B examples lie).
        lora: the trained LoRA (rank and target modules).
        head: ``labelled``: the head runs on the labelled positions only (ours); ``all``: on every one.

    Returns:
        ``linear`` (frozen linears, head and LoRA) and ``attention`` FLOPs.
    """
    dims, adapted = shape.dims(), _adapted(lora)
    first = _first_layer_needs_input_grad(adapted)
    per_token = 0  # FLOPs a token costs in all layers' linears
    for name, (i, o) in dims.items():
        for layer in range(shape.layers):
            grad_in = layer > 0 or first[name]
            per_token += 2 * i * o * (2 if grad_in else 1)  # forward, input gradient
            if name in adapted:  # LoRA's A then B: forward, both weight gradients, B^T always, A^T if grad_in
                per_token += 2 * lora.r * (3 * (i + o) - (0 if grad_in else i))
    linear = attention = 0
    for batch in batches:
        tokens = int(batch["input_ids"].numel())
        pack = batch.get(PACK_KEY)
        if pack is not None:  # attention runs on the examples padded to the longest, (B, T)
            rows, length = pack.gather.shape
            labelled = int((batch["targets"] != IGNORE).sum())
        else:
            rows, length = batch["input_ids"].shape
            labelled = int((batch["labels"][:, 1:] != IGNORE).sum())
        head_rows = labelled if head == "labelled" else tokens
        linear += per_token * tokens + 4 * shape.vocab * shape.hidden * head_rows
        attention += 12 * rows * length * length * shape.q_dim * shape.layers  # QK^T and PV: 4 forward, 8 back
    return {"linear": linear, "attention": attention}


def embed_flops(shape: DecoderShape, lengths: Sequence[int], lora: LoraConfig, batch_size: int = 16) -> dict[str, int]:
    """Matmul FLOPs of embedding prompts of these token ``lengths`` with one adapter on (no gradient, no head).

    The prompts are batched as ``routing.embedding.embed_prompts`` batches them: sorted by length,
    ``batch_size`` a forward, each padded to its longest.

    Returns:
        ``linear`` (frozen linears and LoRA, forward) and ``attention`` FLOPs.
    """
    dims, adapted = shape.dims(), _adapted(lora)
    per_token = shape.layers * sum(2 * i * o + (2 * lora.r * (i + o) if name in adapted else 0)
                                   for name, (i, o) in dims.items())
    order = sorted(lengths)
    linear = attention = 0
    for start in range(0, len(order), batch_size):
        rows, length = len(order[start:start + batch_size]), max(order[start:start + batch_size])
        linear += per_token * rows * length
        attention += 4 * rows * length * length * shape.q_dim * shape.layers  # QK^T and PV, forward
    return {"linear": linear, "attention": attention}
