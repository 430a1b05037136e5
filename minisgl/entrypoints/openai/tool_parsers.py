"""Tool-call formats (stage 1, chat only, tool_choice "auto"): how each model family writes
its calls, read back into OpenAI's `tool_calls` (SGLang's --tool-call-parser, its
function_call/*_detector.py).

Where it sits: OpenAIServingChat picks the format --tool-call-parser names
(`TOOL_CALL_FORMATS`). tool_calls.py hands it the answer's text, after the reasoning parser
took the thinking out: whole (`ToolCallFormat.parse` -> (content, calls)), or as it streams
(`StreamedText` asks `find_start` and `held` what may still begin a call, then `stream` reads
the calls as they come: `read_streamed`, over tool_call_stream.py's CallStream); and it asks
the format for a strict tool's structural-tag begin/end/trigger (`structures`). In: text. Out:
content text and ToolCalls (or, streamed, their deltas). Owns: nothing (a format is
stateless; a stream's state is StreamedText's and CallStream's).

| parser      | models                                         | a call                                             |
|-------------|------------------------------------------------|----------------------------------------------------|
| qwen25      | Qwen2.5, Qwen3                                 | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` |
| llama3      | Llama 3.1, 3.2 (JSON calls)                    | `<|python_tag|>`? `{"name": ..., "parameters": {...}}`, `;` between calls |
| mistral     | Mistral 7B v0.3, Nemo, Small; later compact    | `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` per call |
| pythonic    | Llama 3.2 prompted for it, Llama 4's format    | `[get_weather(city="Paris"), get_time()]` (Python literals, never eval'd) |
| qwen3_coder | Qwen3-Coder (30B-A3B, 480B)                    | `<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>` (values text, typed by the tool's schema: qwen3_coder_calls.py) |

One rule for every format (minisgl's; SGLang's detectors differ in details, e.g. some keep
text after the calls as content): the calls run from the first call markup to the end of
the answer. The content is the text before it, without its trailing blanks; an answer whose
markup is not followed by well-formed calls only (cut short, bad JSON, text after the
calls) is all content. A call of a function the request did not offer is dropped and
logged. A format's special tokens (`<|python_tag|>`, `[TOOL_CALLS]`, ...) never reach the
content: the chat route turns skip_special_tokens off for the parser's sake, and without
tools they would have been skipped.
"""

from __future__ import annotations

import abc
import ast
import json
import logging
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

from minisgl.entrypoints.openai import qwen3_coder_calls
from minisgl.entrypoints.openai.protocol import FunctionCall, ToolCall
from minisgl.entrypoints.openai.tool_call_stream import CallStream, NotCalls, OfferedTools, Reader, check_offered

logger = logging.getLogger("minisgl.tool_calls")

RawCall = Dict[str, Any]  # {"name": str, "arguments" or "parameters": ...} as the model wrote it
# what json raises on text that is no JSON value: JSONDecodeError, and RecursionError from brackets
# nested ~1000 deep (a looping model writes `[[[[...` within an ordinary max_tokens)
NOT_JSON = (json.JSONDecodeError, RecursionError)
Structure = Tuple[str, str, str]  # (begin, end, trigger) of one structural-tag structure


