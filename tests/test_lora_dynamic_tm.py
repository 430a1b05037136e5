"""LoRA loaded and unloaded while serving, the TokenizerManager's side: its lora_update_lock, its
LoRARegistry and its count of each adapter's requests in flight (SGLang's), raced against requests.

A real TokenizerManager is wired to an in-process Scheduler and DetokenizerManager (`_Pipeline`:
the server's three processes in one event loop, one scheduler iteration per turn, in
event_loop_normal's order), so each race plays out deterministically: an n > 1 and a batch request
across an unload, a request still tokenizing when the unload comes, an /abort_request while an
unload waits, requests refused before they are sent, loads racing loads and unloads, a client
that leaves mid-way, a scheduler that refuses an unload. `_Pipeline.unloads_deferred` counts the
unloads that reached the scheduler while a request of theirs was still there: the
TokenizerManager's own wait should leave none (the scheduler would hold such an unload, its
safety net, tested in test_lora_dynamic.py).
A scripted scheduler plays the one race a real one rarely shows: a prefix warm-up refused.
The oracle is PEFT (tests/test_lora.py's helpers).
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional, Tuple

import pytest

from minisgl import Engine
from minisgl.managers.io_struct import (
    AbortReq, BatchStrOutput, GenerateReqInput, LoadLoRAAdapterReqInput, LoRAUpdateOutput, TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
)  # fmt: skip
from minisgl.managers.tokenizer_manager import ReqAbortedError, TokenizerManager
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args

from test_lora import GREEDY, PROMPTS, make_adapter, peft_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def adapters(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("lora-dyn-tm")
    return {"A": make_adapter(tiny_model, str(root / "A"), seed=41), "B": make_adapter(tiny_model, str(root / "B"), seed=42)}


@pytest.fixture(scope="module")
def peft(tiny_model: str, adapters: Dict[str, str]) -> Any:
    """PEFT's greedy tokens, computed once per (adapter, prompt, length)."""
    cache: Dict[Tuple[str, int, int], List[int]] = {}

    def want(adapter: str, prompt_index: int, n: int) -> List[int]:
        key = (adapter, prompt_index, n)
        if key not in cache:
            cache[key] = peft_greedy(tiny_model, adapters[adapter], PROMPTS[prompt_index], n)[0]
        return cache[key]

    return want


class _Pipeline:
    """The server's processes in one event loop: what the TokenizerManager sends goes to the Engine's
    Scheduler; its outputs go through the Engine's DetokenizerManager back to the TokenizerManager,
    and its replies straight back, one scheduler iteration per turn of `run`."""

    def __init__(self, engine: Engine, tmp_path: Any) -> None:
        self.engine, self.scheduler = engine, engine.scheduler
        self.tm = TokenizerManager(engine.server_args, PortArgs.init_new(str(tmp_path)), engine.tokenizer, engine.context_len, engine.vocab_size)
        self.inbox: List[Any] = []
        self.sent: List[Any] = []  # every message the TokenizerManager sent, in order
        self.tm._send_to_scheduler = self._send  # type: ignore[method-assign]
        self.unloads_deferred = 0

    def _send(self, msg: Any) -> None:
        self.inbox.append(msg)
        self.sent.append(msg)

    def iteration(self) -> None:
        """event_loop_normal's body: receive, process (replies out), step, outputs and late replies out
        (a copy that never blocks: test_lora_dynamic.py runs the real loop to check that order)."""
        msgs, self.inbox = self.inbox, []
        for msg in msgs:
            if isinstance(msg, UnloadLoRAAdapterReqInput) and self.scheduler.reqs_of_lora(msg.lora_id):
                self.unloads_deferred += 1
        for reply in self.scheduler.process_input_requests(msgs):
            self.tm._dispatch(reply)
        self._outputs()
        self.scheduler.run_step()
        self._outputs()
        for reply in self.scheduler.pop_control_replies():
            self.tm._dispatch(reply)

    def _outputs(self) -> None:
        for out in self.scheduler.pop_outputs():
            text = self.engine.detokenizer.dispatch(out)
            if text is not None:
                self.tm._dispatch(text)

    async def run(self) -> None:
        while True:
            self.iteration()
            await asyncio.sleep(0 if not self.scheduler.is_idle() or self.inbox else 0.001)

    def sent_of(self, kind: type) -> List[Any]:
        return [m for m in self.sent if isinstance(m, kind)]


