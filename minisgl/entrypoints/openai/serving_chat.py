"""OpenAIServingChat (stage 1, seed 000). In: ChatCompletionRequest. Out: chat.completion(.chunk).

`_convert_to_internal_request` renders the messages with the tokenizer's chat template
and builds a `GenerateReqInput` (text + `to_sampling_params`), which no longer knows it
came from a chat request. The rendered prompt travels as text so that it goes through
the same TokenizerManager tokenization (and dynamic batching) as every other prompt.
Streaming follows sglang-facts.md §10.4: a role chunk per choice, content deltas, tool-call
deltas as the calls are generated (tool_call_stream.py: a call's id and name, then pieces of its
arguments), a finish chunk per choice, with `return_hidden_states` a chunk per choice whose delta carries the
last decode step's hidden state (SGLang's; a non-streaming choice has it as `hidden_states`), an
optional usage chunk, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Dict, List, NamedTuple, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    TopLogprob,
)
from minisgl.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    StreamedHiddenStates,
    UsageCounter,
    abort_events,
    abort_status,
    last_hidden_state,
    openai_finish_reason,
    prepend,
    response_id,
    sse_data,
)
from minisgl.chat_template import template_variables
from minisgl.constrained.reasoner_grammar import REASONING_TAGS
from minisgl.entrypoints.openai.reasoning import ReasoningSplitter, split_reasoning
from minisgl.entrypoints.openai.tool_calls import (
    StreamedText, auto_call_constraint, forced_call_stream, parse_tool_calls, tool_call_constraint, validate_tools,
    visible_tools,
)  # fmt: skip
from minisgl.entrypoints.openai.tool_parsers import NOT_JSON, TOOL_CALL_FORMATS, ToolCallFormat
from minisgl.managers.io_struct import GenerateReqInput
from minisgl.sampling.sampling_params import GRAMMAR_KEYS
from minisgl.utils import ParamError

# apply_chat_template's own parameters: chat_template_kwargs may not pass them (they are not template variables)
_APPLY_CHAT_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "messages",
})  # fmt: skip


def _template_message(m: ChatMessage) -> Dict[str, Any]:
    """A message as the chat template reads it: role and content, and name, tool_calls,
    tool_call_id and reasoning_content when given; a call's arguments as a dict (SGLang's: templates index into them)."""
    message: Dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:  # (Qwen3's template shows the latest turn's; DeepSeek-R1's drops it, by design)
        message["reasoning_content"] = m.reasoning_content
    return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except NOT_JSON:  # (RecursionError too: brackets nested ~1000 deep)
        raise ParamError(f"tool_calls[].function.arguments must be JSON text, got {text!r}", "messages") from None


def _forces_calls(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and request.tool_choice not in (None, "none", "auto")


def _offered_tools(request: ChatCompletionRequest) -> Dict[str, Dict[str, Any]]:
    """The functions offered, each one's parameters schema by name (what a tool-call format
    checks a call's name against, and qwen3_coder types its values by)."""
    return {tool.function.name: tool.function.parameters or {} for tool in request.tools or []}


def _continued(request: ChatCompletionRequest) -> str:
    """The assistant text a continue_final_message request's output goes on from ("" otherwise)."""
    return request.messages[-1].text() if request.continue_final_message else ""


def _choice_name(request: ChatCompletionRequest) -> str:
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return repr(choice or "auto")  # (unset with tools: OpenAI's default)
    return f"function {choice.function.name!r}"


class ChatDelta(NamedTuple):
    """One piece of a streamed choice before it is framed: the chat route sends each as one chunk,
    the Responses route turns each into its events (serving_responses.py)."""

    index: int  # the choice's
    delta: DeltaMessage  # what it adds: role, reasoning_content, content or one tool-call delta; {} at the finish
    logprobs: Optional[ChatChoiceLogprobs] = None  # the tokens of this piece (with logprobs requested)
    finish_reason: Optional[str] = None  # set on the choice's last delta
    matched_stop: Optional[Any] = None
    refused: Optional[Dict[str, Any]] = None  # an abort with a status (its finish_reason dict): the stream ends here


