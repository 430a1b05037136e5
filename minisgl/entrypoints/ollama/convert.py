"""Ollama <-> chat translation (stage 1, the Ollama API). In: a checked OllamaChatRequest or
OllamaGenerateRequest. Out: the ChatCompletionRequest the chat path runs; and back, the chat
answer's pieces in Ollama's words (tool calls with object arguments, logprobs, done_reason).

The Ollama API is a translation layer over the chat path, as the Anthropic one is: `messages`
become chat messages (an assistant's `thinking` its reasoning_content, its `tool_calls` chat's
with JSON-text arguments, a tool message chat's tool message answering the call it names or the
next unanswered one), /api/generate's `system` + `prompt` a system and a user message, `options`
chat's sampling fields (OPTIONS, below: each option is mapped, taken because it changes nothing,
or refused by name), `format` chat's response_format, `tools` chat's function tools, `think`
the chat template's enable_thinking (and reasoning_effort for a level). Everything the chat path
checks (the template, the tools, a grammar) it checks here too.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from pydantic import ValidationError

from minisgl.entrypoints.ollama.protocol import BadOllamaRequest, OllamaGenerateRequest, OllamaMessage, _OllamaRequest
from minisgl.entrypoints.openai.protocol import ChatChoiceLogprobs, ChatCompletionRequest, Tool, ToolCall, validation_message

logger = logging.getLogger("minisgl.ollama")

# --------------------------------------------------------------------------- options
# Ollama's runner settings (api/types.go Runner, and the Python client's older load-time
# options): they say how Ollama loads a model, which minisgl decides once, by server flags
_RUNNER_OPTIONS = frozenset({
    "num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "numa", "low_vram", "f16_kv",
    "vocab_only", "logits_all", "embedding_only", "draft_num_predict",
})  # fmt: skip
# chat field -> the option it came from (what a chat validation error is said about)
_OPTION_OF = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
              "stop": "stop", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}  # fmt: skip


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadOllamaRequest(f"option {name!r} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    # (Ollama takes 3.0 for an integer option: JSON has one number type)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadOllamaRequest(f"option {name!r} must be of type integer, got {value!r}")
    return value


def _only(name: str, allowed: Any, why: str) -> Callable[[Any, int], Dict[str, Any]]:
    """An option taken only at the value that asks for what minisgl does anyway."""

    def check(value: Any, context_len: int) -> Dict[str, Any]:
        if value != allowed:
            raise BadOllamaRequest(f"option {name!r} {value!r} cannot be honoured: {why}; leave it out (or send {json.dumps(allowed)})")
        return {}

    return check


def _num_predict(value: Any, context_len: int) -> Dict[str, Any]:
    n = _integer("num_predict", value)
    # (-1 "until a stop", -2 "fill the context", and 0, which Ollama reads as unset, so no limit
    # (llm/llama_server.go, boundedNumPredict): the scheduler stops at the context)
    if n in (0, -1, -2):
        return {"max_tokens": None}
    if n < 0:
        raise BadOllamaRequest(f"option 'num_predict' must be >= 0 (0: no limit), or -1 (no limit) or -2 (fill the context), got {n}")
    return {"max_tokens": n}


def _top_k(value: Any, context_len: int) -> Dict[str, Any]:
    k = _integer("top_k", value)
    return {"top_k": k if k > 0 else -1}  # (llama.cpp's: top_k <= 0 samples from every token)


def _seed(value: Any, context_len: int) -> Dict[str, Any]:
    n = _integer("seed", value)
    if n == -1:  # (Ollama's default: a random seed each request, which is what no seed is)
        return {}
    if n < -1:
        raise BadOllamaRequest(f"option 'seed' must be >= 0, or -1 (a random seed), got {n}")
    return {"seed": n}


def _num_ctx(value: Any, context_len: int) -> Dict[str, Any]:
    num_ctx(value, context_len)
    return {}  # (checked against the prompt once its tokens are counted: serving.py)


def num_ctx(value: Any, context_len: int) -> Optional[int]:
    """The prompt's limit that option num_ctx sets: None when it is not given or not below the
    model's context. Larger than the context, it is clamped to it, as Ollama clamps it (with a
    warning in the log: minisgl cannot extend a context). Below, Ollama would cut a longer prompt
    (keeping num_keep tokens); minisgl does not cut, so the route refuses a longer prompt
    (a 400 naming num_ctx) and leaves a shorter one alone: the answer may run past num_ctx."""
    if value is None:
        return None
    n = _integer("num_ctx", value)
    if n <= 0:
        raise BadOllamaRequest(f"option 'num_ctx' must be a positive number of tokens, got {n}")
    if n > context_len:
        logger.warning("option num_ctx %d is larger than the model's context (%d tokens): clamped to it", n, context_len)
        return None
    return n if n < context_len else None


def _num_keep(value: Any, context_len: int) -> Dict[str, Any]:
    _integer("num_keep", value)
    return {}  # (what a context shift keeps: minisgl never shifts)


def _stop(value: Any, context_len: int) -> Dict[str, Any]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadOllamaRequest(f"option 'stop' must be a list of strings, got {value!r}")
    return {"stop": value} if value else {}


def _mapped(name: str, field: str, kind: Callable[[str, Any], Any]) -> Callable[[Any, int], Dict[str, Any]]:
    return lambda value, context_len: {field: kind(name, value)}


def _mirostat_param(name: str) -> Callable[[Any, int], Dict[str, Any]]:
    def check(value: Any, context_len: int) -> Dict[str, Any]:
        _number(name, value)
        return {}  # (a mirostat setting: it shapes nothing while mirostat is 0, the only mode minisgl takes)

    return check


_WINDOWLESS = "minisgl's penalties count every generated token (SGLang's), with no window of the last N"
# option -> its check, which returns the chat fields it sets ({} for an option taken as it changes nothing)
OPTIONS: Dict[str, Callable[[Any, int], Dict[str, Any]]] = {
    "temperature": _mapped("temperature", "temperature", _number),
    "top_p": _mapped("top_p", "top_p", _number),
    "top_k": _top_k,
    "min_p": _mapped("min_p", "min_p", _number),
    "seed": _seed,
    "num_predict": _num_predict,
    "stop": _stop,
    "repeat_penalty": _mapped("repeat_penalty", "repetition_penalty", _number),
    "presence_penalty": _mapped("presence_penalty", "presence_penalty", _number),
    "frequency_penalty": _mapped("frequency_penalty", "frequency_penalty", _number),
    "num_ctx": _num_ctx,
    "num_keep": _num_keep,
    "repeat_last_n": _only("repeat_last_n", 0, _WINDOWLESS + " (0, which switches the penalties off, is taken)"),
    "typical_p": _only("typical_p", 1.0, "locally typical sampling is not built"),
    "tfs_z": _only("tfs_z", 1.0, "tail-free sampling is not built"),
    "mirostat": _only("mirostat", 0, "mirostat sampling is not built"),
    "mirostat_tau": _mirostat_param("mirostat_tau"),
    "mirostat_eta": _mirostat_param("mirostat_eta"),
    "penalize_newline": _only("penalize_newline", False, "newlines are penalised like any token (the option is gone from Ollama too)"),
}


def options_fields(options: Optional[Dict[str, Any]], context_len: int) -> Dict[str, Any]:
    """`options` as chat's sampling fields; BadOllamaRequest naming the first option that cannot be honoured."""
    fields: Dict[str, Any] = {}
    for name, value in (options or {}).items():
        if value is None:  # (Ollama skips a null option: it asks for the default)
            continue
        if name in _RUNNER_OPTIONS:
            raise BadOllamaRequest(f"option {name!r} is a setting of Ollama's model runner, which minisgl decides once at start-up "
                                   "(minisgl serve --device, --tp-size, ...); leave it out")  # fmt: skip
        check = OPTIONS.get(name)
        if check is None:
            raise BadOllamaRequest(f"option {name!r} is not an option minisgl knows; the options it takes: {', '.join(OPTIONS)}")
        fields.update(check(value, context_len))
    if (options or {}).get("repeat_last_n") == 0:
        fields.update(_penalties_off(fields))
    return fields