def _play(tiny_model: str, tmp_path: Any, scenario: Any) -> Any:
    """Run `await scenario(pipe)` against a fresh engine (enable_lora, rank 4, every module)."""
    engine = Engine(tiny_model, device="cpu", max_total_tokens=4096, enable_lora=True, max_lora_rank=4, lora_target_modules=["all"])

    async def main() -> Any:
        pipe = _Pipeline(engine, tmp_path)
        loop_task = asyncio.get_running_loop().create_task(pipe.run())
        try:
            return await asyncio.wait_for(scenario(pipe), timeout=120)
        finally:
            loop_task.cancel()
            await asyncio.gather(loop_task, return_exceptions=True)
            pipe.tm.close()

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


async def _load(tm: TokenizerManager, name: str, path: str) -> LoRAUpdateOutput:
    return await tm.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))


async def _unload(tm: TokenizerManager, name: str) -> LoRAUpdateOutput:
    return await tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name))


async def _generate(tm: TokenizerManager, obj: GenerateReqInput) -> List[Dict[str, Any]]:
    return [out async for out in tm.generate_request(obj)]


def _greedy(prompt: Any, lora: Any, n_tokens: int, n: int = 1, rid: Optional[str] = None) -> GenerateReqInput:
    return GenerateReqInput(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n_tokens, "n": n}, lora_path=lora, rid=rid)


