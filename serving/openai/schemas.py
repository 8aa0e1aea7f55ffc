"""Wire models mirroring the OpenAI API (requests validated here, responses built from these).

Every field a request may carry is declared. A chat or completion body (and a chat message) may carry
others: they are ignored with one warning per field name, as vLLM does, or refused by name with
``--strict-fields`` (:mod:`serving.openai.compat`); the other bodies refuse them (``extra="forbid"``).
OpenAI fields this server does not implement are declared with
the only values that mean "not used" (``functions: []``, ``audio: null``...): any
other value is refused by name. ``response_format`` and ``tools`` are served by grammar-constrained
decoding (:mod:`serving.openai.structured`). docs/serving.md's parameter table lists them all. Sampling parameters
beyond OpenAI's follow vLLM (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``best_of``, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``); unset sampling fields take the model's ``generation_config.json`` values
(:mod:`serving.openai.compat`). A ``null`` stands for the field's default, as OpenAI reads it.

Extension fields:

* ``adapters: [{"name": "global", "weight": 0.3}, {"name": "3:local", "weight": 0.7}]`` serves an
  explicit mixture of loaded adapters (weights per adapter; they need not sum to 1), overriding the
  weights the ``model`` name would select. ``model`` must still name something served here.
* ``force`` on ``/v1/unload_lora_adapter`` unloads a pinned adapter.

Every response carries ``fedmosaic: {"mode": ..., "weights": {adapter: weight}, "info": {...}}``: the
weights actually used (after FedDPA routing).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from serving.engine.sampling import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS
from serving.openai.tool_schemas import NamedToolChoice, ResponseFormat, Tool, ToolCall


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"not supported by this server; {what}")


class Strict(BaseModel):
    """Request models: every field declared, anything else refused by name, each value of its documented type.

    Strict types: ``true`` is no integer and ``0`` no boolean, ``"16"`` no ``max_tokens`` (an integer
    is still a number); the OpenAPI document promises these types, so what it calls invalid is refused.
    """

    model_config = ConfigDict(extra="forbid", strict=True)


class Tolerant(Strict):
    """A chat or completion body: fields no schema declares are kept aside (``model_extra``) for
    :class:`serving.openai.compat.FieldPolicy` to ignore with a warning or refuse."""

    model_config = ConfigDict(extra="allow", strict=True)


class AdapterWeight(Strict):
    """One adapter of an explicit mixture."""

    name: str = Field(min_length=1)
    weight: float = Field(ge=-10, le=10, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool | None = False


class SamplingFields(Tolerant):
    """Fields shared by chat and completion requests (``None`` means the default)."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: int | None = Field(1, ge=1, le=128, description="choices per prompt (the server caps prompts x n)")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = Field(None, description="an end-user identifier; no effect on the output")
    # vLLM's extensions
    top_k: int | None = Field(0, ge=-1, description="vLLM: keep the k most likely tokens (0 or -1: all)")
    min_p: float | None = Field(0.0, ge=0, le=1, allow_inf_nan=False,
                                description="vLLM: drop tokens less likely than min_p x the most likely one")
    repetition_penalty: float | None = Field(1.0, gt=0, le=100, allow_inf_nan=False, description="vLLM / HF")
    min_tokens: int | None = Field(0, ge=0, description="vLLM: no end of sequence before this many tokens")
    ignore_eos: bool | None = Field(False, description="vLLM: decode past the end-of-sequence token")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOPS, description="vLLM: token ids that stop")
    # ours
    adapters: list[AdapterWeight] | None = Field(None, max_length=16)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                             "characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit() or not -100 <= bias <= 100:
                raise ValueError("logit_bias maps token ids (integer strings) to biases in [-100, 100]")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids are token ids >= 0")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def mixture(self) -> list[tuple[str, float]] | None:
        """The ``adapters`` extension as (name, weight) pairs."""
        return [(a.name, a.weight) for a in self.adapters] if self.adapters else None