def _json_call(value: Any) -> Optional[RawCall]:
    """`value` if it is a call object (a dict with a string name), else None."""
    return value if isinstance(value, dict) and isinstance(value.get("name"), str) else None


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class ToolCallFormat(abc.ABC):
    """One model family's tool-call format. A subclass names its markup and reads its calls;
    `parse` applies the rules every format shares."""

    name: str = ""  # its --tool-call-parser
    models: str = ""  # whose format it is, for messages
    markers: Tuple[str, ...] = ()  # text that begins the calls wherever it shows
    special: Tuple[str, ...] = ()  # the format's special tokens: dropped from content
    argument_syntax: str = "JSON"  # what its calls' arguments are written in, for messages

    def find_start(self, text: str, at_start: bool) -> int:
        """Where in `text` the calls begin, or -1. `at_start`: `text` opens the answer (only
        blanks were before it), for a format whose calls may begin with plain `{` there."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found, default=-1)

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may still grow into a start or a special
        token: a stream holds them until the next delta says (sent now, they could turn out to
        be markup, which is never content)."""
        longest = 0
        for marker in self.markers + self.special:
            # the longest tail of `text` that is a start of `marker` (a whole marker is found, not held)
            for k in range(min(len(marker), len(text) + 1) - 1, longest, -1):
                if marker.startswith(text[-k:]):
                    longest = k
                    break
        return longest

    @abc.abstractmethod
    def read_calls(self, tail: str) -> Optional[List[RawCall]]:
        """The calls in `tail` (the answer from its first call markup on), or None when `tail`
        is not calls only."""

    @abc.abstractmethod
    def read_streamed(self, stream: CallStream) -> Reader:
        """Reads the calls as they stream, a character at a time, from the first call markup on
        (as `read_calls` reads them whole), handing each call to `stream` (its `call_object`,
        `named_call` or `whole_call`); raises NotCalls where the text is not calls."""

    def stream(self, tool_names: OfferedTools) -> CallStream:
        """A stream of the calls of one answer, from its first call markup on."""
        return CallStream(self.read_streamed, check_offered(tool_names), self.call_id)

    def structures(self, name_json: str) -> List[Structure]:
        """The structural tag's structures for a call of the tool named `name_json` (its name
        as JSON text), the arguments between begin and end; [] for a format whose arguments
        are not JSON (a structural tag holds only a JSON schema)."""
        return []

    @property
    def has_structural_tag(self) -> bool:
        """Whether strict tools can be constrained under "auto" (a format whose arguments are not
        JSON has no structures; probed with an empty name)."""
        return bool(self.structures('""'))

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def arguments(self, call: RawCall, tool_names: OfferedTools) -> Any:
        """A call's arguments as the answer gives them: the JSON the model wrote (a format whose
        values are text types them here, by the tool's schema in `tool_names`)."""
        return call.get("arguments", call.get("parameters", {}))

    def content(self, text: str) -> str:
        """`text` as content: without the format's special tokens."""
        for token in self.special:
            text = text.replace(token, "")
        return text

    def parse(self, text: str, tool_names: OfferedTools) -> Tuple[str, Optional[List[ToolCall]]]:
        """A whole answer: (the content before the calls, the calls), or (content, None) when
        it holds no calls. `tool_names`: the functions offered (the chat route gives each one's
        parameters schema by name, a Mapping: qwen3_coder types its values by them). A call of
        a function not in `tool_names` is dropped (SGLang's "Model attempted to call undefined
        function"): an agent must never be handed a function it did not offer; so is a call whose
        arguments are not an object (a string, a list) of a function whose parameters are one (or
        unset: a function's arguments are an object, OpenAI's and Anthropic's rule); when every call
        is dropped, the answer is its text before the first call, with no calls (SGLang's too:
        the markup of a dropped call is not content either)."""
        check_offered(tool_names)
        start = self.find_start(text, at_start=True)
        raw = self.read_calls(text[start:]) if start >= 0 else None
        if not raw:
            return self.content(text), None
        calls: List[ToolCall] = []
        for call in raw:
            if call["name"] not in tool_names:
                logger.warning("Model attempted to call undefined function: %s", call["name"])
                continue
            arguments = self.arguments(call, tool_names)
            if not isinstance(arguments, dict) and (tool_names[call["name"]] or {}).get("type", "object") == "object":
                # (a function's arguments are an object, OpenAI's and Anthropic's rule: `"arguments": "Oslo"`
                # is no call of it; an agent would break on it, the anthropic SDK's ToolUseBlock does)
                logger.warning("Model called %s with arguments that are not an object: dropped", call["name"])
                continue
            try:  # (ensure_ascii off: "Zürich" as OpenAI and SGLang send it, not "Z\\u00fcrich")
                arguments_json = json.dumps(arguments, ensure_ascii=False)
            except RecursionError:  # (decoded just under the limit, encoded just over it)
                return self.content(text), None
            calls.append(ToolCall(id=self.call_id(), function=FunctionCall(name=call["name"], arguments=arguments_json)))
        # (SGLang strips both ends; the start is kept, as a stream has sent it by the time a call shows)
        return self.content(text[:start]).rstrip(), calls or None


