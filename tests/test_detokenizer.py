"""DetokenizerManager, in process: incremental UTF-8-safe streaming, stop trimming, grouped decode.

The scheduler side is simulated exactly as the BatchTokenIDOutput contract says: the
first emission of a rid carries up to 5 prompt ids of left context and `read_offsets`
marks where the output starts; later emissions carry only the delta ids.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Dict, List, Optional, Sequence

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minisgl.managers import detokenizer_manager
from minisgl.managers.detokenizer_manager import DetokenizerManager, find_printable_text, stop_str_safe_len
from minisgl.managers.io_struct import BatchStrOutput, BatchTokenIDOutput, ClearDecodeStatusReq, FlushCacheReqInput
from minisgl.managers.watchdog import SoftWatchdog
from minisgl.server_args import ServerArgs
from minisgl.test_utils import train_byte_fallback_tokenizer, train_tokenizer

EOS = 2  # <|im_end|>
CONTEXT = 5  # prompt ids of left context on the first emission


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("detok-tokenizer")
    train_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture
def mgr(tokenizer_dir: str) -> DetokenizerManager:
    return DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir))


def token_msg(rows: Sequence[Dict[str, Any]]) -> BatchTokenIDOutput:
    """A BatchTokenIDOutput from per-row dicts (keys: rid, decode_ids, read_offset, output_ids, ...)."""
    return BatchTokenIDOutput(
        rids=[r["rid"] for r in rows],
        finished_reasons=[r.get("finished_reason") for r in rows],
        decode_ids=[r["decode_ids"] for r in rows],
        read_offsets=[r.get("read_offset", 0) for r in rows],
        output_ids=[r.get("output_ids", r["decode_ids"]) for r in rows],
        skip_special_tokens=[r.get("skip_special_tokens", True) for r in rows],
        spaces_between_special_tokens=[r.get("spaces_between_special_tokens", True) for r in rows],
        no_stop_trim=[r.get("no_stop_trim", False) for r in rows],
        stop_strs=[r.get("stop_strs", []) for r in rows],
        stop_regexes=[r.get("stop_regexes", []) for r in rows],
        prompt_tokens=[r.get("prompt_tokens", 0) for r in rows],
        completion_tokens=[r.get("completion_tokens", 0) for r in rows],
        cached_tokens=[0 for _ in rows],
    )


def split_steps(n: int, rng: random.Random, max_step: int = 4) -> List[int]:
    steps = []
    while n > 0:
        steps.append(min(n, rng.randint(1, max_step)))
        n -= steps[-1]
    return steps


def stream(
    mgr: DetokenizerManager,
    prompt_ids: List[int],
    out_ids: List[int],
    steps: List[int],
    finished_reason: Optional[Dict[str, Any]] = None,
    rid: str = "r0",
    **row: Any,
) -> List[str]:
    """Feed out_ids in `steps` chunks as the scheduler would; return every text delta."""
    finished_reason = finished_reason or {"type": "length", "length": len(out_ids)}
    ctx = prompt_ids[-CONTEXT:]
    deltas, pos = [], 0
    for k, n in enumerate(steps):
        chunk = out_ids[pos : pos + n]
        first = pos == 0
        pos += n
        msg = token_msg(
            [
                dict(
                    rid=rid,
                    decode_ids=(ctx + chunk) if first else chunk,
                    read_offset=len(ctx) if first else 0,
                    output_ids=chunk,
                    finished_reason=finished_reason if k == len(steps) - 1 else None,
                    **row,
                )
            ]
        )
        out = mgr.handle_batch_token_id_out(msg)
        assert out.rids == [rid] and out.output_ids == [chunk]
        deltas.append(out.output_strs[0])
    assert pos == len(out_ids)
    return deltas


# ---------------------------------------------------------------------- multi-byte text
MULTIBYTE_TEXTS = [
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Family 👩‍👩‍👧‍👦 and flags 🏳️‍🌈 with 👍🏽 thumbs 🎉",
    "Crème brûlée à la façon de Noël, naïve señor, Ångström, Dvořák",
    "mixed: 日本語 text, émoji 😀 and ascii\nnew line 中文结尾",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_streaming_multibyte_never_emits_replacement_char(mgr: DetokenizerManager, text: str) -> None:
    tok = mgr.tokenizer
    prompt_ids = tok.encode("User said: hello there", add_special_tokens=False)
    out_ids = tok.encode(text, add_special_tokens=False)
    # The test is only meaningful if the tokenizer really cuts characters between tokens.
    assert any(tok.decode(out_ids[:i]).endswith("\ufffd") for i in range(1, len(out_ids)))
    for seed in range(6):
        steps = [1] * len(out_ids) if seed == 0 else split_steps(len(out_ids), random.Random(seed))
        deltas = stream(mgr, prompt_ids, out_ids, steps, rid=f"r{seed}")
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == text == tok.decode(out_ids)
        # It streamed: text arrived before the final message.
        assert "".join(deltas[:-1]) != ""
    assert mgr.decode_status == {}


@pytest.mark.parametrize(("prompt", "answer"), [("Answer with emojis: 😀😀", "🎉 ok"), ("续写：你好", "吗？是的")])
def test_left_context_starting_inside_a_byte_spelled_character_spoils_nothing(
    tmp_path: Any, prompt: str, answer: str
) -> None:
    """Byte fallback (Llama-2, Mistral): the five prompt ids of left context began inside the
    prompt's last character, and the decoder turned that whole run of byte tokens, the
    answer's own bytes included, into U+FFFD ("�������� ok" for "🎉 ok")."""
    train_byte_fallback_tokenizer().save_pretrained(str(tmp_path))
    mgr = DetokenizerManager(ServerArgs(tokenizer_path=str(tmp_path)))
    tok = mgr.tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    out_ids = tok.encode(answer, add_special_tokens=False)
    if tok.convert_ids_to_tokens(out_ids[0]) == "\u2581":
        out_ids = out_ids[1:]  # the answer continues the prompt's word: no word marker
    assert tok.decode(prompt_ids[-CONTEXT:]).startswith("\ufffd")  # the premise: context starts mid-character
    for steps in ([1] * len(out_ids), [len(out_ids)]):  # streamed token by token, and all at once
        assert "".join(stream(mgr, prompt_ids, out_ids, steps)) == answer
    assert mgr.decode_status == {}


