"""OpenAIServingCompletions (stage 1). In: CompletionRequest. Out: text_completion (chunks).

A prompt is a string, a list of strings, a list of token ids or a list of lists of ids;
lists become a batch GenerateReqInput (one choice per prompt and sample, index = i * n + j).
`echo` prepends the prompt text; `logprobs=k` returns OpenAI's legacy logprobs shape, and
with `echo` the prompt's tokens come first in it (their logprobs computed from position 0, the
first one null: nothing comes before it), as OpenAI's and SGLang's do. That is the request
lm-eval-harness scores a continuation with (`max_tokens: 1`, `echo`, `logprobs: 1`; it sums
`token_logprobs[ctxlen:-1]`). `text_offset` counts characters of the decoded text
(`text_offsets`), not token_str lengths. `return_hidden_states` (SGLang's) puts the last decode
step's hidden state in each choice's `hidden_states`; a stream sends it in one chunk per choice
after the others (serving_base.last_hidden_state / StreamedHiddenStates).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.protocol import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from minisgl.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    StreamedHiddenStates,
    UsageCounter,
    abort_events,
    last_hidden_state,
    openai_finish_reason,
    prepend,
    response_id,
    sse_data,
)
from minisgl.managers.io_struct import GenerateReqInput


class OpenAIServingCompletions(OpenAIServingBase):
    def _validate_request(self, request: CompletionRequest) -> Optional[Tuple[str, Optional[str]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return None if prompt else ("The prompt cannot be empty.", "prompt")
        if len(prompt) == 0:
            return "The prompt cannot be an empty list.", "prompt"
        if isinstance(prompt[0], list) and any(len(p) == 0 for p in prompt):
            return "A token-id prompt cannot be empty.", "prompt"
        return None

    def _convert_to_internal_request(self, request: CompletionRequest) -> GenerateReqInput:
        prompt = request.prompt
        is_ids = isinstance(prompt, list) and isinstance(prompt[0], (int, list))
        return GenerateReqInput(
            text=None if is_ids else prompt,
            input_ids=prompt if is_ids else None,
            sampling_params=request.to_sampling_params(),
            rid=request.rid,
            return_logprob=request.logprobs is not None,
            logprob_start_len=0 if request.echo and request.logprobs is not None else -1,
            top_logprobs_num=request.logprobs or 0,
            stream=request.stream,
            priority=request.priority,
            custom_logit_processor=request.custom_logit_processor,
            return_hidden_states=request.return_hidden_states,
            lora_path=self._lora_path(request),
            extra_key=self._extra_key(request),
        )

    def _prompt_text(self, request: CompletionRequest, index: int) -> str:
        """The text of the prompt behind choice `index` (for echo); a token-id prompt decoded
        without its special tokens (a BOS), as SGLang's _get_echo_text."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return prompt
        item = prompt[index // request.n] if isinstance(prompt[0], (str, list)) else prompt
        return item if isinstance(item, str) else self.tokenizer.decode(item, skip_special_tokens=True)

    def _logprobs(
        self, meta_info: Dict[str, Any], request: CompletionRequest, echoed: str, text: str, text_start: int
    ) -> Optional[CompletionLogprobs]:
        """OpenAI's legacy logprobs of this message's output tokens, whose `text` begins at
        character `text_start` of the choice's text; with echo, the prompt's tokens first (in the
        message that carries them: the first of a stream), over the `echoed` text from 0."""
        if request.logprobs is None:
            return None
        result = CompletionLogprobs()
        if request.echo:
            prompt = (meta_info.get("input_token_logprobs") or [], meta_info.get("input_top_logprobs") or [])
            self._add_logprobs(result, request, *prompt, echoed, 0, continues=False)
        output = (meta_info.get("output_token_logprobs") or [], meta_info.get("output_top_logprobs") or [])
        self._add_logprobs(result, request, *output, text, text_start, continues=True)
        return result

    def _add_logprobs(
        self, result: CompletionLogprobs, request: CompletionRequest, token_logprobs: List[Any], top_logprobs: List[Any],
        text: str, text_start: int, continues: bool,
    ) -> None:  # fmt: skip
        ids = [token_id for _, token_id, _ in token_logprobs]
        result.text_offset.extend(self.text_offsets(ids, text, text_start, continues))
        for k, (logprob, token_id, _) in enumerate(token_logprobs):
            result.tokens.append(self.token_str(token_id))
            result.token_logprobs.append(logprob)
            top = top_logprobs[k] if k < len(top_logprobs) else None  # None: the prompt's first token
            result.top_logprobs.append(self._top_dict(top) if request.logprobs and top else None)

    def _top_dict(self, top: List[Any]) -> Dict[str, float]:
        """OpenAI's {token: logprob}: two ids that print alike (byte tokens, each U+FFFD) share a
        key, which keeps the likelier (the list is best first; a dict comprehension kept the last)."""
        out: Dict[str, float] = {}
        for logprob, token_id, _ in top:
            out.setdefault(self.token_str(token_id), logprob)
        return out

    async def _handle_non_streaming_request(self, adapted: GenerateReqInput, request: CompletionRequest, raw_request: Request) -> Response:
        outs = await self._collect(adapted, raw_request)
        usage = UsageCounter(request.n)
        choices: List[CompletionResponseChoice] = []
        for out in outs:
            index = out.get("index", 0)
            meta = out["meta_info"]
            usage.update(index, meta)
            prefix = self._prompt_text(request, index) if request.echo else ""
            finish_reason, matched = openai_finish_reason(meta["finish_reason"])
            choices.append(
                CompletionResponseChoice(
                    index=index,
                    text=prefix + out["text"],
                    logprobs=self._logprobs(meta, request, prefix, out["text"], len(prefix)),
                    finish_reason=finish_reason,
                    matched_stop=matched,
                    hidden_states=last_hidden_state(meta, request),
                )
            )
        response = CompletionResponse(id=response_id(outs[0], request.n), model=request.model, choices=choices, usage=usage.usage(),
                                      metadata={"weight_version": outs[0]["meta_info"]["weight_version"]})  # fmt: skip
        return JSONResponse(response.model_dump())

    async def _stream_events(
        self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], adapted: GenerateReqInput, request: CompletionRequest
    ) -> AsyncIterator[str]:
        rid = response_id(first, request.n)
        created = int(time.time())  # one timestamp for every chunk of the stream, as OpenAI's
        usage = UsageCounter(request.n)
        text_offsets: Dict[int, int] = {}
        hidden_states = StreamedHiddenStates()
        continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats

        def chunk(choice: CompletionResponseChoice) -> str:
            so_far = usage.choice_usage(choice.index) if continuous else None
            return sse_data(CompletionStreamResponse(id=rid, created=created, model=request.model, choices=[choice], usage=so_far))

        async for out in prepend(first, rest):
            index = out.get("index", 0)
            meta = out["meta_info"]
            usage.update(index, meta)
            hidden_states.update(index, meta)
            echoed = ""
            if index not in text_offsets:  # the choice's first chunk: the echoed prompt comes first
                echoed = self._prompt_text(request, index) if request.echo else ""
                text_offsets[index] = len(echoed)
            text = echoed + out["text"]
            reason = meta["finish_reason"]
            refused = abort_events(reason, self.route_param(reason.get("param"), request) if isinstance(reason, dict) else None)
            if refused:
                for event in refused:
                    yield event
                return
            finish_reason, matched = openai_finish_reason(reason)
            logprobs = self._logprobs(meta, request, echoed, out["text"], text_offsets[index])
            text_offsets[index] += len(out["text"])
            if text or finish_reason is not None or (logprobs is not None and logprobs.tokens):
                yield chunk(CompletionResponseChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, matched_stop=matched))
        if request.return_hidden_states:  # (SGLang's: after every choice finished, before the usage)
            for index, last in hidden_states.final():
                choice = CompletionResponseChoice(index=index, text="", hidden_states=last)
                yield sse_data(CompletionStreamResponse(id=rid, created=created, model=request.model, choices=[choice]))
        if request.stream_options is not None and request.stream_options.include_usage:
            body = CompletionStreamResponse(id=rid, created=created, model=request.model, choices=[], usage=usage.usage())
            yield sse_data(body)
        yield sse_data("[DONE]")
