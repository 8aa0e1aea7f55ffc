"""Wire models mirroring the OpenAI API (requests validated here, responses built from these).

Extension fields (accepted on chat and completion requests, ignored by other servers' clients):

* ``adapters: [{"name": "global", "weight": 0.3}, {"name": "3:local", "weight": 0.7}]`` serves an
  explicit mixture of loaded adapters (weights per adapter; they need not sum to 1), overriding the
  weights the ``model`` name would select. ``model`` must still name something served here.
* ``top_k`` (as vLLM; 0 or -1 disables it).

Every response carries ``fedmosaic: {"mode": ..., "weights": {adapter: weight}, "info": {...}}``: the
weights actually used (after FedDPA routing). Only ``n = 1`` is supported.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class AdapterWeight(BaseModel):
    """One adapter of an explicit mixture."""

    name: str = Field(min_length=1)
    weight: float = Field(ge=-10, le=10, allow_inf_nan=False)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completion requests."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    adapters: list[AdapterWeight] | None = Field(None, max_length=16)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings of at most 256 characters")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def mixture(self) -> list[tuple[str, float]] | None:
        """The ``adapters`` extension as (name, weight) pairs."""
        return [(a.name, a.weight) for a in self.adapters] if self.adapters else None


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message text (content parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    def prompt_text(self) -> str:
        """The single prompt (a one-element list is accepted; batches are not)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("send one prompt per request")
        return self.prompt[0]


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body for ``POST /v1/load_lora_adapter`` (plus SGLang's ``pinned``)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    pinned: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fedmosaic"
    root: str
    parent: str | None = None
    fedmosaic: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