# the penalties' fields at the value that penalises nothing
_NO_PENALTY = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _penalties_off(fields: Dict[str, Any]) -> Dict[str, Any]:
    """repeat_last_n 0: llama.cpp's window of no tokens, so no penalty applies. Every penalty set
    to its neutral value (the model's generation_config may set one); one the request sets too is
    a contradiction, refused by name."""
    for field, neutral in _NO_PENALTY.items():
        if fields.get(field, neutral) != neutral:
            raise BadOllamaRequest(f"option 'repeat_last_n' 0 switches the penalties off, but option {_OPTION_OF[field]!r} is "
                                   f"{fields[field]}; leave one of them out")  # fmt: skip
    return dict(_NO_PENALTY)


# --------------------------------------------------------------------------- keep_alive, format, think
_DURATION = re.compile(r"^-?(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))+$|^-?\d+(\.\d*)?$")


def keep_alive_seconds(value: Any) -> Optional[float]:
    """keep_alive as seconds (Ollama's: a number of seconds or a Go duration, "5m", "1h30m", "-1");
    None when not given. BadOllamaRequest for text that is no duration."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    if not _DURATION.match(text):
        raise BadOllamaRequest(f"keep_alive {value!r} is not a duration (send seconds, or a duration such as \"5m\", \"1h\", \"-1\")")
    sign = -1.0 if text.startswith("-") else 1.0
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)?", text.lstrip("-"))
    return sign * sum(float(n) * units[u or "s"] for n, u in parts)


def check_keep_alive(value: Any) -> None:
    """keep_alive is how long the model must stay loaded after the request: minisgl keeps its one
    model loaded for the server's whole life, which meets every value but 0 (unload now)."""
    if keep_alive_seconds(value) == 0:
        raise BadOllamaRequest("keep_alive 0 asks to unload the model, which minisgl cannot do: it serves one model for its whole "
                               "life (stop the server to free its memory); leave keep_alive out")  # fmt: skip


