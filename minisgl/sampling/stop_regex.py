"""Stop regexes: SGLang's `stop_regex` sampling parameter, a stop string given as a pattern.

Where it sits: `SamplingParams.verify` checks and compiles each pattern (a bad one is a 400
from the TokenizerManager) and `normalize` sizes the window of output tokens the scheduler
decodes to search it (`stop_regex_window`); `Req.check_finished` searches that decoded tail
after every token (`search`), as SGLang's does; the DetokenizerManager holds back streamed
text that could still become part of a match (`hold_start`) and cuts the final text where the
match begins (as a stop string is cut, unless `no_stop_trim`).

Patterns take Python `re` syntax (SGLang's: it searches with `re`), checked by the stdlib's
parser, which also tells how wide a match can be; they run on the `regex` package (a
dependency of transformers), whose searches take a timeout and match partially. A user's
pattern runs inside the scheduler every other request waits on, so it is bounded three ways:
- before compiling: nested counted repeats multiply into the compiled program
  (`(?:(?:a{100}){100}){100}` is 34 characters and took 23 GB to compile): their product is
  at most MAX_REPEAT_PRODUCT;
- per token: all of one request's patterns share SEARCH_BUDGET_S of the thread's CPU time (a
  pattern that backtracks badly, or 64 slow ones, would otherwise add seconds to every step),
  and one search stops after a second of wall clock whatever the load; a request that runs
  past either is aborted with a 400 that says why, once;
- the server takes at most 64 patterns and 4,096 characters of them per prompt
  (TokenizerManager).
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import regex

try:  # the stdlib's regex parser: it knows the widths of what a pattern can match
    import re._constants as _sre_constants  # type: ignore[import-not-found]
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # Python 3.10
    import sre_constants as _sre_constants  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# SGLang's MAX_LEN for a pattern of unbounded length: the scheduler decodes the whole output
WHOLE_OUTPUT = 1 << 30
# A match longer than this many characters is searched in the whole output instead of a window
# (the window's decode costs what the whole output's does by then)
_MAX_WINDOW_CHARS = 1024
# The product of nested counted repeats' bounds: what a pattern may multiply its program by
MAX_REPEAT_PRODUCT = 10_000
# One request's search time per token, all its patterns together: CPU time of the searching
# thread, which a loaded machine's descheduling does not add to (wall-clock budgets aborted
# plain patterns under load). A plain pattern searches a window in microseconds and a whole
# 8k-token output in under a millisecond; this only stops a pathological one.
SEARCH_BUDGET_S = 0.05
# One search's wall-clock bound (the regex package's timeout), however loaded the machine: a
# pattern that backtracks badly stops here even before the CPU budget can be read
_SEARCH_WALL_LIMIT_S = 1.0
_REPEATS = tuple(getattr(_sre_constants, n) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_sre_constants, n))
# zero-width tests of the characters around a match (^, $, \b, \B, \A, \Z)
_ANCHOR_OPS = (_sre_constants.AT,)
# what a match needs to see beyond itself, or before it: lookarounds and backreferences
_LOOK_OPS = tuple(getattr(_sre_constants, n) for n in ("ASSERT", "ASSERT_NOT", "GROUPREF", "GROUPREF_EXISTS") if hasattr(_sre_constants, n))


def timeout_message() -> str:
    """The 400 of a request whose search ran past the budget (with --tp-size N: any rank's search)."""
    return (
        f"stop_regex took more than {SEARCH_BUDGET_S * 1e3:g} ms to search the output at one token (all of this "
        "request's patterns together): simplify them; alternatives that overlap under a repeat, like "
        "'(?:\\D|\\D){1,12}', backtrack exponentially"
    )


class StopRegexTimeout(Exception):
    """A request's stop regexes ran past SEARCH_BUDGET_S at one token."""


@dataclass(frozen=True)
class PatternShape:
    """What the stdlib's parser says of a pattern."""

    min_width: int
    max_width: Optional[int]  # None: unbounded
    anchors: bool  # ^ $ \b \B \A \Z
    looks: bool  # lookarounds, backreferences
    repeat_product: int


@functools.lru_cache(maxsize=128)
def pattern_shape(pattern: str) -> PatternShape:
    """The shape of a stop regex; ValueError when it is not Python `re` syntax."""
    try:
        with warnings.catch_warnings():  # ("possible nested set" and the like: re's notes on future syntax)
            warnings.simplefilter("ignore", FutureWarning)
            parsed = _sre_parse.parse(pattern)
        lo, hi = parsed.getwidth()
        anchors, looks, product = _walk(parsed)
        _check_same_in_both(pattern)
    except RecursionError:
        raise ValueError(f"stop_regex {pattern[:80]!r} is nested too deeply") from None
    except ValueError:  # (_check_same_in_both's own message)
        raise
    except Exception as e:  # re.error, and the regex package's own syntax (\p{L}, \m, (?V1), ...) that re refuses
        raise ValueError(f"stop_regex {pattern!r} is not a valid Python regular expression: {e}") from None
    return PatternShape(lo, None if hi >= _sre_constants.MAXREPEAT else hi, anchors, looks, product)


@functools.lru_cache(maxsize=128)
def compile_stop_regex(pattern: str) -> "regex.Pattern[str]":
    """The compiled pattern; ValueError saying what is wrong with it (checked before compiling)."""
    shape = pattern_shape(pattern)
    if shape.repeat_product > MAX_REPEAT_PRODUCT:
        raise ValueError(
            f"stop_regex {pattern[:80]!r} nests counted repeats that multiply to {shape.repeat_product} (at most "
            f"{MAX_REPEAT_PRODUCT}): its compiled form grows with that product"
        )
    try:
        compiled = regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError) as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    if shape.min_width == 0 or compiled.search("") is not None:
        raise ValueError(
            f"stop_regex {pattern!r} can match the empty string, so it would stop every output at its first "
            f"token: make it match at least one character (e.g. 'x+' rather than 'x*')"
        )
    return compiled