class _StreamedCalls:
    """One streamed choice's text as content: all of it, as it comes (no tools to call)."""

    def feed(self, text: str, tokens: List[ChatTokenLogprob]) -> Tuple[str, List[ChatTokenLogprob], List[DeltaToolCall]]:
        """What to send now of a chunk's text: content, its tokens' logprobs, tool-call deltas."""
        return text, tokens, []

    def finish(self, stopped: bool) -> Tuple[str, List[DeltaToolCall], bool]:
        """At the choice's end: (content still to send, tool-call deltas still to send, whether
        the answer is tool calls). `stopped`: the finish was a stop (a cut answer is no call)."""
        return "", [], False


class _ForcedCalls(_StreamedCalls):
    """A forced tool call: the JSON array streams as tool-call deltas, never as content; only the
    whole text says whether it was calls or content cut short (then sent whole, as content)."""

    def __init__(self) -> None:
        self.text: List[str] = []
        self.calls = forced_call_stream()

    def feed(self, text: str, tokens: List[ChatTokenLogprob]) -> Tuple[str, List[ChatTokenLogprob], List[DeltaToolCall]]:
        self.text.append(text)
        return "", tokens, self.calls.feed(text)

    def finish(self, stopped: bool) -> Tuple[str, List[DeltaToolCall], bool]:
        text = "".join(self.text)
        calls = parse_tool_calls(text) if stopped else None
        return ("" if calls else text), self.calls.finish(calls), bool(calls)


class _ParsedCalls(_StreamedCalls):
    """tool_choice "auto" with --tool-call-parser: the text as it comes, up to a possible call;
    the calls as they come. `single` (parallel_tool_calls false): the first call only, as
    `first_call_only` cuts the whole answer's."""

    def __init__(self, tools: Dict[str, Dict[str, Any]], fmt: ToolCallFormat, single: bool = False) -> None:
        self.splitter = StreamedText(tools, fmt)
        self.single = single

    def _kept(self, deltas: List[DeltaToolCall]) -> List[DeltaToolCall]:
        return [d for d in deltas if d.index == 0] if self.single else deltas

    def feed(self, text: str, tokens: List[ChatTokenLogprob]) -> Tuple[str, List[ChatTokenLogprob], List[DeltaToolCall]]:
        return self.splitter.feed(text), tokens, self._kept(self.splitter.tool_deltas())

    def finish(self, stopped: bool) -> Tuple[str, List[DeltaToolCall], bool]:
        if stopped:
            text, calls = self.splitter.finish()
            if calls and self.single:
                calls = calls[:1]
            return text, self._kept(self.splitter.finish_deltas(calls)), bool(calls)
        return self.splitter.unsent(), self._kept(self.splitter.finish_deltas(None)), False  # (cut short: all of it is content)


def first_call_only(request: ChatCompletionRequest, calls: Optional[List[ToolCall]]) -> Optional[List[ToolCall]]:
    """`calls` as parallel_tool_calls allows: with it false, the first call alone. A forced call's
    grammar holds it to one (maxItems 1); a parsed ("auto") answer may still write several: the
    later ones are not sent, and their markup is no content either (the content is the text
    before the first call, as always), so the answer reads as if the model had stopped there."""
    return calls[:1] if calls and request.parallel_tool_calls is False else calls