def test_an_answer_cut_inside_a_byte_spelled_character_keeps_its_whole_ones(tmp_path: Any) -> None:
    """Byte fallback (Llama-2, Mistral): an answer cut by max_tokens after 2 of the 3 bytes of a
    CJK character, right after a newline byte. Decoded at once (a non-streaming answer), the
    decoder turned the whole byte run, the newline and a complete character with it, into
    U+FFFD; a stream had sent them. Both now give the stream's text."""
    train_byte_fallback_tokenizer().save_pretrained(str(tmp_path))
    mgr = DetokenizerManager(ServerArgs(tokenizer_path=str(tmp_path)))
    tok = mgr.tokenizer
    byte = lambda b: tok.convert_tokens_to_ids(f"<0x{b:02X}>")  # noqa: E731
    prompt_ids = tok.encode("Answer:", add_special_tokens=False)
    out_ids = tok.encode("Hello", add_special_tokens=False) + [byte(0x0A)] + [byte(b) for b in "数".encode()]
    out_ids += [byte(b) for b in "据".encode()[:2]]  # cut inside 据
    streamed = "".join(stream(mgr, prompt_ids, out_ids, [1] * len(out_ids)))
    at_once = "".join(stream(mgr, prompt_ids, out_ids, [len(out_ids)]))
    assert streamed.startswith(" Hello\n数") and at_once == streamed
    assert mgr.decode_status == {}


def test_cjk_streams_each_character_as_soon_as_complete(mgr: DetokenizerManager) -> None:
    tok = mgr.tokenizer
    text = "你好世界"
    out_ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(mgr, [], out_ids, [1] * len(out_ids))
    shown = ""
    for i, d in enumerate(deltas):
        shown += d
        # Everything whose bytes have fully arrived is already shown.
        assert shown == tok.decode(out_ids[: i + 1]).rstrip("\ufffd")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=2047), min_size=1, max_size=24),
    seed=st.integers(min_value=0, max_value=10_000),
    prompt=st.sampled_from(["", "Hi", "The quick brown fox jumps over"]),
    max_step=st.integers(min_value=1, max_value=6),
)
def test_property_concatenated_deltas_equal_full_decode(
    mgr: DetokenizerManager, ids: List[int], seed: int, prompt: str, max_step: int
) -> None:
    tok = mgr.tokenizer
    full = tok.decode(ids, skip_special_tokens=True)
    assume("\ufffd" not in full)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    deltas = stream(mgr, prompt_ids, ids, split_steps(len(ids), random.Random(seed), max_step), rid=f"p{seed}")
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)
    assert mgr.decode_status == {}


def test_find_printable_text_rules() -> None:
    assert find_printable_text("hello wor") == "hello "
    assert find_printable_text("line\n") == "line\n"
    assert find_printable_text("你好") == "你好"
    assert find_printable_text("你好\ufffd") == "你好"
    assert find_printable_text("abc\ufffd") == ""


