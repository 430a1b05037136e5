"""Tool calls as they stream (stage 1, chat only): a call's id and name as soon as the name is
read, then its arguments piece by piece, as OpenAI and SGLang stream them.

Where it sits: StreamedText (tool_calls.py) finds where an "auto" answer's calls begin and feeds
the text from there on to a `CallStream`; a forced call's stream is fed the whole answer. The
format (`ToolCallFormat.read_streamed` in tool_parsers.py, `read_forced_calls` here) reads its
markup a character at a time, each call object through `CallStream.call_object`, and the
arguments through `json_value`: an incremental re-serialiser that writes them as
`json.dumps(json.loads(text), ensure_ascii=False)` does (the non-streaming answer's string), so
that a call's pieces add up to that string byte for byte. In: the answer from its first call
markup on, in pieces. Out: `DeltaToolCall`s. Owns: the calls streamed so far.

A reader is a generator: each `yield` takes in the next character (`CallStream.char`), so a
format reads as straight-line code however the text is cut into deltas. Text a reader cannot
read as the format's calls ends it (`NotCalls`): nothing more streams, and `finish` settles the
stream against the whole answer's parse, which stays the only judge of what the calls are.

The rules that keep a piece from being contradicted later:
- a call goes out (its id, name and `arguments: ""`) only once its name is read whole and is
  one of the tools (and, for a format that needs one, once its arguments' key is read);
- JSON is written normalised: `", "` and `": "` between tokens, nothing else; strings decoded
  and re-escaped (`\\u00fc` is "ü", `\\/` is "/", a surrogate pair one character); a number,
  `true`, `null`, ... only once the character after it ends it, as json.loads->json.dumps
  writes it (`1e5` is `100000.0`, `-0` is `0`);
- an object's `, "key": ` only once the key is read and is not a repeat: json.loads keeps a
  repeated key's last value at its first place, so a repeat stops the call's stream (`diverged`)
  and `finish` sends the rest only if what was sent is a prefix of the answer's arguments.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, Generator, List, Mapping, Optional, Set, Tuple

from minisgl.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, ToolCall

logger = logging.getLogger("minisgl.tool_calls")

Reader = Generator[None, str, Any]  # takes in characters (send), returns what it read
# the functions offered, as the chat route hands them to a format: each one's parameters schema
# by name (a name's presence is what every format checks; qwen3_coder types its values by the schema)
OfferedTools = Mapping[str, Dict[str, Any]]
JSON_BLANKS = " \t\n\r"  # json's whitespace (str.isspace takes more: json.loads refuses those)
_UNESCAPE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class NotCalls(Exception):
    """The text is not the format's calls (other markup, bad JSON, a call without a name)."""


def check_offered(tools: OfferedTools) -> OfferedTools:
    """`tools`, checked where a caller hands them in (a caller's bug, so a TypeError there, not a
    failure deep in a stream's reader): a mapping of each function's name to its parameters schema."""
    if not isinstance(tools, Mapping):
        raise TypeError(
            "the offered tools are a mapping of each function's name to its parameters schema, not "
            f"{type(tools).__name__} (qwen3_coder types each value by the schema: names alone would make every value text)"
        )
    return tools


def _escaped(ch: str) -> str:
    """`ch` inside a string as json.dumps(ensure_ascii=False) writes it."""
    return json.dumps(ch, ensure_ascii=False)[1:-1] if ch < " " or ch in '"\\' else ch


def _is_blank(ch: str, json_blanks: bool) -> bool:
    return ch in JSON_BLANKS if json_blanks else ch.isspace()


class StreamedCall:
    """One call as it is read: its name once read whole, its normalised arguments so far."""

    def __init__(self, name: Optional[str] = None) -> None:
        self.name = name
        self.arg_key: Optional[str] = None  # the key whose value the arguments are, once read
        self.parts: List[str] = []  # the arguments as written so far (a list: one join per delta)
        self.sent = 0  # how many of `parts` went out
        self.index: Optional[int] = None  # its place among the choice's calls, once it went out
        self.offered = True  # False: a function the request did not offer (never sent)
        # a repeated key: json.loads keeps its last value, which what was written may contradict
        self.diverged = False

    def write(self, piece: str) -> None:
        if not self.diverged:
            self.parts.append(piece)


