"""Engine outputs: logprobs in the TokenizerManager's shape, and a stream the caller leaves early.

The scheduler emits a non-streaming request every 50 tokens (DEFAULT_FORCE_STREAM_INTERVAL),
so a 60-token answer reaches the Engine in two messages: the result must hold both.
The server-path check replays the Engine's own detokenizer messages into a real
TokenizerManager (no model processes), so both entry points see identical input.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Dict, List

import pytest

from minisgl import Engine
from minisgl.managers.io_struct import BatchStrOutput, BatchTokenIDOutput, GenerateReqInput
from minisgl.managers.scheduler_output_processor_mixin import DEFAULT_FORCE_STREAM_INTERVAL
from minisgl.managers.tokenizer_manager import TokenizerManager
from minisgl.server_args import PortArgs

PROMPT = [5, 6, 7, 8]
LONG = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 60}
TOP_K = 3
LOGPROBS = {"return_logprob": True, "top_logprobs_num": TOP_K}


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Engine:
    with Engine(tiny_model, device="cpu", max_total_tokens=2048) as e:
        yield e


def _record_messages(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> List[BatchStrOutput]:
    """Every BatchStrOutput the Engine's detokenizer hands to the Engine from now on."""
    messages: List[BatchStrOutput] = []
    handle = engine.detokenizer.handle_batch_token_id_out

    def recording(out: Any) -> BatchStrOutput:
        messages.append(handle(out))
        return messages[-1]

    monkeypatch.setitem(engine.detokenizer._request_dispatcher, BatchTokenIDOutput, recording)
    return messages


def _server_result(engine: Engine, tmp_path: Any, messages: List[BatchStrOutput], stream: bool) -> List[Dict[str, Any]]:
    """What the server's TokenizerManager returns for the same request fed the same messages."""

    async def run() -> List[Dict[str, Any]]:
        port_args = PortArgs.init_new(str(tmp_path))
        tm = TokenizerManager(engine.server_args, port_args, engine.tokenizer, 4096, engine.vocab_size)
        obj = GenerateReqInput(input_ids=PROMPT, sampling_params=LONG, stream=stream, **LOGPROBS)
        outs: List[Dict[str, Any]] = []

        async def consume() -> None:
            async for out in tm.generate_request(obj):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        try:
            while not (obj.rid in tm.rid_to_state and tm.rid_to_state[obj.rid].sent):
                assert not task.done(), task.result()  # the request failed before it was sent
                await asyncio.sleep(0.01)
            for msg in messages:  # as the detokenizer would send them
                tm._handle_batch_output(dataclasses.replace(msg, rids=[obj.rid]))
            await asyncio.wait_for(task, timeout=30)
        finally:
            # linger 0: what was queued for the absent scheduler must not block the exit
            # (on a failure, zmq's Context.__del__ would otherwise wait for it forever)
            tm.close()
        return outs

    return asyncio.run(run())


def test_long_request_keeps_every_logprob_and_matches_the_server(engine, monkeypatch, tmp_path):
    messages = _record_messages(engine, monkeypatch)
    out = engine.generate(input_ids=PROMPT, sampling_params=LONG, **LOGPROBS)
    assert len(messages) == 2 and LONG["max_new_tokens"] > DEFAULT_FORCE_STREAM_INTERVAL  # the premise

    meta = out["meta_info"]
    token_lps, top_lps = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(out["output_ids"]) == len(token_lps) == len(top_lps) == 60
    assert [tok for _, tok, _ in token_lps] == out["output_ids"]
    for (lp, tok, text), top in zip(token_lps, top_lps):
        assert len(top) == TOP_K and lp <= 0
        assert text is None  # SGLang's triple: no text unless return_text_in_logprobs
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy picks the top

    (server,) = _server_result(engine, tmp_path, messages, stream=False)
    assert server["output_ids"] == out["output_ids"] and server["text"] == out["text"]
    for key in ("output_token_logprobs", "output_top_logprobs", "finish_reason", "completion_tokens"):
        assert server["meta_info"][key] == meta[key], key


