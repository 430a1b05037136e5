"""Stop regexes: SGLang's `stop_regex` sampling parameter, a stop string given as a pattern.

Where it sits: `SamplingParams.verify` compiles each pattern (a bad one is a 400 from the
TokenizerManager) and `normalize` sizes the window of output tokens the scheduler decodes to
search it (`stop_regex_window`); `Req.check_finished` searches that decoded tail after every
token (`search`), as SGLang's does; the DetokenizerManager holds back streamed text that
could still become a match (`partial_match_start`) and cuts the final text where the match
begins (as a stop string is cut, unless `no_stop_trim`).

Patterns run on the `regex` package (a dependency of transformers), not `re`: its searches
take a timeout, so a pattern that backtracks catastrophically costs one bounded search and an
error for its own request instead of stalling the scheduler every other request waits on; and
it matches partially, which is what lets a stream hold back the start of a match that the
next tokens may complete, as it does for stop strings.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

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
# One search's wall-clock bound. A plain pattern searches a window in microseconds and a whole
# 8k-token output in well under a millisecond; this only ever stops a pathological one, once
# (its request is aborted), and is long enough that a loaded machine never trips it
SEARCH_TIMEOUT_S = 0.25
# What a match of these needs to see lies outside the match itself (the text before it, the
# start of the output, another group): only the whole output gives the answer the user's text would
_CONTEXT_OPS = frozenset(
    getattr(_sre_constants, name)
    for name in ("AT", "ASSERT", "ASSERT_NOT", "GROUPREF", "GROUPREF_EXISTS")
    if hasattr(_sre_constants, name)
)


class StopRegexTimeout(Exception):
    """A stop regex's search ran past SEARCH_TIMEOUT_S."""


@functools.lru_cache(maxsize=512)
def compile_stop_regex(pattern: str) -> "regex.Pattern[str]":
    """The compiled pattern; ValueError saying what is wrong with it."""
    try:
        compiled = regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError) as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    lo, _ = _width(pattern)
    if lo == 0 or (lo is None and compiled.search("") is not None):
        raise ValueError(
            f"stop_regex {pattern!r} can match the empty string, so it would stop every output at its first "
            f"token: make it match at least one character (e.g. 'x+' rather than 'x*')"
        )
    return compiled


def stop_regex_window(pattern: str) -> int:
    """How many of the last output tokens hold every match of `pattern` that a new token completes.

    A match of at most W characters spans at most 4 W tokens (a character is at most 4 UTF-8
    bytes; every token of a byte-level or byte-fallback vocabulary carries at least one). A
    pattern of unbounded length (`\\d+`), or one whose match depends on text around it
    (anchors, lookarounds, backreferences: a window would start mid-word and `\\b` or `^` would
    match there), is searched in the whole output, as SGLang's unbounded ones are.
    """
    _, hi = _width(pattern)
    if hi is None or hi > _MAX_WINDOW_CHARS:
        return WHOLE_OUTPUT
    return 4 * hi


def search(pattern: str, text: str) -> Optional[Tuple[int, int]]:
    """The span of the first match of `pattern` in `text`, or None."""
    try:
        m = compile_stop_regex(pattern).search(text, timeout=SEARCH_TIMEOUT_S)
    except TimeoutError:
        raise StopRegexTimeout(
            f"stop_regex {pattern!r} took more than {SEARCH_TIMEOUT_S:g} s to search the output: "
            f"simplify it (nested repetition like '(a+)+' backtracks exponentially)"
        ) from None
    return m.span() if m is not None else None


def partial_match_start(pattern: str, text: str, start: int = 0) -> Optional[int]:
    """Where in `text` (at or after `start`) a match of `pattern` begins, completed or still
    possible with more text at the end; None if neither. A search that times out holds nothing."""
    try:
        m = compile_stop_regex(pattern).search(text, pos=start, partial=True, timeout=SEARCH_TIMEOUT_S)
    except TimeoutError:
        return None
    if m is None or (m.partial and m.start() == len(text)):  # (the empty tail is a prefix of every match)
        return None
    return m.start()


@functools.lru_cache(maxsize=512)
def _width(pattern: str) -> Tuple[Optional[int], Optional[int]]:
    """(fewest, most) characters a match of `pattern` spans; most is None when unbounded or when
    the match depends on its surroundings, both None when the stdlib cannot parse the pattern
    (the `regex` package's own syntax, like `\\p{L}`)."""
    try:
        parsed = _sre_parse.parse(pattern)
        lo, hi = parsed.getwidth()
    except Exception:  # (re.error, or a construct only the regex package knows)
        return None, None
    if hi >= _sre_constants.MAXREPEAT or _uses_context(parsed):
        return lo, None
    return lo, hi


def _uses_context(node: Any) -> bool:
    """Whether the parsed pattern holds an anchor, a lookaround or a backreference, at any depth."""
    if isinstance(node, _sre_parse.SubPattern):
        return any(op in _CONTEXT_OPS or _uses_context(av) for op, av in node)
    if isinstance(node, (list, tuple)):
        return any(_uses_context(item) for item in node)
    return False
