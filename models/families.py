"""Which model families fedmosaic runs, and on which serving runner: the table and the check made before loading.

The fused runner (``serving/engine/runner/llama.py``) serves the Llama module layout: Llama, Mistral, Qwen2
(q/k/v biases) and Qwen3 (per-head q/k RMSNorm); each is tested against transformers' logits on a tiny random
model (``tests/serving/engine/test_families.py``). Every other decoder-only causal LM that transformers
loads runs on the Hugging Face runner (``serving/engine/runner/hf.py``: the model's own forward over the
engine's KV slots), Gemma tested. :func:`architecture_problem` reads only the config (no weights): a model
type transformers does not know, an encoder-decoder, a state-space or recurrent model, or an encoder refuses
with its name and the supported list before :func:`models.loading.load_base_model` reads a weight.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
TESTS = "tests/serving/engine/test_families.py"
# what the HF runner passes the model's forward (serving.engine.runner.hf.HFRunner._run)
HF_RUNNER_ARGS = ("position_ids", "past_key_values", "logits_to_keep")


@dataclass(frozen=True)
class Family:
    """One row of the table.

    Attributes:
        name: the family (``Qwen3``).
        model_type: the config's ``model_type`` (``*``: every other one the check accepts).
        runner: ``fused`` or ``hf`` (the serving runner; training runs the model's own forward for all).
        tested: the test comparing the engine's logits with transformers' (empty: not tested here).
        note: what the runner does with the family's particulars.
    """

    name: str
    model_type: str
    runner: str
    tested: str
    note: str


FAMILIES = (
    Family("Llama", "llama", "fused", TESTS, "SmolLM2, Llama 2/3; static RoPE (default, linear, llama3)"),
    Family("Mistral", "mistral", "fused", TESTS,
           "sliding window >= max_model_len; a smaller window runs on the HF runner, which applies it"),
    Family("Qwen2", "qwen2", "fused", TESTS, "q/k/v biases; a sliding window as Mistral's"),
    Family("Qwen3", "qwen3", "fused", TESTS, "per-head q_norm/k_norm, no biases; a sliding window as Mistral's"),
    Family("Gemma", "gemma", "hf", TESTS, "GELU MLP, (1 + w) RMSNorm, scaled embeddings"),
    Family("other decoder-only causal LMs", "*", "hf", "",
           "any model transformers' AutoModelForCausalLM builds whose forward takes a KV cache, position_ids "
           "and logits_to_keep (e.g. phi3, gemma2, olmo2, granite); LoRA targets must be nn.Linear"),
)


def table() -> str:
    """The families as aligned text columns (``fedmosaic models list``)."""
    rows = [("family", "model_type", "runner", "tested")]
    rows += [(f.name, f.model_type, f.runner, f.tested or "no") for f in FAMILIES]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
    return "\n".join(lines + ["", *(f"{f.name}: {f.note}" for f in FAMILIES)])


def supported_text() -> str:
    """The supported list, for an error message."""
    return (f"fused engine: {', '.join(FUSED_TYPES)}; Hugging Face runner: other decoder-only causal LMs of "
            "transformers (`fedmosaic models list`)")


def architecture_problem(config: Any) -> str | None:
    """Why a model with this transformers ``config`` cannot be trained or served here, or None when it can.

    Reads the config and the model class's forward signature only; no weight is loaded.
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", None)
    if kind in FUSED_TYPES:
        return None
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {kind!r} is not a causal language model transformers can build"
    if getattr(config, "is_encoder_decoder", False):
        return f"model_type {kind!r} is an encoder-decoder model, not a decoder-only causal LM"
    if hasattr(config, "type_vocab_size") and not getattr(config, "is_decoder", False):
        return f"model_type {kind!r} is an encoder (BERT-style) model, not a decoder-only causal LM"
    try:
        cls: Any = AutoModelForCausalLM._model_mapping[type(config)]  # the class only: no weights
        forward = cls.forward
    except (KeyError, ValueError, ImportError) as exc:
        return f"model_type {kind!r} has no causal-LM class here ({exc})"
    missing = [a for a in HF_RUNNER_ARGS if a not in inspect.signature(forward).parameters]
    if missing:
        return (f"model_type {kind!r}'s forward takes no {', '.join(missing)} (a recurrent or older model): the "
                "engine's KV slots cannot drive it")
    return None


def check_config(config: Any, name: str) -> None:
    """Raise :class:`models.prepare.ModelError` naming the architecture and the supported list when
    :func:`architecture_problem` finds one."""
    from models.prepare import ModelError

    problem = architecture_problem(config)
    if problem is not None:
        raise ModelError(f"cannot use model {name!r}: {problem}. Supported: {supported_text()}")