def test_stream_chunks_carry_the_logprobs_so_far_and_deltas_like_the_servers(engine, monkeypatch, tmp_path):
    full = engine.generate(input_ids=PROMPT, sampling_params=LONG, **LOGPROBS)
    stream = engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True, **LOGPROBS)
    chunks = list(stream)
    assert len(chunks) == 60  # stream_interval 1
    for k, c in enumerate(chunks):  # SGLang's cumulative chunks
        assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) == k + 1
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert chunks[-1]["meta_info"][key] == full["meta_info"][key], key

    # --incremental-streaming-output: each chunk's own, as the TokenizerManager's dicts
    monkeypatch.setattr(engine, "server_args", dataclasses.replace(engine.server_args, incremental_streaming_output=True))
    messages = _record_messages(engine, monkeypatch)
    deltas = list(engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True, **LOGPROBS))
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) == 1 for c in deltas)
    server = _server_result(engine, tmp_path, messages, stream=True)  # it may coalesce chunks: compare concatenations
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert sum((c["meta_info"][key] for c in deltas), []) == full["meta_info"][key], key
        assert sum((c["meta_info"][key] for c in server), []) == full["meta_info"][key], key


def test_logprobs_of_masked_tokens_are_finite_numbers(engine):
    """min_new_tokens masks EOS with -inf; its logprob must stay a JSON number (clamped, as
    SGLang's): -inf made /generate answer a 400 after the whole generation, and a stream
    carry the invalid literal -Infinity."""
    params = {"temperature": 0, "max_new_tokens": 3, "min_new_tokens": 2}
    out = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=engine.vocab_size)
    meta = out["meta_info"]
    json.dumps(meta, allow_nan=False)  # what the server has to send
    first_step = meta["output_top_logprobs"][0]
    assert len(first_step) == engine.vocab_size
    assert min(lp for lp, _, _ in first_step) < -1e30  # the masked EOS: as low as float32 goes


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_stop_ids_covering_the_vocabulary_are_not_all_masked(engine, temperature):
    """min_new_tokens masks the stop ids; when they are every token, masking them all left a row
    of -inf: an arbitrary token with a NaN logprob. Unmasked, the request stops at once."""
    params = {"temperature": temperature, "max_new_tokens": 3, "min_new_tokens": 2, "stop_token_ids": list(range(engine.vocab_size))}
    out = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
    meta = out["meta_info"]
    json.dumps(meta, allow_nan=False)
    assert meta["finish_reason"]["type"] == "stop" and len(meta["output_token_logprobs"]) == 1


def test_logprob_lists_are_present_and_empty_when_not_asked_for(engine):
    meta = engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 3})["meta_info"]
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []  # the server's shape


def test_top_logprobs_without_return_logprob_is_refused_as_by_the_server(engine):
    with pytest.raises(ValueError, match="top_logprobs_num needs return_logprob"):
        engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=LONG, top_logprobs_num=TOP_K)
    assert engine.rid_to_state == {} and engine.scheduler.is_idle()  # nothing was queued


def _assert_idle_and_nothing_leaked(engine: Engine) -> None:
    assert engine.rid_to_state == {}
    assert engine.scheduler.is_idle()
    engine.scheduler.check_integrity()
    engine.scheduler.check_memory_when_idle()
    load = engine.get_load()
    assert load.num_running_reqs == load.num_waiting_reqs == load.protected_tokens == load.num_used_tokens == 0
    assert load.available_tokens + load.evictable_tokens == load.max_total_num_tokens


@pytest.mark.parametrize("prompts", [PROMPT, [PROMPT, [9, 10, 11]]], ids=["single", "batch"])
def test_breaking_out_of_a_stream_aborts_and_frees_everything(engine, prompts):
    for chunk in engine.generate(input_ids=prompts, sampling_params=LONG, stream=True):
        if chunk["meta_info"]["completion_tokens"] >= 3:
            break
    _assert_idle_and_nothing_leaked(engine)
    # the engine serves the next request as if nothing happened
    again = engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 5})
    assert len(again["output_ids"]) == 5


def test_closing_a_stream_mid_way_aborts_it(engine):
    gen = engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True)
    first = next(gen)
    assert first["meta_info"]["finish_reason"] is None
    gen.close()
    _assert_idle_and_nothing_leaked(engine)


def test_a_stream_outliving_its_engine_closes_quietly(tiny_model):
    """shutdown() aborts and forgets everything; a stream dropped afterwards must not raise."""
    import gc
    import sys

    with Engine(tiny_model, device="cpu") as engine:
        stream = engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True)
        next(stream)
    unraisable = []
    old_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        del stream
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert [u for u in unraisable if "Engine._stream" in repr(u.object)] == []  # (other objects' __del__ aside)


