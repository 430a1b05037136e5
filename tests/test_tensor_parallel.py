"""Tensor parallelism, the process side: N scheduler ranks in lockstep (managers/tp_lockstep.py).

The Engine with tp_size=2 (rank 0 in this process, rank 1 a child) against tp_size=1 on the
same tiny model, and the server with --tp-size 2 against the same oracle. Only rank 0's
outputs are seen, so each test also makes sure rank 1 really followed: a rank checks its
scheduler against rank 0's at every broadcast and at shutdown, and exits non-zero when they
differ, so "every rank exited 0 after shutdown()" means rank 1 ran the same steps.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

import httpx
import openai
import pytest
import torch

from minisgl import Engine
from minisgl.entrypoints.engine_tp import RankDiedError
from minisgl.managers.io_struct import AbortReq, TpBroadcastInput, decode
from minisgl.managers.tp_lockstep import TpLeader, agree_on_ready_grammars, apply_broadcast, heartbeat_interval, lockstep_state
from minisgl.server_args import ServerArgs
from test_server_e2e import Server  # (the e2e tests' server process, its log and readiness wait)

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
# both engines: small chunks (a 70-token prompt prefills in three), a radix cache, room for a batch
ENGINE_ARGS = dict(device="cpu", max_total_tokens=1024, chunked_prefill_size=32)
LONG = list(range(10, 80))  # 70 tokens: chunked
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
IDLE_DIST_TIMEOUT = 6  # s: the idle test's Engine's and the server's --dist-timeout (heartbeat 1.5 s)


@pytest.fixture(scope="module")
def oracle(tiny_model: str) -> Iterator[Engine]:
    engine = Engine(tiny_model, **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tp2(tiny_model: str) -> Iterator[Engine]:
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    procs = list(engine._tp.procs)
    yield engine
    engine.shutdown()
    # rank 1 followed every test on it: it checks its scheduler against rank 0's at shutdown too, and exits 1 if they differ
    assert [p.exitcode for p in procs] == [0]


def _children_since(before: List[Any]) -> List[Any]:
    """Child processes started since `before` (the module's fixtures keep theirs running)."""
    return [p for p in mp.active_children() if p not in before]


def _workload(engine: Engine, stop: Optional[str]) -> List[Dict[str, Any]]:
    """The same calls on any engine; what each answered (the test compares two engines)."""
    outs: List[Dict[str, Any]] = []
    # a batch, with a chunked prompt and logprobs
    outs += engine.generate(input_ids=[[5, 6, 7], LONG, [40, 41, 42, 43]], sampling_params=GREEDY,
                            return_logprob=True, top_logprobs_num=2)  # fmt: skip
    # a radix hit: the long prompt's prefix is cached
    outs.append(engine.generate(input_ids=LONG[:60] + [3, 4, 5], sampling_params=GREEDY))
    # an abort after three steps (the request is mid-decode then)
    rid = engine.add_request(input_ids=[9, 10, 11], sampling_params={**GREEDY, "max_new_tokens": 50, "ignore_eos": True})
    for _ in range(3):
        engine.step(snapshot=False)
    engine.abort(rid)
    engine.run_until_idle()
    outs.append(engine.get_result(rid))
    # a stream dropped after its first chunk: aborted at the next step (Engine._dropped)
    stream = engine.generate(input_ids=[12, 13], sampling_params={**GREEDY, "max_new_tokens": 40, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()
    if stop is not None:  # stop strings and regexes (the scheduler finds them in the decoded tail on every rank)
        outs.append(engine.generate("The quick brown fox", {**GREEDY, "max_new_tokens": 16, "stop": [stop]}))
        outs.append(engine.generate("The quick brown fox", {**GREEDY, "max_new_tokens": 16, "stop_regex": [re.escape(stop[:2]) + "."]}))
    # a grammar compiles on each rank's threads; the ranks agree when it is ready (without the grammar
    # extra installed, structured output is a 400 on every rank alike)
    if importlib.util.find_spec("xgrammar") is not None:
        outs += engine.generate(input_ids=[[20, 21], [22, 23]], sampling_params={**GREEDY, "max_new_tokens": 12, "json_schema": SCHEMA})
    assert engine.flush_cache()
    return outs


def _assert_same(got: List[Dict[str, Any]], want: List[Dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"] and g["text"] == w["text"]
        gm, wm = g["meta_info"], w["meta_info"]
        assert gm["finish_reason"] == wm["finish_reason"] and gm["cached_tokens"] == wm["cached_tokens"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            got_lp = [lp for entry in gm[key] for lp in (entry if key == "output_top_logprobs" else [entry])]
            want_lp = [lp for entry in wm[key] for lp in (entry if key == "output_top_logprobs" else [entry])]
            assert [e[1] for e in got_lp] == [e[1] for e in want_lp]
            assert all(abs(a[0] - b[0]) <= 1e-4 for a, b in zip(got_lp, want_lp))


def test_tp2_engine_answers_as_tp1_and_its_rank_follows_every_step(oracle: Engine, tp2: Engine) -> None:
    text = oracle.generate("The quick brown fox", {**GREEDY, "max_new_tokens": 16})["text"]
    stop = text[3:6] if len(text) >= 6 else None
    assert oracle.flush_cache()  # (both start from an empty radix cache)
    want = _workload(oracle, stop)
    got = _workload(tp2, stop)
    _assert_same(got, want)
    assert want[3]["meta_info"]["cached_tokens"] >= 60  # (the radix hit happened)
    assert want[4]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(want[4]["output_ids"]) < 50
    if stop is not None:
        assert want[5]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert want[6]["meta_info"]["finish_reason"] == {"type": "stop", "matched": re.escape(stop[:2]) + "."}
    # (rank 1 checked its scheduler against rank 0's at each broadcast; at shutdown too, whose test
    # reads its exit code)


def test_an_idle_engine_keeps_its_ranks_past_the_collectives_timeout(oracle: Engine, tiny_model: str) -> None:
    """Rank 1 waits in a broadcast whose timeout is --dist-timeout; the Engine's heartbeat thread
    wakes it while the caller does nothing for longer than that. (Its own Engine: a timeout this
    short bounds every collective, the start-up's included.)"""
    engine = Engine(tiny_model, tp_size=2, dist_timeout=IDLE_DIST_TIMEOUT, **ENGINE_ARGS)
    procs = list(engine._tp.procs)
    assert heartbeat_interval(IDLE_DIST_TIMEOUT) == 1.5
    time.sleep(IDLE_DIST_TIMEOUT + 1.5)
    want = oracle.generate(input_ids=[30, 31, 32], sampling_params=GREEDY)
    assert engine.generate(input_ids=[30, 31, 32], sampling_params=GREEDY)["output_ids"] == want["output_ids"]
    engine.shutdown()  # (stops and joins the ranks, which ended in step)
    assert [p.exitcode for p in procs] == [0] and not any(p.is_alive() for p in procs)


def test_unseeded_sampling_with_retractions_draws_what_one_rank_draws(tiny_model: str, capfd: Any) -> None:
    """Temperature 1 and top_p 0.9 without a seed (the runner's generator, seeded from --random-seed,
    on every rank), in a KV pool small enough to retract: two ranks draw the tokens one rank draws,
    and only rank 0 says it retracted (rank 1 keeps the warnings that are its own)."""
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i] * 3 for i in range(12)]
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 40, "ignore_eos": True}
    small = dict(device="cpu", max_total_tokens=256, chunked_prefill_size=32, random_seed=7)
    outs, retracted = [], []
    for tp_size in (1, 2):
        engine = Engine(tiny_model, tp_size=tp_size, **small)
        procs = list(engine._tp.procs) if engine._tp is not None else []
        outs.append([o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)])
        retracted.append(engine.scheduler.num_retracted_reqs_total)
        engine.shutdown()
        assert [p.exitcode for p in procs] == [0] * (tp_size - 1)
    assert retracted[0] > 0 and retracted[1] == retracted[0]
    assert outs[1] == outs[0]
    assert "Scheduler TP1] KV cache pool is full" not in capfd.readouterr().err


def _follower_whose_stop_regex_times_out(*args: Any) -> None:
    """An Engine's rank > 0 whose stop_regex searches all run past their time budget (a rank that
    is slower, or busier, at that moment than rank 0)."""
    from minisgl.managers.scheduler import run_tp_follower_process
    from minisgl.sampling import stop_regex

    def first_match(patterns: Any, text: str, budget_s: Any = None) -> Any:
        if patterns:
            raise stop_regex.StopRegexTimeout(stop_regex.timeout_message())
        return []

    stop_regex.first_match = first_match
    run_tp_follower_process(*args)


def test_a_stop_regex_timeout_on_one_rank_ends_the_request_on_every_rank(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its search budget is time, which each rank measures on its own: one rank's timeout is every
    rank's (an all_reduce MAX per search of a request with stop_regex), so all end it with the
    400 one rank gives; the other requests, and the ranks, go on."""
    from minisgl.entrypoints import engine_tp
    from minisgl.sampling.stop_regex import timeout_message

    monkeypatch.setattr(engine_tp, "run_tp_follower_process", _follower_whose_stop_regex_times_out)
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    procs = list(engine._tp.procs)
    with pytest.raises(ValueError, match=re.escape(timeout_message())):
        engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "stop_regex": "never matches [0-9]{9}"})
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"]["finish_reason"]["type"] == "length"
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]


def test_a_forgotten_engine_stops_its_ranks_and_gives_the_threads_back(tiny_model: str) -> None:
    """A second tp Engine in the same process works; dropped without shutdown(), its ranks stop
    (a finalizer) and this process gets back the thread count it had."""
    before = mp.active_children()
    torch.set_num_threads(2)
    try:
        engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
        assert torch.get_num_threads() == 1  # two ranks share the two threads
        assert engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"]["finish_reason"]["type"] == "length"
        procs = list(engine._tp.procs)
        del engine
        gc.collect()
        assert [p.exitcode for p in procs] == [0] and not _children_since(before)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_a_rank_that_dies_makes_the_engine_raise_not_hang(tiny_model: str) -> None:
    before = mp.active_children()
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    rank1 = engine._tp.procs[0]
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.join(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 of this Engine exited \(exit code -9\)"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="rank 1 of this Engine exited"):  # (and every later call says so)
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    engine.shutdown()
    assert not _children_since(before)


def test_a_rank_that_dies_in_the_middle_of_a_step_is_named(tiny_model: str) -> None:
    """Rank 0's collective breaks ("Connection closed by peer"): the error is the rank's death."""
    before = mp.active_children()
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    rank1, forward = engine._tp.procs[0], engine.model_runner.forward

    def forward_after_a_death(batch: Any) -> Any:
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        return forward(batch)

    engine.model_runner.forward = forward_after_a_death
    with pytest.raises(RankDiedError, match=r"tensor-parallel rank 1 of this Engine exited \(exit code -9\)"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    engine.shutdown()
    assert not _children_since(before)


def test_an_engine_that_fails_to_start_leaves_no_rank_and_gives_the_threads_back(tiny_model: str) -> None:
    before = mp.active_children()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="leave no room for a prompt"):  # (every rank refuses it; rank 0 says it)
            Engine(tiny_model, device="cpu", tp_size=2, max_total_tokens=4)
        assert not _children_since(before) and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def _follower_that_fails_at_start(server_args: Any, rank: int, store_path: str, pipe_writer: Any, *rest: Any) -> None:
    """An Engine's rank > 0 that refuses to start before it joins the group (what only it refuses)."""
    pipe_writer.send({"status": "error", "message": "ValueError: only rank 1 refuses this"})
    sys.exit(1)


def test_a_rank_that_fails_before_joining_is_the_error_and_leaves_no_thread_waiting(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own message, at once; and rank 0's rendezvous, in a helper thread, stops waiting for it
    (it waited up to --dist-timeout, 30 minutes by default)."""
    before = mp.active_children()
    from minisgl.entrypoints import engine_tp

    monkeypatch.setattr(engine_tp, "run_tp_follower_process", _follower_that_fails_at_start)
    with pytest.raises(RankDiedError, match="tensor-parallel rank 1 failed to start: ValueError: only rank 1 refuses this"):
        Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    deadline = time.monotonic() + 2
    while any(t.name == "minisgl-tp-join" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "minisgl-tp-join" for t in threading.enumerate())
    assert not _children_since(before)


def test_a_rank_that_dies_while_rank_0_waits_in_a_start_up_collective_is_said_at_once(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, NCCL sees a dead peer only at --dist-timeout: rank 0 builds its ModelRunner while
    the Engine watches the ranks. (A collective that does not return stands in for NCCL's here.)"""
    before = mp.active_children()
    from minisgl.model_executor.model_runner import ModelRunner

    released = threading.Event()

    def min_over_ranks(self: Any, value: int) -> int:  # (rank 0's first collective after loading)
        for child in _children_since(before):
            if child.name == "minisgl-engine-tp1":
                os.kill(child.pid, signal.SIGKILL)
        released.wait(45)
        raise RuntimeError("the collective gave up")

    monkeypatch.setattr(ModelRunner, "_min_over_ranks", min_over_ranks)
    start = time.monotonic()
    try:
        with pytest.raises(RankDiedError, match=r"tensor-parallel rank 1 of this Engine exited \(exit code -9\)"):
            Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
        assert time.monotonic() - start < 30
    finally:
        released.set()
    assert not _children_since(before)


def test_the_engine_s_ranks_run_with_the_caller_s_float32_matmul_settings(oracle: Engine, tiny_model: str) -> None:
    """Rank 0 is the caller's process, with its torch.set_float32_matmul_precision (on the CPU,
    "medium" runs oneDNN's float32 matmuls in bfloat16); the spawned ranks started with torch's
    defaults. They take rank 0's, and say so in their ready message (checked: a difference is a
    RankDiedError at start)."""
    from minisgl.managers.tp_process import torch_math_settings

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
        assert torch_math_settings()["float32_matmul_precision"] == "medium"
        assert engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"]["finish_reason"]["type"] == "length"
        engine.shutdown()
    finally:
        torch.set_float32_matmul_precision(before)


class _StartingChild:
    """A child process as _wait_ready sees it (a name, alive until it failed)."""

    def __init__(self, name: str) -> None:
        self.name, self.exitcode = name, None

    def is_alive(self) -> bool:
        return True


def _server_start_up_error(messages: Dict[int, Any]) -> str:
    """_wait_ready's error for a --tp-size 2 server whose children send these {index: (delay_s, message)}."""
    from minisgl.entrypoints.http_server import _wait_ready

    children = [_StartingChild(n) for n in ("minisgl-scheduler", "minisgl-scheduler_tp1", "minisgl-detokenizer")]
    pipes = [mp.Pipe(duplex=False) for _ in children]

    def send(i: int, delay: float, message: Any) -> None:
        time.sleep(delay)
        pipes[i][1].send(message)

    senders = [threading.Thread(target=send, args=(i, *m), daemon=True) for i, m in messages.items()]
    for t in senders:
        t.start()
    with pytest.raises(RuntimeError) as failed:
        _wait_ready(children, [reader for reader, _ in pipes], timeout=20)  # type: ignore[arg-type]
    for t in senders:
        t.join(5)
    return str(failed.value)


def test_the_server_reports_the_rank_that_failed_first_not_rank_0_s_echo() -> None:
    now = time.time()
    cause = {"status": "error", "message": "RuntimeError: rank 1's own failure", "failed_at": now}
    echo = {"status": "error", "message": "RuntimeError: Connection closed by peer", "failed_at": now + 0.05}
    # rank 0's echo is read first; rank 1's failure came before it and arrives within the second
    assert _server_start_up_error({0: (0.0, echo), 1: (0.3, cause)}) == "minisgl-scheduler_tp1 failed to start: RuntimeError: rank 1's own failure"
    # rank 0 failed first: rank 1's error, read first, is the echo
    own = {**cause, "message": "RuntimeError: rank 0's own failure"}
    assert _server_start_up_error({1: (0.0, echo), 0: (0.3, own)}) == "minisgl-scheduler failed to start: RuntimeError: rank 0's own failure"
    # a setting every rank refuses: rank 0's ValueError, at once
    refused = {"status": "error", "message": "ValueError: every rank refuses this", "failed_at": now + 0.05}
    assert _server_start_up_error({0: (0.0, refused), 1: (0.3, cause)}) == "minisgl-scheduler failed to start: ValueError: every rank refuses this"


def test_a_rank_out_of_step_stops_with_both_states_named(oracle: Engine) -> None:
    scheduler = oracle.scheduler
    state = lockstep_state(scheduler)
    apply_broadcast(scheduler, TpBroadcastInput([], run_step=False, lockstep_state=state), rank=1)  # in step: fine
    wrong = [state[0] + 1, *state[1:]]
    with pytest.raises(RuntimeError, match=rf"rank 1 fell out of lockstep with rank 0 \(forward_ct {state[0]} here, {state[0] + 1} on rank 0\)"):
        apply_broadcast(scheduler, TpBroadcastInput([AbortReq(abort_all=True)], lockstep_state=wrong), rank=1)
    assert lockstep_state(scheduler) == state  # (nothing of that iteration ran)


def _turn_of(lock: Any) -> Any:
    """A heartbeat turn (Engine._heartbeat_turn's shape) from a plain lock: taken without waiting."""

    @contextlib.contextmanager
    def turn() -> Iterator[bool]:
        if not lock.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    return turn


def _follower_that_samples_otherwise(*args: Any) -> None:
    """An Engine's rank > 0 whose sampler always draws the last token of the vocabulary (a rank whose
    logits or generator differ), before the ranks' token sync when a step has one."""
    from minisgl.layers.sampler import Sampler
    from minisgl.managers.scheduler import run_tp_follower_process

    forward = Sampler.forward

    def forward_otherwise(self: Any, logits: torch.Tensor, info: Any, generator: Any = None, sync_token_ids: Any = None) -> Any:
        def bend_then_sync(ids: torch.Tensor) -> None:
            ids.fill_(logits.shape[-1] - 1)
            if sync_token_ids is not None:
                sync_token_ids(ids)

        return forward(self, logits, info, generator, bend_then_sync)

    Sampler.forward = forward_otherwise  # type: ignore[method-assign]
    run_tp_follower_process(*args)


def test_a_rank_that_samples_other_tokens_is_caught_or_synced(oracle: Engine, tiny_model: str, monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    """A grammar step syncs the ranks' tokens (an all_reduce MIN, SGLang's): rank 1's last-token
    draws lose to rank 0's, and both stay in step. A plain step does not sync: the token checksum
    in the lockstep state stops rank 1 at the next broadcast, and the Engine names its exit."""
    from minisgl.entrypoints import engine_tp

    monkeypatch.setattr(engine_tp, "run_tp_follower_process", _follower_that_samples_otherwise)
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    if importlib.util.find_spec("xgrammar") is not None:
        params = {**GREEDY, "max_new_tokens": 12, "json_schema": SCHEMA}
        want = oracle.generate(input_ids=[20, 21], sampling_params=params)
        assert engine.generate(input_ids=[20, 21], sampling_params=params)["output_ids"] == want["output_ids"]
    with pytest.raises(RankDiedError, match=r"tensor-parallel rank 1 of this Engine exited \(exit code 1\)"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert re.search(r"rank 1 fell out of lockstep with rank 0 \(token_checksum \d+ here, \d+ on rank 0\)", capfd.readouterr().err)
    engine.shutdown()


def test_sync_token_ids_across_tp_keeps_such_a_rank_in_step(oracle: Engine, tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SYNC_TOKEN_IDS_ACROSS_TP=1 (SGLang's variable): every step's tokens are synced."""
    from minisgl.entrypoints import engine_tp

    monkeypatch.setattr(engine_tp, "run_tp_follower_process", _follower_that_samples_otherwise)
    monkeypatch.setenv("SYNC_TOKEN_IDS_ACROSS_TP", "1")
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    procs = list(engine._tp.procs)
    prompts = [[5, 6, 7], LONG]
    want = [o["output_ids"] for o in oracle.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == want
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]


def _gloo_threads() -> int:
    """How many of this process's threads are gloo process groups' workers (by their Linux name)."""
    names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")


def _follower_that_counts_gloo_threads(*args: Any) -> None:
    """An Engine's rank > 0 that exits 3 (at once: no finalization) when gloo's workers outlive its run."""
    from minisgl.managers.scheduler import run_tp_follower_process

    run_tp_follower_process(*args)
    if _gloo_threads():
        os._exit(3)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_an_orderly_shutdown_joins_the_gloo_threads_of_every_rank(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo worker still freeing a collective's tensor while the interpreter finalized aborted the
    rank (exit -6, "terminate called without an active exception"; 1 run in ~15 on a loaded machine):
    each rank destroys its group before it exits, joining them; rank 0, this process, at shutdown()."""
    from minisgl.entrypoints import engine_tp

    monkeypatch.setattr(engine_tp, "run_tp_follower_process", _follower_that_counts_gloo_threads)
    before = _gloo_threads()  # (a module fixture's Engine may hold its own)
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    procs = list(engine._tp.procs)
    if _gloo_threads() == before:
        pytest.skip("this torch does not name gloo's threads")
    engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]
    assert _gloo_threads() == before


def test_the_engine_heartbeat_never_falls_inside_a_call() -> None:
    """A beat sent while rank 0 is in a step would pair with that step's collectives (the grammar
    all_reduce, the forward's) on the other ranks: it waits for the Engine's lock to be free."""

    class Group:
        sent: List[bytes] = []

        def broadcast_bytes(self, data: bytes) -> bytes:
            self.sent.append(data)
            return data

    busy = threading.RLock()
    leader = TpLeader(Group(), scheduler=None, heartbeat_s=0.05)
    with busy:  # a call (a step) runs for ten heartbeat intervals
        leader.start_heartbeat(_turn_of(busy))
        time.sleep(0.5)
        assert Group.sent == []
    deadline = time.monotonic() + 5
    while not Group.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    leader.shutdown()
    frames = [decode(data) for data in Group.sent]
    assert frames[0] == TpBroadcastInput([], run_step=False) and frames[-1].shutdown  # beats, then the shutdown


def test_a_broadcast_started_inside_a_broadcast_is_refused_not_a_deadlock() -> None:
    """A finalizer the garbage collector runs mid-broadcast, on the same thread, that broadcasts
    (a forgotten Engine's shutdown frame): it would wait for the leader's lock its thread holds."""
    inner: List[BaseException] = []

    class Group:
        def broadcast_bytes(self, data: bytes) -> bytes:
            if data == b"outer":
                try:
                    leader._send(b"inner")  # (what the finalizer would do)
                except RuntimeError as e:
                    inner.append(e)
            return data

    leader = TpLeader(Group(), scheduler=None, heartbeat_s=60)
    sender = threading.Thread(target=leader._send, args=(b"outer",), daemon=True)
    sender.start()
    sender.join(10)
    assert not sender.is_alive(), "the nested broadcast deadlocked"
    assert len(inner) == 1 and "started inside another one on the same thread" in str(inner[0])
    leader._send(b"next")  # (the leader is usable afterwards)


def test_a_stream_the_collector_drops_inside_a_heartbeat_is_released_at_the_next_step(tiny_model: str) -> None:
    """The garbage collector may finalize a dropped stream in the heartbeat thread, in the middle of
    its broadcast: the beat counts as a call in progress, so the release waits for the next step,
    as inside any call (it used to broadcast an abort from inside the broadcast: a deadlock)."""
    engine = Engine(tiny_model, tp_size=2, dist_timeout=8, **ENGINE_ARGS)  # a heartbeat after 2 s quiet
    procs = list(engine._tp.procs)
    group = engine._tp.group
    real, collected = group.broadcast_bytes, threading.Event()

    def broadcast_bytes(data: Optional[bytes], src: int = 0) -> bytes:
        if threading.current_thread().name == "minisgl-tp-heartbeat" and not collected.is_set():
            collected.set()
            gc.collect()  # (what an automatic collection in this thread does)
        return real(data, src)

    group.broadcast_bytes = broadcast_bytes
    gc.disable()  # (only the heartbeat's collection finds the cycle)
    try:
        stream = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 40, "ignore_eos": True}, stream=True)
        next(stream)
        [rid] = engine.rid_to_state
        cycle: List[Any] = [stream]
        cycle.append(cycle)  # a dropped stream that only the collector frees
        del stream, cycle
        assert collected.wait(30)
        assert engine._lock.acquire(timeout=10), "the heartbeat deadlocked"
        engine._lock.release()
        assert engine._dropped == [rid]  # released at the next step
    finally:
        gc.enable()
    while not engine.scheduler.is_idle():
        engine.step(snapshot=False)
    assert not engine.rid_to_state
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]


def test_close_sends_no_shutdown_frame_into_another_threads_call(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finalizer of an Engine whose lock another thread holds (a step of it would be in the
    forward's collectives) waits for that call a while, then terminates the ranks rather than
    broadcast into the middle of it."""
    from minisgl.entrypoints import engine_tp

    monkeypatch.setattr(engine_tp, "LOCK_TIMEOUT_S", 0.5)
    engine = Engine(tiny_model, tp_size=2, **ENGINE_ARGS)
    procs = list(engine._tp.procs)
    holding, done = threading.Event(), threading.Event()

    def a_call() -> None:
        with engine._lock:
            holding.set()
            done.wait(30)

    caller = threading.Thread(target=a_call, daemon=True)
    caller.start()
    assert holding.wait(10)
    engine._tp.close()  # (what the finalizer runs)
    done.set()
    caller.join(10)
    assert [p.exitcode for p in procs] == [-signal.SIGTERM]  # terminated: no shutdown frame reached it
    engine.shutdown()


def _grammar_rank(rank: int, store: str, results: Any) -> None:
    from minisgl.distributed import init_tensor_parallel_group

    torch.set_num_threads(1)
    group = init_tensor_parallel_group(rank, 2, store, timeout_s=60)
    # request 0: compiled everywhere; 1: only on rank 1 (rank 0 still waits, and is not over time);
    # 2: only on rank 0, and over time by rank 0's clock; 3: nowhere, over time by rank 1's clock only
    done = [[True, False, True, False], [True, True, False, False]][rank]
    over_time = [[False, False, True, False], [False, False, False, True]][rank]
    results.put((rank, agree_on_ready_grammars(group, done, over_time)))


def test_ranks_agree_on_ready_grammars_and_rank_0_times_them_out(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_grammar_rank, args=(r, str(tmp_path / "store"), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got[0] == got[1] == ([True, False, False, False], [False, False, True, False])
    assert agree_on_ready_grammars(None, [True, False], [True, True]) == ([True, False], [False, True])  # one rank


def test_what_cannot_stay_in_step_is_refused(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl import server_args

    with pytest.raises(ValueError, match="--enable-custom-logit-processor .* use --tp-size 1"):
        ServerArgs(tp_size=2, enable_custom_logit_processor=True)
    with pytest.raises(ValueError, match="--dist-timeout must be a whole number of seconds >= 1"):
        ServerArgs(tp_size=2, dist_timeout=0)
    # one rank per GPU: more ranks than GPUs is refused before any process starts
    monkeypatch.setattr(server_args, "_cuda_available", lambda: True)
    monkeypatch.setattr(server_args, "_cuda_device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--tp-size 2 runs one rank per GPU, and torch sees 1 \(CUDA_VISIBLE_DEVICES"):
        server_args.resolve_server_args(ServerArgs(model_path=tiny_model, device="cuda", tp_size=2))
    assert server_args.resolve_server_args(ServerArgs(model_path=tiny_model, device="cuda")).device == "cuda"


# --------------------------------------------------------------------------- the server, --tp-size 2
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # (a zombie is dead, not yet reaped)
    except FileNotFoundError:
        return False


def tp2_server(model: str, log_path: str, *flags: str) -> Server:
    """The e2e tests' server with two ranks and a small pool."""
    return Server(model, log_path, "--tp-size", "2", "--max-total-tokens", "1024", *flags)


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = tp2_server(tiny_model, str(tmp_path_factory.mktemp("srv") / "tp2.log"), "--dist-timeout", str(IDLE_DIST_TIMEOUT), "--visualize")
    yield s
    s.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_server_tp2_answers_as_tp1(server: Server, oracle: Engine, tiny_model: str) -> None:
    assert set(server.pids) == {"scheduler", "scheduler_tp1", "detokenizer"}
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    want = oracle.generate("The quick brown fox", GREEDY)
    r = httpx.post(server.url + "/generate", json={"text": "The quick brown fox", "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"] == want["output_ids"]
    # stop_regex: the ranks agree on its search timing out (here it does not), and stop alike
    regex = {**GREEDY, "max_new_tokens": 16, "stop_regex": re.escape(want["text"][2:4]) + "."}
    want_regex = oracle.generate("The quick brown fox", regex)
    r = httpx.post(server.url + "/generate", json={"text": "The quick brown fox", "sampling_params": regex}, timeout=60)
    assert r.status_code == 200, r.text
    assert (r.json()["text"], r.json()["meta_info"]["finish_reason"]) == (want_regex["text"], want_regex["meta_info"]["finish_reason"])
    assert want_regex["meta_info"]["finish_reason"]["type"] == "stop"
    chat = [{"role": "user", "content": "def main():"}]
    prompt = oracle.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    want_chat = oracle.generate(prompt, GREEDY)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model=tiny_model, messages=chat, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat["text"]


@pytest.mark.e2e
@pytest.mark.slow
def test_server_tp2_ops_routes_show_rank_0(server: Server, tmp_path: Any) -> None:
    """The visualizer, /metrics and the profiler are rank 0's: its snapshots, its load, its trace."""
    r = httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"]}, timeout=60)
    assert r.status_code == 200, r.text
    httpx.post(server.url + "/generate", json={"input_ids": [5, 6], "sampling_params": GREEDY}, timeout=60)
    assert httpx.post(server.url + "/stop_profile", timeout=60).status_code == 200
    assert [name.endswith("-TP-0.trace.json.gz") for name in os.listdir(tmp_path)] == [True]  # (rank 0 only)
    snapshot = httpx.get(server.url + "/visualizer/snapshot", timeout=10).json()
    assert snapshot["step"] >= 1 and snapshot["memory"]["total"] == 1024
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r"^sglang:max_total_num_tokens\{[^}]*\} 1024\.0$", metrics, re.M)


@pytest.mark.e2e
@pytest.mark.slow
def test_server_tp2_idle_past_the_collectives_timeout_then_serves(server: Server, oracle: Engine) -> None:
    """Rank 0 blocks on its socket while idle; without its heartbeat rank 1 would time out in
    the broadcast (--dist-timeout 6) and the server would exit."""
    time.sleep(IDLE_DIST_TIMEOUT + 1.5)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/generate", json={"input_ids": [30, 31, 32], "sampling_params": GREEDY}, timeout=60)
    assert r.json()["output_ids"] == oracle.generate(input_ids=[30, 31, 32], sampling_params=GREEDY)["output_ids"]


@pytest.mark.e2e
@pytest.mark.slow
def test_server_tp2_stops_cleanly_with_no_process_left(server: Server) -> None:
    assert server.stop() == 0
    time.sleep(0.5)
    assert [name for name, pid in server.pids.items() if _alive(pid)] == []


@pytest.mark.e2e
@pytest.mark.slow
def test_killing_a_follower_rank_exits_the_server_nonzero(tiny_model: str, tmp_path: Any) -> None:
    s = tp2_server(tiny_model, str(tmp_path / "tp2-kill.log"))
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}, "stream": True}
        with httpx.stream("POST", s.url + "/generate", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # generating
            os.kill(s.pids["scheduler_tp1"], signal.SIGKILL)
            start = time.monotonic()
            list(lines)  # (the stream ends: an error event, or the connection closes)
        code = s.proc.wait(timeout=15)
        assert code != 0 and time.monotonic() - start < 10
        assert "scheduler_tp1 (exit code -9) died" in s.read_log()
        time.sleep(0.5)
        assert [name for name, pid in s.pids.items() if _alive(pid)] == []
    finally:
        s.stop()
