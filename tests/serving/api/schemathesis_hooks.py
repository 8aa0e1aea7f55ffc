"""Schemathesis hooks that make fuzzed requests reach generation and adapter loading.

A generated ``model`` is a random string, so nearly every generated completion request gets 404 and
the sampling parameters beside it are never exercised. With ``SCHEMATHESIS_HOOKS`` naming this
module, most schema-valid bodies name a served model instead (``FEDMOSAIC_FUZZ_MODELS``, comma
separated) and most adapter loads name a real folder (``FEDMOSAIC_FUZZ_FOLDERS``) under the name
``hot``. A value schemathesis made invalid on purpose (an empty string) is left alone, so its
negative tests still see it refused.
"""

from __future__ import annotations

import os
import random
from typing import Any

import schemathesis

MODELS = [m for m in os.environ.get("FEDMOSAIC_FUZZ_MODELS", "").split(",") if m]
FOLDERS = [f for f in os.environ.get("FEDMOSAIC_FUZZ_FOLDERS", "").split(",") if f]
_draw = random.Random(int(os.environ.get("FEDMOSAIC_FUZZ_SEED", "0")))


def _valid(value: object) -> bool:
    return isinstance(value, str) and bool(value)


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:  # noqa: ARG001 - the hook's signature
    """Point most generated bodies at served models and real adapter folders."""
    if not isinstance(body, dict):
        return body
    if MODELS and _valid(body.get("model")) and _draw.random() < 0.85:
        body["model"] = _draw.choice(MODELS)
    if FOLDERS and _valid(body.get("lora_path")) and _draw.random() < 0.7:
        body["lora_path"] = _draw.choice(FOLDERS)
        if _valid(body.get("lora_name")) and _draw.random() < 0.7:
            body["lora_name"] = "hot"
    return body