async def _until(condition: Any, what: str) -> None:
    for _ in range(20_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def _finished_in_order(tasks: Dict[str, "asyncio.Task[Any]"]) -> List[str]:
    order: List[str] = []
    for name, task in tasks.items():
        task.add_done_callback(lambda _, name=name: order.append(name))
    return order


# ---------------------------------------------------------------------------- requests across an unload
def test_an_n_gt_1_and_a_batch_request_with_the_adapter_finish_before_its_unload(tiny_model: str, adapters: Dict[str, str], peft: Any, tmp_path: Any) -> None:
    """An n = 2 request (its prefix warm-up runs with the adapter too) and a batch naming the adapter
    for one prompt, both in flight when the unload comes: every sample gets the adapter's tokens,
    the unload answers last, and the scheduler never saw it before the last of them ended."""

    async def scenario(pipe: _Pipeline) -> None:
        tm = pipe.tm
        assert (await _load(tm, "a", adapters["A"])).success
        loop = asyncio.get_running_loop()
        tasks = {
            "n2": loop.create_task(_generate(tm, _greedy(PROMPTS[0], "a", 12, n=2))),
            "batch": loop.create_task(_generate(tm, _greedy(PROMPTS, ["a", None], 12))),
        }
        await asyncio.sleep(0)  # (both resolved the adapter and registered their requests)
        tasks["unload"] = loop.create_task(_unload(tm, "a"))
        order = _finished_in_order(tasks)
        n2, batch, unload = await asyncio.gather(*tasks.values())
        assert order[-1] == "unload" and unload.success and unload.loaded_adapters == {}
        assert [o["output_ids"] for o in n2] == [peft("A", 0, 12)] * 2
        by_index = {o["index"]: o["output_ids"] for o in batch}
        assert by_index[0] == peft("A", 0, 12) and by_index[1] != peft("A", 1, 12)  # (prompt 1 ran on the base model)
        assert pipe.unloads_deferred == 0 and pipe.scheduler.model_runner.lora_manager.adapters == {}
        assert tm.lora_in_flight.count("a") == 0 and not tm.rid_to_state

    _play(tiny_model, tmp_path, scenario)


def test_a_request_still_tokenizing_when_the_unload_comes_runs_with_the_adapter_first(tiny_model: str, adapters: Dict[str, str], peft: Any, tmp_path: Any) -> None:
    """The unload is sent to the scheduler only once a request that resolved the adapter before it
    came, but was still being tokenized, has run with it (SGLang's counter is taken at resolution)."""

    async def scenario(pipe: _Pipeline) -> None:
        tm = pipe.tm
        assert (await _load(tm, "a", adapters["A"])).success
        gate = asyncio.Event()
        tokenize = tm._tokenize_one_request

        async def slow_tokenize(obj: GenerateReqInput) -> TokenizedGenerateReqInput:
            await gate.wait()  # (a long prompt in a worker thread, the dynamic batch tokenizer's wait)
            return await tokenize(obj)

        tm._tokenize_one_request = slow_tokenize  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        generate = loop.create_task(_generate(tm, _greedy(PROMPTS[0], "a", 10)))
        await asyncio.sleep(0)
        unload = loop.create_task(_unload(tm, "a"))
        await asyncio.sleep(0.2)  # (many scheduler iterations)
        assert not unload.done() and not pipe.sent_of(UnloadLoRAAdapterReqInput)  # waiting for it
        gate.set()
        order = _finished_in_order({"generate": generate, "unload": unload})
        [out], done = await asyncio.gather(generate, unload)
        assert out["output_ids"] == peft("A", 0, 10) and done.success and order == ["generate", "unload"]
        assert pipe.unloads_deferred == 0

    _play(tiny_model, tmp_path, scenario)


def test_an_abort_of_the_adapter_s_request_ends_the_unload_s_wait(tiny_model: str, adapters: Dict[str, str], tmp_path: Any) -> None:
    """/abort_request of the long request an unload waits for: the request ends aborted, and the
    unload goes through right after, long before the request would have finished."""

    async def scenario(pipe: _Pipeline) -> None:
        tm = pipe.tm
        assert (await _load(tm, "a", adapters["A"])).success
        loop = asyncio.get_running_loop()
        generate = loop.create_task(_generate(tm, _greedy(PROMPTS[0], "a", 2000, rid="long")))
        await _until(lambda: pipe.scheduler.reqs_of_lora("a") and pipe.scheduler.running_batch.reqs, "the request runs")
        unload = loop.create_task(_unload(tm, "a"))
        await asyncio.sleep(0.05)
        assert not unload.done()
        tm.abort_request("long")
        [out] = await generate
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 2000
        done = await unload
        assert done.success and pipe.scheduler.model_runner.lora_manager.adapters == {} and pipe.unloads_deferred == 0

    _play(tiny_model, tmp_path, scenario)


def test_requests_refused_before_they_are_sent_leave_the_adapter_free_to_unload(tiny_model: str, adapters: Dict[str, str], tmp_path: Any) -> None:
    """Two requests naming the adapter, refused after they were registered (and counted as its) but
    before anything was sent: an id outside the vocabulary, a prompt past the context. Neither stays
    counted, so the adapter's unload goes through at once (a count left at 1 would make it, and
    every later load and unload behind lora_update_lock, wait forever)."""

    async def scenario(pipe: _Pipeline) -> None:
        tm = pipe.tm
        assert (await _load(tm, "a", adapters["A"])).success
        for prompt, message in (([10**9], "outside the vocabulary"), ([1] * (pipe.engine.context_len + 1), "longer than the model's context length")):
            with pytest.raises(ValueError, match=message):
                await _generate(tm, _greedy(prompt, "a", 2))
        assert tm.lora_in_flight.count("a") == 0 and not tm.rid_to_state and not pipe.sent_of(TokenizedGenerateReqInput)
        assert (await asyncio.wait_for(_unload(tm, "a"), 5)).success
        assert pipe.scheduler.model_runner.lora_manager.adapters == {}

    _play(tiny_model, tmp_path, scenario)


# ---------------------------------------------------------------------------- loads and unloads racing
def test_two_loads_of_one_name_at_once_load_it_once(tiny_model: str, adapters: Dict[str, str], peft: Any, tmp_path: Any) -> None:
    async def scenario(pipe: _Pipeline) -> None:
        tm = pipe.tm
        first, second = await asyncio.gather(_load(tm, "a", adapters["A"]), _load(tm, "a", adapters["B"]))
        assert first.success and not second.success
        assert second.error_message.startswith("LoRA adapter 'a' is already loaded (from '" + adapters["A"])
        assert len(pipe.sent_of(LoadLoRAAdapterReqInput)) == 1 and tm.lora_registry.loaded_adapters() == {"a": adapters["A"]}
        [out] = await _generate(tm, _greedy(PROMPTS[0], "a", 8))
        assert out["output_ids"] == peft("A", 0, 8)

    _play(tiny_model, tmp_path, scenario)


def test_a_load_that_comes_while_an_unload_waits_runs_after_it(tiny_model: str, adapters: Dict[str, str], peft: Any, tmp_path: Any) -> None:
    """Loads and unloads take turns (lora_update_lock): a load of the same name, other weights,
    sent while the unload waits for a running request, answers after the unload, under a new
    lora_id; the running request keeps the old weights, a new one gets the new."""

    async def scenario(pipe: _Pipeline) -> None:
        tm = pipe.tm
        assert (await _load(tm, "a", adapters["A"])).success
        loop = asyncio.get_running_loop()
        tasks = {"generate": loop.create_task(_generate(tm, _greedy(PROMPTS[0], "a", 40)))}
        await _until(lambda: pipe.scheduler.running_batch.reqs, "the request runs")
        tasks["unload"] = loop.create_task(_unload(tm, "a"))
        await asyncio.sleep(0)
        tasks["load"] = loop.create_task(_load(tm, "a", adapters["B"]))
        order = _finished_in_order(tasks)
        [out], unload, load = await asyncio.gather(*tasks.values())
        assert order == ["generate", "unload", "load"] and unload.success and load.success
        assert out["output_ids"] == peft("A", 0, 40)
        assert tm.lora_registry.lora_id_of("a") == "a#2" and list(pipe.scheduler.model_runner.lora_manager.adapters) == ["a#2"]
        [again] = await _generate(tm, _greedy(PROMPTS[0], "a", 8))
        assert again["output_ids"] == peft("B", 0, 8)

    _play(tiny_model, tmp_path, scenario)


def test_a_client_that_leaves_mid_load_or_mid_unload_leaves_it_whole(tiny_model: str, adapters: Dict[str, str], peft: Any, tmp_path: Any) -> None:
    """A client disconnect cancels the route's handler: the load (sent, not yet answered) and the
    unload (waiting for a running request) still finish, and name and weights agree after each."""

    async def scenario(pipe: _Pipeline) -> None:
        tm, manager = pipe.tm, pipe.scheduler.model_runner.lora_manager
        load = asyncio.get_running_loop().create_task(_load(tm, "a", adapters["A"]))
        await _until(lambda: pipe.sent_of(LoadLoRAAdapterReqInput), "the load is sent")
        load.cancel()
        await _until(lambda: "a" in tm.lora_registry.loaded_adapters(), "the load completes")
        assert list(manager.adapters) == ["a"]
        generate = asyncio.get_running_loop().create_task(_generate(tm, _greedy(PROMPTS[0], "a", 30)))
        await _until(lambda: pipe.scheduler.running_batch.reqs, "the request runs")
        unload = asyncio.get_running_loop().create_task(_unload(tm, "a"))
        await asyncio.sleep(0.01)
        unload.cancel()
        [out] = await generate
        assert out["output_ids"] == peft("A", 0, 30)
        await _until(lambda: not manager.adapters, "the unload completes")
        assert tm.lora_registry.loaded_adapters() == {} and not tm.lora_update_lock.locked()

    _play(tiny_model, tmp_path, scenario)


def test_an_unload_the_scheduler_refuses_leaves_the_adapter_named_and_usable(
    tiny_model: str, adapters: Dict[str, str], peft: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the scheduler answers an unload with a failure and keeps the weights, the name comes back
    (same lora_id, same place in /v1/models): requests run with it, and a later unload works."""

    async def scenario(pipe: _Pipeline) -> None:
        tm, manager = pipe.tm, pipe.scheduler.model_runner.lora_manager
        for name in ("a", "b"):
            assert (await _load(tm, name, adapters["A"])).success
        monkeypatch.setattr(pipe.scheduler, "unload_lora_adapter", lambda msg: LoRAUpdateOutput(False, "refused here", manager.loaded_adapters()))
        out = await _unload(tm, "a")
        assert not out.success and out.error_message == "refused here"
        assert [(r.lora_name, r.lora_id) for r in tm.lora_registry.refs()] == [("a", "a"), ("b", "b")]
        [again] = await _generate(tm, _greedy(PROMPTS[0], "a", 8))
        assert again["output_ids"] == peft("A", 0, 8)
        monkeypatch.undo()
        assert (await _unload(tm, "a")).success and sorted(manager.adapters) == ["b"]
        assert (await _load(tm, "a", adapters["B"])).success and tm.lora_registry.lora_id_of("a") == "a#2"

    _play(tiny_model, tmp_path, scenario)


# ---------------------------------------------------------------------------- a refused prefix warm-up (scripted)
def test_a_refused_warm_up_aborts_its_sibling_and_the_unload_waits_for_that_one(tiny_model: str, tmp_path: Any) -> None:
    """n = 2 over two prompts sends one prefix warm-up per prompt, each with the adapter. The
    scheduler refuses one (a full queue's 503): the request fails, its other warm-up is aborted
    rather than left running for nobody, and an unload of the adapter, though the request is gone,
    reaches the scheduler only once that warm-up's end came back (it is counted as the adapter's)."""
    args = resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", enable_lora=True, max_lora_rank=4, lora_target_modules=("all",)))
    from minisgl.utils import get_tokenizer

    tokenizer = get_tokenizer(tiny_model)

    async def main() -> None:
        tm = TokenizerManager(args, PortArgs.init_new(str(tmp_path)), tokenizer, 256, len(tokenizer))
        sent: List[Any] = []

        def scheduler(msg: Any) -> None:  # answers loads and unloads; requests wait to be answered below
            sent.append(msg)
            if isinstance(msg, (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)):
                loaded = {} if isinstance(msg, UnloadLoRAAdapterReqInput) else {"a": "/x/a"}
                asyncio.get_running_loop().call_soon(tm._dispatch, LoRAUpdateOutput(True, None, loaded))

        def finish(rid: str, message: str, status: Optional[int]) -> None:
            reason = {"type": "abort", "message": message, "status_code": status}
            tm._dispatch(BatchStrOutput(rids=[rid], finished_reasons=[reason], output_strs=[""], output_ids=[[]],
                                        prompt_tokens=[3], completion_tokens=[0], cached_tokens=[0]))  # fmt: skip

        tm._send_to_scheduler = scheduler  # type: ignore[method-assign]
        try:
            assert (await _load(tm, "a", "/x/a")).success
            client = asyncio.get_running_loop().create_task(_generate(tm, _greedy([[5, 6, 7], [8, 9, 10]], "a", 4, n=2)))
            await _until(lambda: len([m for m in sent if isinstance(m, TokenizedGenerateReqInput)]) == 2, "both warm-ups sent")
            kept, refused = [m for m in sent if isinstance(m, TokenizedGenerateReqInput)]
            assert kept.lora_id == refused.lora_id == "a"
            finish(refused.rid, "The request queue is full.", 503)
            with pytest.raises(ReqAbortedError, match="queue is full"):
                await client
            assert any(isinstance(m, AbortReq) and m.rid == kept.rid for m in sent)  # the sibling aborted
            unload = asyncio.get_running_loop().create_task(_unload(tm, "a"))
            await asyncio.sleep(0.05)
            assert not unload.done() and not any(isinstance(m, UnloadLoRAAdapterReqInput) for m in sent)
            finish(kept.rid, "Aborted", None)  # (the scheduler's answer to that abort)
            assert (await unload).success and isinstance(sent[-1], UnloadLoRAAdapterReqInput)
            assert tm.lora_registry.loaded_adapters() == {} and not tm.rid_to_state
        finally:
            tm.close()

    asyncio.run(asyncio.wait_for(main(), 60))  # (a regression fails here instead of hanging the suite)