# ---------------------------------------------------------------------- stop handling
def _stop_case(tok: Any, span: int) -> tuple[List[int], str, str]:
    """Output ids that end where a stop string spanning `span` tokens completes, that string, and the full text."""
    text = "The answer is 42. Then we stop here and carry on."
    ids = tok.encode(text, add_special_tokens=False)
    k = 8  # token ' The'
    window = tok.decode(ids[k : k + span])
    stop = window[1:-1] if span > 2 else window[1:]  # cut inside the first and last token
    assert len(tok.encode(stop, add_special_tokens=False)) >= 1
    out_ids = ids[: k + span]  # the scheduler finishes as soon as the stop string is complete
    return out_ids, stop, tok.decode(out_ids)


@pytest.mark.parametrize("span", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stop_string_trimmed_and_never_leaked(mgr: DetokenizerManager, span: int, seed: int) -> None:
    tok = mgr.tokenizer
    out_ids, stop, full = _stop_case(tok, span)
    expected = full[: full.find(stop)]
    steps = [1] * len(out_ids) if seed == 0 else split_steps(len(out_ids), random.Random(seed), 3)
    reason = {"type": "stop", "matched": stop}
    deltas = stream(mgr, [], out_ids, steps, reason, stop_strs=[stop, "never-matches"])
    shown = ""
    for d in deltas:
        shown += d
        # No part of the stop string ever reaches the client.
        assert expected.startswith(shown), (shown, stop)
    assert shown == expected


@pytest.mark.parametrize("span", [2, 3])
def test_stop_string_kept_with_no_stop_trim(mgr: DetokenizerManager, span: int) -> None:
    out_ids, stop, full = _stop_case(mgr.tokenizer, span)
    reason = {"type": "stop", "matched": stop}
    deltas = stream(mgr, [], out_ids, [1] * len(out_ids), reason, stop_strs=[stop], no_stop_trim=True)
    assert "".join(deltas) == full[: full.find(stop) + len(stop)]


def test_possible_stop_prefix_held_back_then_released(mgr: DetokenizerManager) -> None:
    tok = mgr.tokenizer
    out_ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    deltas = stream(mgr, [], out_ids, [1] * len(out_ids), stop_strs=["beta gammX"])
    shown = ""
    for i, d in enumerate(deltas[:-1]):
        shown += d
        text = tok.decode(out_ids[: i + 1])
        if text.endswith(" beta"):
            # " beta" could start the stop string: not shown yet.
            assert not shown.endswith("beta")
    assert "".join(deltas) == "alpha beta gamma delta"
    assert stop_str_safe_len("x beta gam", ["beta gammX"]) == len("x ")
    assert stop_str_safe_len("x beta gammX y", ["beta gammX"]) == len("x ")


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_token_trimmed_unless_no_stop_trim(mgr: DetokenizerManager, no_stop_trim: bool) -> None:
    tok = mgr.tokenizer
    body = tok.encode("All done here", add_special_tokens=False)
    reason = {"type": "stop", "matched": EOS}
    steps = split_steps(len(body) + 1, random.Random(3), 2)
    deltas = stream(mgr, [], body + [EOS], steps, reason, skip_special_tokens=False, no_stop_trim=no_stop_trim)
    assert "".join(deltas) == ("All done here<|im_end|>" if no_stop_trim else "All done here")
    # A stop token from stop_token_ids that is an ordinary word is trimmed the same way.
    word = tok.encode(" and", add_special_tokens=False)
    assert len(word) == 1
    ids = tok.encode("All done", add_special_tokens=False) + word
    deltas = stream(mgr, [], ids, [1] * len(ids), {"type": "stop", "matched": word[0]}, rid="w", no_stop_trim=no_stop_trim)
    assert "".join(deltas) == ("All done and" if no_stop_trim else "All done")


# ---------------------------------------------------------------------- batching and state
def test_grouped_batch_decode_matches_decoding_each_alone(tokenizer_dir: str) -> None:
    tok = train_tokenizer()
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    flags = [(True, True), (False, True), (False, False), (True, False), (False, True)]
    rows = [
        dict(rid=f"g{i}", decode_ids=ids[: 4 + i], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        for i, (skip, spaces) in enumerate(flags)
    ]
    batched = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir))
    calls: List[int] = []
    real_batch_decode = batched.tokenizer.batch_decode

    def counting_batch_decode(ids_list: List[List[int]], **kw: Any) -> List[str]:
        calls.append(len(ids_list))
        return real_batch_decode(ids_list, **kw)

    batched.tokenizer.batch_decode = counting_batch_decode
    out = batched.handle_batch_token_id_out(token_msg(rows))
    assert len(calls) == len(set(flags))  # one batch_decode per flag group
    for i, row in enumerate(rows):
        alone = DetokenizerManager(ServerArgs(tokenizer_path=tokenizer_dir))
        assert out.output_strs[i] == alone.handle_batch_token_id_out(token_msg([row])).output_strs[0]
    assert "<|im_start|>" in out.output_strs[1] and "<|im_start|>" not in out.output_strs[0]


