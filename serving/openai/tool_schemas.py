"""Wire models of structured output and tools: ``response_format``, ``tools``, ``tool_choice`` and the
``tool_calls`` of earlier assistant turns (OpenAI's shapes; :mod:`serving.openai.structured` serves them).

Each refuses fields it does not declare and values of the wrong type, as :class:`serving.openai.schemas.Strict`
does (its own base here: ``schemas`` imports these).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    """Every field declared, each value of its documented type."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str

    def parsed(self) -> Any:
        """``arguments`` decoded (the string itself when it is not JSON)."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: the schema answers follow (``strict: false`` ignores what it cannot enforce)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = False


class ResponseFormat(Strict):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, value: JsonSchemaFormat | None, info: Any) -> JsonSchemaFormat | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema goes with type json_schema")
        return value

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema, strict}")
        return self


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = False


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName
