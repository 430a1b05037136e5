"""Engine API: SGLang's shapes for generate (single, list, stream, n), step() and snapshot()."""

from __future__ import annotations

import pytest

from minisgl import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
SNAPSHOT_KEYS = {
    "step", "time", "forward_mode", "log_line", "waiting_queue", "grammar_queue", "chunked_req", "batch", "running_batch",
    "adder", "memory", "radix", "new_token_ratio", "speculative", "events", "finished",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model):
    with Engine(tiny_model, device="cpu", max_total_tokens=2048) as e:
        yield e


def test_generate_single_returns_sglang_dict(engine):
    out = engine.generate("The quick brown fox", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The quick brown fox", add_special_tokens=False))
    assert meta["e2e_latency"] > 0 and 0 < meta["ttft"] <= meta["e2e_latency"]
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])


def test_generate_list_and_input_ids(engine):
    outs = engine.generate(["one", "two three"], GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    for text, out in zip(["one", "two three"], outs):  # each entry is its own prompt's answer
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == out["output_ids"]


def test_stream_chunks_are_cumulative_as_sglangs_and_the_last_is_the_answer(engine):
    full = engine.generate("streaming text", GREEDY)
    chunks = list(engine.generate("streaming text", GREEDY, stream=True))
    assert len(chunks) == 6  # stream_interval 1: one chunk per token
    assert [c["output_ids"] for c in chunks] == [full["output_ids"][: k + 1] for k in range(6)]
    assert all(full["text"].startswith(c["text"]) for c in chunks) and chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_incremental_streaming_output_streams_what_each_chunk_adds(tiny_model):
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, incremental_streaming_output=True) as e:
        full = e.generate("streaming text", GREEDY)
        chunks = list(e.generate("streaming text", GREEDY, stream=True))
    assert len(chunks) == 6
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_a_stream_read_late_gets_one_chunk_with_everything_so_far(engine):
    """SGLang hands a stream its latest out_list entry: with cumulative chunks nothing is lost."""
    stream = engine.generate("read late", GREEDY, stream=True)
    engine.run_until_idle()  # every message arrives before the first read
    chunks = list(stream)
    assert len(chunks) == 1 and len(chunks[0]["output_ids"]) == 6
    assert chunks[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_n_fans_out_into_n_requests(engine):
    outs = engine.generate("same prompt", {**GREEDY, "n": 2})
    assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[0]["meta_info"]["id"] != outs[1]["meta_info"]["id"]


@pytest.mark.parametrize("chunk", [64, 24, 20], ids=["room-left", "prompt-fills-the-chunk", "prompt-split"])
def test_the_adder_record_says_why_requests_waited(tiny_model, chunk):
    """A 24-token prompt that exactly fills the chunk budget is admitted whole with nothing left
    waiting: the record said OTHER "rem_chunk_tokens exhausted", as if a request had been held back."""
    engine = Engine(tiny_model, device="cpu", chunked_prefill_size=chunk, max_total_tokens=1024)
    try:
        engine.add_request(input_ids=list(range(3, 27)), sampling_params=GREEDY, rid="R")
        adder = engine.step()["adder"]
        expected = "OTHER" if chunk < 24 else "QUEUE_EMPTY"  # split: the rest of R waits for the next chunk
        assert (adder["stop_reason"], adder["admitted"]) == (expected, ["R"]), adder["stop_detail"]
    finally:
        engine.shutdown()


def test_step_and_snapshot_follow_the_documented_schema(engine):
    rid = engine.add_request("step by step", GREEDY)
    snap = engine.step()
    assert set(snap) == SNAPSHOT_KEYS
    assert snap["forward_mode"] == "EXTEND" and snap["batch"]["reqs"][0]["rid"] == rid
    assert snap["log_line"].startswith("Prefill batch, #new-seq: 1, #new-token: ")
    assert set(snap["memory"]) == {"total", "available", "evictable", "protected", "used", "page_size",
                                   "req_slots_total", "req_slots_free"}  # fmt: skip
    assert snap["adder"]["stop_reason"] == "QUEUE_EMPTY" and snap["adder"]["admitted"] == [rid]
    assert set(snap["radix"]) >= {"num_nodes", "total_tokens", "evictable", "protected", "tree"}
    snap = engine.step()
    assert snap["forward_mode"] == "DECODE" and [r["rid"] for r in snap["running_batch"]] == [rid]
    engine.run_until_idle()
    assert engine.snapshot()["finished"][0]["rid"] == rid
    assert set(engine.snapshot()["finished"][0]) >= {"finish_reason", "queue_ms", "schedule_ms", "forward_ms", "ttft_ms"}
    # the memory panel's numbers are the pool's: used = total - available - evictable
    load, mem, radix = engine.get_load(), engine.snapshot()["memory"], engine.snapshot()["radix"]
    assert (mem["total"], mem["available"], mem["evictable"], mem["protected"]) == (
        2048, load.available_tokens, load.evictable_tokens, load.protected_tokens)
    assert mem["used"] == 2048 - load.available_tokens - load.evictable_tokens == load.num_used_tokens
    assert radix["total_tokens"] == load.evictable_tokens + load.protected_tokens > 0
    engine.get_result(rid)
    assert engine.step()["forward_mode"] == "IDLE"  # idle step also runs the leak check


def test_flush_cache_and_load(engine):
    engine.generate("fill the cache", GREEDY)
    assert engine.get_load().evictable_tokens > 0
    assert engine.flush_cache()
    load = engine.get_load()
    assert load.evictable_tokens == 0 and load.available_tokens == load.max_total_num_tokens


def test_requests_after_a_flush_are_served(tiny_model):
    """A last admission that ran out of budget (page 4: pages + max_new over-reserve) marks the
    batch full; the request then finishes in a decode step. A flush at that moment left the flag
    set on an empty batch, and every later request waited forever."""
    eng = Engine(tiny_model, device="cpu", page_size=4, max_total_tokens=64, chunked_prefill_size=-1)
    eng.generate(input_ids=list(range(20, 29)), sampling_params={**GREEDY, "max_new_tokens": 53})
    assert eng.scheduler.running_batch.batch_is_full  # the premise: a full flag set at admission
    assert eng.flush_cache()
    rid = eng.add_request(input_ids=[30, 31, 32, 33], sampling_params={**GREEDY, "max_new_tokens": 4})
    eng.run_until_idle(max_steps=50)  # (generate() would spin forever on the bug)
    assert len(eng.get_result(rid)["output_ids"]) == 4
    eng.shutdown()


def test_add_request_rejects_n_and_bad_params(engine):
    with pytest.raises(ValueError, match="n > 1"):
        engine.add_request("x", {"n": 2})
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("x", {"top_p": 2.0})


@pytest.mark.parametrize("n", ["2", True, 2.5])
def test_generate_refuses_a_non_integer_n_before_queueing(engine, n):
    with pytest.raises(ValueError, match="n must be an integer"):
        engine.generate(["a", "b"], {**GREEDY, "n": n})
    assert engine.rid_to_state == {} and engine.scheduler.is_idle()


def test_idle_check_runs_once_per_idle_period_after_the_outputs(tiny_model):
    """The leak check walks the whole tree: it must run after the last token is delivered
    (not hold it back), and once per idle period (not on every step of an idle engine)."""
    engine = Engine(tiny_model, device="cpu")
    delivered_before_check = []
    engine.scheduler.check_memory_when_idle = lambda: delivered_before_check.append(not engine.has_unfinished_requests())
    engine.generate("one", {**GREEDY, "max_new_tokens": 3})
    engine.step()
    engine.step()
    assert delivered_before_check == [True]
    engine.generate("two", {**GREEDY, "max_new_tokens": 3})
    assert delivered_before_check == [True, True]


def test_freeze_gc_passes_through_scheduler_and_detokenizer(tiny_model):
    """The scheduler freezes its GC and queues the message for the detokenizer, which
    freezes too (one process here, so the same gc; the server test covers the processes)."""
    import gc

    from minisgl.managers.io_struct import FreezeGCReq

    engine = Engine(tiny_model, device="cpu")
    calls = []
    engine.detokenizer.handle_freeze_gc = lambda msg: calls.append(msg)
    engine.detokenizer._request_dispatcher[FreezeGCReq] = engine.detokenizer.handle_freeze_gc
    try:
        assert engine.scheduler.process_input_requests([FreezeGCReq()]) == []  # no reply to the tokenizer
        assert gc.get_freeze_count() > 0
        out = engine.generate("still serving", {**GREEDY, "max_new_tokens": 2})
        assert len(calls) == 1 and len(out["output_ids"]) == 2
    finally:
        gc.unfreeze()


def test_calls_from_two_threads_take_turns(tiny_model):
    """A generate() in a background thread while the notebook adds and steps: the two drove one
    scheduler at once (AssertionErrors, a wrong greedy answer, a KV leak at the idle check)."""
    import threading

    with Engine(tiny_model, device="cpu", max_total_tokens=2048) as engine:
        params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
        reference = engine.generate("a background job", params)["output_ids"]
        box = {}
        worker = threading.Thread(target=lambda: box.update(out=engine.generate("a background job", params)))
        worker.start()
        errors = []
        for i in range(30):
            try:
                rid = engine.add_request(f"foreground {i}", {"temperature": 0, "max_new_tokens": 2})
                while not engine.rid_to_state[rid].finished:
                    engine.step()
                engine.get_result(rid)
            except Exception as e:  # noqa: BLE001 - every failure is the finding
                errors.append(repr(e))
        worker.join(timeout=120)
        assert errors == [] and box["out"]["output_ids"] == reference
        engine.run_until_idle()
        engine.step()  # the idle check (pool accounting) runs here and raises on a leak


def test_a_stream_whose_request_is_collected_elsewhere_ends_or_says_why(engine):
    """get_result on the last chunk's rid, or the widget's Reset mid-stream, gave a bare KeyError."""
    chunks = []
    for chunk in engine.generate("collected", GREEDY, stream=True):
        chunks.append(chunk)
        if chunk["meta_info"]["finish_reason"] is not None:
            engine.get_result(chunk["meta_info"]["id"])  # the caller takes the result itself
    assert len(chunks) == 6
    stream = engine.generate("reset midway", {**GREEDY, "max_new_tokens": 30}, stream=True)
    first = next(stream)
    engine.abort(first["meta_info"]["id"])
    engine.run_until_idle()
    engine.get_result(first["meta_info"]["id"])  # what the widget's Reset does to every rid
    with pytest.raises(RuntimeError, match="was collected elsewhere"):
        list(stream)
    assert engine.rid_to_state == {}


def test_a_finished_uncollected_rid_says_how_to_free_it(engine):
    rid = engine.add_request("kept", GREEDY, rid="kept")
    engine.run_until_idle()
    with pytest.raises(ValueError, match=r"rid 'kept' finished, but its result was not collected: engine.get_result\('kept'\)"):
        engine.add_request("again", GREEDY, rid="kept")
    engine.get_result(rid)


def test_get_load_counts_a_request_mid_chunk_as_running(tiny_model):
    """/get_load (and the /metrics gauges) read 0 running, 0 waiting while a long prompt was
    being prefilled chunk by chunk: a busy server looked idle to a load balancer."""
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, chunked_prefill_size=16) as e:
        e.add_request(input_ids=list(range(10, 110)), sampling_params={**GREEDY, "max_new_tokens": 3})
        e.step()
        assert e.scheduler.chunked_req is not None
        load = e.get_load()
        assert (load.num_running_reqs, load.num_waiting_reqs) == (1, 0)
        while e.scheduler.chunked_req is not None:
            e.step()
        assert e.get_load().num_running_reqs == 1  # just prefilled, not yet merged into the batch
        e.run_until_idle()
        assert e.get_load().num_running_reqs == 0


def test_the_engine_needs_no_server_packages(tiny_model):
    """A GPU image may carry torch, triton and transformers only: the Engine (and so the triton
    engine test and bench_offline) must not import pyzmq or fastapi. It failed at its first
    output, reading logprobs through the TokenizerManager's module."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("zmq", "fastapi", "uvicorn", "starlette"):
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        from minisgl import Engine
        with Engine({tiny_model!r}, device="cpu", max_total_tokens=1024) as e:
            out = e.generate("hello", {{"max_new_tokens": 3, "temperature": 0}}, return_logprob=True)
        assert len(out["output_ids"]) == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