def test_a_stream_dropped_before_its_first_chunk_releases_its_requests(engine):
    stream = engine.generate(input_ids=[PROMPT, [9, 10, 11]], sampling_params=LONG, stream=True)
    assert len(engine.rid_to_state) == 2  # submitted at the call: bad input would have raised there
    del stream
    _assert_idle_and_nothing_leaked(engine)


def test_a_stream_the_garbage_collector_drops_inside_a_step_is_released_at_the_next(engine, monkeypatch):
    """A stream kept alive by a reference cycle (an exception that holds its frame) is finalized
    whenever the collector runs: here, inside another generate()'s forward. Releasing it there
    ran a step inside the step (the lock is reentrant) and broke the Engine for good."""
    import gc

    class Holder:  # an app object holding its stream, in a cycle
        def __init__(self) -> None:
            self.me = self
            self.stream = engine.generate(input_ids=[9, 10, 11], sampling_params=LONG, stream=True)
            next(self.stream)

    expected = engine.generate(input_ids=[PROMPT, [5, 6, 7]], sampling_params=LONG)
    box = [Holder()]
    forward, calls = engine.scheduler.run_batch, []

    def forward_with_a_collection(batch):
        calls.append(1)
        if len(calls) == 3:
            box.clear()
            gc.collect()  # what any allocation does once generation 0 is over its threshold
        return forward(batch)

    monkeypatch.setattr(engine.scheduler, "run_batch", forward_with_a_collection)
    got = engine.generate(input_ids=[PROMPT, [5, 6, 7]], sampling_params=LONG)
    monkeypatch.undo()
    assert len(calls) > 3 and [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    engine.step()  # (the dropped stream's request, if it was still running, ends at this forward)
    _assert_idle_and_nothing_leaked(engine)


def test_ctrl_c_while_a_batch_is_queued_leaves_nothing_behind(engine, monkeypatch):
    """Ctrl-C while generate() queues (process_input_requests): the requests were half-queued,
    never collected, decoded unseen in later calls, and shutdown() spun for ever."""
    import os
    import signal

    queue = engine.scheduler.process_input_requests

    def hit_by_ctrl_c(requests):
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the requests are queued
        return queue(requests)

    monkeypatch.setattr(engine.scheduler, "process_input_requests", hit_by_ctrl_c)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(input_ids=[PROMPT, [9, 10]], sampling_params=LONG)
    finally:
        signal.signal(signal.SIGINT, interrupt)
    monkeypatch.undo()
    _assert_idle_and_nothing_leaked(engine)


def test_shutdown_from_another_thread_tells_a_waiting_generate_so(tiny_model):
    import threading

    engine = Engine(tiny_model, device="cpu")
    errors: List[BaseException] = []

    def long_generate() -> None:
        try:
            engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 500})
        except BaseException as e:  # noqa: BLE001 (what the thread saw is the point)
            errors.append(e)

    worker = threading.Thread(target=long_generate)
    worker.start()
    while not engine.rid_to_state:
        pass
    engine.shutdown()
    worker.join(60)
    assert len(errors) == 1 and "was shut down" in str(errors[0]), errors


