"""Responses API request objects (stage 1, the Responses API). In: the JSON of POST /v1/responses.
Out: a checked `ResponsesRequest` and its input items, which serving_responses.py translates
into a ChatCompletionRequest.

The openai SDK's types (openai/types/responses/) are the schema. The request model is
`extra="forbid"` and strict, as chat's: a field minisgl does not know is a 400 that names it.
Fields of the OpenAI API that minisgl knows but does not build (background, conversation,
prompt, ...) are declared so that `refusal` can say why each is refused; their null asks for
nothing and is accepted. Input items are checked one by one (`parse_item`), so that an error
names the item (`input[2]`) and says what to send instead.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, Field, ValidationError

from minisgl.entrypoints.openai.protocol import STRICT, validation_message
from minisgl.sampling.sampling_params import MAX_TOP_LOGPROBS_NUM

# an output item a client sends back as input carries the id and status it was given: they name
# it, they ask for nothing (OpenAI takes them too)
_ITEM_STATUS = Optional[Literal["in_progress", "completed", "incomplete"]]

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value built
# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, string values up to 512
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512


class InputTextPart(BaseModel):
    model_config = STRICT
    type: Literal["input_text"]
    text: str


class OutputTextPart(BaseModel):
    """An assistant message's text, as a response's output has it (sent back as input)."""

    model_config = STRICT
    type: Literal["output_text"]
    text: str
    annotations: Optional[List[Any]] = None  # (minisgl's are always [])
    logprobs: Optional[List[Any]] = None  # (what the output said of its tokens: no input to the model)


class MessageItem(BaseModel):
    """A message: the EasyInputMessage (`{"role", "content"}`, no type needed) or a `message` item."""

    model_config = STRICT
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, List[Union[InputTextPart, OutputTextPart]]]
    id: Optional[str] = None
    status: _ITEM_STATUS = None


class FunctionCallItem(BaseModel):
    """A call the model made (a function_call output item, sent back with the conversation)."""

    model_config = STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: Optional[str] = None
    status: _ITEM_STATUS = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call, from the client: the chat route's tool message."""

    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, List[InputTextPart]]
    id: Optional[str] = None
    status: _ITEM_STATUS = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningTextPart(BaseModel):
    model_config = STRICT
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(BaseModel):
    model_config = STRICT
    type: Literal["summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning output item sent back: its text goes with the assistant turn after it
    (the chat message's reasoning_content; the chat template decides whether the model sees it).
    Its summary must be empty, as minisgl's own are (parse_item refuses another: it would be
    dropped, as no chat message field carries it)."""

    model_config = STRICT
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: List[SummaryTextPart] = Field(default_factory=list)
    content: Optional[List[ReasoningTextPart]] = None
    status: _ITEM_STATUS = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def parse_item(item: Any, where: str) -> InputItem:
    """One element of `input`, checked; ValueError naming `where` (e.g. "input[2]") and what to send."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object (a message or an item), got {type(item).__name__}")
    kind = item.get("type", "message" if "role" in item else None)
    content = item.get("content")
    if kind == "message" and isinstance(content, list):
        media = sorted({p.get("type") for p in content if isinstance(p, dict) and p.get("type") in _MEDIA_PARTS})
        if media:
            raise ValueError(f"{where}: {', '.join(media)} parts are not supported by minisgl (it serves text-only models); send input_text parts")
        if item.get("role") != "assistant" and any(isinstance(p, dict) and p.get("type") == "output_text" for p in content):
            raise ValueError(f"{where}: output_text parts belong to assistant messages; a {item.get('role')} message sends input_text")
    model = _ITEM_TYPES.get(kind)
    if model is None:
        built = ", ".join(sorted(_ITEM_TYPES))
        raise ValueError(f"{where}: input items of type {kind!r} are not supported by minisgl; it takes {built} (and messages without a type)")
    try:
        parsed = model.model_validate(item)
    except ValidationError as e:
        raise ValueError(validation_message(e, where)[0]) from None
    if isinstance(parsed, ReasoningItem) and parsed.summary:
        raise ValueError(f"{where}.summary: reasoning summaries are not built (minisgl writes none, and no chat message carries one); "
                         "send the reasoning as content (reasoning_text parts) and summary []")  # fmt: skip
    return parsed


