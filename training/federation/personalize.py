"""The end of a client's training: its personalization step, then FedDPA's local-instance index.

After the last round each client runs its method's ``finalize`` (FedLoRA / FedDPA-F fine-tune a copy of
the final global adapter; pFedSeq's never-sampled clients do the same). For methods with FedDPA's
instance-wise weighting (paper 000, section 4.3) the client then embeds its own training prompts with
the final global adapter on (final-layer last-token states) and keeps them as a faiss index beside its
adapter, for the serving router, with the calibration of its weighting (``routing.calibration``: the
instances against each other and against public background prompts, embedded with the same adapter).
A client with held-out examples first checks its local adapter on them (``training.federation.local_gate``); the
calibration keeps the verdict as its gain on lambda.
The simulator runs this for every client in-process, a Flower node for its own client, where the
instances live (the Flower server then gathers every ``embeddings.*`` file).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from routing.background import BACKGROUND_PROMPTS, background_id
from routing.cache import EmbeddingIndex
from routing.calibration import calibrate
from routing.embedding import embed_prompts
from training.data import ClientData, PromptConfig, Record, prompt_texts
from training.federation import durable
from training.federation.local_gate import GateResult, check_local
from training.local.runtime import Runtime
from training.protocol import ClientAlgorithm, ClientContext, Method
from training.state import StateDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def finish_client(method: Method, client: ClientAlgorithm, state: StateDict, ctx: ClientContext,
                  index_folder: Path | None, mixture_weight: float | None = None) -> dict[str, float]:
    """Personalize ``ctx``'s client from the final server ``state``; save its instance index where it is used.

    Args:
        method: the run's method (its ``instance_weighting`` flag says whether clients need the index).
        client: the method's client half.
        state: the final server state (the global adapter).
        ctx: the client's context; ``finalize`` updates its private state.
        index_folder: where to save the index (None: no index).
        mixture_weight: FedDPA's lambda, checked on the client's held-out examples when it has some and
            a local adapter (None or 0: no check).

    Returns:
        The personalization's metrics (``ClientAlgorithm.finalize``).
    """
    metrics = dict(client.finalize(state, ctx) or {})  # a client written before finalize returned metrics: none
    if index_folder is not None and method.instance_weighting and state:
        ctx.runtime.set("global", state)
        gate = None
        if ctx.data.validation and mixture_weight and "local" in ctx.private:
            ctx.runtime.set("local", ctx.private["local"])
            rt = ctx.runtime
            gate = check_local(rt.loaded, rt.adapted, rt.train.prompt_style, ctx.data.validation,
                               min(float(mixture_weight), 1.0))
        save_instance_index(ctx.runtime, ctx.data, index_folder, gate)
    return metrics


def save_instance_index(rt: Runtime, client: ClientData, folder: Path, gate: GateResult | None = None) -> None:
    """Embed ``client``'s training instances with the runtime's ``global`` adapter on; save the index in ``folder``.

    The prompts are formatted exactly as training formatted them, so serving's request embedding (same
    template, same adapter) is comparable. The index is saved with its calibration, its files written
    durably (:mod:`training.federation.durable`). Training embeds the last token, as the paper; ``fedmosaic calibrate
    --feddpa-embedding mean`` rebuilds the index mean-pooled. ``gate``, the check of the client's local
    adapter, sets the calibration's gain.
    """
    prompts = instance_prompts(client, rt.tokenizer, rt.train.prompt_style)
    vecs = embed_prompts(rt.model, rt.adapted, rt.tokenizer, prompts, ("global",), autocast=rt.loaded.autocast)
    background = background_states(rt)
    calibration = calibrate(vecs, background, background_id=background_id())
    if gate is not None:
        calibration = dataclasses.replace(calibration, gain=gate.gain, gate=gate.asdict())
    write_index(EmbeddingIndex(vecs, calibration=calibration), folder)


# runtime -> (global adapter's fingerprint, template) -> background states: every client of a simulated run
# embeds the same public prompts under the same final global adapter
_BACKGROUND: weakref.WeakKeyDictionary[Runtime, dict[tuple[str, str], np.ndarray]] = weakref.WeakKeyDictionary()


def background_states(rt: Runtime) -> np.ndarray:
    """The background prompts' states under the runtime's current ``global`` adapter, embedded once per adapter."""
    digest = hashlib.sha256()
    for name, value in sorted(rt.adapted.adapter_state("global").items()):
        digest.update(name.encode())
        digest.update(value.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    key = (digest.hexdigest(), rt.train.prompt_style)
    cache = _BACKGROUND.setdefault(rt, {})
    if key not in cache:
        cache.clear()  # one adapter at a time: the final global of the run being finished
        generic = background_prompts(rt.tokenizer, rt.train.prompt_style)
        cache[key] = embed_prompts(rt.model, rt.adapted, rt.tokenizer, generic, ("global",),
                                   autocast=rt.loaded.autocast)
    return cache[key]


def instance_prompts(client: ClientData, tokenizer: PreTrainedTokenizerBase, style: str) -> list[str]:
    """``client``'s training instances as the prompts its index embeds (the run's template, as in training)."""
    return prompt_texts(client.train, tokenizer, PromptConfig.named(style))


def write_index(index: EmbeddingIndex, folder: Path) -> None:
    """Save ``index`` (vectors, pooling record, faiss file, calibration) into ``folder``, every file durably."""
    staging = Path(tempfile.mkdtemp(prefix=durable.TMP_PREFIX))
    try:
        index.save(staging)
        for f in sorted(staging.iterdir()):
            durable.write_file(Path(folder) / f.name, functools.partial(shutil.copyfile, f))  # copyfile(f, tmp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def background_prompts(tokenizer: PreTrainedTokenizerBase, style: str) -> list[str]:
    """The public background prompts (``routing.background``) in the run's prompt template.

    Used where a calibration is computed: here at the end of training, and by ``fedmosaic calibrate``
    for runs trained before calibrations existed.
    """
    records = [Record(instruction=text, output="") for text in BACKGROUND_PROMPTS]
    return prompt_texts(records, tokenizer, PromptConfig.named(style))
