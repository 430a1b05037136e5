"""OpenAI protocol objects (stage 1, seed 000). In: request JSON. Out: pydantic objects.

Where it sits: the HTTP routes validate the body into `ChatCompletionRequest` /
`CompletionRequest`; the serving classes turn those into `GenerateReqInput` through
`to_sampling_params`, and build the responses and stream chunks defined here.
`EmbeddingRequest` (/v1/embeddings) and SGLang's `/encode` body become an `EmbeddingReqInput`;
`ScoringRequest` (/v1/score) goes to `TokenizerManager.score_request`.

Every request model is `extra="forbid"` and `strict=True`: a field minisgl does not
implement (functions, audio, ...) or a value of the wrong type is a
400 that names the field, never silently ignored (STYLE.md). Only int -> float is
coerced, as JSON has a single number type.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, ClassVar, Dict, FrozenSet, List, Literal, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from minisgl.sampling.sampling_params import (
    GENERATION_CONFIG_SAMPLING_KEYS, MAX_N, MAX_TOP_LOGPROBS_NUM, SamplingParams,
)  # fmt: skip

STRICT = ConfigDict(extra="forbid", strict=True)  # (every request model's: the Responses' and the Messages API's too)


# pydantic's name for the branch of a union a value was tried against (`input.str`, `input.list[any]`,
# `content.list[union[InputTextPart,OutputTextPart]]`): no field of the request, so no part of a param
_UNION_BRANCH = re.compile(r"^(?:str|int|float|bool|none|[A-Z]\w*|[a-z][\w-]*\[.*\])$")


def field_path(loc: Sequence[Any], prefix: str = "") -> str:
    """A pydantic error's loc as the field it names, `prefix` first: `a.b[2].c`, union branch tags left out."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_BRANCH.match(str(part)):
            path += f".{part}" if path else str(part)
    return path


def validation_message(e: ValidationError, prefix: str = "") -> Tuple[str, str]:
    """(a message naming the field, the field) of a ValidationError's first error; `prefix`: where the validated object sits."""
    first = e.errors()[0]
    field = field_path(first.get("loc", ()), prefix)
    return (f"{field}: {first.get('msg')}" if field else str(first.get("msg"))), field


# Fields of the OpenAI API, and of SGLang's /generate, that minisgl does not implement. Naming
# them lets the error say "not supported" rather than "unknown" (the 400 is the same either way).
UNSUPPORTED_FIELDS = frozenset(
    {
        "functions", "function_call", "audio", "modalities", "prediction", "store",
        "metadata", "service_tier", "web_search_options", "suffix", "best_of", "user",
        "image_data",
        # SGLang's own, on /generate or the OpenAI routes
        "audio_data", "video_data", "input_embeds", "session_params", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "data_parallel_rank",
        # chat's fields (tool calls, tool_calls.py), not /v1/completions' or /generate's
        "tools", "tool_choice", "parallel_tool_calls",
    }
)  # fmt: skip

# /generate fields SGLang types as nullable: null is their default there
GENERATE_NULL_MEANS_DEFAULT = frozenset(
    {"return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream", "return_hidden_states"}
)


