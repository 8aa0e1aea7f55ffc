"""What a loaded base model is: a frozen model, its tokenizer and the dtype policy its forwards run under.

:func:`frozen` makes one from a model and tokenizer (eval mode, every parameter frozen, a pad token, the
``autocast-bf16`` policy's linear weights stored in bfloat16 once); :mod:`models.loading` and
:mod:`models.tiny` both build theirs through it.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from models import settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class LoadedModel:
    """A frozen base model with its tokenizer and the dtype policy it runs under.

    Attributes:
        model: the HF causal LM, in eval mode, every parameter frozen.
        tokenizer: its tokenizer, with a pad token set.
        name: a short name for logs and adapter configs (``base_model_name_or_path``).
        dtype: ``float32``, ``bfloat16`` or ``autocast-bf16`` (fp32 weights, bf16 compute).
    """

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    name: str
    dtype: settings.DType

    @property
    def device(self) -> torch.device:
        """Where the model's weights live (read from them, so a moved model reports its new place)."""
        for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
            return tensor.device
        return torch.device("cpu")

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Return the compute context for this model's dtype policy on its device."""
        return compute_context(self.dtype, self.device.type)


def compute_context(dtype: settings.DType, device_type: str = "cpu") -> contextlib.AbstractContextManager[None]:
    """Return ``torch.autocast(device_type, bfloat16)`` for ``autocast-bf16``, a no-op context otherwise.

    Args:
        dtype: the dtype policy.
        device_type: the model's device type (``cpu`` or ``cuda``): autocast only affects operations
            on its own device type, so a CUDA model under CPU autocast would silently run in fp32.
    """
    if dtype == "autocast-bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def frozen(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, name: str, dtype: settings.DType
) -> LoadedModel:
    """Put ``model`` in eval mode with every parameter frozen, give ``tokenizer`` a pad token, wrap both.

    Args:
        model: the causal LM, already on its device and in its dtype.
        tokenizer: its tokenizer; without a pad token it pads with the end-of-sequence token.
        name: the short name of :attr:`LoadedModel.name`.
        dtype: the dtype policy the model runs under.
    """
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    if dtype == "autocast-bf16":
        store_linear_bf16(model)
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, dtype=dtype)


def store_linear_bf16(model: torch.nn.Module) -> int:
    """Store the frozen ``nn.Linear`` weights of an ``autocast-bf16`` model in bfloat16, once.

    Under bf16 autocast every linear layer casts its float32 weight to bfloat16 on each call (and keeps
    the copy for the backward pass): the same rounding, paid once per forward. Stored in bfloat16, the
    cast is a no-op, so every forward and gradient is bit-identical and the weights take half the memory.
    Embeddings, norms and a head tied to the input embeddings stay float32: they feed the float32
    residual stream and lookups, which autocast does not touch.

    Args:
        model: the frozen causal LM.

    Returns:
        The number of weights re-stored.
    """
    get_input_embeddings = getattr(model, "get_input_embeddings", None)  # HF models have it, a bare Module not
    embeddings = get_input_embeddings() if get_input_embeddings is not None else None
    tied = {id(embeddings.weight)} if embeddings is not None else set()
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in tied \
                and module.weight.dtype == torch.float32 and not module.weight.requires_grad:
            module.weight = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            count += 1
    return count


COMPILE_MODES = ("default", "max-autotune")
# torch.compile modes refused for training, each with the reason a user is told
REFUSED_COMPILE_MODES = {
    "reduce-overhead": "its CUDA graphs crashed the process (a segmentation fault in the compiled backward of a "
                       "training step; H200, torch 2.11) and add nothing on a CPU",
}


def check_compile_mode(mode: str, source: str = "") -> None:
    """Raise ``ValueError`` naming the problem unless ``mode`` is one of :data:`COMPILE_MODES`.

    Args:
        mode: the mode to check.
        source: what gave it, put before the error (e.g. ``the Flower run config's compile``).
    """
    prefix = f"{source}: " if source else ""
    if isinstance(mode, str) and mode in REFUSED_COMPILE_MODES:
        raise ValueError(f"{prefix}compile mode {mode!r} is not offered for training: "
                         f"{REFUSED_COMPILE_MODES[mode]}; use one of {', '.join(COMPILE_MODES)}")
    if mode not in COMPILE_MODES:
        raise ValueError(f"{prefix}compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")


def compile_decoder_layers(model: torch.nn.Module, mode: str = "default") -> int:
    """Compile each decoder layer of ``model`` in place with ``torch.compile`` (dynamic shapes).

    The layers are compiled, not the whole model: HF's model body keeps its mask and cache logic eager,
    and every layer shares one compiled code object (each adapter set in the forward, a batch with no
    padding and a one-row batch make their own variants, hence the raised recompile limit). The first
    layer stays eager: its input needs no gradient, unlike every other layer's, so compiling it would
    double the training variants (each a compilation of 10-20 s on a small CPU) for a thirtieth of the
    forward.
    Adapted layers trace without a graph break when the batch's weights are host floats
    (``AdapterContext.uniform``, the trainer's case); per-row weights still run, with a break.

    Args:
        model: a causal LM with its decoder layers in ``model.model.layers`` (Llama, Mistral, Qwen2/3).
        mode: a ``torch.compile`` mode, ``default`` or ``max-autotune`` (``reduce-overhead`` is refused:
            :data:`REFUSED_COMPILE_MODES`).

    Returns:
        The number of layers compiled (layers already compiled, and the first, are left as they are).

    Raises:
        ValueError: an unknown or refused mode, or a model without that layer list.
    """
    check_compile_mode(mode)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"cannot compile {type(model).__name__}: its decoder layers are not in model.model.layers "
                         "(Llama, Mistral and Qwen models have them there); train without compile")
    from torch._dynamo import config as dynamo_config

    dynamo_config.recompile_limit = max(int(dynamo_config.recompile_limit), 64)
    count = 0
    for layer in list(layers)[1:] or list(layers):  # a one-layer model: its layer
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(mode=mode, dynamic=True)
            count += 1
    return count