def test_a_second_ctrl_c_during_the_clean_up_still_forgets_the_requests(engine, monkeypatch):
    """generate()'s clean-up steps until its aborted requests are let go; a second interrupt
    there left their states behind for ever."""
    run_step, calls = engine.scheduler.run_step, []

    def interrupted() -> None:
        calls.append(1)
        if len(calls) in (3, 4):  # the first lands in generate(), the second in its clean-up
            raise KeyboardInterrupt
        run_step()

    monkeypatch.setattr(engine, "_guarded", lambda fn, *args: fn(*args))  # (an escaped exception breaks the Engine)
    monkeypatch.setattr(engine.scheduler, "run_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(input_ids=[PROMPT, [9, 10]], sampling_params=LONG)
    monkeypatch.undo()
    assert engine.rid_to_state == {}
    engine.run_until_idle()
    engine.step()
    _assert_idle_and_nothing_leaked(engine)


# --------------------------------------------------------------------------- bad calls leave nothing behind


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_ids": [PROMPT, [10**9]]},  # the second prompt is outside the vocabulary
        {"input_ids": [PROMPT, PROMPT], "sampling_params": [LONG, {"max_new_tokens": 2.5}]},
        {"prompt": ["fine", 5]},
    ],
    ids=["bad-ids", "bad-params", "bad-type"],
)
def test_a_bad_entry_in_a_batch_queues_none_of_it(engine, kwargs):
    """As the server's _validate_request_shape: every entry is checked before any is queued."""
    with pytest.raises(ValueError):
        engine.generate(**{"sampling_params": LONG, **kwargs})
    _assert_idle_and_nothing_leaked(engine)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"prompt": 5}, "`prompt` must be a string or a non-empty list of strings, got int"),
        ({"prompt": b"hi"}, "got bytes"),
        ({"prompt": []}, "got an empty list"),
        ({"input_ids": 5}, "`input_ids` must be a list of ints or a list of such lists, got int"),
        ({"input_ids": [[5, 6], 7]}, "mixes lists and ints"),
        ({"prompt": ["a", "b"], "sampling_params": "greedy"}, "sampling_params must be an object .a dict., got str"),
        ({"prompt": ["a", "b"], "sampling_params": 5}, "sampling_params must be an object .a dict., got int"),
        ({"prompt": ["a", "b"], "sampling_params": [{"n": [1]}, {"n": 1}]}, "n must be an integer"),
    ],
)
def test_wrong_prompt_types_say_what_to_pass(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        engine.generate(**kwargs)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"prompt": ["a", "b"]}, "add_request takes a single prompt; pass a list to generate()"),
        ({"input_ids": [PROMPT, PROMPT]}, "add_request takes a single prompt; pass a list to generate()"),
        ({"sampling_params": LONG}, "Exactly one of `prompt` and `input_ids` must be given"),
        ({"input_ids": PROMPT, "rid": 1}, "`rid` must be a string, got int"),
    ],
)
def test_add_request_mistakes_say_what_to_change(engine, kwargs, needle):
    """A batch handed to add_request was told about a `rid` list the caller never passed; an
    int rid was a bare AssertionError deep in tokenization."""
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request(**kwargs)
    _assert_idle_and_nothing_leaked(engine)


def test_an_error_inside_a_step_is_raised_as_is_and_the_engine_then_says_it_is_broken(tiny_model, monkeypatch):
    """An exception that escapes a scheduler step (signals are held to its end, so a bug or a
    handler minisgl cannot hold) leaves requests and KV that no longer add up. generate()'s
    clean-up stepped that scheduler again and raised its own error instead of the user's;
    now the original propagates and every later call says to make a new Engine."""
    engine = Engine(tiny_model, device="cpu")
    run_step, calls = engine.scheduler.run_step, []

    def fails_on_the_fourth() -> None:
        calls.append(1)
        if len(calls) == 4:
            raise TimeoutError("the user's timeout")
        run_step()

    monkeypatch.setattr(engine.scheduler, "run_step", fails_on_the_fourth)
    with pytest.raises(TimeoutError, match="the user's timeout"):
        engine.generate(input_ids=[PROMPT, [9, 10]], sampling_params={**LONG, "max_new_tokens": 500})
    with pytest.raises(RuntimeError, match=r"stopped in the middle of a scheduler step \(TimeoutError: the user's timeout\)"):
        engine.generate(input_ids=PROMPT, sampling_params=LONG)
    engine.shutdown()  # still possible, and final
    with pytest.raises(RuntimeError, match="was shut down"):
        engine.step()


