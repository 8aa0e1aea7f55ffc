"""The demo's event handlers: UI values in, API calls through :class:`demos.client.ApiClient`, UI values out.

Each handler is a plain method (callable from tests without a browser) returning the values or
``gr.update`` objects of the components :mod:`demos.app` wires it to. API errors are never swallowed:
they become the visible status text, an error bubble in the chat, or the text of the failed answer.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gradio as gr

from demos import render
from demos.client import ApiClient, ApiError, ModelEntry, StreamUpdate
from demos.heatmap import find_expert_usage, usage_figure

logger = logging.getLogger(__name__)

INSTRUCTION, CHAT = "instruction (as trained)", "chat template"
FORMATS = (INSTRUCTION, CHAT)


def message_text(content: Any) -> str:
    """Text of a chat message whose content is a string or Gradio's list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    return "" if content is None else str(content)


def error_text(exc: Exception) -> str:
    """How an error is shown: the API's own message, with status and code."""
    return f"⚠️ API error — {exc}" if isinstance(exc, ApiError) else f"⚠️ {type(exc).__name__}: {exc}"


class Handlers:
    """Everything the UI does, over one API client."""

    def __init__(self, client: ApiClient) -> None:
        self.client = client

    # ---- models and adapters -------------------------------------------------------------------
    def _models(self) -> tuple[list[ModelEntry], str]:
        try:
            models = self.client.models()
        except ApiError as exc:
            return [], error_text(exc)
        clients = render.clients(models)
        return models, (f"Connected to `{self.client.base_url}`: {len(models)} models, "
                        f"{len(clients)} FedDPA clients ({', '.join(clients) or 'none'}).")

    def refresh(self, current: str | None = None) -> tuple[Any, ...]:
        """(status, chat target, compare client, unload name, adapters table) from ``/v1/models``."""
        models, status = self._models()
        choices = render.model_choices(models)
        values = [v for _, v in choices]
        target = current if current in values else (values[0] if values else None)
        clients = render.clients(models)
        loaded = render.loaded_adapters(models)
        return (status, gr.update(choices=choices, value=target),
                gr.update(choices=clients, value=clients[0] if clients else None),
                gr.update(choices=loaded, value=None), render.adapter_rows(models))

    def load_adapter(self, name: str, path: str, pinned: bool, replace: bool, current: str | None) -> tuple[Any, ...]:
        """Load (or replace) an adapter, then refresh; the server's message or error first."""
        if not name.strip() or not path.strip():
            return ("⚠️ give the adapter a name and a folder (relative to the server's adapter root)",
                    *self.refresh(current))
        try:
            message = self.client.load_adapter(name.strip(), path.strip(), pinned, replace)
        except ApiError as exc:
            message = error_text(exc)
        return (message, *self.refresh(current))

    def unload_adapter(self, name: str | None, current: str | None) -> tuple[Any, ...]:
        """Unload an adapter, then refresh."""
        if not name:
            return ("⚠️ pick a loaded adapter to unload", *self.refresh(current))
        try:
            message = self.client.unload_adapter(name)
        except ApiError as exc:
            message = error_text(exc)
        return (message, *self.refresh(current))

    # ---- chat ----------------------------------------------------------------------------------
    def chat(self, message: str, history: list[dict[str, Any]] | None, target: str | None, fmt: str,
             max_tokens: float, temperature: float) -> Iterator[tuple[Any, ...]]:
        """Stream an answer into the chat: yields (history, prompt box, route, extension JSON, heatmap)."""
        history = list(history or [])
        if not message or not message.strip():
            yield history, message, "⚠️ type a prompt first", None, gr.update(visible=False)
            return
        if not target:
            yield history, message, "⚠️ pick a model (is the API reachable? press Refresh)", None, \
                gr.update(visible=False)
            return
        # routing notes (messages with a metadata title) are the demo's, not the conversation's
        turns = [{"role": m["role"], "content": message_text(m.get("content"))} for m in history
                 if m.get("role") in ("user", "assistant") and not (m.get("metadata") or {}).get("title")]
        turns.append({"role": "user", "content": message})
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        yield history, "", f"_{target} is answering…_", None, gr.update()
        last = StreamUpdate("")
        try:
            for last in self.client.stream(target, message if fmt == INSTRUCTION else turns, int(max_tokens),
                                           float(temperature), instruction=fmt == INSTRUCTION):
                history[-1] = {"role": "assistant", "content": last.text}
                yield history, "", f"_{target} is answering…_", None, gr.update()
        except ApiError as exc:
            history[-1] = {"role": "assistant", "content": error_text(exc)}
            yield history, "", f"**{error_text(exc)}**", None, gr.update(visible=False)
            return
        if not last.text.strip():
            history[-1] = {"role": "assistant", "content": f"_(empty answer, finish reason: {last.finish_reason})_"}
        history.append({"role": "assistant", "content": render.route_markdown(last.extension),
                        "metadata": {"title": f"⚖️ {target}: {render.route_summary(last.extension)}",
                                     "status": "done"}})
        yield history, "", self.route(target, last), dict(last.extension or {}), self.heatmap(last.extension)

    @staticmethod
    def route(target: str, update: StreamUpdate) -> str:
        """Markdown for the route panel of one finished answer."""
        return f"### How `{target}` answered\n\n" + render.route_markdown(update.extension)

    @staticmethod
    def heatmap(extension: Mapping[str, Any] | None) -> Any:
        """A visible AMoLE heatmap when the answer reports expert usage, else a hidden plot."""
        usage = find_expert_usage(extension)
        if usage is None:
            return gr.update(visible=False, value=None)
        return gr.update(visible=True, value=usage_figure(usage))

    # ---- side by side --------------------------------------------------------------------------
    def compare(self, client: str | None, prompt: str, fmt: str, max_tokens: float,
                temperature: float) -> tuple[str, str, str, str]:
        """The same prompt to ``global``, ``<client>:local`` and ``<client>`` (FedDPA): three answers + route."""
        if not client:
            return ("⚠️ pick a client",) * 3 + ("",)
        if not prompt or not prompt.strip():
            return ("⚠️ type a prompt first",) * 3 + ("",)
        targets = ("global", f"{client}:local", client)

        def ask(target: str) -> StreamUpdate | Exception:
            try:
                return self.client.answer(target, prompt, int(max_tokens), float(temperature),
                                          instruction=fmt == INSTRUCTION)
            except ApiError as exc:
                return exc

        with ThreadPoolExecutor(len(targets)) as pool:  # the engine batches the three requests together
            results = list(pool.map(ask, targets))
        texts = [error_text(r) if isinstance(r, Exception)
                 else r.text if r.text.strip() else f"(empty answer, finish reason: {r.finish_reason})"
                 for r in results]
        combined = results[-1]
        route = (f"**{error_text(combined)}**" if isinstance(combined, Exception)
                 else self.route(client, combined))
        return texts[0], texts[1], texts[2], route

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluation(self) -> tuple[str, list[tuple[Any, str]], str]:
        """(tables as Markdown, plots for a gallery, status) from the served run's ``eval/`` files."""
        try:
            files = self.client.run_files()
        except ApiError as exc:
            return "", [], error_text(exc)
        tables, plots, problems = [], [], []
        for item in files:
            path = str(item.get("path", ""))
            try:
                if path.endswith(".md"):
                    tables.append(f"#### `{path}`\n\n" + self.client.run_file(path).decode("utf-8", "replace"))
                elif path.endswith(".png"):
                    from PIL import Image

                    plots.append((Image.open(io.BytesIO(self.client.run_file(path))), path))
            except (ApiError, OSError) as exc:
                problems.append(f"{path}: {error_text(exc)}")
        status = f"{len(tables)} tables and {len(plots)} plots from the served run's `eval/` folder."
        if not files:
            status = "The run's `eval/` folder holds no tables or plots yet."
        return "\n\n".join(tables), plots, "\n\n".join([status, *problems])