def stop_regex_window(pattern: str) -> int:
    """How many of the last output tokens hold every match of `pattern` that a new token completes.

    A match of at most W characters spans at most 4 W tokens (a character is at most 4 UTF-8
    bytes, and a token that shows text carries at least one; a skipped special token shows
    none, so a run of them inside a match can push it out of the window, as with stop strings
    and in SGLang). A pattern of unbounded length (`\\d+`), or one whose match depends on text
    around it (anchors, `\\b`, lookarounds, backreferences: a window would start mid-word and
    `\\b` or `^` would match there), is searched in the whole output, as SGLang's unbounded ones are.
    """
    shape = pattern_shape(pattern)
    if shape.max_width is None or shape.anchors or shape.looks or shape.max_width > _MAX_WINDOW_CHARS:
        return WHOLE_OUTPUT
    return 4 * shape.max_width


def first_match(patterns: Sequence[str], text: str, budget_s: Optional[float] = None) -> List[Tuple[int, int, str]]:
    """(start, end, pattern) of each pattern's first match in `text`; StopRegexTimeout when they
    take more than `budget_s` together (SEARCH_BUDGET_S by default).

    A trailing U+FFFD is a character still arriving (its other bytes come with the next token):
    it is left out, so `[^\\w\\s]` does not stop on the first byte of "你"."""
    text = text.rstrip("\ufffd")
    budget = SEARCH_BUDGET_S if budget_s is None else budget_s
    found = []
    t0 = time.thread_time()
    for pattern in patterns:
        try:
            m = compile_stop_regex(pattern).search(text, timeout=_SEARCH_WALL_LIMIT_S if budget > 0 else 0)
        except TimeoutError:
            m, budget = None, -1.0
        if time.thread_time() - t0 > budget:
            raise StopRegexTimeout(timeout_message())
        if m is not None:
            found.append((m.start(), m.end(), pattern))
    return found