class Qwen25Format(ToolCallFormat):
    """Qwen2.5 / Qwen3 (SGLang's Qwen25Detector): `<tool_call>\\n{json}\\n</tool_call>` blocks."""

    name, models = "qwen25", "Qwen2.5/Qwen3"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def read_calls(self, tail: str) -> Optional[List[RawCall]]:
        calls = []
        for body in self._CALL.findall(tail):
            try:
                call = _json_call(json.loads(body))
            except NOT_JSON:
                return None
            if call is None:
                return None
            calls.append(call)
        if self._CALL.sub("", tail).strip():  # (text after or between the blocks, or one left open)
            return None
        return calls or None

    def read_streamed(self, stream: CallStream) -> Reader:
        while True:  # (blocks with blanks between them, as the regex reads them)
            yield from stream.expect("<tool_call>")
            yield from stream.peek_nonblank(json_blanks=False)
            yield from stream.call_object()
            yield from stream.peek_nonblank(json_blanks=False)
            yield from stream.expect("</tool_call>")
            yield from stream.peek_nonblank(json_blanks=False)

    def structures(self, name_json: str) -> List[Structure]:
        return [('<tool_call>\n{"name":' + name_json + ', "arguments":', "}\n</tool_call>", "<tool_call>")]


class Llama3Format(ToolCallFormat):
    """Llama 3.1 / 3.2's JSON calls (SGLang's Llama32Detector): `{"name": ..., "parameters":
    {...}}`, several joined by `;` or blanks, after `<|python_tag|>`, opening the answer (Meta's
    template asks for bare JSON; the tag is the model's own habit, for its built-in tools), or,
    minisgl's, a bare `{"name":` after some text: the strict tools' tag forces a call there
    (`structures`), which must then be read as one (SGLang reads text + JSON as text)."""

    name, models = "llama3", "Llama 3.1/3.2's JSON calls"
    _TAG, _BARE = "<|python_tag|>", '{"name":'
    markers, special = (_TAG, _BARE), (_TAG,)

    def find_start(self, text: str, at_start: bool) -> int:
        if at_start:  # (SGLang's: an answer that starts with `{` is a call)
            blanks = _skip_blanks(text, 0)
            if text.startswith("{", blanks):
                return blanks
        return super().find_start(text, at_start)

    def read_calls(self, tail: str) -> Optional[List[RawCall]]:
        tagged = tail.startswith(self._TAG)
        text = tail[len(self._TAG) :] if tagged else tail
        decoder, calls, i = json.JSONDecoder(), [], _skip_blanks(text, 0)
        while True:
            try:
                value, i = decoder.raw_decode(text, i)
            except NOT_JSON:
                return None
            call = _json_call(value)
            # an untagged answer that is a JSON object with a "name" (asked-for JSON about a
            # person, say) is not a call: a call names its arguments too
            if call is None or not (tagged or "parameters" in call or "arguments" in call):
                return None
            calls.append(call)
            # between calls: `;` (SGLang's separator; a trailing one is harmless), or blanks alone
            # (calls on lines of their own: SGLang reads them too), or the tag again (the strict
            # tools' tag lets each call be written either way)
            i = _skip_blanks(text, i)
            if text.startswith(";", i):
                i = _skip_blanks(text, i + 1)
            if text.startswith(self._TAG, i):
                i = _skip_blanks(text, i + len(self._TAG))
            if i == len(text):
                return calls
            if text[i] != "{":
                return None

    def read_streamed(self, stream: CallStream) -> Reader:
        tagged = (yield from stream.peek()) == "<"
        if tagged:
            yield from stream.expect(self._TAG)
        stream.needs_arg_key = not tagged  # (as read_calls: an untagged call names its arguments)
        while True:
            yield from stream.peek_nonblank(json_blanks=False)
            yield from stream.call_object()
            ch = yield from stream.peek_nonblank(json_blanks=False)
            if ch == ";":
                yield from stream.char()
                ch = yield from stream.peek_nonblank(json_blanks=False)
            if ch == "<":
                yield from stream.expect(self._TAG)
                ch = yield from stream.peek_nonblank(json_blanks=False)
            if ch != "{":
                raise NotCalls

    def structures(self, name_json: str) -> List[Structure]:
        # SGLang's is the tagged one (with "arguments"). The bare one, triggered by `{"name":`,
        # is minisgl's: Meta's template asks for bare JSON, which a `<|python_tag|>` trigger
        # alone would leave unconstrained. "parameters" is the key Meta's template asks for.
        body = self._BARE + name_json + ', "parameters":'
        return [(self._TAG + body, "}", self._TAG), (body, "}", self._BARE)]