def format_fields(fmt: Any) -> Dict[str, Any]:
    """`format` as chat's response_format: "json" any JSON object, a dict a JSON schema ("" none)."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        title = fmt.get("title")
        return {"response_format": {"type": "json_schema", "json_schema": {"name": title if isinstance(title, str) else "format", "schema": fmt}}}
    raise BadOllamaRequest(f'format {fmt!r} is not supported: send "json" or a JSON schema (an object)')


THINK_LEVELS = ("low", "medium", "high", "max")
# a level -> chat's reasoning_effort: "max" is Ollama's newest level, and where a model's levels
# stop at "high" (harmony's), Ollama sends it as "high" too
_EFFORT = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


def think_fields(think: Any, model: str, reasoning_parser: Optional[str], read: Optional[FrozenSet[str]]) -> Dict[str, Any]:
    """`think` as chat's fields; `reasoning_parser`: the server's --reasoning-parser (None: the model
    is taken for one that does not think); `read`: the chat template's variables (None: unparsed).
    - omitted: the model's own default; its thinking comes back in `thinking` when the parser finds it;
    - false: enable_thinking false where the template has the switch; nothing to turn off without a parser;
    - true: thinking on; needs a reasoning parser (Ollama's 400 "does not support thinking" otherwise);
    - "low" / "medium" / "high" / "max": thinking on, the level as chat's reasoning_effort (a template
      variable; "max" as "high", the highest level chat's reasoning_effort has)."""
    if think is None:
        return {}
    switch = read is None or "enable_thinking" in read
    if think is False:
        if switch:
            return {"chat_template_kwargs": {"enable_thinking": False}}
        if reasoning_parser is None:
            return {}
        raise BadOllamaRequest(f"think false cannot be honoured: this model thinks (--reasoning-parser {reasoning_parser}) and its chat "
                               "template has no enable_thinking switch to turn it off; leave think out")  # fmt: skip
    if isinstance(think, str) and think not in THINK_LEVELS:
        raise BadOllamaRequest(f"think {think!r} is not supported: send true, false or a level ({', '.join(THINK_LEVELS)})")
    if reasoning_parser is None:
        raise BadOllamaRequest(f"{model!r} does not support thinking: minisgl returns a model's thinking when the server runs with "
                               "--reasoning-parser (qwen3 or deepseek-r1); leave think out")  # fmt: skip
    fields: Dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}} if read is not None and "enable_thinking" in read else {}
    if isinstance(think, str):
        fields["reasoning_effort"] = _EFFORT[think]
    return fields