def hold_start(patterns: Sequence[str], text: str, start: int = 0) -> int:
    """Where a stream must stop sending `text` (from `start`, what it already sent): the earliest
    place a match of any pattern begins, or could begin once more text comes; len(text) if none.

    A bounded pattern holds its last max-width characters (a match that more text completes lies
    there, whatever anchor it ends with: `\\b` and `$` read one character past it at most); a
    plain unbounded one holds from where a partial match starts; one with lookarounds (which
    may read any number of characters past the match) or unbounded with anchors holds
    everything, since the `regex` package misplaces partial matches that end in an assertion
    (`ab\\B` on "xab"). A search that runs past the budget holds everything too: the finish
    sends it."""
    safe = len(text)
    t0 = time.thread_time()
    for pattern in patterns:
        shape = pattern_shape(pattern)
        if shape.looks or (shape.max_width is None and shape.anchors):
            return start
        try:
            m = compile_stop_regex(pattern).search(text, pos=start, partial=True, timeout=_SEARCH_WALL_LIMIT_S)
        except TimeoutError:
            return start
        if time.thread_time() - t0 > SEARCH_BUDGET_S:
            return start
        if m is not None and not (m.partial and m.start() == len(text)):  # (the empty tail: a prefix of every match)
            safe = min(safe, m.start())
        if shape.max_width is not None:
            safe = min(safe, max(len(text) - shape.max_width, start))
    return safe


def cut_span(pattern: str, text: str, start: int = 0) -> Optional[Tuple[int, int]]:
    """The span of the match a finish cuts at: the first at or after `start` (what a stream already
    sent held none), or None (also when the search runs past a generous bound: nothing is cut)."""
    try:
        m = compile_stop_regex(pattern).search(text, pos=start, timeout=_SEARCH_WALL_LIMIT_S)
    except TimeoutError:
        return None
    return m.span() if m is not None else None


def _check_same_in_both(pattern: str) -> None:
    """ValueError for what `re` reads as literal text and the `regex` package as syntax: a `{` that
    is not a repeat count (`(?:END){i<=60}` is a fuzzy match there, wider than any window, or
    empty with `{d<=3}`) and a POSIX class (`[[:alpha:]]`). Escaped, both read the same in both."""
    for m in _BRACE_OR_POSIX.finditer(pattern):
        backslashes = len(m.group("escapes"))
        if backslashes % 2:  # (escaped: a literal in both)
            continue
        if m.group("brace") is not None and _REPEAT_COUNT.match(pattern, m.start("brace")) is None:
            raise ValueError(
                f"stop_regex {pattern!r} has a '{{' that is not a repeat count: write '\\{{' for the character (the "
                f"regex package that runs stop regexes reads '{{...}}' after an item as a fuzzy-match constraint)"
            )
        if m.group("posix") is not None:
            raise ValueError(f"stop_regex {pattern!r} has a POSIX class ({m.group('posix')}), which is not Python syntax")


_BRACE_OR_POSIX = regex.compile(r"(?P<escapes>\\*)(?:(?P<brace>\{)|(?P<posix>\[:\^?[A-Za-z]+:\]))")
_REPEAT_COUNT = regex.compile(r"\{(?:\d+|\d*,\d*)\}")


def _walk(node: Any, product: int = 1) -> Tuple[bool, bool, int]:
    """(has anchors, has lookarounds or backreferences, the largest product of nested counted
    repeat bounds) of a parsed pattern, at any depth."""
    anchors = looks = False
    worst = product
    items: Any
    if isinstance(node, _sre_parse.SubPattern):
        items = list(node)
    elif isinstance(node, (list, tuple)):
        items = [("", x) for x in node]
    else:
        return False, False, product
    for op, av in items:
        anchors |= op in _ANCHOR_OPS
        looks |= op in _LOOK_OPS
        inner = product
        if op in _REPEATS:
            lo, hi, body = av
            bound = hi if hi < _sre_constants.MAXREPEAT else max(lo, 1)
            inner = product * max(bound, 1)
            a, lk, w = _walk(body, inner)
        else:
            a, lk, w = _walk(av, inner)
        anchors, looks, worst = anchors or a, looks or lk, max(worst, w)
    return anchors, looks, worst