def _drop_nulls(data: Any, null_means_default: FrozenSet[str]) -> Any:
    """A body without the fields whose null asks for their default, or for an unsupported feature
    not to be used: the same as leaving them out (clients that fill in every field send them)."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if not (v is None and (k in null_means_default or k in UNSUPPORTED_FIELDS))}


# --------------------------------------------------------------------------- common
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error envelope `{"error": {...}}` (see docs/server.md for why not SGLang's flat body)."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    # SGLang's and vLLM's: every chunk of a choice also carries that choice's usage so far
    continuous_usage_stats: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minisgl"
    # SGLang's: the served model's root is its own name; a LoRA adapter's card has its directory as
    # root and the served model as parent (and no max_model_len)
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard] = Field(default_factory=list)


# Fields the OpenAI reference documents as nullable whose minisgl type is not: an explicit
# null (the openai SDK sends one for `n=None`) means the default, as leaving the field out does.
NULL_MEANS_DEFAULT = frozenset({"frequency_penalty", "presence_penalty", "n", "logprobs", "stream", "echo", "return_hidden_states"})

# what a knob neither the request nor generation_config.json sets takes: SamplingParams' default
_BUILTIN_DEFAULTS = {key: getattr(SamplingParams(), key) for key in GENERATION_CONFIG_SAMPLING_KEYS}


class JsonSchemaResponseFormat(BaseModel):
    """response_format's json_schema object (OpenAI's): the output is a JSON document matching `schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")  # (a pydantic BaseModel has .schema)
    strict: Optional[bool] = False


class StructureFormat(BaseModel):
    """One structure of SGLang's structural_tag response format: `begin`, JSON matching `schema`, `end`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    begin: str
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema; and
    SGLang's structural_tag: free text in which whatever follows a trigger is one of the
    structures (its `structures` + `triggers`, or xgrammar's own `format` object)."""

    model_config = STRICT
    type: str
    json_schema: Optional[JsonSchemaResponseFormat] = None
    structures: Optional[List[StructureFormat]] = None
    triggers: Optional[List[str]] = None
    format: Optional[Dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _known_type_and_sglangs_unwrapped_schema(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "text", "json_object", "json_schema", "structural_tag"):
            # before the fields: another type's own fields would be named instead
            raise ValueError(
                f"response_format type {data.get('type')!r} is not supported by minisgl; use text, json_object, "
                f"json_schema or structural_tag"
            )
        # {"type": "json_schema", "schema": {...}} without the json_schema wrapper: SGLang takes it,
        # named after the schema's title (clients built for it send this shape)
        if isinstance(data, dict) and data.get("type") == "json_schema" and "json_schema" not in data and "schema" in data:
            data = dict(data)
            schema = data.pop("schema")
            title = schema.get("title") if isinstance(schema, dict) else None
            data["json_schema"] = {"name": title if isinstance(title, str) else "Schema", "schema": schema}
            if "strict" in data:  # (its strict flag moves in with it)
                data["json_schema"]["strict"] = data.pop("strict")
        return data

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        tag_fields = [name for name in ("structures", "triggers", "format") if getattr(self, name) is not None]
        if self.type != "structural_tag" and tag_fields:
            raise ValueError(f"response_format {tag_fields} belong to type structural_tag, not {self.type}")
        if self.type == "structural_tag" and sorted(tag_fields) not in (["structures", "triggers"], ["format"]):
            raise ValueError(
                'response_format structural_tag needs "structures" ([{"begin", "schema", "end"}]) and "triggers" '
                '(SGLang\'s shape), or a "format" object (xgrammar\'s), not both'
            )
        return self

    def grammar(self) -> Dict[str, str]:
        """The sampling key it constrains the output with (SGLang's mapping, §10.3): json_object is
        the schema {"type": "object"}; text constrains nothing."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema" and self.json_schema is not None:
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        if self.type == "structural_tag" and self.format is not None:
            return {"structural_tag": json.dumps({"type": "structural_tag", "format": self.format})}
        if self.type == "structural_tag":
            structures = [s.model_dump(by_alias=True) for s in self.structures or []]
            return {"structural_tag": json.dumps({"structures": structures, "triggers": self.triggers})}
        return {}


class _SamplingFields(BaseModel):
    """Sampling fields shared by chat and completions (sglang-facts.md §10.3)."""

    model_config = STRICT
    null_means_default: ClassVar[FrozenSet[str]] = NULL_MEANS_DEFAULT

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_that_mean_default(cls, data: Any) -> Any:
        # An unsupported field set to null asks for nothing minisgl does not do (clients that
        # fill every field send them): the same as leaving it out, where any other value is a 400.
        return _drop_nulls(data, cls.null_means_default)

    model: str
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    stop: Optional[Union[str, List[str]]] = None
    stop_regex: Optional[Union[str, List[str]]] = None  # SGLang's: patterns that stop like stop strings
    stop_token_ids: Optional[List[int]] = None
    seed: Optional[int] = None
    # token id (a decimal string: JSON keys are strings) -> bias added to its logit, in [-100, 100]
    logit_bias: Optional[Dict[str, float]] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # structured output: OpenAI's response_format, or SGLang's own fields (at most one of them)
    response_format: Optional[ResponseFormat] = None
    json_schema: Optional[str] = None  # a JSON schema's text
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    rid: Optional[str] = None
    priority: Optional[int] = None  # SGLang's: with --enable-priority-scheduling (docs/scheduler.md)
    # SGLang's: with --enable-custom-logit-processor, a CustomLogitProcessor.to_str() that edits the
    # logits before sampling, and the parameters it reads (sampling/custom_logit_processor.py)
    custom_logit_processor: Optional[str] = None
    custom_params: Optional[Dict[str, Any]] = None
    # SGLang's (chat and completions): with --enable-return-hidden-states, each choice carries the
    # hidden state of its last decode step (OpenAIServingBase.last_hidden_state)
    return_hidden_states: bool = False
    # SGLang's extra field: the loaded adapter to run with, by name (a `model` of "BASE:NAME" names one too, and wins)
    lora_path: Optional[str] = None
    # the request's own radix-tree namespace, SGLang's pair (cache_salt is vLLM's name): the
    # prompt reuses cached K/V only of requests that sent the same cache_salt + extra_key
    cache_salt: Optional[str] = None
    extra_key: Optional[str] = None

    def _common_sampling_params(self, max_new_tokens: Optional[int], defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The SGLang sampling_params dict. An unset knob takes `defaults` (the model's
        generation_config, chat only), else SGLang's built-in default."""
        fallback = {**_BUILTIN_DEFAULTS, **(defaults or {})}

        def get_param(name: str) -> Any:  # SGLang's order: the request, generation_config, built-in
            value = getattr(self, name)
            return fallback[name] if value is None else value

        params: Dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            **{name: get_param(name) for name in GENERATION_CONFIG_SAMPLING_KEYS},
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "stop": self.stop,
            "stop_regex": self.stop_regex,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "seed": self.seed,
            "n": self.n,
        }
        if self.logit_bias:  # (checked by SamplingParams: decimal ids inside the vocabulary, values in [-100, 100])
            params["logit_bias"] = self.logit_bias
        if self.custom_params is not None:  # (without custom_logit_processor: refused by the TokenizerManager)
            params["custom_params"] = self.custom_params
        grammars = {key: getattr(self, key) for key in ("json_schema", "regex", "ebnf") if getattr(self, key) is not None}
        if self.response_format is not None:
            from_format = self.response_format.grammar()
            if from_format and grammars:
                raise ValueError(f"response_format {self.response_format.type} and {sorted(grammars)} both constrain the output: give one")
            grammars.update(from_format)
        params.update(grammars)  # (SamplingParams.verify refuses two of them, and a json_schema that is not JSON)
        return params


# --------------------------------------------------------------------------- chat
class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None  # (a forced call is always constrained to `parameters`; an "auto" one when strict)


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = STRICT
    name: str


class ToolChoice(BaseModel):
    """A named function the model must call (`{"type": "function", "function": {"name": ...}}`)."""

    model_config = STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call the model made (in a response), or made earlier (in an assistant message)."""

    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageFunctionCall(BaseModel):
    # extra keys ignored: the openai SDK's parse helpers add parsed_arguments to the answers a
    # client sends back, SGLang's tool calls carry an index (its request model ignores extras too)
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A call the model made earlier, in an assistant message of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


# fields of an assistant message as the openai SDK returns it (`message.model_dump()`), which a
# client sends back as they are: null, they ask for nothing
_MESSAGE_NULL_FIELDS = frozenset({"refusal", "audio", "function_call", "annotations"})


class ChatMessage(BaseModel):
    model_config = STRICT
    # ("function", the legacy role of functions/function_call, is not supported)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[MessageToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    # an assistant's earlier thinking, as a --reasoning-parser answer returned it: the template decides
    # (Qwen3's shows the latest turn's, DeepSeek-R1's leaves reasoning out of the history on purpose)
    reasoning_content: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _drop_null_answer_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _MESSAGE_NULL_FIELDS)}
        return data

    @model_validator(mode="after")
    def _content_where_needed(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers), and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:  # (an assistant message that only calls tools)
            return ""
        if isinstance(self.content, str):
            return self.content
        # SGLang joins the text parts with a space for string-content templates
        return " ".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage]
    max_tokens: Optional[int] = Field(default=None, ge=0)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_NUM)
    continue_final_message: bool = False
    # SGLang's: extra variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    # SGLang's: with --reasoning-parser, the thinking goes to reasoning_content (false: all of it in content)
    separate_reasoning: bool = True
    # SGLang's: false sends a stream's reasoning_content in one piece, once the thinking has ended
    stream_reasoning: bool = True
    # OpenAI's: how hard a reasoning model thinks; a chat-template variable (gpt-oss's), as in SGLang
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    # tools the model may call: forced calls are constrained, "auto" ones need --tool-call-parser (tool_calls.py)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ToolChoice]] = None
    parallel_tool_calls: bool = True

    def to_sampling_params(self, defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """`defaults`: the model's generation_config sampling keys (ModelConfig.default_sampling_params)."""
        # max_completion_tokens wins over the deprecated max_tokens; None lets the
        # scheduler clamp to the context length (sglang-facts.md §10.3).
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._common_sampling_params(max_new, defaults)


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # (SGLang's and DeepSeek's field; --reasoning-parser)
    tool_calls: Optional[List[ToolCall]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[List[ChatTokenLogprob]] = None


def _without_null_hidden_states(data: Dict[str, Any]) -> Dict[str, Any]:
    """A choice's `hidden_states` key only when the request asked (SGLang's serializers drop a null
    one: a client that never asks never sees the field)."""
    if data.get("hidden_states") is None:
        data.pop("hidden_states", None)
    return data


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None
    hidden_states: Optional[List[float]] = None  # return_hidden_states: the last decode step's

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Dict[str, Any]:
        return _without_null_hidden_states(handler(self))


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: UsageInfo
    # SGLang's: {"weight_version": the weights that answered}; a non-streamed answer only (its
    # chunks have no metadata). Not the Responses API's `metadata`, the request's own, echoed.
    metadata: Dict[str, Any] = Field(default_factory=dict)


def _without_nulls(fields: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None  # in the call's first delta only
    arguments: str  # "" in the first delta, then the next piece of the arguments' JSON text

    @model_serializer(mode="wrap")
    def _only_what_is_sent(self, handler: Any) -> Dict[str, Any]:
        return _without_nulls(handler(self))


class DeltaToolCall(BaseModel):
    """A piece of a streamed call, OpenAI's: the first names the call (index, id, type, function
    name, arguments ""), the next ones add to its arguments ({index, function: {arguments}})."""

    index: int  # the call's place in the choice's tool_calls
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _only_what_is_sent(self, handler: Any) -> Dict[str, Any]:
        return _without_nulls(handler(self))


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None
    hidden_states: Optional[List[float]] = None  # return_hidden_states: in a chunk of its own, after the finish

    @model_serializer(mode="wrap")
    def _only_what_changed(self, handler: Any) -> Dict[str, Any]:
        # a delta names only what it adds ({"content": ...}; {} in the finish chunk), while the
        # chunk around it spells out its nulls (finish_reason, logprobs, usage), as OpenAI's do
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    prompt: Union[str, List[str], List[int], List[List[int]]]
    rid: Optional[Union[str, List[str]]] = None  # a list: one per prompt of a batch, as SGLang's
    # OpenAI: "integer or null, defaults to 16": a null is the 16 too, not "up to the context"
    # (chat's null max_tokens does mean no limit)
    null_means_default: ClassVar[FrozenSet[str]] = NULL_MEANS_DEFAULT | {"max_tokens"}
    max_tokens: int = Field(default=16, ge=0)
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_NUM)

    def to_sampling_params(self) -> Dict[str, Any]:
        return self._common_sampling_params(self.max_tokens)


class CompletionLogprobs(BaseModel):
    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None
    hidden_states: Optional[List[float]] = None  # return_hidden_states: the last decode step's

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Dict[str, Any]:
        return _without_null_hidden_states(handler(self))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[CompletionResponseChoice]
    usage: UsageInfo
    metadata: Dict[str, Any] = Field(default_factory=dict)  # SGLang's {"weight_version": ...}, as the chat's


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[CompletionResponseChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(BaseModel):
    """SGLang's /v1/tokenize body (also served at /tokenize)."""

    model_config = STRICT
    model: Optional[str] = None
    prompt: Union[str, List[str]]
    add_special_tokens: bool = True  # as a text prompt of /v1/completions is encoded


class DetokenizeRequest(BaseModel):
    """SGLang's /v1/detokenize body (also served at /detokenize)."""

    model_config = STRICT
    model: Optional[str] = None
    tokens: Union[List[int], List[List[int]]]
    skip_special_tokens: bool = True


# --------------------------------------------------------------------------- native /generate
class GenerateRequest(BaseModel):
    """SGLang's native /generate body: text or input_ids (single or batch) + sampling_params
    (one dict for all, or a batch's list of one per prompt; the logprob fields likewise)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_that_mean_default(cls, data: Any) -> Any:
        return _drop_nulls(data, GENERATE_NULL_MEANS_DEFAULT)  # (sglang.bench_serving sends "lora_path": null)

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    # the logprob fields: one value for all prompts of a batch, or a list of one per prompt
    return_logprob: Union[bool, List[bool]] = False
    logprob_start_len: Union[int, List[int]] = -1  # prompt logprobs from this position; -1: none
    top_logprobs_num: Union[int, List[int]] = 0
    return_text_in_logprobs: bool = False  # each (logprob, id, text) entry with its token's text
    token_ids_logprob: Optional[Union[List[int], List[Optional[List[int]]]]] = None  # ids every position reports
    # SGLang's: with --enable-return-hidden-states, meta_info["hidden_states"] (one for all prompts, or one per prompt)
    return_hidden_states: Union[bool, List[bool]] = False
    stream: bool = False
    priority: Optional[int] = None  # with --enable-priority-scheduling: how important (all prompts of a batch)
    # with --enable-custom-logit-processor: CustomLogitProcessor.to_str() for all prompts, or a list
    # of one per prompt (None: none); its parameters go in sampling_params["custom_params"]
    custom_logit_processor: Optional[Union[str, List[Optional[str]]]] = None
    # SGLang's: the loaded adapter's name (None: the base model), one for all prompts or one per prompt
    lora_path: Optional[Union[str, List[Optional[str]]]] = None
    # SGLang's: the request's own radix-tree namespace (a tenant's cache salt), one for all prompts or one per prompt
    extra_key: Optional[Union[str, List[Optional[str]]]] = None


# --------------------------------------------------------------------------- embeddings
class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body (SGLang's EmbeddingRequest, without its image inputs): one
    text, a list of texts, one token-id list or a list of them. `user` (OpenAI's end-user id) is
    written to the request log with --log-requests, and changes nothing else."""

    model_config = STRICT
    input: Union[str, List[str], List[int], List[List[int]]]
    model: str
    # base64: each embedding as the base64 of its little-endian float32 bytes (what the openai
    # client asks for when its caller names no format, and decodes back to floats)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None  # Matryoshka: only for a model that declares it (tokenization.check_dimensions)
    user: Optional[str] = None


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[List[float], str]  # a str with encoding_format base64
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: List[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


class EncodeRequest(BaseModel):
    """SGLang's native /encode body (its EmbeddingReqInput's text fields): text or input_ids,
    single or a batch; the answer is the TokenizerManager's {"embedding", "meta_info"} (a list
    for a batch)."""

    model_config = STRICT
    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    dimensions: Optional[int] = None


# --------------------------------------------------------------------------- /v1/score
class ScoringRequest(BaseModel):
    """SGLang's /v1/score body (its ScoringRequest): a text query with text items (a string or a
    list of strings), or a token-id query with token-id items (a list of id lists); the labels
    whose next-token probabilities to return. Which pairs are accepted is checked by
    tokenizer_manager_score_mixin.build_score_request (a 400 naming the field)."""

    model_config = STRICT
    query: Optional[Union[str, List[int]]] = None
    items: Optional[Union[str, List[str], List[List[int]]]] = None
    label_token_ids: Optional[List[int]] = None
    apply_softmax: bool = False  # softmax over the labels only; else each label's probability
    item_first: bool = False  # item + query instead of query + item
    model: str = "default"


class ScoringResponse(BaseModel):
    """SGLang's ScoringResponse, its field order; `usage` with minisgl's cached tokens (the radix hit)."""

    scores: List[List[float]]  # one list per item, in the order of label_token_ids
    model: str
    usage: Optional[UsageInfo] = None
    object: Literal["scoring"] = "scoring"


# --------------------------------------------------------------------------- /start_profile
class ProfileReqInput(BaseModel):
    """SGLang's /start_profile body (its io_struct.ProfileReqInput): every field may be left out,
    and null asks for the default (docs/server.md). start_step, profile_by_stage, merge_profiles
    and profile_stages ask for what minisgl does not do: set, each is a 400 that says why."""

    model_config = STRICT
    output_dir: Optional[str] = None  # default: $SGLANG_TORCH_PROFILER_DIR, else /tmp
    start_step: Optional[int] = None
    num_steps: Optional[int] = None  # stop by itself after this many steps that run a batch
    activities: Optional[List[str]] = None  # CPU, GPU, MEM; default CPU (+ GPU on CUDA)
    profile_by_stage: Optional[bool] = None  # (null or false: asks for nothing)
    with_stack: Optional[bool] = None  # default true
    record_shapes: Optional[bool] = None  # default true
    merge_profiles: Optional[bool] = None
    profile_prefix: Optional[str] = None  # the trace's file name starts with "<profile_prefix>-"
    profile_stages: Optional[List[str]] = None


# --------------------------------------------------------------------------- /load_lora_adapter, /unload_lora_adapter
class LoadLoRAAdapterRequest(BaseModel):
    """SGLang's /load_lora_adapter body (its LoadLoRAAdapterReqInput's client fields): the name
    requests will use, the PEFT directory, and `pinned` (docs/server.md)."""

    model_config = STRICT
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """SGLang's /unload_lora_adapter body: the name of a loaded adapter."""

    model_config = STRICT
    lora_name: str


# --------------------------------------------------------------------------- weight updates while serving
class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's /update_weights_from_disk body (UpdateWeightFromDiskReqInput's client fields; its
    is_async, keep_pause, ... options are unknown fields here: a 400 naming them)."""

    model_config = STRICT
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class UpdateWeightsFromTensorRequest(BaseModel):
    """SGLang's /update_weights_from_tensor body. Each serialized_named_tensors entry is base64 text
    of a safetensors file (minisgl.models.weight_update.serialize_named_tensors), not SGLang's
    pickle: the server never unpickles a request (docs/server.md)."""

    model_config = STRICT
    serialized_named_tensors: List[str]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class GetWeightsByNameRequest(BaseModel):
    """SGLang's /get_weights_by_name body: a checkpoint tensor name, and how many rows to return."""

    model_config = STRICT
    name: str
    truncate_size: int = Field(default=100, ge=0)
