"""Chat messages -> the prompt format a run's adapters were trained with.

A run records the prompt format it trained with (run.json ``train.prompt_style``). Adapters trained on
the FedDPA paper's short Alpaca template (``alpaca_short``) never saw the base model's chat template, so
a chat request to one of the run's targets is rendered in the trained template instead (docs/serving.md,
"Chat requests to a run"):

* the last ``user`` message is the instruction;
* ``system`` and ``developer`` messages, joined by a blank line, are the context: the template's
  ``### Input:`` block, the field a record's input (Dolly's context) fills in training;
* every other turn (earlier user and assistant turns, tool results, assistant turns after the last user
  message) follows the system text in that block as a transcript, one ``Role: text`` line each, in order;
* with ``continue_final_message`` a final assistant message is not in the transcript: its text follows
  ``### Response:`` and the answer continues it.

So a record sent as ``[system: input, user: instruction]`` (or ``[user: instruction]`` without an input)
gives exactly the prompt training and ``fedmosaic eval`` render (``training.data.prompts``; the
templates are copied here because ``serving`` does not import ``training``, and the tests hold the two
equal). A run trained with ``--prompt-style chat`` keeps the chat template, as do the base model and
adapters loaded from outside the run's folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from serving.errors import InvalidRequest, ServingError
from serving.openai.schemas import ChatMessage

if TYPE_CHECKING:
    from serving.stack import ServingStack

CHAT_TEMPLATE = "chat"  # the style that trains (and so serves) on the base model's chat template
# training.data.prompts.ALPACA_SHORT and ALPACA_SHORT_INPUT (tests/serving/openai/test_chat_format.py)
TEMPLATES: dict[str, tuple[str, str]] = {
    "alpaca_short": ("### Instruction:\n{instruction}\n\n### Response:\n",
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"),
}
CONTEXT_ROLES = ("system", "developer")
SPEAKERS = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def template_head(style: str) -> str:
    """The trained template's own text before the instruction (``### Instruction:\\n``): the same for every
    caller, so other tenants' cached KV may serve it (:attr:`serving.openai.builders.Choice.shared_prefix`)."""
    return TEMPLATES[style][0].split("{instruction}", 1)[0]


def transcript_line(message: ChatMessage) -> str:
    """One turn of the context's transcript: ``User: text``, ``Assistant: text``, ``Tool: text``."""
    return f"{SPEAKERS.get(message.role, message.role.title())}: {message.text()}"


def trained_prompt(messages: Sequence[ChatMessage], style: str, continue_final: bool = False) -> str:
    """The prompt of ``messages`` in the trained template ``style`` (see the module docstring).

    Raises:
        InvalidRequest: no user message, or ``continue_final`` without a final assistant message.
    """
    instruction_at = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    if instruction_at is None:
        raise InvalidRequest(f"this model answers in the prompt format its run trained with ({style}): the last "
                             "user message is its instruction, and the messages have none", param="messages")
    turns = list(messages)
    answer = ""
    if continue_final:
        if turns[-1].role != "assistant":
            raise InvalidRequest("continue_final_message needs a final assistant message to continue",
                                 param="continue_final_message")
        answer = turns.pop().text()
    context = "\n\n".join(m.text() for m in turns if m.role in CONTEXT_ROLES)
    others = [transcript_line(m) for i, m in enumerate(turns) if m.role not in CONTEXT_ROLES and i != instruction_at]
    context = "\n\n".join(part for part in (context, "\n".join(others)) if part)
    plain, with_input = TEMPLATES[style]
    instruction = messages[instruction_at].text()
    prompt = with_input.format(instruction=instruction, input=context) if context.strip() else plain.format(
        instruction=instruction)
    return prompt + answer


def trained_style(stack: ServingStack | None, model: str, mixture: Sequence[tuple[str, float]] | None = None
                  ) -> str | None:
    """The trained template a chat request to ``model`` is rendered in, or None for the chat template.

    A target is the run's when every adapter it uses (FedDPA's global and local, an AMoLE client's model,
    each adapter of an explicit mixture) was loaded from the served run's folder; the base model, adapters
    from elsewhere and a run trained on the chat template get None. A name that serves nothing gets None
    too: submitting it answers the 404.
    """
    run = stack.run_info if stack is not None else None
    if stack is None or run is None or run.prompt_style == CHAT_TEMPLATE:
        return None
    try:
        plan = stack.plan(model, mixture)
    except ServingError:
        return None
    if not plan.names:
        return None
    for name in plan.names:
        owner = stack.pool.amole_model_of(name) if plan.mode == "amole" else name
        info = stack.pool.info(owner) if owner is not None else []
        if not info or not _inside(info[0].path, run.root):
            return None
    return run.prompt_style


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())
