"""Anthropic Messages API request objects (stage 1, the Anthropic Messages API). In: the JSON of
POST /v1/messages and /v1/messages/count_tokens. Out: a checked `MessagesRequest` whose content
blocks are checked one by one, which convert.py translates into a ChatCompletionRequest.

The `anthropic` SDK's types (anthropic/types/: message_create_params.py, the *_block_param.py,
tool_param.py, thinking_config_*.py, tool_choice_*.py) are the schema. The request model is
`extra="forbid"` and strict, as chat's: a field minisgl does not know is a 400 that names it.
Fields of Anthropic's API that minisgl knows but does not build (metadata, service_tier,
container, mcp_servers, ...) are declared so that `refusal` can say why each is refused; their
null asks for nothing and is accepted. Blocks are checked one by one (`parse_block`), so that an
error names the block (`messages[2].content[1]`) and says what to send instead.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, Field, ValidationError

from minisgl.entrypoints.openai.protocol import STRICT, validation_message



# what joins a message's (or a tool_result's) text blocks (SGLang joins `system` blocks so; chat would join parts with a space)
BLOCK_SEPARATOR = "\n"


class BadMessagesRequest(ValueError):
    """A request the Messages API cannot run: a 400 (invalid_request_error) whose message names the field."""


class CacheControl(BaseModel):
    """A prompt-cache breakpoint. minisgl's radix tree caches every prompt's prefix with or without
    one, so the marker asks for what happens anyway; a `ttl` is a promise of how long (5m, 1h) that
    an LRU cache under memory pressure cannot make: refused (see `check_cache_control`)."""

    model_config = STRICT
    type: Literal["ephemeral"]
    ttl: Optional[str] = None


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[List[Any]] = None  # (refused unless null or []: minisgl cites nothing)


class ToolUseBlock(BaseModel):
    """A call the model made, sent back in an assistant turn: the chat message's tool_calls."""

    model_config = STRICT
    type: Literal["tool_use"]
    id: str
    name: str
    input: Dict[str, Any]
    cache_control: Optional[CacheControl] = None
    # (the SDK's own ToolUseBlock, sent back with model_dump(), carries both, null)
    caller: Optional[Dict[str, Any]] = None  # who made the call: {"type": "direct"} (the model) is the only caller here
    toolset_name: Optional[str] = None  # (toolsets are Anthropic's server-side tool families: refused unless null)