class MistralFormat(ToolCallFormat):
    """Mistral (SGLang's MistralDetector): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`
    (7B v0.3, Nemo, Small 2501; a call may carry the "id" the template wrote back), or the
    compact `[TOOL_CALLS]name[ARGS]{...}` of later models, once per call. Several tagged
    arrays in a row are read as one list of calls (the strict tools' tag writes one per call)."""

    name, models = "mistral", "Mistral's [TOOL_CALLS]"
    _TAG, _ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (_TAG,)
    special = (_TAG, _ARGS, "[CALL_ID]")  # (newer tokenizers' special tokens of the format)

    def read_calls(self, tail: str) -> Optional[List[RawCall]]:
        calls: List[RawCall] = []
        for piece in tail.split(self._TAG)[1:]:  # each tag: a JSON array, or compact name[ARGS]{...}
            found = self._read_array(piece.strip()) if piece.lstrip().startswith("[") else self._read_compact(piece)
            if found is None:
                return None
            calls += found
        return calls or None

    def _read_array(self, text: str) -> Optional[List[RawCall]]:
        try:
            array, end = json.JSONDecoder().raw_decode(text)
        except NOT_JSON:
            return None
        if text[end:].strip() or not isinstance(array, list) or not array:
            return None
        calls = [_json_call(c) for c in array]
        return None if None in calls else calls  # type: ignore[return-value]

    def _read_compact(self, piece: str) -> Optional[List[RawCall]]:
        name, found, args = piece.partition(self._ARGS)
        if not found or not name.strip():
            return None
        try:
            arguments = json.loads(args)
        except NOT_JSON:
            return None
        return [{"name": name.strip(), "arguments": arguments}] if isinstance(arguments, dict) else None

    def read_streamed(self, stream: CallStream) -> Reader:
        while True:  # (each tag: an array of calls, or one compact call)
            yield from stream.expect(self._TAG)
            if (yield from stream.peek_nonblank(json_blanks=False)) == "[":
                yield from stream.char()
                yield from stream.call_array()
                yield from stream.peek_nonblank(json_blanks=False)
            else:
                yield from self._stream_compact(stream)

    def _stream_compact(self, stream: CallStream) -> Reader:
        """`name[ARGS]{...}`: the name once `[ARGS]` ends it, then the arguments."""
        chars: List[str] = []
        while not (chars[-1:] == ["]"] and "".join(chars[-len(self._ARGS) :]) == self._ARGS):
            chars.append((yield from stream.char()))
            # (a tag first is a piece without [ARGS]; a name past any tool's is never one sent)
            if "".join(chars[-len(self._TAG) :]) == self._TAG or len(chars) > 256:
                raise NotCalls
        name = "".join(chars[: -len(self._ARGS)]).strip()
        if not name:
            raise NotCalls
        yield from stream.named_call(name)
        if (yield from stream.peek_nonblank()) != "[":  # (json.loads: only json's blanks after the object)
            raise NotCalls

    def structures(self, name_json: str) -> List[Structure]:
        return [('[TOOL_CALLS] [{"name":' + name_json + ', "arguments":', "}]", self._TAG)]

    def call_id(self) -> str:
        # Mistral's chat template refuses, on the next turn, a call id that is not 9 letters
        # or digits ("Tool call IDs should be alphanumeric strings with length 9!")
        return uuid.uuid4().hex[:9]


