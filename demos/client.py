"""The demo's HTTP client of the fedmosaic API (httpx): models, streamed answers, adapters, run files.

The demo talks to the server only through its public, OpenAI-compatible API, so it stays honest about
what the API offers. Every response of a generation endpoint carries the ``fedmosaic`` extension
(``{"mode", "weights", "info"}``: the FedDPA weight and how it was obtained, or AMoLE's expert usage);
streamed answers deliver it in their last chunk. Errors come back as :class:`ApiError` with the
server's OpenAI envelope (status, type, code, message) so the UI can show them as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

# The FedDPA papers' short Alpaca template (paper 000, docs/methods.md 2.3): what the adapters were trained on.
INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
INSTRUCTION_STOP = ("### Instruction",)


class ApiError(Exception):
    """The API answered with an error (or could not be reached).

    Attributes:
        status: HTTP status (None for an error reported inside an SSE stream or a connection failure).
        code: the envelope's ``code`` (``model_not_found``, ``not_ready``, ...), when there is one.
        kind: the envelope's ``type`` (``NotFoundError``, ...).
    """

    def __init__(self, message: str, status: int | None = None, code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.kind = message, status, code, kind

    def __str__(self) -> str:
        where = f"HTTP {self.status}" if self.status is not None else "API"
        code = f", {self.code}" if self.code else ""
        return f"{where}{code}: {self.message}"

    @classmethod
    def from_envelope(cls, body: Any, status: int | None) -> ApiError:
        """Build from ``{"error": {...}}`` (or any other body)."""
        error = body.get("error") if isinstance(body, Mapping) else None
        if isinstance(error, Mapping):
            return cls(str(error.get("message", "unknown error")), status, error.get("code"), error.get("type"))
        return cls(str(body)[:500] or "empty response", status)


@dataclass(frozen=True)
class ModelEntry:
    """One entry of ``GET /v1/models``.

    Attributes:
        id: what the ``model`` field accepts.
        kind: ``base``, ``adapter``, ``feddpa`` (a client: global + local) or whatever the server says.
        details: the entry's ``fedmosaic`` field (version, pinned, loaded, adapters...).
        root: the adapter folder (adapters) or the base model.
    """

    id: str
    kind: str
    details: Mapping[str, Any] = field(default_factory=dict)
    root: str = ""


@dataclass(frozen=True)
class StreamUpdate:
    """The answer so far; ``extension`` and ``finish_reason`` arrive with the last chunk."""

    text: str
    extension: Mapping[str, Any] | None = None
    finish_reason: str | None = None


class ApiClient:
    """A small synchronous client of one fedmosaic server.

    Args:
        base_url: the server, with or without the trailing ``/v1`` (``http://127.0.0.1:8000``).
        api_key: bearer key when the server requires one.
        timeout: seconds per request (generation on a CPU can take a while).
        transport: an httpx transport (tests).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError.from_envelope(_json_or_text(response), response.status_code)
        return response

    def health(self) -> bool:
        """True when the server answers ``/health`` with 200 (loaded and serving).

        Raises:
            ApiError: 503 while the model loads (with the server's reason) or the server is unreachable.
        """
        return self._request("GET", "/health").status_code == 200

    def models(self) -> list[ModelEntry]:
        """Every name the ``model`` field accepts, in the server's order."""
        data = self._request("GET", "/v1/models").json().get("data", [])
        return [ModelEntry(str(m["id"]), str((m.get("fedmosaic") or {}).get("kind", "adapter")),
                           dict(m.get("fedmosaic") or {}), str(m.get("root", ""))) for m in data]

    def stream(self, model: str, prompt: str | Sequence[Mapping[str, str]], max_tokens: int = 64,
               temperature: float = 0.0, instruction: bool = True) -> Iterator[StreamUpdate]:
        """Stream one answer.

        Args:
            model: the target (base, ``global``, ``<client>:local``, ``<client>``, an AMoLE client...).
            prompt: the instruction text (``instruction=True``: sent to ``/v1/completions`` in the
                training template) or chat messages (``/v1/chat/completions``: the server renders them in
                the template a run's adapters trained with, the model's chat template for other targets).
            max_tokens: generation budget.
            temperature: 0 is greedy.
            instruction: which of the two endpoints and prompt formats to use.

        Yields:
            The growing answer; the last update carries the ``fedmosaic`` extension.

        Raises:
            ApiError: an HTTP error before the stream starts, or an error event inside it.
        """
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
        if instruction:
            path = "/v1/completions"
            text = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
            body.update(prompt=INSTRUCTION_TEMPLATE.format(instruction=text), stop=list(INSTRUCTION_STOP))
        else:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        answer = ""
        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError.from_envelope(_json_or_text(response), response.status_code)
                for event in _sse_events(response.iter_lines()):
                    if "error" in event:
                        raise ApiError.from_envelope(event, None)
                    for choice in event.get("choices") or []:
                        answer += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        finish = choice.get("finish_reason")
                        yield StreamUpdate(answer, event.get("fedmosaic") if finish else None, finish)
        except httpx.HTTPError as exc:
            raise ApiError(f"connection to {self.base_url}{path} failed: {exc}") from exc

    def answer(self, model: str, prompt: str, max_tokens: int = 64, temperature: float = 0.0,
               instruction: bool = True) -> StreamUpdate:
        """The complete answer of :meth:`stream` (its last update)."""
        last = StreamUpdate("")
        for last in self.stream(model, prompt, max_tokens, temperature, instruction):  # noqa: B007
            pass
        return last

    def load_adapter(self, name: str, path: str, pinned: bool = False, replace: bool = False) -> str:
        """``POST /v1/load_lora_adapter`` (``replace`` reloads in place as a new version); the server's message."""
        body = {"lora_name": name, "lora_path": path, "pinned": pinned, "load_inplace": replace}
        return self._request("POST", "/v1/load_lora_adapter", json=body).text

    def unload_adapter(self, name: str) -> str:
        """``POST /v1/unload_lora_adapter``; the server's message."""
        return self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name}).text

    def run_files(self) -> list[dict[str, Any]]:
        """The served run's evaluation files (``GET /v1/run/files``): path, bytes, media_type."""
        return list(self._request("GET", "/v1/run/files").json().get("data", []))

    def run_file(self, path: str) -> bytes:
        """One evaluation file's bytes (``GET /v1/run/files/{path}``)."""
        return self._request("GET", f"/v1/run/files/{path}").content


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Parse ``data: {json}`` lines until ``data: [DONE]`` (comments and blank lines skipped)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ApiError(f"malformed stream event {payload[:200]!r}") from exc
        if isinstance(event, dict):
            yield event