class ContentPart(Strict):
    type: Literal["text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value != "text":
            raise _unsupported(f"content parts of type {value!r} (text parts only)")
        return value


class ChatMessage(Tolerant):
    """One message; the fields of earlier assistant turns that OpenAI clients send back are accepted empty."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, description="passed to the chat template")
    tool_call_id: str | None = Field(None, description="passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="an earlier assistant turn's calls")
    function_call: None = None
    refusal: None = None
    audio: None = None
    annotations: list[dict[str, Any]] | None = Field(None, max_length=0)

    @field_validator("annotations", "function_call", "refusal", "audio", mode="before")
    @classmethod
    def _empty(cls, value: Any) -> Any:
        if value not in (None, []):
            raise _unsupported("send null (audio, annotations and legacy function calls are not implemented)")
        return value

    def text(self) -> str:
        """The message text (content parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """What the chat template reads: role, content, and name / tool_call_id / tool_calls when given
        (tool calls as Hugging Face templates read them: arguments as an object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.parsed()}} for c in self.tool_calls]
        return out


# arguments of apply_chat_template the server sets itself: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tools", "documents",
                                      "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
                                      "truncation", "max_length", "tokenizer_kwargs"})


# OpenAI chat fields accepted only with the value that means "not used"
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "store": (None, False), "modalities": (None, ["text"]),
    "service_tier": (None, "auto", "default"),
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat template controls (where the model's chat template renders the messages)
    add_generation_prompt: bool | None = Field(True, description="vLLM: open the assistant's turn after the "
                                               "messages")
    continue_final_message: bool | None = Field(False, description="vLLM: continue the final (assistant) message "
                                                "instead of opening a new turn; needs add_generation_prompt: false")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM: extra variables passed to the chat "
                                                        "template (e.g. enable_thinking)")
    # structured output and tools (serving.openai.structured)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted, no effect on the output
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI features this server does not implement: only their "not used" values
    functions: list[dict[str, Any]] | None = Field(None, max_length=0)
    function_call: Literal["none"] | None = None
    audio: None = None
    prediction: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None
    store: Literal[False] | None = None
    modalities: list[Literal["text"]] | None = None
    service_tier: Literal["auto", "default"] | None = None

    @field_validator(*_CHAT_NEUTRAL, mode="before")
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        allowed = _CHAT_NEUTRAL[info.field_name]
        if value not in allowed:
            raise _unsupported("accepted values: " + ", ".join("null" if a is None else repr(a) for a in allowed))
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, value: int | None, info: Any) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, value: bool | None, info: Any) -> bool | None:
        if value and info.data.get("add_generation_prompt") is not False:
            raise ValueError("continue_final_message: true needs add_generation_prompt: false (vLLM's rule)")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {taken} (the server's own arguments; "
                             "add_generation_prompt and continue_final_message are request fields)")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists (a batch)")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=128, description="vLLM: sample this many per prompt, answer the "
                                "n with the highest cumulative log-probability (not with stream)")
    suffix: str | None = Field(None, max_length=0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in x)

        if isinstance(value, str) or ids(value):
            return value
        if isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(map(ids, value))):
            return value
        raise ValueError("prompt takes a string, a non-empty list of strings, a list of token ids (integers >= 0) "
                         "or a non-empty list of such lists")

    @field_validator("suffix", mode="before")
    @classmethod
    def _neutral(cls, value: Any) -> Any:
        if value not in (None, ""):
            raise _unsupported("send null")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: Any) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        if value is not None and value > n and info.data.get("stream"):
            raise _unsupported("best_of above n with stream: true (the best are known only at the end); "
                               "leave best_of out or equal to n when streaming")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the batch: text, or token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        ids = [t for t in value if isinstance(t, int)]
        if len(ids) == len(value):  # token ids: one prompt
            return [ids]
        return [t for t in value if not isinstance(t, int)]  # a batch (the validator admits no mix of kinds)


class LoadLoraAdapterRequest(Strict):
    """vLLM's body for ``POST /v1/load_lora_adapter`` (plus SGLang's ``pinned``)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    pinned: bool = False


class UnloadLoraAdapterRequest(Strict):
    """vLLM's body for ``POST /v1/unload_lora_adapter`` (plus ``force`` for a pinned adapter)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    force: bool = False


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
