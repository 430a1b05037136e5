"""Ollama API request objects (stage 1, the Ollama API). In: the JSON of POST /api/chat, /api/generate
and /api/show. Out: checked `OllamaChatRequest` / `OllamaGenerateRequest` / `OllamaShowRequest`, which
convert.py translates into a ChatCompletionRequest.

Ollama's own types (api/types.go: ChatRequest, GenerateRequest, Message, ToolCall, Options) and
the `ollama` Python client's (_types.py) are the schema. The models are strict and
`extra="forbid"`, as chat's: a field minisgl does not know is a 400 that names it (Ollama's Go
server ignores unknown fields; minisgl never ignores what a client asked for). Fields of Ollama's
API that minisgl cannot honour (images, suffix, template, context, ...) are declared so that
convert.py can say why each is refused; their null or empty value asks for nothing and is taken.
`options` stays a dict: convert.py checks it option by option (OPTIONS), so that an error names
`options.<name>` and says what to send instead.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator

from minisgl.entrypoints.openai.protocol import STRICT

# Ollama's own limit on top_logprobs (api/types.go: "0-20")
MAX_OLLAMA_TOP_LOGPROBS = 20


class BadOllamaRequest(ValueError):
    """A request the Ollama API cannot run: a 400 `{"error": message}` whose message names the field."""


class OllamaToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: Dict[str, Any]  # (an object, not JSON text: Ollama's difference from OpenAI)
    index: Optional[int] = None  # (Ollama's Go server writes it; a client sends it back)


class OllamaToolCall(BaseModel):
    """A call the model made earlier, in an assistant message (Ollama's ToolCall)."""

    model_config = STRICT
    function: OllamaToolCallFunction
    id: Optional[str] = None  # (newer Ollama servers write one; older calls have none)


class OllamaMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = None  # (the Python client leaves out a None content)
    thinking: Optional[str] = None  # an assistant's earlier thinking (chat's reasoning_content)
    images: Optional[List[Any]] = None  # (refused unless empty: text-only models)
    tool_calls: Optional[List[OllamaToolCall]] = None
    tool_name: Optional[str] = None  # a tool message: the tool that ran
    tool_call_id: Optional[str] = None  # a tool message: the call it answers (newer Ollama)

    @field_validator("role", mode="before")
    @classmethod
    def _lowercase_role(cls, role: Any) -> Any:
        # (Ollama's Message.UnmarshalJSON lowercases the role: "User" is "user" there too)
        return role.lower() if isinstance(role, str) else role


class _OllamaRequest(BaseModel):
    """What /api/chat and /api/generate share (Ollama's ChatRequest and GenerateRequest)."""

    model_config = STRICT
    model: str = Field(min_length=1)
    stream: Optional[bool] = None  # (Ollama's default is true: None streams)
    format: Optional[Union[str, Dict[str, Any]]] = None  # "json", "" or a JSON schema
    options: Optional[Dict[str, Any]] = None
    keep_alive: Optional[Union[int, float, str]] = None  # seconds, or a Go duration ("5m", "-1")
    think: Optional[Union[bool, str]] = None  # true/false, or a level ("low", "medium", "high", "max")
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_OLLAMA_TOP_LOGPROBS)
    truncate: Optional[bool] = None  # (Ollama: cut a prompt past num_ctx; refused if true)
    shift: Optional[bool] = None  # (Ollama: shift the context when the answer fills it; refused if true)

    @property
    def streams(self) -> bool:
        return self.stream is None or self.stream


class OllamaChatRequest(_OllamaRequest):
    """POST /api/chat."""

    messages: Optional[List[OllamaMessage]] = None  # (none or []: the "load" call)
    tools: Optional[List[Dict[str, Any]]] = None  # (each checked as chat's function tool)


class OllamaGenerateRequest(_OllamaRequest):
    """POST /api/generate."""

    prompt: Optional[str] = None  # (none or "": the "load" call)
    system: Optional[str] = None
    raw: Optional[bool] = None
    # Ollama's, refused unless null or empty (convert.py says why)
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[List[int]] = None
    images: Optional[List[Any]] = None
    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None


class OllamaShowRequest(BaseModel):
    """POST /api/show: `model` (`name`, its older spelling, is taken too). Ollama's Go client sends
    every field of its ShowRequest (no omitempty): system, template and name "", options null;
    those empty values ask for nothing and are taken, a non-empty system, template or options is
    refused by name (serving.py)."""

    model_config = STRICT
    model: Optional[str] = None
    name: Optional[str] = None
    verbose: Optional[bool] = None  # (true asks for the tokenizer's arrays: refused)
    system: Optional[str] = None  # (Ollama: show the model as if created with this system message)
    template: Optional[str] = None  # (Ollama: ... with this Go template)
    options: Optional[Dict[str, Any]] = None  # (Ollama: ... with these parameters)
