"""OpenAI ``response_format`` and ``tools`` -> the grammar a chat request decodes under, and tool calls back out.

* ``response_format: {"type": "json_object"}``: any JSON object; ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``: JSON valid under the schema. Both are compact (``", "`` and ``": "``
  separators, no other whitespace: a small model cannot wander off into blank lines). With ``strict:
  true`` a schema keyword the grammar cannot enforce (:data:`UNENFORCED`, or any keyword it does not
  know) is refused with a 400 naming it; with ``strict: false`` such keywords are ignored and the rest
  is still enforced. Either way an object takes only the properties its schema declares unless its
  ``additionalProperties`` allows others (as vLLM's xgrammar backend reads a schema).
* ``tools`` with ``tool_choice``: ``none`` decodes freely without the tools; ``auto`` (the default) lets
  the answer be text with tool calls anywhere in it; ``required`` makes it one or more calls and nothing
  else; a named function makes it calls of that function. A call is written
  ``<tool_call>{"name": "<function>", "arguments": <JSON valid under its parameters>}</tool_call>``
  (several separated by a newline when ``parallel_tool_calls`` is not false), the format Hermes-style
  models are trained on. The tools reach the model through the chat template's ``tools`` argument when
  the template reads one, else as a system preamble (:func:`tool_preamble`); earlier assistant calls
  and ``tool`` messages are kept in the history the same way.

Grammars are compiled by :class:`serving.engine.grammar.GrammarCompiler` (xgrammar), one per tokenizer.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from serving.engine.grammar import Grammar, GrammarCompiler
from serving.engine.sampling import SamplingParams
from serving.errors import InvalidRequest
from serving.openai.schemas import ChatCompletionRequest, ChatMessage, Tool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# keywords xgrammar enforces, and annotations that constrain nothing
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "oneOf", "allOf", "$ref", "$defs", "definitions", "minItems", "maxItems", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "patternProperties", "propertyNames"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "nullable", "strict"})
UNENFORCED = frozenset({"not", "if", "then", "else", "multipleOf", "uniqueItems", "dependentRequired",
                        "dependentSchemas", "contains", "minContains", "maxContains", "unevaluatedProperties",
                        "unevaluatedItems", "minProperties", "maxProperties"})
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "propertyNames", "contains",
        "unevaluatedProperties", "unevaluatedItems")  # keywords whose value is one subschema
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> subschema
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")  # lists of subschemas


@dataclass(frozen=True)
class Structure:
    """What a chat request's ``response_format`` and ``tools`` make of it.

    Attributes:
        grammar: the grammar its answers decode under (None: free text).
        tools: the tool definitions the prompt shows (OpenAI's ``{"type": "function", "function": ...}``).
        calls: the answers may hold tool calls, returned as ``tool_calls``.
    """

    grammar: Grammar | None = None
    tools: tuple[dict[str, Any], ...] = ()
    calls: bool = False


_COMPILERS: dict[int, tuple[object, GrammarCompiler]] = {}
_LOCK = threading.Lock()


def compiler_for(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    """The grammar compiler of ``tokenizer`` (built once: it reads the whole vocabulary)."""
    with _LOCK:
        held = _COMPILERS.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            held = _COMPILERS[id(tokenizer)] = (tokenizer, GrammarCompiler(tokenizer))
        return held[1]


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield key, schema[key]
    for key in _MAP:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            yield f"{key}.{name}", sub
    for key in _LIST:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            yield f"{key}[{i}]", sub


def check_schema(schema: Any, where: str, strict: bool, param: str) -> None:
    """Refuse what cannot be a schema, and under ``strict`` every keyword the grammar would not enforce.

    Raises:
        InvalidRequest: names the keyword and where it is (``where`` is the path so far).
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} is not a JSON schema (an object or a boolean)", param=param)
    if strict:
        for key in schema:
            if key in UNENFORCED or key not in ENFORCED | ANNOTATIONS:
                raise InvalidRequest(f"the JSON schema keyword {key!r} at {where} is not supported with strict: true "
                                     "(the grammar cannot enforce it); drop it, or send strict: false to have it "
                                     "ignored", param=param)
    for key, sub in _subschemas(schema):
        check_schema(sub, f"{where}.{key}", strict, param)


def response_grammar(body: ChatCompletionRequest, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar of ``response_format`` (None for text)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return compiler.json_schema({"type": "object"}, "JSON object", strict=False)
    spec = fmt.json_schema
    assert spec is not None  # the wire model requires it with json_schema
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    strict = bool(spec.strict)
    check_schema(schema, "response_format.json_schema.schema", strict, "response_format")
    return compiler.json_schema(schema, f"JSON schema {spec.name!r}")  # undeclared properties only where allowed


def _call_tag(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    check_schema(params, f"tools[{tool.function.name}].function.parameters", bool(tool.function.strict), "tools")
    return {"type": "tag", "begin": f'{CALL_OPEN}{{"name": {json.dumps(tool.function.name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1},  # no blank runs
            "end": "}" + CALL_CLOSE}


def plan(body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase) -> Structure:
    """The :class:`Structure` of ``body`` (compiles its grammar; cached by xgrammar for repeated schemas).

    Raises:
        InvalidRequest: a schema or tool it cannot serve, or a ``tool_choice`` naming no tool (each named).
    """
    tools = list(body.tools or [])
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    wants_json = body.response_format is not None and body.response_format.type != "text"
    if choice != "none" and not tools:
        raise InvalidRequest(f"tool_choice {_choice_name(choice)!r} needs tools", param="tool_choice")
    if choice == "none" or not tools:
        grammar = response_grammar(body, compiler_for(tokenizer)) if wants_json else None
        return Structure(grammar)
    if wants_json:
        raise InvalidRequest("response_format json_object or json_schema together with tools is not supported; "
                             "send tool_choice: none, or drop response_format", param="response_format")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tool names must be distinct, got {names}", param="tools")
    if not isinstance(choice, str):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                 f"the tools {names}", param="tool_choice")
        tools_called = [t for t in tools if t.function.name == choice.function.name]
    else:
        tools_called = tools
    tags = [_call_tag(t) for t in tools_called]
    single = body.parallel_tool_calls is False
    if choice == "auto":
        form: dict[str, Any] = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
                                "stop_after_first": single}
    else:
        form = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                "stop_after_first": single}
    grammar = compiler_for(tokenizer).structural_tag({"type": "structural_tag", "format": form}, "tool calls")
    return Structure(grammar, tuple(t.model_dump(exclude_none=True) for t in tools), calls=True)


def _choice_name(choice: Any) -> str:
    return choice if isinstance(choice, str) else choice.function.name


def native_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer's chat template renders a ``tools`` argument itself."""
    template = getattr(tokenizer, "chat_template", None)
    return "tools" in str(template or "")


def tool_preamble(tools: tuple[dict[str, Any], ...]) -> str:
    """The system text that shows ``tools`` to a model whose chat template has no ``tools`` argument."""
    lines = [json.dumps({k: v for k, v in t["function"].items() if k != "strict"}) for t in tools]
    return ("You may call these functions:\n" + "\n".join(lines) + "\n\nTo call one, answer with "
            f'{CALL_OPEN}{{"name": <function name>, "arguments": <its arguments as a JSON object>}}{CALL_CLOSE}, '
            "one such block for each call.")


def call_text(message: ChatMessage) -> str:
    """An earlier assistant turn's text with its tool calls written as the model writes them."""
    blocks = [f'{CALL_OPEN}{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}{CALL_CLOSE}'
              for c in message.tool_calls or ()]
    return "\n".join([message.text(), *blocks] if message.text() else blocks)


def prompt_body(body: ChatCompletionRequest, structure: Structure, native: bool) -> ChatCompletionRequest:
    """``body`` as the prompt renders it: without a native ``tools`` argument the tools become a system
    preamble and earlier calls become text; with one, the tools go to the template's ``tools``."""
    if native:  # the server's own template argument, past the check that keeps callers from setting it
        kwargs = {**(body.chat_template_kwargs or {}), "tools": list(structure.tools)}
        return body.model_copy(update={"chat_template_kwargs": kwargs}) if structure.tools else body
    if not (structure.tools or any(m.tool_calls for m in body.messages)):
        return body
    messages = [m.model_copy(update={"content": call_text(m), "tool_calls": None}) if m.tool_calls else m
                for m in body.messages]
    if structure.tools:
        preamble = tool_preamble(structure.tools)
        if messages[0].role == "system":
            messages[0] = messages[0].model_copy(update={"content": messages[0].text() + "\n\n" + preamble})
        else:
            messages.insert(0, ChatMessage(role="system", content=preamble))
    return body.model_copy(update={"messages": messages})


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls or None, the OpenAI ``tool_calls``) of an answer; an unfinished call stays text."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    rest = _CALL.sub("", text).strip() if calls else text
    return (rest or None), calls


def constrain(params: SamplingParams, structure: Structure) -> SamplingParams:
    """``params`` decoding under ``structure``'s grammar.

    Raises:
        InvalidRequest: ``min_tokens`` beside a grammar (it could forbid the only end the grammar allows).
    """
    if structure.grammar is None:
        return params
    if params.min_tokens:
        raise InvalidRequest("min_tokens cannot be combined with response_format or tools", param="min_tokens")
    return replace(params, grammar=structure.grammar)