def test_a_sigalrm_timeout_inside_a_forward_lands_after_the_step(engine, monkeypatch):
    """A signal.alarm timeout around generate() (pytest-timeout's way too) raised inside a
    forward: a half-built batch, KV leaked and every later call failing. Every signal with a
    Python handler is held to the end of the step, as Ctrl-C is."""
    import os
    import signal

    forward, calls = engine.scheduler.run_batch, []

    def forward_hit_by_the_alarm(batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGALRM)  # delivered while the forward runs
        return forward(batch)

    monkeypatch.setattr(engine.scheduler, "run_batch", forward_hit_by_the_alarm)
    previous = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("too slow")))
    try:
        with pytest.raises(TimeoutError, match="too slow"):
            engine.generate(input_ids=[PROMPT, [9, 10]], sampling_params={**LONG, "max_new_tokens": 50})
    finally:
        signal.signal(signal.SIGALRM, previous)
    monkeypatch.undo()
    _assert_idle_and_nothing_leaked(engine)
    assert len(engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 5})["output_ids"]) == 5


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("in_step", [1, 3], ids=["prefill", "decode"])
def test_ctrl_c_inside_a_forward_lands_after_the_step(engine, monkeypatch, stream, in_step):
    """A real SIGINT in the middle of the model's forward (where Ctrl-C usually lands): it used
    to leave a half-built batch that no abort could reach, and generate() spun forever."""
    import os
    import signal

    forward, calls = engine.scheduler.run_batch, []

    def forward_hit_by_ctrl_c(batch):
        calls.append(1)
        if len(calls) == in_step:
            os.kill(os.getpid(), signal.SIGINT)  # delivered while the forward runs
        return forward(batch)

    monkeypatch.setattr(engine.scheduler, "run_batch", forward_hit_by_ctrl_c)
    alarm = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("generate() hangs")))
    # Python's Ctrl-C handler, as in a notebook or a terminal: a pytest started in the background
    # (`cmd &`, nohup) inherits SIGINT ignored, which the Engine rightly keeps
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.alarm(60)
    try:
        with pytest.raises(KeyboardInterrupt):
            out = engine.generate(input_ids=[PROMPT, [9, 10]], sampling_params={**LONG, "max_new_tokens": 50}, stream=stream)
            if stream:
                list(out)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm)
        signal.signal(signal.SIGINT, interrupt)
    monkeypatch.undo()
    _assert_idle_and_nothing_leaked(engine)
    assert len(engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 5})["output_ids"]) == 5


def test_context_length_is_checked_as_by_the_server(engine):
    context_len = engine.context_len  # the tiny model's 2048
    with pytest.raises(ValueError, match=rf"The input \({context_len} tokens\) is longer than the model's context length"):
        engine.generate(input_ids=[5] * context_len, sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="Requested token count exceeds the model's maximum context length"):
        engine.generate(input_ids=[5] * (context_len - 10), sampling_params={"max_new_tokens": 100})
    _assert_idle_and_nothing_leaked(engine)