class OpenAIServingChat(OpenAIServingBase):
    def _streamed_calls(self, request: ChatCompletionRequest) -> _StreamedCalls:
        if _forces_calls(request):
            return _ForcedCalls()
        if not self._parses_calls(request):
            return _StreamedCalls()
        return _ParsedCalls(_offered_tools(request), self._call_format(), single=request.parallel_tool_calls is False)

    def _reasoning_splitter(self, request: ChatCompletionRequest) -> Optional[ReasoningSplitter]:
        """A choice's splitter of <think>...</think>, with --reasoning-parser unless the request
        says separate_reasoning: false (SGLang's)."""
        parser = self.tokenizer_manager.server_args.reasoning_parser
        return ReasoningSplitter(parser, _continued(request)) if parser is not None and request.separate_reasoning else None

    def _thinks(self, request: ChatCompletionRequest) -> bool:
        """Whether the model writes its thinking before the answer (SGLang's require_reasoning): a
        grammar then holds only after it. deepseek-r1 always; qwen3 unless enable_thinking is false."""
        parser = self.tokenizer_manager.server_args.reasoning_parser
        if parser is None:
            return False
        start, end, _ = REASONING_TAGS[parser]
        continued = _continued(request)  # (continuing an answer whose thinking ended: no more to come)
        if continued.rfind(end) > continued.rfind(start):
            return False
        if continued.rfind(start) > continued.rfind(end):
            return True
        return parser == "deepseek-r1" or (request.chat_template_kwargs or {}).get("enable_thinking") is not False

    def _split_reasoning(self, request: ChatCompletionRequest, text: str) -> Tuple[Optional[str], str]:
        """(reasoning_content or None, the answer) of a whole choice's text."""
        parser = self.tokenizer_manager.server_args.reasoning_parser
        if parser is None or not request.separate_reasoning:
            return None, text
        reasoning, answer = split_reasoning(parser, text, _continued(request))
        return reasoning or None, answer

    def _call_format(self) -> ToolCallFormat:
        """The model family's tool-call format, named by --tool-call-parser."""
        return TOOL_CALL_FORMATS[self.tokenizer_manager.server_args.tool_call_parser]

    def _parses_calls(self, request: ChatCompletionRequest) -> bool:
        """tool_choice "auto" (or unset) with tools, on a server with a --tool-call-parser."""
        return bool(request.tools) and request.tool_choice in (None, "auto") and self.tokenizer_manager.server_args.tool_call_parser is not None

    def _validate_request(self, request: ChatCompletionRequest) -> Optional[Tuple[str, Optional[str]]]:
        if not request.messages:
            return "Messages cannot be empty.", "messages"
        if request.top_logprobs and not request.logprobs:
            return "top_logprobs requires logprobs to be true.", "top_logprobs"
        if request.continue_final_message and request.messages[-1].role != "assistant":
            return "continue_final_message requires the last message to be from the assistant.", "continue_final_message"
        # name the field the user sent (max_completion_tokens wins when both are given)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_new = getattr(request, field)
        context_len = self.tokenizer_manager.context_len
        # SGLang's chat check, which holds only without auto-truncate (the gate then clamps it)
        if max_new is not None and max_new > context_len and not self.tokenizer_manager.server_args.allow_auto_truncate:
            return f"{field} is too large: {max_new}. This model supports at most {context_len} completion tokens.", field
        if self.tokenizer_manager.server_args.reasoning_parser is None and not request.stream_reasoning:
            # (it would be dropped without a word: there is no reasoning to hold back. separate_reasoning
            # true is the default, which clients that send every field send: accepted)
            return "stream_reasoning: false needs a server started with --reasoning-parser (qwen3 or deepseek-r1); or leave the field out", "stream_reasoning"
        return validate_tools(request, self.tokenizer_manager.server_args.tool_call_parser)

    def _apply_chat_template(self, request: ChatCompletionRequest) -> str:
        """Render the messages; each goes to the template whole (role, content and name, as in SGLang)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ParamError("This model's tokenizer has no chat template; start the server with --chat-template FILE, or use /v1/completions.", "messages")
        messages = [_template_message(m) for m in request.messages]
        prompt = self._render(messages, request)
        # A template that never reads `name`, or an assistant's earlier `tool_calls`, would drop
        # them without a word: refuse instead. (tool_call_id is not checked: Qwen's template, for
        # one, renders tool results in order without it.)
        # A tool message's `name` repeats the function's name (OpenAI's cookbook sends it), as
        # its tool_call_id names the call: not checked either.
        for key, what in (("name", "messages[].name"), ("tool_calls", "an assistant message's tool_calls")):
            checked = [m for m in messages if key in m and not (key == "name" and m["role"] == "tool")]
            if checked:
                without = [{k: v for k, v in m.items() if k != key} if any(m is c for c in checked) else m for m in messages]
                if self._render(without, request) == prompt:
                    raise ParamError(f"{what} is not used by this model's chat template; remove it or put it in the content.", "messages")
        return prompt

    def _template_kwargs(self, request: ChatCompletionRequest) -> Dict[str, Any]:
        """chat_template_kwargs, and reasoning_effort (SGLang passes it to the template), each checked
        to be a variable the template reads (one it never reads would be dropped without a word, as
        an unused `name` would)."""
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _APPLY_CHAT_TEMPLATE_ARGS)
        if reserved:
            raise ParamError(f"chat_template_kwargs {reserved} are arguments of apply_chat_template itself, not template variables", "chat_template_kwargs")
        read = template_variables(self.tokenizer.chat_template)
        unused = sorted(set(kwargs) - read) if read is not None else []  # (unparsed here: passed on, as SGLang does)
        if unused:
            raise ParamError(f"chat_template_kwargs {unused} are not used by this model's chat template; remove them", "chat_template_kwargs")
        if request.reasoning_effort is not None:
            if "reasoning_effort" in kwargs:
                raise ParamError("reasoning_effort is given twice (the field and chat_template_kwargs); keep one", "reasoning_effort")
            if read is not None and "reasoning_effort" not in read:
                raise ParamError(
                    "reasoning_effort is not used by this model's chat template (a template variable, read by "
                    "reasoning models' templates such as gpt-oss's); remove it",
                    "reasoning_effort",
                )
            kwargs["reasoning_effort"] = request.reasoning_effort
        return kwargs

    def _render(self, messages: List[Dict[str, Any]], request: ChatCompletionRequest) -> str:
        kwargs = self._template_kwargs(request)
        if request.tools and request.tool_choice != "none":  # (SGLang's rule: "none" hides them)
            # a template that does not read them (the built-in model's) shows the model nothing of
            # the tools; a forced call is still shaped by its schema (tool_calls.py)
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in visible_tools(request)]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # jinja2.TemplateError and friends: the messages do not fit the template
            raise ParamError(f"Cannot apply the chat template to these messages: {e}", "messages") from e

    def route_param(self, param: Optional[str], request: ChatCompletionRequest) -> Optional[str]:
        """An engine error's field (/generate's name) by chat's: the prompt is the messages, the
        output budget the field the client sent, a grammar where it came from (response_format, or
        the tools whose calls it holds); chat's own names (a conversion's ParamError) pass as they are."""
        if param in ("text", "input_ids"):
            return "messages"
        if param in ("max_new_tokens", "min_new_tokens"):
            return {"max_new_tokens": "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
                    "min_new_tokens": "min_tokens"}[param]  # fmt: skip
        named = super().route_param(param, request)  # (response_format's grammar; chat's own names pass as they are)
        if param in GRAMMAR_KEYS and getattr(request, param, None) is None and named != "response_format":
            return "tools"  # (neither chat's own field of that name nor response_format's: a tool call's schema)
        return named

    def _convert_to_internal_request(self, request: ChatCompletionRequest) -> GenerateReqInput:
        return self.to_generate_request(request)

    def to_generate_request(self, request: ChatCompletionRequest) -> GenerateReqInput:
        """The GenerateReqInput that runs a checked chat request (`precheck` passed): its prompt from the
        chat template, its sampling params, a tool call's grammar (the Responses route runs its
        translated requests through it too). ValueError for what only this step finds."""
        sampling_params = request.to_sampling_params(self.tokenizer_manager.default_sampling_params)
        # a forced call's JSON array, or the structural tag that holds "auto" calls of strict tools
        key, constraint = "json_schema", tool_call_constraint(request)
        if constraint is None and self._parses_calls(request):
            key, constraint = "structural_tag", auto_call_constraint(request, self._call_format())
        if constraint is not None:
            # the fields the user set that constrain the output too (response_format becomes json_schema)
            other = sorted(k for k in ("json_schema", "regex", "ebnf") if getattr(request, k) is not None)
            if request.response_format is not None and request.response_format.grammar():
                other.append("response_format")
            if other:  # (SGLang 0.5.23 refuses it too: the call's schema and another grammar cannot both hold)
                what = "a tool call" if key == "json_schema" else "strict tools' calls"
                raise ParamError(f"tool_choice {_choice_name(request)} constrains the output to {what}; drop {', '.join(other)}", "tool_choice")
            sampling_params[key] = constraint
        if self._parses_calls(request):
            sampling_params["skip_special_tokens"] = False  # (SGLang's: a format's markers may be special tokens)
        # (add_special_tokens False: the template writes the BOS itself where the model wants one)
        return self._generate_input(request, self._apply_chat_template(request), sampling_params, False, self._thinks(request))

    def to_raw_generate_request(self, request: ChatCompletionRequest, prompt: str) -> GenerateReqInput:
        """The GenerateReqInput that runs `prompt` as it is (no chat template: Ollama's raw
        /api/generate) with a checked chat request's every other field: sampling, grammar
        (response_format), logprobs, LoRA adapter, priority, logit processor, cache namespace.
        The prompt is tokenized as /v1/completions tokenizes one (special tokens added), and no
        template said whether the model thinks first, so a grammar holds from the first token."""
        sampling_params = request.to_sampling_params(self.tokenizer_manager.default_sampling_params)
        return self._generate_input(request, prompt, sampling_params, True, False)

    def _generate_input(self, request: ChatCompletionRequest, text: str, sampling_params: Dict[str, Any], add_special_tokens: bool,
                        require_reasoning: bool) -> GenerateReqInput:  # fmt: skip
        """The one place a chat request's fields become a GenerateReqInput's (so a route that builds
        its prompt another way cannot drop one)."""
        return GenerateReqInput(
            text=text,
            add_special_tokens=add_special_tokens,
            sampling_params=sampling_params,
            rid=request.rid,
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
            stream=request.stream,
            priority=request.priority,
            custom_logit_processor=request.custom_logit_processor,
            require_reasoning=require_reasoning,
            return_hidden_states=request.return_hidden_states,
            lora_path=self._lora_path(request),
            extra_key=self._extra_key(request),
        )

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, meta_info: Dict[str, Any], request: ChatCompletionRequest) -> Optional[ChatChoiceLogprobs]:
        if not request.logprobs:
            return None
        tops = meta_info.get("output_top_logprobs") or []
        content: List[ChatTokenLogprob] = []
        for k, (logprob, token_id, _) in enumerate(meta_info.get("output_token_logprobs") or []):
            token = self.token_str(token_id)
            top = tops[k] if k < len(tops) and request.top_logprobs else []
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=logprob,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(token=self.token_str(tid), logprob=lp, bytes=list(self.token_str(tid).encode("utf-8")))
                        for lp, tid, _ in top
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------------ non-streaming
    async def _handle_non_streaming_request(self, adapted: GenerateReqInput, request: ChatCompletionRequest, raw_request: Request) -> Response:
        response = self.chat_response(await self._collect(adapted, raw_request), request)
        return JSONResponse(response.model_dump(exclude_none=False))

    def chat_response(self, outs: List[Dict[str, Any]], request: ChatCompletionRequest) -> ChatCompletionResponse:
        """The final outputs of a request as its chat.completion (what the Responses route translates too)."""
        usage = UsageCounter(request.n)
        choices = []
        for out in outs:
            index = out.get("index", 0)
            meta = out["meta_info"]
            usage.update(index, meta)
            finish_reason, matched = openai_finish_reason(meta["finish_reason"])
            reasoning, answer = self._split_reasoning(request, out["text"])
            # (an answer cut short, by max_tokens or a stop string, is no call: it stays content)
            content, calls = answer, None
            if finish_reason == "stop" and _forces_calls(request):
                calls = parse_tool_calls(answer)
                content = None if calls else answer
            elif self._parses_calls(request):  # (the format's special tokens are never content)
                fmt = self._call_format()
                content, calls = fmt.parse(answer, _offered_tools(request)) if finish_reason == "stop" else (fmt.content(answer), None)
                calls = first_call_only(request, calls)
            # (every call dropped, as undefined: the text before them, as a stream sends it)
            message = ChatCompletionMessage(content=content, reasoning_content=reasoning)
            if calls:  # SGLang's: finish_reason tool_calls, matched_stop dropped
                message = ChatCompletionMessage(content=content or None, reasoning_content=reasoning, tool_calls=calls)
                finish_reason, matched = "tool_calls", None
            choices.append(
                ChatCompletionResponseChoice(
                    index=index,
                    message=message,
                    logprobs=self._logprobs(meta, request),
                    finish_reason=finish_reason,
                    matched_stop=matched,
                    hidden_states=last_hidden_state(meta, request),
                )
            )
        return ChatCompletionResponse(id=response_id(outs[0], request.n), model=request.model, choices=choices, usage=usage.usage(),
                                      metadata={"weight_version": outs[0]["meta_info"]["weight_version"]})  # fmt: skip

    # ------------------------------------------------------------------ streaming
    async def _stream_events(
        self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], adapted: GenerateReqInput, request: ChatCompletionRequest
    ) -> AsyncIterator[str]:
        """The chat route's SSE writer: one chunk per ChatDelta, then hidden states, usage, [DONE]."""
        rid = response_id(first, request.n)
        created = int(time.time())  # one timestamp for every chunk of the stream, as OpenAI's
        usage = UsageCounter(request.n)
        hidden_states = StreamedHiddenStates()
        continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats

        async for d in self.stream_deltas(first, rest, request, usage, hidden_states):
            if d.refused is not None:  # (a refused request: the error event, then [DONE])
                for event in abort_events(d.refused, self.route_param(d.refused.get("param"), request)):
                    yield event
                return
            choice = ChatCompletionResponseStreamChoice(
                index=d.index, delta=d.delta, logprobs=d.logprobs, finish_reason=d.finish_reason, matched_stop=d.matched_stop
            )
            so_far = usage.choice_usage(d.index) if continuous else None
            yield sse_data(ChatCompletionStreamResponse(id=rid, created=created, model=request.model, choices=[choice], usage=so_far))
        if request.return_hidden_states:  # (SGLang's: after every finish chunk, before the usage)
            for index, last in hidden_states.final():
                choice = ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(hidden_states=last))
                yield sse_data(ChatCompletionStreamResponse(id=rid, created=created, model=request.model, choices=[choice]))
        if request.stream_options is not None and request.stream_options.include_usage:
            body = ChatCompletionStreamResponse(id=rid, created=created, model=request.model, choices=[], usage=usage.usage())
            yield sse_data(body)
        yield sse_data("[DONE]")

    async def stream_deltas(
        self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], request: ChatCompletionRequest,
        usage: UsageCounter, hidden_states: StreamedHiddenStates,
    ) -> AsyncIterator[ChatDelta]:  # fmt: skip
        """A stream's output dicts as ChatDeltas, in the order they are to be sent: per choice a role
        delta, reasoning deltas, content deltas (with their tokens' logprobs), tool-call deltas, a
        finish delta; or a refused one (an abort with a status) that ends it. `usage` and
        `hidden_states` are kept up to date as each output arrives, before its deltas: a writer
        that reads them while it renders a delta sees the counts so far."""
        role_sent: set = set()
        calls_of: Dict[int, _StreamedCalls] = {}  # per choice: its text, held back where it may be a call
        thinking_of: Dict[int, Optional[ReasoningSplitter]] = {}  # per choice: its reasoning, apart
        # stream_reasoning false: per choice, the reasoning (and its tokens' logprobs) not sent yet
        thought: Dict[int, Tuple[str, List[ChatTokenLogprob]]] = {}

        def reasoning_delta(index: int, reasoning: str, tokens: List[ChatTokenLogprob], done: bool) -> Optional[ChatDelta]:
            """The delta that sends `reasoning` now, or None while stream_reasoning false holds it."""
            if not request.stream_reasoning:
                held, held_tokens = thought.get(index, ("", []))
                reasoning, tokens = held + reasoning, held_tokens + tokens
                if not done:
                    thought[index] = (reasoning, tokens)
                    return None
                thought.pop(index, None)
            if not reasoning and not tokens:
                return None
            # (held tokens of no reasoning at all, e.g. blanks before an answer that does not think,
            # go out in their order as an empty content delta, as a stream sends such tokens anyway)
            delta = DeltaMessage(reasoning_content=reasoning) if reasoning else DeltaMessage(content="")
            return ChatDelta(index, delta, logprobs=ChatChoiceLogprobs(content=tokens) if tokens else None)

        async for out in prepend(first, rest):
            index = out.get("index", 0)
            meta = out["meta_info"]
            usage.update(index, meta)
            hidden_states.update(index, meta)
            reason = meta["finish_reason"]
            if index not in role_sent and abort_status(reason) is None:  # (a refused request: the error event alone, as SGLang)
                role_sent.add(index)
                yield ChatDelta(index, DeltaMessage(role="assistant", content=""))
            logprobs = self._logprobs(meta, request)
            calls = calls_of.setdefault(index, self._streamed_calls(request))
            thinking = thinking_of.setdefault(index, self._reasoning_splitter(request))
            tokens_in = logprobs.content if logprobs is not None else []
            answer = out["text"]
            if thinking is not None:
                thinking_before = thinking.mode in ("opening", "reasoning")
                reasoning, answer = thinking.feed(answer)
                ended = thinking.mode in ("closing", "content")
                # a chunk's tokens go with its reasoning unless some of its text is the answer; held
                # back (stream_reasoning false), so do those of text the splitter holds (blanks, a
                # piece of a tag): sent now, they would overtake the reasoning's
                with_reasoning = not answer and (bool(reasoning) or (not request.stream_reasoning and thinking_before))
                sent = reasoning_delta(index, reasoning, tokens_in if with_reasoning else [], done=ended)
                if sent is not None:
                    yield sent
                tokens_in = [] if with_reasoning else tokens_in
            text, tokens, deltas = calls.feed(answer, tokens_in)
            if text or tokens:
                yield ChatDelta(index, DeltaMessage(content=text), logprobs=ChatChoiceLogprobs(content=tokens) if logprobs else None)
            for delta in deltas:  # (one a chunk: the openai SDK merges a chunk's tool_calls by index)
                yield ChatDelta(index, DeltaMessage(tool_calls=[delta]))
            if reason is None:
                continue
            if abort_status(reason) is not None:
                yield ChatDelta(index, DeltaMessage(), refused=reason)
                return
            finish_reason, matched = openai_finish_reason(reason)
            thinking = thinking_of.pop(index)
            if thinking is not None:  # what it held: the end of the reasoning, or of an answer's first blanks
                reasoning, answer = thinking.finish()
                sent = reasoning_delta(index, reasoning, [], done=True)
                if sent is not None:
                    yield sent
                text, _, deltas = calls_of[index].feed(answer, [])
                if text:
                    yield ChatDelta(index, DeltaMessage(content=text))
                for delta in deltas:
                    yield ChatDelta(index, DeltaMessage(tool_calls=[delta]))
            text, deltas, called = calls_of.pop(index).finish(stopped=finish_reason == "stop")
            if text:
                yield ChatDelta(index, DeltaMessage(content=text))
            for delta in deltas:  # (what the calls still owe: the end of the last one's arguments, ...)
                yield ChatDelta(index, DeltaMessage(tool_calls=[delta]))
            if called:
                finish_reason, matched = "tool_calls", None  # (SGLang's)
            yield ChatDelta(index, DeltaMessage(), finish_reason=finish_reason, matched_stop=matched)