class PythonicFormat(ToolCallFormat):
    """Python call syntax (SGLang's PythonicDetector): `[f(a=1), g(b="x")]`, the arguments
    Python literals (read with `ast.literal_eval`: nothing is ever evaluated), optionally
    between Llama 4's `<|python_start|>` and `<|python_end|>`."""

    name, models = "pythonic", "Llama 3.2/4's [f(x=1)]"
    markers, argument_syntax = ("<|python_start|>",), "Python"
    special = ("<|python_start|>", "<|python_end|>")
    # `[` then a function's name and `(`, and what may still grow into one. A name is at most 64
    # characters (OpenAI's limit): a stream holds at most that much of a `[identifier` run, where
    # an unbounded hold re-scanned the whole run at every delta (quadratic, on the event loop)
    _START = re.compile(r"\[[A-Za-z_]\w{0,63}\(")
    _PARTIAL = re.compile(r"\[(?:[A-Za-z_]\w{0,63})?\Z")

    def find_start(self, text: str, at_start: bool) -> int:
        match = self._START.search(text)
        found = [i for i in (super().find_start(text, at_start), match.start() if match else -1) if i >= 0]
        return min(found, default=-1)

    def held(self, text: str) -> int:
        match = self._PARTIAL.search(text)
        return max(super().held(text), len(text) - match.start() if match else 0)

    def read_calls(self, tail: str) -> Optional[List[RawCall]]:
        tree = _python_expression(self.content(tail).strip())
        if tree is None or not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = [_python_call(node) for node in tree.body.elts]
        return None if None in calls else calls  # type: ignore[return-value]

    def read_streamed(self, stream: CallStream) -> Reader:
        """Each call whole, once its `)` arrives (its arguments are Python, not JSON: they are
        known only whole)."""
        if (yield from stream.peek()) == "<":
            yield from stream.expect("<|python_start|>")
        if (yield from stream.take_nonblank(json_blanks=False)) != "[":
            raise NotCalls
        while True:
            yield from stream.peek_nonblank(json_blanks=False)
            text = yield from _read_python_call(stream)
            tree = _python_expression(text)
            call = _python_call(tree.body) if tree is not None else None
            if call is None:
                raise NotCalls
            try:  # (as parse writes them)
                stream.whole_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
            except RecursionError:
                raise NotCalls from None
            ch = yield from stream.take_nonblank(json_blanks=False)
            if ch == "]":
                return
            if ch != ",":
                raise NotCalls


def _python_expression(text: str) -> Optional[ast.Expression]:
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _python_call(node: ast.AST) -> Optional[RawCall]:
    """A pythonic call `f(a=1)` as a RawCall, or None: keyword arguments only (a positional one,
    or **kwargs, has no parameter name), each a literal with a JSON form."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        json.dumps(arguments, allow_nan=False)  # (a set, bytes or 1e999 has no JSON)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    return {"name": node.func.id, "arguments": arguments}


def _read_python_call(stream: CallStream) -> Reader:
    """The text of one call, `name(...)`, through the `)` that closes it: brackets counted
    outside string literals ('', "", triple-quoted; a backslash escapes the next character)."""
    chars: List[str] = []
    depth, quote, run = 0, "", 0  # brackets open; the open string's quote; unescaped quotes in a row
    while True:
        ch = yield from stream.char()
        chars.append(ch)
        if quote:
            if ch == "\\":
                chars.append((yield from stream.char()))
                run = 0
            elif ch == quote[0]:
                run += 1
                if run == len(quote):
                    quote, run = "", 0
            else:
                run = 0
        elif ch in "'\"":
            second = yield from stream.char()
            if second != ch:  # (a string opens)
                stream.put_back(second)
                quote = ch
                continue
            chars.append(second)
            third = yield from stream.char()
            if third == ch:  # (a triple-quoted one opens)
                chars.append(third)
                quote = ch * 3
            else:  # ('' or "": an empty string)
                stream.put_back(third)
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth <= 0:
                if depth < 0 or ch != ")":
                    raise NotCalls
                return "".join(chars)
        elif depth == 0 and not (ch.isalnum() or ch == "_"):
            raise NotCalls  # (only the function's name before its `(`)


class QwenCoderFormat(ToolCallFormat):
    """Qwen3-Coder (SGLang's Qwen3CoderDetector): `<tool_call>` blocks of `<function=NAME>` and
    `<parameter=KEY>` tags, each value the text between its tags, typed by the tool's parameters
    schema; read and streamed in qwen3_coder_calls.py (its docstring has the rules)."""

    name, models = "qwen3_coder", "Qwen3-Coder's <function=...>"
    markers, argument_syntax = (qwen3_coder_calls.TOOL_CALL,), "XML-like <parameter=...>"

    def read_calls(self, tail: str) -> Optional[List[RawCall]]:
        return qwen3_coder_calls.read_calls(tail)

    def arguments(self, call: RawCall, tool_names: OfferedTools) -> Any:
        return qwen3_coder_calls.typed_arguments(call["name"], call["arguments"], tool_names)

    def read_streamed(self, stream: CallStream) -> Reader:
        """Each call's header at `<function=NAME>`, each parameter at its `</parameter>`."""
        return qwen3_coder_calls.read_streamed(stream)


TOOL_CALL_FORMATS: Dict[str, ToolCallFormat] = {
    fmt.name: fmt for fmt in (Qwen25Format(), Llama3Format(), MistralFormat(), PythonicFormat(), QwenCoderFormat())
}