def test_auto_truncate_cuts_the_prompt_and_clamps_the_output(tiny_model):
    with Engine(tiny_model, device="cpu", allow_auto_truncate=True) as eng:
        context_len = eng.context_len
        # cut to the scheduler's own limit (max_req_input_len, as SGLang's), with room left to generate
        limit = eng.scheduler.max_req_input_len - 1
        out = eng.generate(input_ids=[5] * (context_len + 50), sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        assert (out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"]) == (limit, 4)
        out = eng.generate(input_ids=[5] * (context_len - 10), sampling_params={"max_new_tokens": 100, "ignore_eos": True})
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == context_len - 10 and 0 < meta["completion_tokens"] <= 10
        assert meta["finish_reason"]["type"] == "length"


def test_shutdown_is_final(tiny_model):
    eng = Engine(tiny_model, device="cpu")
    stream = eng.generate(input_ids=[PROMPT, PROMPT], sampling_params=LONG, stream=True)
    next(stream)
    unread = eng.generate(input_ids=PROMPT, sampling_params=LONG, stream=True)
    eng.shutdown()
    assert eng.scheduler is None and eng.model_runner is None  # model and KV pool can be freed
    for s in (stream, unread):
        with pytest.raises(RuntimeError, match="shut down while this stream was open"):
            next(s)
    for call in (lambda: eng.generate("hi"), lambda: eng.add_request("hi"), eng.step, eng.get_load, eng.run_until_idle):
        with pytest.raises(RuntimeError, match=r"shut down; create a new Engine"):
            call()
    eng.shutdown()  # a second shutdown is harmless


def test_has_unfinished_requests_takes_turns_with_other_calls(engine):
    """It walks the request table, which another thread's generate() or get_result() changes
    ("dictionary changed size during iteration" under a widget's run loop): it holds the lock."""
    import threading

    answered = threading.Event()
    with engine._lock:  # a call in flight on this thread; the check runs on another
        checker = threading.Thread(target=lambda: (engine.has_unfinished_requests(), answered.set()))
        checker.start()
        assert not answered.wait(0.2), "has_unfinished_requests() ran while another call held the Engine"
    assert answered.wait(10)
    checker.join()


# --------------------------------------------------------------------------- asyncio, and rids
def test_async_generate_serves_concurrent_tasks_as_generate_does(engine):
    """SGLang's async_generate: awaited for a result, or an async iterator with stream=True;
    concurrent tasks share the steps and each gets its own answer."""
    prompts = [PROMPT, [9, 10, 11], [12, 13]]
    expected = engine.generate(input_ids=prompts, sampling_params=LONG)

    async def run() -> List[Any]:
        async def streamed(ids: List[int]) -> List[int]:
            out: List[int] = []
            async for chunk in await engine.async_generate(input_ids=ids, sampling_params=LONG, stream=True):
                out = chunk["output_ids"]  # (everything so far)
            return out

        whole = [engine.async_generate(input_ids=ids, sampling_params=LONG) for ids in prompts]
        return await asyncio.gather(*whole, *[streamed(ids) for ids in prompts])

    results = asyncio.run(run())
    assert [r["output_ids"] for r in results[:3]] == [e["output_ids"] for e in expected]
    assert results[3:] == [e["output_ids"] for e in expected]
    _assert_idle_and_nothing_leaked(engine)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancelled_async_generate_aborts_its_requests(engine, stream):
    """A web handler's task is cancelled when its client goes away: the requests must not
    keep decoding (the thread pool pattern it replaces decoded to the end)."""
    start = engine.scheduler.forward_ct

    async def run() -> None:
        async def consume() -> None:
            if stream:
                async for _ in await engine.async_generate(input_ids=[PROMPT, [9, 10]], sampling_params={**LONG, "max_new_tokens": 500}, stream=True):
                    pass
            else:
                await engine.async_generate(input_ids=[PROMPT, [9, 10]], sampling_params={**LONG, "max_new_tokens": 500})

        task = asyncio.ensure_future(consume())
        while engine.get_load().num_running_reqs < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    _assert_idle_and_nothing_leaked(engine)
    # aborted, not decoded to the end: the 500 tokens asked for would take 500 steps
    assert engine.scheduler.forward_ct - start < 250


def test_generate_takes_the_callers_rids_and_abort_of_an_n_rid_reaches_every_sample(engine):
    out = engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 2}, rid="mine")
    assert out["meta_info"]["id"] == "mine"
    outs = engine.generate(input_ids=[PROMPT, [9, 10]], sampling_params={**LONG, "max_new_tokens": 2}, rid=["a", "b"])
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]

    async def run() -> List[Dict[str, Any]]:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params={**LONG, "n": 2, "max_new_tokens": 500}, rid="job"))
        while engine.get_load().num_running_reqs < 2:
            await asyncio.sleep(0.01)
        await loop.run_in_executor(None, engine.abort, "job")  # the rid the caller knows, not the samples'
        return await asyncio.wait_for(task, timeout=60)

    samples = asyncio.run(run())
    assert [s["meta_info"]["id"] for s in samples] == ["job-0", "job-1"]
    assert [s["meta_info"]["finish_reason"]["type"] for s in samples] == ["abort", "abort"]
    assert engine._samples_of == {}
    _assert_idle_and_nothing_leaked(engine)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"input_ids": PROMPT, "rid": 5}, "`rid` must be a string"),
        ({"input_ids": PROMPT, "rid": ""}, "must not be empty"),
        ({"input_ids": [PROMPT, PROMPT], "rid": "one"}, "must be a list of 2 ids"),
        ({"input_ids": [PROMPT, PROMPT], "rid": ["x", "x"]}, "must not repeat"),
    ],
)
def test_bad_rids_say_what_to_pass(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(sampling_params=LONG, **kwargs)
    assert engine.rid_to_state == {}


def test_a_new_engine_neither_restarts_another_engines_draws_nor_reseeds_the_users_rng(tiny_model):
    """Each ModelRunner seeded torch's global RNG: a second Engine made the first one's unseeded
    samples repeat, and reset the random state of the user's own code."""
    import torch

    sampled = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 12}
    first = Engine(tiny_model, device="cpu")
    try:
        a = first.generate(input_ids=PROMPT, sampling_params=sampled)["output_ids"]
        torch.manual_seed(123)
        expected = torch.rand(4)
        torch.manual_seed(123)
        with Engine(tiny_model, device="cpu") as second:  # the same --random-seed
            assert torch.equal(torch.rand(4), expected)  # the user's RNG went on where it was
            assert second.generate(input_ids=PROMPT, sampling_params=sampled)["output_ids"] == a  # the seed still decides
        b = first.generate(input_ids=PROMPT, sampling_params=sampled)["output_ids"]
        assert b != a  # the first Engine's draws went on too
    finally:
        first.shutdown()


