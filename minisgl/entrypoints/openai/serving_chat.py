"""OpenAIServingChat (stage 1, seed 000). In: ChatCompletionRequest. Out: chat.completion(.chunk).

`_convert_to_internal_request` renders the messages with the tokenizer's chat template
and builds a `GenerateReqInput` (text + `to_sampling_params`), which no longer knows it
came from a chat request. The rendered prompt travels as text so that it goes through
the same TokenizerManager tokenization (and dynamic batching) as every other prompt.
Streaming follows sglang-facts.md §10.4: a role chunk per choice, content deltas, a
finish chunk per choice, an optional usage chunk, then `data: [DONE]`.
"""

from __future__ import annotations

import functools
import time
from typing import Any, AsyncIterator, Dict, FrozenSet, List, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import meta

from minisgl.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from minisgl.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    UsageCounter,
    abort_status,
    error_body,
    openai_finish_reason,
    prepend,
    response_id,
    sse_data,
)
from minisgl.managers.io_struct import GenerateReqInput

# apply_chat_template's own parameters: chat_template_kwargs may not pass them (they are not template variables)
_APPLY_CHAT_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "messages",
})  # fmt: skip


def template_variables(template: Any) -> Optional[FrozenSet[str]]:
    """The variables a Jinja chat template reads from its context (the names chat_template_kwargs
    may set), or None when this Jinja cannot parse it (an extension transformers adds)."""
    if isinstance(template, dict):  # named templates: the default one renders chat
        template = template.get("default")
    return _variables_read_by(template) if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)
def _variables_read_by(source: str) -> Optional[FrozenSet[str]]:
    # transformers renders with loopcontrols ({% break %}) and its {% generation %} block
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    try:  # (find_undeclared_variables compiles too: an unknown filter fails there)
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:  # the render says what is wrong, as a 400
        return None


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens), for
    parsing only: the block renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class OpenAIServingChat(OpenAIServingBase):
    def _validate_request(self, request: ChatCompletionRequest) -> Optional[str]:
        if not request.messages:
            return "Messages cannot be empty."
        if request.top_logprobs and not request.logprobs:
            return "top_logprobs requires logprobs to be true."
        if request.continue_final_message and request.messages[-1].role != "assistant":
            return "continue_final_message requires the last message to be from the assistant."
        # name the field the user sent (max_completion_tokens wins when both are given)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_new = getattr(request, field)
        context_len = self.tokenizer_manager.context_len
        # SGLang's chat check, which holds only without auto-truncate (the gate then clamps it)
        if max_new is not None and max_new > context_len and not self.tokenizer_manager.server_args.allow_auto_truncate:
            return f"{field} is too large: {max_new}. This model supports at most {context_len} completion tokens."
        return None

    def _apply_chat_template(self, request: ChatCompletionRequest) -> str:
        """Render the messages; each goes to the template whole (role, content and name, as in SGLang)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; use /v1/completions instead.")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        for message, m in zip(messages, request.messages):
            if m.name is not None:
                message["name"] = m.name
        prompt = self._render(messages, request)
        if any(m.name is not None for m in request.messages):
            # A template that never reads `name` would drop it without a word: refuse instead.
            if self._render([{"role": m["role"], "content": m["content"]} for m in messages], request) == prompt:
                raise ValueError("messages[].name is not used by this model's chat template; remove it or put it in the content.")
        return prompt

    def _template_kwargs(self, request: ChatCompletionRequest) -> Dict[str, Any]:
        """chat_template_kwargs, each checked to be a variable the template reads (one it never
        reads would be dropped without a word, as an unused `name` would)."""
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _APPLY_CHAT_TEMPLATE_ARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs {reserved} are arguments of apply_chat_template itself, not template variables")
        read = template_variables(self.tokenizer.chat_template)
        unused = sorted(set(kwargs) - read) if read is not None else []  # (unparsed here: passed on, as SGLang does)
        if unused:
            raise ValueError(f"chat_template_kwargs {unused} are not used by this model's chat template; remove them")
        return kwargs

    def _render(self, messages: List[Dict[str, str]], request: ChatCompletionRequest) -> str:
        kwargs = self._template_kwargs(request)
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # jinja2.TemplateError and friends: the messages do not fit the template
            raise ValueError(f"Cannot apply the chat template to these messages: {e}") from e

    def _convert_to_internal_request(self, request: ChatCompletionRequest) -> GenerateReqInput:
        return GenerateReqInput(
            text=self._apply_chat_template(request),
            add_special_tokens=False,  # the template writes the BOS itself where the model wants one
            sampling_params=request.to_sampling_params(self.tokenizer_manager.default_sampling_params),
            rid=request.rid,
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
            stream=request.stream,
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
        outs = await self._collect(adapted, raw_request)
        usage = UsageCounter(request.n)
        choices = []
        for out in outs:
            index = out.get("index", 0)
            meta = out["meta_info"]
            usage.update(index, meta)
            finish_reason, matched = openai_finish_reason(meta["finish_reason"])
            choices.append(
                ChatCompletionResponseChoice(
                    index=index,
                    message=ChatCompletionMessage(content=out["text"]),
                    logprobs=self._logprobs(meta, request),
                    finish_reason=finish_reason,
                    matched_stop=matched,
                )
            )
        response = ChatCompletionResponse(id=response_id(outs[0], request.n), model=request.model, choices=choices, usage=usage.usage())
        return JSONResponse(response.model_dump(exclude_none=False))

    # ------------------------------------------------------------------ streaming
    async def _stream_events(
        self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], adapted: GenerateReqInput, request: ChatCompletionRequest
    ) -> AsyncIterator[str]:
        rid = response_id(first, request.n)
        created = int(time.time())  # one timestamp for every chunk of the stream, as OpenAI's
        usage = UsageCounter(request.n)
        role_sent: set = set()

        def chunk(index: int, delta: DeltaMessage, **kw: Any) -> str:
            choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, **kw)
            body = ChatCompletionStreamResponse(id=rid, created=created, model=request.model, choices=[choice])
            return sse_data(body)

        async for out in prepend(first, rest):
            index = out.get("index", 0)
            meta = out["meta_info"]
            usage.update(index, meta)
            if index not in role_sent:
                role_sent.add(index)
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            logprobs = self._logprobs(meta, request)
            if out["text"] or (logprobs is not None and logprobs.content):
                yield chunk(index, DeltaMessage(content=out["text"]), logprobs=logprobs)
            reason = meta["finish_reason"]
            if reason is not None:
                status = abort_status(reason)
                if status is not None:
                    yield sse_data(error_body(reason.get("message") or "Aborted", status))
                    yield sse_data("[DONE]")
                    return
                finish_reason, matched = openai_finish_reason(reason)
                yield chunk(index, DeltaMessage(), finish_reason=finish_reason, matched_stop=matched)
        if request.stream_options is not None and request.stream_options.include_usage:
            body = ChatCompletionStreamResponse(id=rid, created=created, model=request.model, choices=[], usage=usage.usage())
            yield sse_data(body)
        yield sse_data("[DONE]")