def test_interleaved_requests_in_one_batch(mgr: DetokenizerManager) -> None:
    tok = mgr.tokenizer
    a = tok.encode("你好，世界", add_special_tokens=False)
    b = tok.encode("hello world again", add_special_tokens=False)
    got = {"a": "", "b": ""}
    n = max(len(a), len(b))
    for i in range(n):
        rows = []
        for rid, ids in (("a", a), ("b", b)):
            if i < len(ids):
                done = i == len(ids) - 1
                reason = {"type": "length", "length": len(ids)} if done else None
                rows.append(dict(rid=rid, decode_ids=[ids[i]], finished_reason=reason))
        out = mgr.handle_batch_token_id_out(token_msg(rows))
        for rid, s in zip(out.rids, out.output_strs):
            got[rid] += s
    assert got == {"a": "你好，世界", "b": "hello world again"}
    assert len(mgr.decode_status) == 0


def test_passthrough_fields_and_state_lifecycle(mgr: DetokenizerManager) -> None:
    msg = token_msg([dict(rid="x", decode_ids=[40, 41], output_ids=[41], read_offset=1, prompt_tokens=7, completion_tokens=1)])
    msg.output_token_logprobs_val = [[float("-inf")]]
    msg.output_token_logprobs_idx = [[41]]
    msg.time_stats = [{"queue": 0.5}]
    out = mgr.dispatch(msg)
    assert isinstance(out, BatchStrOutput)
    assert out.output_ids == [[41]] and out.prompt_tokens == [7] and out.completion_tokens == [1]
    assert out.output_token_logprobs_val == [[float("-inf")]] and out.time_stats == [{"queue": 0.5}]
    assert list(mgr.decode_status) == ["x"]
    # Aborted upstream: the state is dropped on request, and nothing is sent back.
    assert mgr.dispatch(ClearDecodeStatusReq(rids=["x", "unknown"])) is None
    assert len(mgr.decode_status) == 0
    with pytest.raises(TypeError, match="FlushCacheReqInput"):
        mgr.dispatch(FlushCacheReqInput())


def test_abort_finish_flushes_held_back_text(mgr: DetokenizerManager) -> None:
    tok = mgr.tokenizer
    ids = tok.encode("wait for it", add_special_tokens=False)
    deltas = stream(mgr, [], ids, [1] * len(ids), {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
    assert deltas[-1] != "" and "".join(deltas) == "wait for it"


# ---------------------------------------------------------------------- soft watchdog
def test_soft_watchdog_reports_a_slow_iteration_once(caplog: pytest.LogCaptureFixture) -> None:
    wd = SoftWatchdog("Unit", 0.1, describe=lambda: "rids=['slow-1']")
    try:
        with caplog.at_level(logging.WARNING, logger="minisgl"):
            with wd.disable():
                time.sleep(0.35)  # waiting for input is not a stall
            wd.feed()
            assert wd.num_timeouts == 0
            time.sleep(0.4)  # one slow iteration
            wd.feed()
            deadline = time.monotonic() + 5  # the watchdog thread counts, then logs
            while "Unit watchdog timeout" not in caplog.text:
                assert time.monotonic() < deadline, "the watchdog never logged the slow iteration"
                time.sleep(0.01)
        assert wd.num_timeouts == 1
        assert "Unit watchdog timeout" in caplog.text and "slow-1" in caplog.text
        assert "--soft-watchdog-timeout" in caplog.text
    finally:
        wd.stop()


def test_soft_watchdog_off_without_timeout(caplog: pytest.LogCaptureFixture) -> None:
    wd = SoftWatchdog("Off", None)
    assert wd._thread is None  # no thread at all, so nothing can ever report
    with caplog.at_level(logging.INFO, logger="minisgl"):
        time.sleep(0.3)  # an "iteration" far longer than any timeout a test would set
        with wd.disable():
            wd.feed()
        time.sleep(0.1)
    assert wd.num_timeouts == 0 and not [r for r in caplog.records if "watchdog timeout" in r.getMessage()]


def test_freeze_gc_freezes_and_answers_nothing(mgr: DetokenizerManager) -> None:
    import gc

    from minisgl.managers.io_struct import FreezeGCReq

    gc.unfreeze()
    try:
        assert mgr.dispatch(FreezeGCReq()) is None  # nothing goes back to the tokenizer
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_oldest_decode_state_is_dropped_past_the_bound(mgr: DetokenizerManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rid that never finishes (its abort lost) must not grow the table for ever: a server runs for days."""
    monkeypatch.setattr(detokenizer_manager, "DETOKENIZER_MAX_STATES", 2)
    for rid in ("a", "b", "c"):
        mgr.handle_batch_token_id_out(token_msg([dict(rid=rid, decode_ids=[40, 41])]))
    assert list(mgr.decode_status) == ["b", "c"]