def test_a_cancel_that_lands_while_async_generate_submits_still_releases_what_it_queued(engine):
    """The submit runs in the executor, here waiting for the lock behind another thread: a
    cancel ended the await, the submit queued its requests anyway, and nobody released them."""
    import threading

    async def run() -> None:
        holder_has_it, let_go = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with engine._lock:
                holder_has_it.set()
                let_go.wait(30)

        threading.Thread(target=hold_the_lock).start()
        holder_has_it.wait(30)
        task = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params=LONG, rid="mine"))
        await asyncio.sleep(0.2)  # the submit waits for the lock in the executor
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        let_go.set()
        for _ in range(300):  # the release runs in the executor once the submit is done
            await asyncio.sleep(0.05)
            if not engine.rid_to_state and engine.scheduler.is_idle():
                break

    asyncio.run(run())
    engine.step()
    _assert_idle_and_nothing_leaked(engine)
    assert engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 2}, rid="mine")["meta_info"]["id"] == "mine"


@pytest.mark.parametrize("how", ["aclose", "dropped"])
def test_an_async_stream_closed_or_dropped_before_its_first_chunk_releases_its_requests(engine, how):
    import gc

    async def run() -> None:
        chunks = await engine.async_generate(input_ids=[PROMPT, [9, 10]], sampling_params=LONG, stream=True)
        assert len(engine.rid_to_state) == 2
        if how == "aclose":
            await chunks.aclose()
        else:
            del chunks
            gc.collect()
            await asyncio.sleep(0.1)  # asyncio closes a dropped async generator on the loop

    asyncio.run(run())
    _assert_idle_and_nothing_leaked(engine)


def test_a_dropped_n_stream_frees_its_rid_for_the_next_call(engine, monkeypatch):
    import gc

    class Holder:  # a stream in a reference cycle
        def __init__(self) -> None:
            self.me = self
            self.stream = engine.generate(input_ids=[9, 10, 11], sampling_params={**LONG, "n": 2}, stream=True, rid="job")
            next(self.stream)

    box = [Holder()]
    forward, calls = engine.scheduler.run_batch, []

    def forward_with_a_collection(batch):
        calls.append(1)
        if len(calls) == 2:
            box.clear()
            gc.collect()
        return forward(batch)

    monkeypatch.setattr(engine.scheduler, "run_batch", forward_with_a_collection)
    engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 5})
    monkeypatch.undo()
    engine.step()
    _assert_idle_and_nothing_leaked(engine)
    assert engine._samples_of == {}
    again = engine.generate(input_ids=PROMPT, sampling_params={**LONG, "n": 2, "max_new_tokens": 2}, rid="job")
    assert [o["meta_info"]["id"] for o in again] == ["job-0", "job-1"]


def test_ctrl_c_while_add_request_queues_leaves_nothing_behind(engine, monkeypatch):
    import os
    import signal

    queue = engine.scheduler.process_input_requests

    def hit_by_ctrl_c(requests):
        os.kill(os.getpid(), signal.SIGINT)
        return queue(requests)

    monkeypatch.setattr(engine.scheduler, "process_input_requests", hit_by_ctrl_c)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.add_request(input_ids=PROMPT, sampling_params=LONG, rid="lost")
    finally:
        signal.signal(signal.SIGINT, interrupt)
    monkeypatch.undo()
    _assert_idle_and_nothing_leaked(engine)


def test_the_rid_of_a_running_n_request_is_in_flight_and_abort_of_it_ends_every_sample(engine):
    """add_request took the rid of an n > 1 request whose samples ran, and abort(rid) then ended
    the samples but not the request that had their parent's name."""
    stream = engine.generate(input_ids=[9, 10], sampling_params={**LONG, "n": 2}, stream=True, rid="job")
    with pytest.raises(ValueError, match="rid 'job' is already in flight"):
        engine.add_request(input_ids=PROMPT, sampling_params=LONG, rid="job")
    engine.abort("job")
    finishes = {}
    for chunk in stream:
        finishes[chunk["index"]] = chunk["meta_info"]["finish_reason"]
    assert [finishes[j]["type"] for j in (0, 1)] == ["abort", "abort"]
    _assert_idle_and_nothing_leaked(engine)