# --------------------------------------------------------------------------- messages
def _no_images(images: Optional[List[Any]], where: str) -> None:
    if images:
        raise BadOllamaRequest(f"{where}: images are not supported by minisgl (it serves text-only models); send text")


def chat_messages(messages: List[OllamaMessage]) -> List[Dict[str, Any]]:
    """The messages as chat's. An assistant's calls get ids where they have none (`call_<n>`, Ollama's
    older calls carry none), so that each tool message answers one: the call it names by
    tool_call_id, else the first unanswered call of its tool_name, else the first unanswered."""
    chat: List[Dict[str, Any]] = []
    unanswered: List[Tuple[str, str]] = []  # (id, name) of the latest assistant message's calls
    count = 0
    for i, m in enumerate(messages):
        _no_images(m.images, f"messages[{i}].images")
        if m.role != "assistant" and (m.tool_calls or m.thinking is not None):
            raise BadOllamaRequest(f"messages[{i}]: only assistant messages carry tool_calls and thinking")
        if m.role != "tool" and (m.tool_name is not None or m.tool_call_id is not None):
            raise BadOllamaRequest(f"messages[{i}]: only tool messages carry tool_name and tool_call_id")
        message: Dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant":
            if m.thinking:
                message["reasoning_content"] = m.thinking
            calls = []
            for call in m.tool_calls or []:
                count += 1
                calls.append({"id": call.id or f"call_{count}", "type": "function",
                              "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)}})  # fmt: skip
            if calls:
                message["tool_calls"] = calls
                unanswered = [(c["id"], c["function"]["name"]) for c in calls]
        elif m.role == "tool":
            answered = _answered(unanswered, m, i)
            unanswered.remove(answered)
            message["tool_call_id"] = answered[0]
            if m.tool_name is not None:
                message["name"] = m.tool_name
        chat.append(message)
    return chat


def _answered(unanswered: List[Tuple[str, str]], m: OllamaMessage, i: int) -> Tuple[str, str]:
    if m.tool_call_id is not None:
        match = [c for c in unanswered if c[0] == m.tool_call_id]
    elif m.tool_name is not None:
        match = [c for c in unanswered if c[1] == m.tool_name]
    else:
        match = unanswered
    if not match:
        said = f" (tool_call_id {m.tool_call_id!r})" if m.tool_call_id else f" (tool_name {m.tool_name!r})" if m.tool_name else ""
        raise BadOllamaRequest(f"messages[{i}]: this tool message{said} answers no unanswered tool call of the assistant message before it")
    return match[0]


def generate_messages(request: OllamaGenerateRequest) -> List[Dict[str, Any]]:
    """/api/generate's prompt as the chat it is (Ollama's template renders `system` and the prompt
    as a system and a user message)."""
    system = [{"role": "system", "content": request.system}] if request.system else []
    return system + [{"role": "user", "content": request.prompt or ""}]


def check_generate(request: OllamaGenerateRequest) -> None:
    """/api/generate's fields minisgl cannot honour: BadOllamaRequest naming the first."""
    _no_images(request.images, "images")
    if request.suffix:
        raise BadOllamaRequest("suffix (fill-in-the-middle) is not supported by minisgl: it has no insert template; send the prompt alone")
    if request.template:
        raise BadOllamaRequest("template is not supported: minisgl renders prompts with the model's Jinja chat template (or "
                               "minisgl serve --chat-template FILE), not Ollama's Go templates; leave it out or send raw: true")  # fmt: skip
    if request.context:
        raise BadOllamaRequest("context (deprecated by Ollama) is not supported: minisgl returns none; keep a conversation's "
                               "memory by sending it as /api/chat messages")  # fmt: skip
    for name in ("width", "height", "steps"):
        if getattr(request, name) is not None:
            raise BadOllamaRequest(f"{name} is for image generation models, which minisgl does not serve")
    if request.raw and request.system:
        raise BadOllamaRequest("system goes through the chat template, which raw: true skips; put it in the prompt")
    if request.raw and request.think is not None:
        raise BadOllamaRequest("think goes through the chat template and the reasoning parser, which raw: true skips; leave it out")


# --------------------------------------------------------------------------- the request
def to_chat_request(request: _OllamaRequest, messages: List[Dict[str, Any]], rid: str, context_len: int,
                    template_fields: Dict[str, Any], raw: bool = False) -> ChatCompletionRequest:  # fmt: skip
    """The chat request that runs `request` (its `messages` translated), always streamed inside (the
    first output's time is when the prompt was evaluated); `template_fields`: think_fields'. `raw`:
    the prompt is sent as it is, its thinking not split out. BadOllamaRequest for what cannot be
    translated, a chat validation error named by Ollama's field."""
    check_keep_alive(request.keep_alive)
    for name in ("truncate", "shift"):
        if getattr(request, name):
            raise BadOllamaRequest(f"{name} true cannot be honoured: minisgl neither cuts a prompt past the context (it is a 400) nor "
                                   f"shifts the context (the answer stops there, done_reason \"length\"); send false or leave it out")  # fmt: skip
    body: Dict[str, Any] = {"model": request.model, "messages": messages, "rid": rid, "stream": True,
                            **options_fields(request.options, context_len), **format_fields(request.format), **template_fields}  # fmt: skip
    if raw:
        body["separate_reasoning"] = False
    if request.logprobs:
        body["logprobs"] = True
    if request.top_logprobs:
        if not request.logprobs:
            raise BadOllamaRequest("top_logprobs needs logprobs: true")
        body["top_logprobs"] = request.top_logprobs
    tools = getattr(request, "tools", None)
    if tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, field = validation_message(e)
        option = _OPTION_OF.get(field.split(".")[0].split("[")[0])
        if option is not None:
            message = f"option {option!r}{message[len(field.split('.')[0].split('[')[0]):]}"
        raise BadOllamaRequest(message) from None


def _chat_tool(tool: Dict[str, Any], i: int) -> Dict[str, Any]:
    try:
        return Tool.model_validate({"type": "function", **tool}).model_dump(exclude_none=True)
    except ValidationError as e:
        raise BadOllamaRequest(validation_message(e, f"tools[{i}]")[0]) from None


# --------------------------------------------------------------------------- the answer
def done_reason(finish_reason: Optional[str]) -> str:
    """Ollama's done_reason of a chat finish: "length" when the budget or the context ran out, else
    "stop" (Ollama says "stop" for an answer of tool calls too)."""
    return "length" if finish_reason == "length" else "stop"


def ollama_tool_calls(calls: List[ToolCall]) -> List[Dict[str, Any]]:
    """Chat's calls as Ollama's: arguments an object (the chat path's parse keeps only calls whose
    arguments are one), `index` their place in the answer, `id` chat's."""
    return [{"id": call.id, "function": {"index": k, "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
            for k, call in enumerate(calls)]  # fmt: skip


def ollama_logprobs(logprobs: Optional[ChatChoiceLogprobs]) -> Optional[List[Dict[str, Any]]]:
    """Chat's token logprobs as Ollama's (the same fields: token, logprob, bytes, top_logprobs)."""
    if logprobs is None or logprobs.content is None:
        return None
    return [entry.model_dump() for entry in logprobs.content]