class ToolResultBlock(BaseModel):
    """The result of a call, in a user turn: the chat route's tool message."""

    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: str
    content: Optional[Union[str, List[Any]]] = None  # (blocks: parse_block checks each, as a message's, and keeps them parsed)
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        """The result as the tool message's text: its text blocks joined as a message's are."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else BLOCK_SEPARATOR.join(block.text for block in self.content)


class ThinkingBlock(BaseModel):
    """An assistant turn's thinking, sent back: the chat message's reasoning_content. Its signature
    is not checked (minisgl signs nothing: the ones it returns are empty)."""

    model_config = STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]
_BLOCK_TYPES = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock}
# which roles may hold which blocks (Anthropic's rule: the model calls, the user answers)
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking"), "system": ("text",), "tool_result": ("text",)}
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")


def parse_block(block: Any, where: str, role: str) -> Block:
    """One content block, checked; BadMessagesRequest naming `where` (e.g. "messages[2].content[0]") and what to send."""
    if not isinstance(block, dict):
        raise BadMessagesRequest(f"{where} must be a content block (an object with a type), got {type(block).__name__}")
    kind = block.get("type")
    if kind in _MEDIA_BLOCKS:
        raise BadMessagesRequest(f"{where}: {kind} blocks are not supported by minisgl (it serves text-only models); send text blocks")
    if kind == "redacted_thinking":
        raise BadMessagesRequest(f"{where}: redacted_thinking blocks are not supported: minisgl never writes them and cannot read their encrypted data")
    model = _BLOCK_TYPES.get(kind)
    if model is None:
        raise BadMessagesRequest(f"{where}: content blocks of type {kind!r} are not supported by minisgl; it takes text, tool_use, tool_result and thinking "
                         "(server tools' blocks belong to tools it does not run)")  # fmt: skip
    if kind not in _ROLE_BLOCKS[role]:
        allowed = " and ".join(_ROLE_BLOCKS[role])
        holder = "a tool_result's content" if role == "tool_result" else f"{_a(role)} {role} message"
        raise BadMessagesRequest(f"{where}: {_a(kind)} {kind} block cannot be in {holder} ({holder} holds {allowed} blocks)")
    try:
        parsed = model.model_validate(block)
    except ValidationError as e:
        raise BadMessagesRequest(validation_message(e, where)[0]) from None
    if isinstance(parsed, TextBlock) and parsed.citations:
        raise BadMessagesRequest(f"{where}.citations: citations are not supported by minisgl (it cites no documents); leave them out")
    if isinstance(parsed, ToolUseBlock):
        _check_tool_use(parsed, where)
    if isinstance(parsed, ToolResultBlock) and isinstance(parsed.content, list):  # (its blocks by the same rules: citations, images, a ttl)
        parsed.content = [parse_block(inner, f"{where}.content[{i}]", "tool_result") for i, inner in enumerate(parsed.content)]
    check_cache_control(getattr(parsed, "cache_control", None), f"{where}.cache_control")
    return parsed


def _a(word: str) -> str:
    """The article before `word` ("an assistant", "a user")."""
    return "an" if word[:1] in "aeio" else "a"  # (no "an user": u sounds "you")


def check_cache_control(cache_control: Optional[CacheControl], field: str) -> None:
    """BadMessagesRequest for a cache_control with a ttl; `field`: where it sits (e.g. "system[0].cache_control")."""
    if cache_control is not None and cache_control.ttl is not None:
        raise BadMessagesRequest(f"{field}.ttl: a cache lifetime is not supported by minisgl: its radix cache keeps every prompt's "
                         "prefix until memory runs short (least recently used first), with no promise of a time; leave ttl out")  # fmt: skip


def _check_tool_use(block: ToolUseBlock, where: str) -> None:
    """A tool_use block's caller and toolset_name: what the SDK's own block holds is accepted."""
    if block.caller is not None and block.caller.get("type") != "direct":
        raise BadMessagesRequest(f"{where}.caller: calls made by {block.caller.get('type')!r} are not supported by minisgl: it runs no server tools "
                                 '(code execution) that call tools; the model calls them itself: send caller {"type": "direct"} or leave it out')  # fmt: skip
    if block.caller is not None and set(block.caller) != {"type"}:
        raise BadMessagesRequest(f'{where}.caller: a {{"type": "direct"}} caller has no other field')
    if block.toolset_name is not None:
        raise BadMessagesRequest(f"{where}.toolset_name: toolsets are not supported by minisgl (it runs no MCP or server toolsets); leave it null")


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant", "system"]
    content: Union[str, List[Any]]  # (blocks checked by parse_block, which names each)


class Tool(BaseModel):
    """A custom tool (a client tool): a chat function tool. Server tools (web_search, bash,
    text_editor, code_execution, ...) have a `type` of their own and are refused in convert.py."""

    model_config = STRICT
    name: str = Field(min_length=1)
    input_schema: Dict[str, Any]
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None
    strict: Optional[bool] = None
    cache_control: Optional[CacheControl] = None
    # (Anthropic's; checked in convert.py: what minisgl does is accepted, the rest refused by name)
    eager_input_streaming: Optional[bool] = None
    allowed_callers: Optional[List[str]] = None
    defer_loading: Optional[bool] = None
    input_examples: Optional[List[Any]] = None


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = Field(default=None, ge=1)
    display: Optional[Literal["summarized", "omitted"]] = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what shapes the prompt (no max_tokens, no sampling)."""

    model_config = STRICT
    model: str
    messages: List[Message]
    system: Optional[Union[str, List[Any]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    cache_control: Optional[CacheControl] = None
    # Anthropic's, refused unless null: see refusal()
    output_config: Optional[Any] = None
    mcp_servers: Optional[Any] = None
    context_management: Optional[Any] = None
    container: Optional[Any] = None
    speed: Optional[Any] = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (Anthropic's MessageCreateParams): what minisgl builds, plus the fields it
    refuses by name (see `refusal`)."""

    max_tokens: int = Field(ge=0)  # (0: a prefill alone, Anthropic's cache warm-up: the prompt enters the radix cache)
    stop_sequences: Optional[List[str]] = None
    # (not in the newest SDK's create() signature, still taken by Anthropic's API and sent by clients)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=1)
    stream: Optional[bool] = None
    # Anthropic's, refused unless null: see refusal()
    metadata: Optional[Any] = None
    service_tier: Optional[Any] = None
    inference_geo: Optional[Any] = None
    diagnostics: Optional[Any] = None
    user_profile_id: Optional[Any] = None
    workspace_id: Optional[Any] = None


# field -> why it is refused (a non-null value of it is a 400 naming it)
_REFUSED_FIELDS = {
    "metadata": "metadata (user_id) is not supported by minisgl (the chat route refuses `user` too); leave it out",
    "service_tier": "service tiers do not exist on minisgl",
    "inference_geo": "inference_geo does not exist on minisgl: it runs where it is started",
    "diagnostics": "diagnostics (prompt-cache miss reasons) are not built",
    "user_profile_id": "user_profile_id is not supported by minisgl",
    "workspace_id": "workspaces do not exist on minisgl",
    "output_config": "output_config (effort, format) is not built on this route; use /v1/chat/completions' reasoning_effort and response_format",
    "mcp_servers": "MCP servers are not supported: minisgl runs no tools itself; declare custom tools and run them yourself",
    "context_management": "context_management (clearing earlier tool results or thinking) is not built; send the messages you want the model to see",
    "container": "containers (code execution, skills) do not exist on minisgl",
    "speed": "speed modes do not exist on minisgl",
}


def refusal(request: CountTokensRequest) -> Optional[Tuple[str, str]]:
    """(message, param) for the first field minisgl does not build, else None."""
    for name, why in _REFUSED_FIELDS.items():
        if getattr(request, name, None) is not None:
            return why, name
    try:
        check_cache_control(request.cache_control, "cache_control")
    except BadMessagesRequest as e:
        return str(e), "cache_control.ttl"
    return None