class CallStream:
    """One choice's calls as they stream. `read(stream)` is the format's reader; `tool_names`
    the functions offered, as the format was given them (the chat route's: each one's
    parameters schema by name, which qwen3_coder types its values by; None: any, for a forced
    call, whose names the grammar holds to the tools); `arg_keys` the keys of the arguments,
    the first winning where both are written."""

    def __init__(
        self,
        read: Callable[["CallStream"], Reader],
        tool_names: Optional[OfferedTools],
        call_id: Callable[[], str],
        arg_keys: Tuple[str, ...] = ("arguments", "parameters"),
        needs_arg_key: bool = False,
    ) -> None:
        self.tool_names, self.call_id, self.arg_keys = tool_names, call_id, arg_keys
        self.needs_arg_key = needs_arg_key  # a call is one only if its arguments' key is written
        self.streamed: List[StreamedCall] = []  # the calls that went out, in index order
        self.out: List[DeltaToolCall] = []  # deltas not handed out yet
        self._back: Optional[str] = None  # a character a reader looked at and put back
        self._reader: Optional[Reader] = read(self)
        next(self._reader)  # (to its first read)

    # ---------------------------------------------------------------- feeding and settling
    def feed(self, text: str) -> List[DeltaToolCall]:
        """The deltas `text` (the next piece of the answer) completes."""
        for ch in text:
            if self._reader is None:
                break
            try:
                self._reader.send(ch)
            except (StopIteration, NotCalls):  # (the calls ended, or are none: the final parse judges)
                self._reader = None
        self._flush()
        out, self.out = self.out, []
        return out

    def finish(self, calls: Optional[List[ToolCall]]) -> List[DeltaToolCall]:
        """At the choice's end, given the whole answer's calls (None: it has none): the deltas
        the stream still owes so that its calls add up to them, each call's arguments byte for
        byte. A call the stream did not send (one after text the stream could not read as
        calls, or any call of a format read whole) goes out whole here. What cannot be settled is
        logged: calls sent of an answer that turned out to hold none (cut short, bad JSON,
        text after the calls), or pieces sent that the answer's arguments do not start with
        (a repeated key)."""
        out: List[DeltaToolCall] = []
        if not calls:
            if self.streamed:
                logger.info("Streamed %d tool call(s) of an answer that turned out to hold none", len(self.streamed))
            return out
        for index, call in enumerate(calls):
            name, arguments = call.function.name, call.function.arguments
            if index >= len(self.streamed):
                out.append(_header(index, call.id, name))
                out += [_piece(index, arguments)] if arguments else []
                continue
            streamed = self.streamed[index]
            sent = "".join(streamed.parts[: streamed.sent])
            if streamed.name != name or not arguments.startswith(sent):
                logger.warning("Streamed tool call %d (%s) differs from the answer's (%s): not settled", index, streamed.name, name)
                continue
            out += [_piece(index, arguments[len(sent) :])] if len(arguments) > len(sent) else []
        if len(self.streamed) > len(calls):
            logger.warning("Streamed %d tool calls of an answer that holds %d", len(self.streamed), len(calls))
        return out

    def _ready(self, call: StreamedCall) -> None:
        """Sends the call's header once it is certainly a call: its name read whole and offered
        (and its arguments' key read, where the format needs one)."""
        if call.index is not None or call.name is None or not call.offered:
            return
        if self.needs_arg_key and call.arg_key is None:
            return
        if self.tool_names is not None and call.name not in self.tool_names:
            call.offered = False  # (dropped, as the whole answer's parse drops it)
            return
        self._flush()  # (the calls before it first)
        call.index = len(self.streamed)
        self.streamed.append(call)
        self.out.append(_header(call.index, self.call_id(), call.name))

    def _flush(self) -> None:
        """Sends what the calls that went out have written since."""
        for call in self.streamed[-1:]:  # (only the last call is still being written)
            if call.sent < len(call.parts):
                piece = "".join(call.parts[call.sent :])
                call.sent = len(call.parts)
                self.out.append(_piece(call.index, piece))  # type: ignore[arg-type]

    # ---------------------------------------------------------------- reading characters
    def char(self) -> Reader:
        """The next character."""
        if self._back is not None:
            ch, self._back = self._back, None
            return ch
        return (yield)

    def put_back(self, ch: str) -> None:
        """Leaves `ch`, read to look at it, to be read next."""
        self._back = ch

    def peek(self) -> Reader:
        """The next character, left to be read."""
        self._back = yield from self.char()
        return self._back

    def take_nonblank(self, json_blanks: bool = True) -> Reader:
        """The next character that is not a blank (json's four, or any str.isspace one)."""
        while True:
            ch = yield from self.char()
            if not _is_blank(ch, json_blanks):
                return ch

    def peek_nonblank(self, json_blanks: bool = True) -> Reader:
        """Skips blanks; the next character, left to be read."""
        self._back = yield from self.take_nonblank(json_blanks)
        return self._back

    def expect(self, word: str) -> Reader:
        """The format's markup, `word`, next."""
        for expected in word:
            if (yield from self.char()) != expected:
                raise NotCalls

    # ---------------------------------------------------------------- calls
    def call_object(self) -> Reader:
        """One call object, `{"name": ..., "arguments": {...}}`, keys in any order, other keys
        read and dropped: its header goes out once its name is read (and offered), its
        arguments as they come (written ahead of a name that comes after them, and sent then)."""
        if (yield from self.char()) != "{":
            raise NotCalls
        call, keys = StreamedCall(), set()
        if (yield from self.peek_nonblank()) == "}":
            raise NotCalls  # (no name: no call)
        while True:
            key = yield from self._key()
            repeated = key in keys
            keys.add(key)
            if key == "name" and not repeated:
                if (yield from self.take_nonblank()) != '"':
                    raise NotCalls  # (a name that is no string: no call)
                call.name = yield from self.json_string()
            elif key in self.arg_keys and call.arg_key is None:
                call.arg_key = key
                self._ready(call)  # (a format that needs the key sends the header now)
                yield from self.json_value(call)
            else:
                # a repeated name, or arguments the answer takes over those written (a repeat,
                # or "arguments" after "parameters"): what was written may not be the answer's
                rank = self.arg_keys.index(key) if key in self.arg_keys else len(self.arg_keys)
                if key == "name" or (call.arg_key is not None and rank <= self.arg_keys.index(call.arg_key)):
                    call.diverged = True
                yield from self.json_value()
            self._ready(call)
            ch = yield from self.take_nonblank()
            if ch == "}":
                break
            if ch != ",":
                raise NotCalls
        if call.name is None or (self.needs_arg_key and call.arg_key is None):
            raise NotCalls
        if call.arg_key is None:
            call.write("{}")  # (no arguments written: the answer's are {})
        self._ready(call)

    def call_array(self) -> Reader:
        """`[call, call, ...]` once its `[` was read: the calls, up to the closing `]` (an empty
        array is no calls)."""
        if (yield from self.peek_nonblank()) == "]":
            raise NotCalls
        while True:
            yield from self.peek_nonblank()
            yield from self.call_object()
            ch = yield from self.take_nonblank()
            if ch == "]":
                return
            if ch != ",":
                raise NotCalls

    def open_call(self, name: str) -> StreamedCall:
        """A call whose name the format wrote outside JSON: its header goes out now (if offered),
        then what the format writes of its arguments (`StreamedCall.write`), as it comes."""
        call = StreamedCall(name)
        call.arg_key = "arguments"
        self._ready(call)
        return call

    def named_call(self, name: str) -> Reader:
        """A call whose name the format wrote outside JSON (Mistral's compact `name[ARGS]{...}`):
        its arguments, a JSON object."""
        call = self.open_call(name)
        if (yield from self.peek_nonblank()) != "{":
            raise NotCalls
        yield from self.json_value(call)

    def whole_call(self, name: str, arguments: str) -> None:
        """A call read whole (a pythonic one, when its `)` arrives): out at once."""
        self.open_call(name).write(arguments)

    # ---------------------------------------------------------------- JSON, normalised
    def _key(self) -> Reader:
        """An object's key and its colon."""
        if (yield from self.take_nonblank()) != '"':
            raise NotCalls
        key = yield from self.json_string()
        if (yield from self.take_nonblank()) != ":":
            raise NotCalls
        return key

    def json_value(self, call: Optional[StreamedCall] = None) -> Reader:
        """One JSON value, written to `call` (when given) as json.dumps(json.loads(value),
        ensure_ascii=False) writes it. Containers are a stack, not recursion: a looping
        model's `[[[[...` is thousands deep."""
        write = call.write if call is not None else _drop
        stack: List[Optional[Set[str]]] = []  # the open containers: an object's keys so far, None for an array
        while True:
            # a value begins
            ch = yield from self.take_nonblank()
            if ch in "{[":
                write(ch)
                close = "}" if ch == "{" else "]"
                if (yield from self.peek_nonblank()) == close:
                    write((yield from self.char()))
                else:
                    stack.append(set() if ch == "{" else None)
                    if ch == "{":
                        yield from self._member_key(stack[-1], call, write, first=True)
                    continue
            elif ch == '"':
                yield from self.json_string(call)
            else:
                yield from self._scalar(ch, write)
            # a value ended: it closes containers, or a comma begins the next value
            while True:
                if not stack:
                    return
                ch = yield from self.take_nonblank()
                keys = stack[-1]
                if ch == ",":
                    if keys is None:
                        write(", ")
                    else:
                        yield from self._member_key(keys, call, write, first=False)
                    break
                if ch != ("]" if keys is None else "}"):
                    raise NotCalls
                write(ch)
                stack.pop()

    def _member_key(self, keys: Set[str], call: Optional[StreamedCall], write: Callable[[str], None], first: bool) -> Reader:
        key = yield from self._key()
        if key in keys and call is not None:
            call.diverged = True  # (json.loads keeps the last value, at the first one's place)
        keys.add(key)
        write(("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": ")

    def _scalar(self, first: str, write: Callable[[str], None]) -> Reader:
        """A number, true, false, null (or json's NaN / Infinity): written once the next
        character ends it, as json.loads->json.dumps writes it."""
        if first in ",:]}":
            raise NotCalls
        chars = [first]
        while True:
            ch = yield from self.char()
            if ch in JSON_BLANKS or ch in ",]}":
                self._back = ch
                break
            chars.append(ch)
        try:
            value = json.loads("".join(chars))
        except (ValueError, RecursionError):  # (ValueError too: an int past Python's digit limit)
            raise NotCalls from None
        write(json.dumps(value))

    def json_string(self, call: Optional[StreamedCall] = None) -> Reader:
        """A string, after its opening quote: returned decoded, and written to `call` (when given)
        decoded and re-escaped as json.dumps(ensure_ascii=False) escapes it."""
        write = call.write if call is not None else _drop
        chars: List[str] = []
        high = ""  # an escaped high surrogate, until the next character says whether a low one pairs with it
        write('"')
        while True:
            ch = yield from self.char()
            escaped_high = False
            if ch == "\\":
                escape = yield from self.char()
                if escape == "u":
                    digits = ""
                    for _ in range(4):
                        digit = yield from self.char()
                        if digit not in _HEX:
                            raise NotCalls
                        digits += digit
                    code = int(digits, 16)
                    if high and 0xDC00 <= code <= 0xDFFF:  # (json pairs them into one character)
                        ch, high = chr(0x10000 + ((ord(high) - 0xD800) << 10) + code - 0xDC00), ""
                    else:
                        ch, escaped_high = chr(code), 0xD800 <= code <= 0xDBFF
                elif escape in _UNESCAPE:
                    ch = _UNESCAPE[escape]
                else:
                    raise NotCalls
            elif ch == '"':
                ch = ""
            elif ch < " ":
                raise NotCalls  # (json.loads refuses a control character in a string)
            if high:  # (no low half came: the high one stands alone)
                chars.append(high)
                write(high)
                high = ""
            if not ch:
                write('"')
                return "".join(chars)
            if escaped_high:
                high = ch
                continue
            chars.append(ch)
            write(_escaped(ch))


def _drop(piece: str) -> None:
    """Where a value nobody streams is written (read only to be checked and skipped)."""


def _header(index: int, call_id: str, name: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call_id, type="function", function=DeltaFunctionCall(name=name, arguments=""))


def _piece(index: int, arguments: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))


def read_forced_calls(stream: CallStream) -> Reader:
    """A forced call's answer (tool_calls.py): a JSON array of {"name", "parameters"}."""
    if (yield from stream.take_nonblank()) != "[":
        raise NotCalls
    yield from stream.call_array()