def test_a_signal_asyncio_watches_is_delivered_once_when_it_lands_in_a_step(engine, monkeypatch):
    """loop.add_signal_handler reads the signal from its wakeup fd, written when it arrived;
    raising it again after the step ran the callback twice."""
    import os
    import signal

    forward, calls, seen = engine.scheduler.run_batch, [], []

    def forward_hit_by_the_signal(batch):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return forward(batch)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: seen.append(1))
        try:
            engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 5})  # (in the loop's thread)
            await asyncio.sleep(0.2)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    monkeypatch.setattr(engine.scheduler, "run_batch", forward_hit_by_the_signal)
    asyncio.run(run())
    assert seen == [1]


def test_sglangs_none_defaults_of_the_logprob_fields_are_the_defaults(engine):
    """SGLang's Engine.generate defaults logprob_start_len and top_logprobs_num to None; code that
    forwards them got a ValueError."""
    out = engine.generate(input_ids=PROMPT, sampling_params={**LONG, "max_new_tokens": 2}, return_logprob=True,
                          logprob_start_len=None, top_logprobs_num=None)  # fmt: skip
    assert len(out["meta_info"]["output_token_logprobs"]) == 2 and out["meta_info"]["input_token_logprobs"] == []


def test_a_cancelled_submit_that_ends_while_asyncio_run_shuts_down_still_releases(engine):
    """asyncio.run had shut its executor down when the submit ended: scheduling the release there
    raised, and the request stayed queued, its rid in flight for good."""
    import threading
    import time

    holder_has_it, let_go = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with engine._lock:
            holder_has_it.set()
            let_go.wait(30)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    holder_has_it.wait(30)
    threading.Timer(0.5, let_go.set).start()  # after main() returned: asyncio.run waits for its executor

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.async_generate(input_ids=PROMPT, sampling_params=LONG, rid="late"), 0.1)

    asyncio.run(main())
    holder.join(30)
    for _ in range(100):
        if not engine.rid_to_state:
            break
        time.sleep(0.05)
    engine.step()
    _assert_idle_and_nothing_leaked(engine)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancelled_async_generate_cleans_up_without_freezing_the_loop(engine, monkeypatch, stream):
    """The clean-up waited for the step in progress and stepped the aborts on the loop's own
    thread: every other client of the app froze for as long (here a step takes 0.3 s)."""
    import time

    forward = engine.scheduler.run_batch

    def slow_forward(batch):
        time.sleep(0.3)
        return forward(batch)

    monkeypatch.setattr(engine.scheduler, "run_batch", slow_forward)
    gaps: List[float] = []

    async def run() -> None:
        async def consume() -> None:
            if stream:
                async for _ in await engine.async_generate(input_ids=PROMPT, sampling_params=LONG, stream=True):
                    pass
            else:
                await engine.async_generate(input_ids=PROMPT, sampling_params=LONG)

        async def heartbeat() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.5)  # a step or two in the executor
        beat = asyncio.ensure_future(heartbeat())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # the heartbeat's next beat records any gap the clean-up made
        beat.cancel()

    asyncio.run(run())
    monkeypatch.undo()
    assert max(gaps) < 0.2, max(gaps)  # (a step on the loop's thread: >= 0.3 s)
    _assert_idle_and_nothing_leaked(engine)


def test_n_samples_find_their_prompt_cached_after_a_prefix_warmup(engine):
    """SGLang prefills an n > 1 prompt once, alone (max_new_tokens 0), before its samples: copies
    admitted in one prefill batch each computed the whole prompt (1-3x for 8 copies)."""
    prompt = [5 + (7 * i) % 200 for i in range(300)]
    outs = engine.generate(input_ids=prompt, sampling_params={**LONG, "n": 4, "max_new_tokens": 2})
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1] * 4  # every copy: all but the last token
    assert [o["meta_info"]["id"] for o in outs] == [outs[0]["meta_info"]["id"][:-2] + f"-{j}" for j in range(4)]
    _assert_idle_and_nothing_leaked(engine)  # (the warm-up left no state behind)