class FunctionTool(BaseModel):
    """A function tool in the Responses' flat shape (chat nests the same under "function")."""

    model_config = STRICT
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    """`text`: its `format` becomes the chat's response_format (checked there)."""

    model_config = STRICT
    format: Optional[Dict[str, Any]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(BaseModel):
    model_config = STRICT
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None  # (the deprecated name of summary)


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's ResponseCreateParams): what minisgl builds, plus the knobs of
    chat's it takes here (docs/server.md), plus the fields it refuses by name (see `refusal`)."""

    model_config = STRICT
    model: str
    input: Union[str, List[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_NUM)
    include: Optional[List[str]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    metadata: Optional[Dict[str, str]] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    # chat's sampling knobs (SGLang's and OpenAI chat's), taken as chat takes them
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    # OpenAI's, refused unless null (or their default): see refusal()
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream_options: Optional[Dict[str, Any]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    max_tool_calls: Optional[int] = None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


# field -> why it is refused (a non-null value of it is a 400 naming it)
_REFUSED_FIELDS = {
    "background": "background responses are not built: minisgl answers while the client waits (or streams); leave background out or false",
    "conversation": "conversations (the Conversations API) are not built; continue a stored response with previous_response_id instead",
    "prompt": "prompt templates (stored on OpenAI's dashboard) do not exist on minisgl; send the text in input / instructions",
    "stream_options": "stream_options (include_obfuscation) is not built: minisgl's stream events carry no obfuscation field",
    "user": "user is not supported by minisgl (the chat route refuses it too)",
    "service_tier": "service tiers do not exist on minisgl",
    "safety_identifier": "safety_identifier is not supported by minisgl",
    "prompt_cache_key": "prompt_cache_key is not supported by minisgl; its prefix cache reuses any shared prefix by itself",
    "max_tool_calls": "max_tool_calls limits built-in tool calls, which minisgl does not run",
}


def refusal(request: ResponsesRequest) -> Optional[Tuple[str, str]]:
    """(message, param) for the first field minisgl does not build, else None."""
    for name, why in _REFUSED_FIELDS.items():
        value = getattr(request, name)
        if value is not None and not (name == "background" and value is False):
            return why, name
    if request.truncation == "auto":
        return 'truncation "auto" (dropping the start of the conversation to fit) is not built; a too-long input is a 400 ("disabled", the default)', "truncation"
    other = [v for v in request.include or [] if v != LOGPROBS_INCLUDE]
    if other:
        return f"include {other} is not supported by minisgl; the one value built is {LOGPROBS_INCLUDE!r}", "include"
    if request.top_logprobs and not request.logprobs:
        return f'top_logprobs needs include ["{LOGPROBS_INCLUDE}"] (the logprobs it adds to are returned only then)', "top_logprobs"
    if request.text is not None and request.text.verbosity is not None:
        return "text.verbosity is not supported by minisgl: nothing here controls the length of an answer but max_output_tokens", "text.verbosity"
    if request.reasoning is not None and (request.reasoning.summary or request.reasoning.generate_summary):
        return "reasoning summaries are not built: minisgl returns the reasoning itself (with --reasoning-parser); leave reasoning.summary out", "reasoning.summary"
    metadata = request.metadata or {}
    if len(metadata) > METADATA_MAX_PAIRS or any(len(k) > METADATA_MAX_KEY or len(v) > METADATA_MAX_VALUE for k, v in metadata.items()):
        return (f"metadata holds at most {METADATA_MAX_PAIRS} pairs, keys up to {METADATA_MAX_KEY} characters and values up to "
                f"{METADATA_MAX_VALUE} (OpenAI's limits)"), "metadata"  # fmt: skip
    return None
