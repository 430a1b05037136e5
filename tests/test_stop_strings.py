"""Stop strings and stop regexes end to end, with the sampled tokens scripted.

Each test feeds a fixed token sequence through the real chain a sampled token takes:
`Req.check_finished` (the scheduler decides), `stream_output` (what is emitted) and the
`DetokenizerManager` (what text the user gets). A script can spell a stop string in ways
a model may but a tokenizer would not (byte by byte, around a special token), which is
where the scheduler's decoded tail and the user's text used to disagree.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import pytest

from minisgl.managers.detokenizer_manager import DetokenizerManager
from minisgl.managers.schedule_batch import Req
from minisgl.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.server_args import ServerArgs
from minisgl.test_utils import train_byte_fallback_tokenizer, train_tokenizer


class _Emitter(SchedulerOutputProcessorMixin):
    """Only the scheduler's output side: stream_output collects into _outputs."""

    def __init__(self) -> None:
        self._outputs: List[Any] = []
        self.server_args = SimpleNamespace(stream_interval=1)
        self.draft_worker = None  # (no speculative decoding: stream_output reads it)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("stop-tokenizer")
    train_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def sp_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama-2 / Mistral style: U+2581 word marker, byte fallback (minisgl.test_utils)."""
    path = tmp_path_factory.mktemp("stop-sp-tokenizer")
    train_byte_fallback_tokenizer().save_pretrained(str(path))
    return str(path)


def run_script(
    tokenizer_dir: str, script: List[int], stream: bool, prompt: str = "Prompt:", deltas: Optional[List[str]] = None, **params: Any
) -> Tuple[str, Optional[Dict[str, Any]]]:
    """(the text the user gets, the finish reason) for `script` sampled one token per step;
    `deltas`, when given, collects the text each step sent."""
    detok = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir))
    tokenizer = detok.tokenizer
    sampling = SamplingParams.from_dict({"max_new_tokens": len(script) + 5, "ignore_eos": True, **params})
    sampling.normalize(tokenizer)
    sampling.verify()
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    req = Req("r", None, prompt_ids, sampling, stream=stream, vocab_size=len(tokenizer), tokenizer=tokenizer)
    emitter, text, finish = _Emitter(), "", None
    for token in script:
        req.output_ids.append(token)
        req.check_finished()
        emitter.stream_output([req])
        for out in emitter._outputs:
            str_out = detok.handle_batch_token_id_out(out)
            text += "".join(str_out.output_strs)
            if deltas is not None:
                deltas.append("".join(str_out.output_strs))
            finish = str_out.finished_reasons[-1] or finish
        emitter._outputs.clear()
        if req.finished():
            break
    return text, finish


def ids(tokenizer_dir: str, text: str) -> List[int]:
    return DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir)).tokenizer.encode(text, add_special_tokens=False)


def byte_ids(tokenizer_dir: str, text: str) -> List[int]:
    """`text` (ASCII) spelled one byte-level token per character, as no tokenizer would encode it."""
    tokenizer = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir)).tokenizer
    tokens = ["\u0120" if c == " " else c for c in text]  # byte-level BPE writes a space as U+0120
    return tokenizer.convert_tokens_to_ids(tokens)


@pytest.mark.parametrize("stream", [True, False])
def test_the_stop_that_starts_first_in_the_text_wins_whatever_the_list_order(tokenizer_dir: str, stream: bool) -> None:
    # the last token completes both "ab" and "b": "ab" starts first, so nothing of it may show
    script = byte_ids(tokenizer_dir, "xab")
    text, finish = run_script(tokenizer_dir, script, stream, stop=["b", "ab"])
    assert (text, finish) == ("x", {"type": "stop", "matched": "ab"})


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_completed_by_the_last_allowed_token_is_a_stop(tokenizer_dir: str, stream: bool) -> None:
    """SGLang 0.5.23 checks stops before length; the 0.5.9 order handed the stop string to the user."""
    script = ids(tokenizer_dir, "Say hello")
    text, finish = run_script(tokenizer_dir, script, stream, stop=" hello", max_new_tokens=len(script))
    assert (text, finish) == ("Say", {"type": "stop", "matched": " hello"})


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_spelled_with_more_tokens_than_its_encoding_is_found(tokenizer_dir: str, stream: bool) -> None:
    assert len(ids(tokenizer_dir, " hello")) < len(" hello")  # the premise: normally fewer tokens than bytes
    script = ids(tokenizer_dir, "Say") + byte_ids(tokenizer_dir, " hello") + ids(tokenizer_dir, " there")
    text, finish = run_script(tokenizer_dir, script, stream, stop=" hello")
    assert (text, finish) == ("Say", {"type": "stop", "matched": " hello"})


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_around_a_skipped_special_token_matches_the_text_the_user_sees(tokenizer_dir: str, stream: bool) -> None:
    tokenizer = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir)).tokenizer
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = byte_ids(tokenizer_dir, "ab") + [special] + byte_ids(tokenizer_dir, "c and more")
    text, finish = run_script(tokenizer_dir, script, stream, stop="bc")  # the user reads "abc and more"
    assert (text, finish) == ("a", {"type": "stop", "matched": "bc"})
    # with special tokens kept the text reads "ab<|endoftext|>c": no stop, all of it arrives
    text, finish = run_script(tokenizer_dir, script, stream, stop="bc", skip_special_tokens=False, max_new_tokens=len(script))
    assert text == "ab<|endoftext|>c and more" and finish is not None and finish["type"] == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_that_spells_a_skipped_special_token_stops_as_sglangs_does(tokenizer_dir: str, stream: bool) -> None:
    """stop=["<|endoftext|>"] (a ChatML client's "<|im_end|>" on a model whose EOS is another token):
    the user's text skips it, so it never matched and the model ran on into made-up turns.
    SGLang matches stops against a decode that keeps special tokens."""
    tokenizer = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir)).tokenizer
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = byte_ids(tokenizer_dir, "ab") + [special] + byte_ids(tokenizer_dir, "c and more")
    text, finish = run_script(tokenizer_dir, script, stream, stop=["<|endoftext|>", "zzz"])
    assert (text, finish) == ("ab", {"type": "stop", "matched": "<|endoftext|>"})


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_with_a_leading_space_at_the_start_of_a_sentencepiece_output(sp_tokenizer_dir: str, stream: bool) -> None:
    """The scheduler decoded its tail alone, and a SentencePiece decode drops the leading
    space: " 42" read "42", the stop went unseen, and the user got it (and all after it)."""
    script = ids(sp_tokenizer_dir, " 42. The answer is")
    text, finish = run_script(sp_tokenizer_dir, script, stream, prompt="The answer is", stop=" 42")
    assert (text, finish) == ("", {"type": "stop", "matched": " 42"})


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_after_a_byte_spelled_character_is_seen_at_once(sp_tokenizer_dir: str, stream: bool) -> None:
    """A tail that began inside the bytes of the emoji before the stop decoded as U+FFFD
    throughout that byte run (byte fallback), so "🎉" was seen only tokens later, or never
    when the model ended right after it: the user got the stop string."""
    eos = 2  # </s>
    script = ids(sp_tokenizer_dir, "Party 😀🎉") + [eos]
    text, finish = run_script(
        sp_tokenizer_dir, script, stream, prompt="Say it with emojis:", stop="🎉", stop_token_ids=[eos], ignore_eos=False
    )
    assert (text, finish) == (" Party 😀", {"type": "stop", "matched": "🎉"})


class _CountingStr(str):
    """A stop string that counts how many of its prefixes the checks build."""

    slices = 0

    def __getitem__(self, key: Any) -> str:
        _CountingStr.slices += 1
        return str.__getitem__(self, key)


def test_a_long_stop_string_costs_what_the_text_does_not_its_own_length_squared(tokenizer_dir: str) -> None:
    """A 1.6 MB stop string that never matches built every one of its prefixes at every step
    (~7 s a step at 400k characters): one request stalled every other, and a longer one
    tripped the watchdog and took the server down."""
    from minisgl.managers.detokenizer_manager import stop_str_safe_len

    stop = _CountingStr("\U0001f600" * 100_000)
    tokenizer = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir)).tokenizer
    sampling = SamplingParams.from_dict({"max_new_tokens": 8, "stop": "x"})
    sampling.normalize(tokenizer)
    sampling.stop_strs = [stop]  # (normalize would tokenize it; the check is what is measured)
    req = Req("r", None, tokenizer.encode("Prompt:"), sampling, vocab_size=len(tokenizer), tokenizer=tokenizer)
    req.output_ids = ids(tokenizer_dir, "a few words")
    _CountingStr.slices = 0
    assert req.check_match_stop_str_prefix() is False
    assert stop_str_safe_len("a few words", [stop], start=3) == len("a few words")
    assert _CountingStr.slices <= 2 * (len("a few words") + 1)  # prefixes no longer than the text


# --------------------------------------------------------------------------- stop regexes
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_stop_regex_cuts_the_text_where_its_match_begins(tokenizer_dir: str, stream: bool, no_stop_trim: bool) -> None:
    """Like a stop string: the match is cut (kept with no_stop_trim), the pattern is what matched."""
    script = byte_ids(tokenizer_dir, "Order 123 shipped")
    text, finish = run_script(tokenizer_dir, script, stream, stop_regex=r"\d{3}", no_stop_trim=no_stop_trim)
    assert (text, finish) == ("Order 123" if no_stop_trim else "Order ", {"type": "stop", "matched": r"\d{3}"})


def test_a_stream_holds_back_what_a_stop_regex_may_still_match_then_releases_it(tokenizer_dir: str) -> None:
    deltas: List[str] = []
    script = byte_ids(tokenizer_dir, "Order 12 shipped")
    text, finish = run_script(tokenizer_dir, script, True, deltas=deltas, stop_regex=r"\d{3}", max_new_tokens=len(script))
    assert text == "Order 12 shipped" and finish == {"type": "length", "length": len(script)}
    sent = ["".join(deltas[: i + 1]) for i in range(len(deltas))]  # (one token, one character, per step)
    assert sent[7].startswith("Order") and "1" not in sent[7]  # at "Order 12": held while a third digit could come
    assert all(len(sent[i]) >= i + 1 - 3 for i in range(len(sent)))  # never more than the pattern's 3 characters held


@pytest.mark.parametrize("stream", [True, False])
def test_an_unbounded_stop_regex_matches_across_the_whole_output(tokenizer_dir: str, stream: bool) -> None:
    """"Order.*shipped" is searched in the whole output (a window could not hold every match),
    and a stream sends nothing from "Order" on while the match may still complete."""
    deltas: List[str] = []
    script = byte_ids(tokenizer_dir, "Hi. Order 12345678901234567890 shipped today")
    text, finish = run_script(tokenizer_dir, script, stream, deltas=deltas, stop_regex="Order.*shipped")
    assert (text, finish) == ("Hi. ", {"type": "stop", "matched": "Order.*shipped"})
    assert all("O" not in d for d in deltas)


@pytest.mark.parametrize("stream", [True, False])
def test_an_anchored_stop_regex_sees_the_start_of_the_output_not_of_a_window(tokenizer_dir: str, stream: bool) -> None:
    text, finish = run_script(tokenizer_dir, byte_ids(tokenizer_dir, "Order 1"), stream, stop_regex="^Or")
    assert (text, finish) == ("", {"type": "stop", "matched": "^Or"})
    script = byte_ids(tokenizer_dir, "No Order")
    text, finish = run_script(tokenizer_dir, script, stream, stop_regex="^Or", max_new_tokens=len(script))
    assert text == "No Order" and finish is not None and finish["type"] == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_the_first_stop_in_the_text_wins_between_strings_and_regexes(tokenizer_dir: str, stream: bool) -> None:
    script = byte_ids(tokenizer_dir, "ab1 cd")
    text, finish = run_script(tokenizer_dir, script, stream, stop="b1", stop_regex=[r"\d", "zz"])
    assert (text, finish) == ("a", {"type": "stop", "matched": "b1"})
    text, finish = run_script(tokenizer_dir, script, stream, stop=" cd", stop_regex=[r"\d", "zz"])
    assert (text, finish) == ("ab", {"type": "stop", "matched": r"\d"})


def test_stop_regexes_that_search_too_long_end_their_own_request_with_an_error(
    tokenizer_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One budget per token for all of a request's patterns: 64 slow ones just under a per-search
    limit added seconds to every other request's steps."""
    from minisgl.sampling import stop_regex

    monkeypatch.setattr(stop_regex, "SEARCH_BUDGET_S", 0)  # (any search runs past it)
    text, finish = run_script(tokenizer_dir, byte_ids(tokenizer_dir, "abc"), False, stop_regex="b+c")
    assert finish is not None and finish["type"] == "abort" and finish["status_code"] == 400
    assert "stop_regex took more than 0 ms to search the output at one token (all of this request's patterns" in finish["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_character_still_arriving_in_byte_tokens_does_not_match_as_u_fffd(tokenizer_dir: str, stream: bool) -> None:
    """"Stop at the first punctuation": the first byte of 你 decoded as U+FFFD, which [^\\w\\s] matched."""
    script = ids(tokenizer_dir, "Hello 你好 world. More")
    assert len(script) > len("Hello 你好 world. More".encode()) // 3  # (the premise: 你 and 好 are spelled in bytes)
    text, finish = run_script(tokenizer_dir, script, stream, stop_regex=r"[^\w\s]")
    assert (text, finish) == ("Hello 你好 world", {"type": "stop", "matched": r"[^\w\s]"})


@pytest.mark.parametrize("pattern, text, expected", [(r"ab\B", "xabc", "x"), (r"\s\b", "x yz", "x"), (r"b\B", "abc d", "a")])
def test_a_stream_never_sends_what_a_match_ending_in_an_assertion_cuts(tokenizer_dir: str, pattern: str, text: str, expected: str) -> None:
    """The regex package misplaces a partial match that ends in an assertion ("ab\\B" on "xab"): the
    stream sent "ab", which the finish then cut."""
    script = byte_ids(tokenizer_dir, text)
    assert run_script(tokenizer_dir, script, True, stop_regex=pattern) == run_script(tokenizer_dir, script, False, stop_regex=pattern)
    assert run_script(tokenizer_dir, script, True, stop_regex=pattern)[0] == expected


def test_the_finish_cuts_at_the_first_match_in_the_held_back_text() -> None:
    """A stream held no match in what it sent, so the cut is searched for in the rest only (a slow
    pattern over a long output no longer times out there and leaves the match in the text)."""
    from minisgl.managers.detokenizer_manager import trim_matched_stop

    finish = {"type": "stop", "matched": r"\d"}
    assert trim_matched_stop("1xx2yy", finish, False, [], [r"\d"], sent=1) == "1xx"
    assert trim_matched_stop("1xx2yy", finish, True, [], [r"\d"], sent=1) == "1xx2"


@pytest.mark.parametrize(
    "value, message",
    [
        ("(", "stop_regex '(' is not a valid Python regular expression: missing )"),
        ("x*", "stop_regex 'x*' can match the empty string"),
        (r"\b", "can match the empty string"),
        (["a", 3], "stop_regex must be a string or a list of strings"),
        # the regex package's own syntax: fuzzy matches could be wider than any window, or empty
        ("(?:END){i<=60}", "has a '{' that is not a repeat count"),
        ("[[:alpha:]]+", "has a POSIX class ([:alpha:])"),
        (r"\p{L}{2}", "is not a valid Python regular expression"),
        ("(" * 2000 + "a" + ")" * 2000, "is nested too deeply"),  # (was a RecursionError: a 500)
        # 34 characters that took 23 GB to compile
        ("(?:(?:(?:a{100}){100}){100}){100}", "nests counted repeats that multiply to 100000000 (at most 10000)"),
    ],
)
def test_a_bad_stop_regex_is_refused_saying_what_to_change(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        p = SamplingParams.from_dict({"stop_regex": value})
        p.normalize()
        p.verify()


def test_a_stop_regex_window_holds_every_match_a_new_token_completes() -> None:
    from minisgl.sampling.stop_regex import WHOLE_OUTPUT, stop_regex_window

    assert stop_regex_window(r"\d{3}") == 12  # 3 characters of up to 4 UTF-8 bytes (a token each at worst)
    assert stop_regex_window("END|STOP") == 16
    # unbounded, or depending on text around the match: everything
    for pattern in [r"\d+", "^Or", r"\bcat\b", r"(?<=a)b", r"(a)\1", "x{2,5000}"]:
        assert stop_regex_window(pattern) == WHOLE_OUTPUT, pattern


def test_a_stream_holds_what_a_lookahead_may_still_complete(tokenizer_dir: str) -> None:
    """a(?=b\\B) matches one character, decided only by the ones after it, and the regex package
    misplaces its partial match on "xab": a hold of its width sent the "a" the finish then cut."""
    script = byte_ids(tokenizer_dir, "xabc")
    assert run_script(tokenizer_dir, script, True, stop_regex=r"a(?=b\B)") == run_script(tokenizer_dir, script, False, stop_regex=r"a(?=b\B)")
    assert run_script(tokenizer_dir, script, True, stop_regex=r"a(?=b\B)")[0] == "x"
