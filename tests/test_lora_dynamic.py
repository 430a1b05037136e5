"""LoRA adapters loaded and unloaded while serving (SGLang's dynamic LoRA), in-process: an adapter
loaded at run time answers as PEFT does, an unload waits for the adapter's requests and then
refuses it, a name loaded again with other weights never reuses the K/V cached under the old
ones, and every refusal (rank, modules, --max-loaded-loras, a taken name, not an adapter) says
what to change and leaves the rest untouched. The oracle is PEFT (tests/test_lora.py's helpers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

from minisgl import Engine, ServerArgs
from minisgl.lora.lora_registry import LORA_NOT_ENABLED, LoRARegistry, lora_name_of
from minisgl.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput, TokenizedGenerateReqInput, UnloadLoRAAdapterReqInput
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.server_args import resolve_server_args

from test_lora import GREEDY, PROMPTS, _edited_adapter, make_adapter, peft_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

ALL = ["all"]


@pytest.fixture(scope="module")
def adapters(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("lora-dyn")
    return {
        "one": make_adapter(tiny_model, str(root / "one"), seed=21),
        "two": make_adapter(tiny_model, str(root / "two"), seed=22),  # same shape, other weights
        "qv": make_adapter(tiny_model, str(root / "qv"), seed=23, targets=["q_proj", "v_proj"], r=2),
        "r8": make_adapter(tiny_model, str(root / "r8"), seed=24, r=8),
    }


def _engine(tiny_model: str, **args: Any) -> Engine:
    args = {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ALL, **args}
    return Engine(tiny_model, device="cpu", max_total_tokens=4096, **args)


def _greedy(engine: Engine, prompt: List[int], lora: Optional[str], n: int = 8) -> Dict[str, Any]:
    return engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n}, return_logprob=True, lora_path=lora)


def _logprobs(out: Dict[str, Any]) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])


# ---------------------------------------------------------------------------- load, run, unload
def test_an_adapter_loaded_while_serving_answers_as_peft_and_is_gone_after_its_unload(tiny_model: str, adapters: Dict[str, str]) -> None:
    with _engine(tiny_model) as e:  # (no adapter at start)
        base = [_greedy(e, p, None) for p in PROMPTS]
        out = e.load_lora_adapter("one", adapters["one"])
        assert out.success and out.loaded_adapters == {"one": adapters["one"]}
        for prompt, before in zip(PROMPTS, base):
            want_ids, want_lps = peft_greedy(tiny_model, adapters["one"], prompt, 8)
            got = _greedy(e, prompt, "one")
            assert got["output_ids"] == want_ids and torch.allclose(_logprobs(got), torch.tensor(want_lps), atol=1e-4)
            assert want_ids != before["output_ids"]  # (the adapter matters: else this test could not fail)
            assert _greedy(e, prompt, None)["output_ids"] == before["output_ids"]  # the base model untouched
        out = e.unload_lora_adapter("one")
        assert out.success and out.loaded_adapters == {}
        assert e.model_runner.lora_manager.adapters == {}  # the weights are gone
        with pytest.raises(ValueError, match="LoRA adapter 'one' is not loaded; no adapter is loaded"):
            _greedy(e, PROMPTS[0], "one")
        assert [_greedy(e, p, None)["output_ids"] for p in PROMPTS] == [b["output_ids"] for b in base]


def test_unload_lets_the_adapter_s_requests_finish_first(tiny_model: str, adapters: Dict[str, str]) -> None:
    """SGLang's unload waits for the adapter's requests in flight: one queued and one running when
    the unload comes both finish with PEFT's tokens, a base request beside them is unaffected, and
    only then are the weights dropped; a request naming it after the unload began is refused."""
    want = peft_greedy(tiny_model, adapters["one"], PROMPTS[0], 24)[0]
    with _engine(tiny_model) as e:
        base_want = _greedy(e, PROMPTS[1], None, n=24)["output_ids"]
        e.load_lora_adapter("one", adapters["one"])
        running = e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 24}, lora_path="one")
        e.step()
        e.step()  # (prefilled, decoding)
        queued = e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 24}, lora_path="one")
        beside = e.add_request(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 24})
        assert not e.rid_to_state[running].finished and len(e.scheduler.reqs_of_lora("one")) == 2  # (in flight)
        e.unload_lora_adapter("one")
        assert "one" not in e.model_runner.lora_manager.adapters
        assert e.get_result(running)["output_ids"] == want
        assert e.get_result(queued)["output_ids"] == want
        e.run_until_idle()
        assert e.get_result(beside)["output_ids"] == base_want
        with pytest.raises(ValueError, match="LoRA adapter 'one' is not loaded"):
            e.add_request(input_ids=PROMPTS[0], lora_path="one")


def test_an_unload_reaching_the_scheduler_while_the_adapter_runs_is_answered_after_its_requests(tiny_model: str, adapters: Dict[str, str]) -> None:
    """The scheduler's own wait, the safety net under the TokenizerManager's count: an unload that
    arrives while a request of that load runs and another is queued gets no reply yet, a request
    naming the load from then on is refused, and once the last one finished (with the adapter's
    tokens) the weights go and the reply comes, after that step."""
    want = peft_greedy(tiny_model, adapters["one"], PROMPTS[0], 12)[0]
    with _engine(tiny_model) as e:
        e.load_lora_adapter("one", adapters["one"])
        running = e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 12}, lora_path="one")
        e.step()
        queued = e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 12}, lora_path="one")
        assert e.scheduler.process_input_requests([UnloadLoRAAdapterReqInput("one", "one")]) == []  # held
        late = e.scheduler.handle_generate_request(_tokenized("late", "one"))
        assert late.to_finish.message == "LoRA adapter 'one' is being unloaded; load it again (/load_lora_adapter) to use it"
        replies: List[Any] = []
        while not replies:
            assert "one" in e.model_runner.lora_manager.adapters  # (kept while a request needs it)
            e.step()
            replies = e.scheduler.pop_control_replies()
        assert replies == [LoRAUpdateOutput(True, None, {})] and e.model_runner.lora_manager.adapters == {}
        assert e.get_result(running)["output_ids"] == want and e.get_result(queued)["output_ids"] == want
        assert not e.scheduler.pending_lora_unloads


def test_the_server_loop_sends_a_held_unload_s_reply_before_it_waits_idle(tiny_model: str, adapters: Dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """event_loop_normal itself, on stand-in sockets: an unload that arrives while a request of its
    adapter runs is held; the step that finishes the request sends the request's end, then the
    unload's reply, and only then does the idle loop block on recv. (A reply popped before the step
    would wait unsent in that blocked recv, with the TokenizerManager's lora_update_lock held,
    until some other message came.)"""
    import minisgl.managers.scheduler as scheduler_module
    from minisgl.managers.io_struct import decode

    class Blocked(Exception):
        pass

    inbox = [[_tokenized("r", "one")], [UnloadLoRAAdapterReqInput("one", "one")]]  # (r: 2 tokens; the unload comes after its first)
    seen: List[Any] = []

    def recv_requests(socket: Any, block: bool, timeout_s: Optional[float] = None) -> List[Any]:
        if inbox:
            return inbox.pop(0)
        if block or len(seen) > 100:  # (the loop ends here; a loop that never idles ends too)
            seen.append("recv blocks" if block else "never idle")
            raise Blocked
        return []

    class Socket:
        def send(self, data: bytes) -> None:
            msg = decode(data)
            if isinstance(msg, LoRAUpdateOutput):
                seen.append(("unload reply", msg.success, msg.loaded_adapters))
            elif any(getattr(msg, "finished_reasons", None) or []):
                seen.append(("finished", msg.rids))

    with _engine(tiny_model) as e:
        e.load_lora_adapter("one", adapters["one"])
        monkeypatch.setattr(scheduler_module, "recv_requests", recv_requests)
        # (no watchdogs: a hard one's thread would outlive this loop and end the test process)
        monkeypatch.setattr(e.scheduler, "server_args", dataclasses.replace(e.scheduler.server_args, watchdog_timeout=None))
        with pytest.raises(Blocked):
            scheduler_module.event_loop_normal(e.scheduler, None, Socket(), Socket())
        assert seen == [("finished", ["r"]), ("unload reply", True, {}), "recv blocks"]
        assert e.model_runner.lora_manager.adapters == {}


def _tokenized(rid: str, lora_id: str) -> TokenizedGenerateReqInput:
    """A request as the scheduler receives it, naming adapter load `lora_id` (none was resolved here)."""
    return TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=PROMPTS[1], sampling_params=SamplingParams(max_new_tokens=2), lora_id=lora_id)


def test_the_scheduler_refuses_a_request_of_a_load_it_no_longer_holds_in_the_adapter_s_name(tiny_model: str, adapters: Dict[str, str]) -> None:
    """A request naming a load the scheduler does not hold (the TokenizerManager refuses it first;
    this is the last gate) is refused with the adapter's name, never the id, and runs its one-token
    prefill on the base model, in the base model's radix namespace (no stale id in extra_key)."""
    with _engine(tiny_model) as e:
        e.load_lora_adapter("x", adapters["one"])
        e.unload_lora_adapter("x")
        gone = e.scheduler.handle_generate_request(_tokenized("gone", "x"))
        assert gone.to_finish.message == "LoRA adapter 'x' is not loaded; no adapter is loaded"
        assert gone.lora_id is None and gone.extra_key is None
        e.load_lora_adapter("x", adapters["two"])  # (lora_id x#2)
        stale = e.scheduler.handle_generate_request(_tokenized("stale", "x"))
        assert stale.to_finish.message == "LoRA adapter 'x' was unloaded and loaded again while this request was on its way: send it again"
        assert stale.lora_id is None and stale.extra_key is None
        e.unload_lora_adapter("x")
        assert e.scheduler.handle_generate_request(_tokenized("gone2", "x#2")).to_finish.message == "LoRA adapter 'x' is not loaded; no adapter is loaded"
        e.run_until_idle()
        e.scheduler.check_integrity()


def test_an_interrupted_unload_leaves_the_adapter_loaded_named_and_unloadable(tiny_model: str, adapters: Dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (delivered after a step: Engine.step holds signals until then) or an error in a step
    while unload_lora_adapter waits for the adapter's request: the call re-raises, and the adapter
    is still loaded and named: requests run with it, and a later unload works."""
    want = peft_greedy(tiny_model, adapters["one"], PROMPTS[0], 24)[0]
    with _engine(tiny_model) as e:
        e.load_lora_adapter("one", adapters["one"])
        rid = e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 24}, lora_path="one")
        step = type(e).step
        for error in (KeyboardInterrupt, RuntimeError):

            def step_then_fail(self: Engine, snapshot: bool = True) -> Any:
                step(self, snapshot)
                raise error("interrupted")

            monkeypatch.setattr(Engine, "step", step_then_fail)
            with pytest.raises(error):
                e.unload_lora_adapter("one")
            monkeypatch.undo()
            assert _state(e) == ({"one": adapters["one"]}, ["one"]) and e.lora_registry.lora_id_of("one") == "one"
        assert _greedy(e, PROMPTS[0], "one", n=24)["output_ids"] == want  # a new request runs with it
        assert e.get_result(rid)["output_ids"] == want
        assert e.unload_lora_adapter("one").success and _state(e) == ({}, [])
        e.load_lora_adapter("one", adapters["two"])
        assert e.lora_registry.lora_id_of("one") == "one#2"


def test_a_name_loaded_again_with_other_weights_never_reuses_the_old_cached_kv(tiny_model: str, adapters: Dict[str, str]) -> None:
    """Each load gets its own lora_id (SGLang's), and the radix namespace is the id, not the name:
    the prompt cached under the first "x" is not a hit for the second, whose answer is PEFT's."""
    prompt = list(range(60, 100))  # 40 tokens: a stale hit would cover 39 of them
    with _engine(tiny_model) as e:
        e.load_lora_adapter("x", adapters["one"])
        first = _greedy(e, prompt, "x")
        assert first["meta_info"]["cached_tokens"] == 0
        assert _greedy(e, prompt, "x")["meta_info"]["cached_tokens"] == len(prompt) - 1  # (the cache would hit)
        e.unload_lora_adapter("x")
        e.load_lora_adapter("x", adapters["two"])
        assert e.lora_registry.lora_id_of("x") == "x#2"
        again = _greedy(e, prompt, "x")
        assert again["meta_info"]["cached_tokens"] == 0  # nothing computed with the old weights is reused
        want_ids, want_lps = peft_greedy(tiny_model, adapters["two"], prompt, 8)
        assert again["output_ids"] == want_ids and torch.allclose(_logprobs(again), torch.tensor(want_lps), atol=1e-4)
        assert want_ids != first["output_ids"]  # (other weights: a stale hit would have shown)
        assert _greedy(e, prompt, "x")["meta_info"]["cached_tokens"] == len(prompt) - 1  # its own K/V is reused
        e.scheduler.check_integrity()
        tree = e.snapshot()["radix"]["tree"]
        json.dumps(tree)
        assert sorted(str(c["lora_id"]) for c in tree["children"]) == ["x", "x#2"]  # the old namespace left to eviction


def test_lora_paths_adapters_unload_and_load_again_under_their_name(tiny_model: str, adapters: Dict[str, str]) -> None:
    """A start-up adapter is an adapter like the others: its id is its name, it unloads, and the
    name takes a new load (max_lora_rank and the modules inferred from lora_paths)."""
    with Engine(tiny_model, device="cpu", max_total_tokens=4096, lora_paths=[f"one={adapters['one']}"]) as e:
        assert e.lora_registry.lora_id_of("one") == "one"
        assert e.model_runner.lora_manager.max_lora_rank == 4
        e.unload_lora_adapter("one")
        e.load_lora_adapter("one", adapters["two"], pinned=True)
        assert e.lora_registry.refs()[0].pinned and e.lora_registry.lora_id_of("one") == "one#2"
        assert _greedy(e, PROMPTS[0], "one")["output_ids"] == peft_greedy(tiny_model, adapters["two"], PROMPTS[0], 8)[0]
        with pytest.raises(ValueError, match=r"rank 8, above --max-lora-rank 4 \(not given: the largest rank of --lora-paths\): "
                                             r"restart the server with --max-lora-rank 8 or more"):  # fmt: skip
            e.load_lora_adapter("r8", adapters["r8"])


# ---------------------------------------------------------------------------- refusals
def _state(e: Engine) -> Any:
    return e.lora_registry.loaded_adapters(), sorted(e.model_runner.lora_manager.adapters)


def test_refused_loads_say_what_to_change_and_change_nothing(tiny_model: str, adapters: Dict[str, str], tmp_path: Any) -> None:
    dora = _edited_adapter(adapters["one"], tmp_path / "dora", use_dora=True)
    (tmp_path / "empty").mkdir()
    with _engine(tiny_model, lora_target_modules=["q_proj", "v_proj", "k_proj"], max_loaded_loras=2) as e:
        e.load_lora_adapter("qv", adapters["qv"])
        before = _state(e)
        want = _greedy(e, PROMPTS[0], "qv")["output_ids"]
        for name, path, message in (
            ("r8", adapters["r8"], "has rank 8, above --max-lora-rank 4: restart the server with --max-lora-rank 8 or more"),
            ("all", adapters["one"], "targets ['down_proj', 'gate_proj', 'o_proj', 'up_proj'], outside --lora-target-modules "
                                     "['k_proj', 'q_proj', 'v_proj']: restart the server with --lora-target-modules down_proj "
                                     "gate_proj k_proj o_proj q_proj up_proj v_proj (or all)"),
            ("qv", adapters["qv"], "LoRA adapter 'qv' is already loaded"),
            ("gone", str(tmp_path / "nope"), "is not a directory"),
            ("empty", str(tmp_path / "empty"), "has no adapter_config.json"),
            ("dora", dora, "use_dora=True is not supported"),
            ("", adapters["qv"], "lora_name must be a non-empty string"),
            ("a\0b", adapters["qv"], "holds a NUL character"),
            (" qv2", adapters["qv"], "lora_name ' qv2' starts or ends with whitespace; name the adapter without it"),
            ("x" * 257, adapters["qv"], "lora_name takes at most 256 characters, got 257"),
            ("p", "", "lora_path must be the adapter's directory (a PEFT save_pretrained directory), got ''"),
        ):  # fmt: skip
            with pytest.raises(ValueError) as info:
                e.load_lora_adapter(name, path)
            assert message in str(info.value), (name, str(info.value))
            assert _state(e) == before, name
        with pytest.raises(ValueError, match="pinned must be True or False"):
            e.load_lora_adapter("p", adapters["qv"], pinned="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="lora_path must be the adapter's directory"):
            e.load_lora_adapter("p", 3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="LoRA adapter 'zz' is not loaded; the loaded adapters are: qv"):
            e.unload_lora_adapter("zz")
        for bad in (["qv"], None, ""):  # (checked as a load's name is: a list is no unhashable-key TypeError)
            with pytest.raises(ValueError) as info:
                e.unload_lora_adapter(bad)  # type: ignore[arg-type]
            assert str(info.value) == f"lora_name must be a non-empty string (the adapter's name), got {bad!r}"
        assert _state(e) == before
        # --max-loaded-loras 2: a second adapter loads, a third is refused until one is unloaded
        e.load_lora_adapter("qv2", adapters["qv"])
        with pytest.raises(ValueError, match=r"the maximum number of loaded LoRA adapters is 2 \(--max-loaded-loras\), loaded: qv, qv2"):
            e.load_lora_adapter("qv3", adapters["qv"])
        e.unload_lora_adapter("qv2")
        e.load_lora_adapter("qv3", adapters["qv"])
        assert _greedy(e, PROMPTS[0], "qv")["output_ids"] == want  # what was loaded answers as before
        assert _greedy(e, PROMPTS[0], "qv3")["output_ids"] == want
    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as off:
        for call in (lambda: off.load_lora_adapter("one", adapters["one"]), lambda: off.unload_lora_adapter("one"),
                     lambda: off.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 1}, lora_path="one")):  # fmt: skip
            with pytest.raises(ValueError) as info:
                call()
            assert str(info.value) == LORA_NOT_ENABLED and "(the Engine: lora_paths=[...], or enable_lora=True" in LORA_NOT_ENABLED


def test_a_refused_load_uses_up_no_lora_id_and_ids_never_repeat(tiny_model: str, adapters: Dict[str, str], tmp_path: Any) -> None:
    """A load's id is committed only when it succeeds: a name refused first still gets its plain
    id. Ids of every (name, load) pair differ, names holding '#' included, and name the adapter back."""
    with _engine(tiny_model) as e:
        with pytest.raises(ValueError, match="is not a directory"):
            e.load_lora_adapter("x", str(tmp_path / "nope"))
        e.load_lora_adapter("x", adapters["one"])
        assert e.lora_registry.lora_id_of("x") == "x"
    registry, seen = LoRARegistry(), set()

    def load(name: str) -> str:
        with registry.loading(name, "/p", False, None) as update:
            update.out = LoRAUpdateOutput(True)
        lora_id = registry.lora_id_of(name)
        assert lora_id not in seen and lora_name_of(lora_id) == name
        seen.add(lora_id)
        return lora_id

    def unload(name: str) -> None:
        with registry.unloading(name) as update:
            update.out = LoRAUpdateOutput(True)

    assert [load("x#2"), load("x")] == ["x#2#1", "x"]
    unload("x")
    assert load("x") == "x#2"  # (not the id of adapter "x#2")
    for _ in range(3):
        unload("x#2")
        load("x#2")
        unload("x")
        load("x")
    assert registry.lora_id_of("x") == "x#5" and registry.lora_id_of("x#2") == "x#2#4"


def test_an_adapter_is_read_with_the_server_s_watchdogs_paused(tiny_model: str, adapters: Dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading an adapter from a slow disk inside the scheduler's loop is slow, not hung: the load
    runs under Scheduler.watchdogs_paused (the server's loop pauses its hard watchdog with it)."""
    seen: List[Any] = []
    with _engine(tiny_model) as e:

        @contextlib.contextmanager
        def paused() -> Iterator[None]:
            seen.append(sorted(e.model_runner.lora_manager.adapters))
            yield
            seen.append(sorted(e.model_runner.lora_manager.adapters))

        monkeypatch.setattr(e.scheduler, "watchdogs_paused", paused)
        e.load_lora_adapter("one", adapters["one"])
    assert seen == [[], ["one"]]  # read inside the pause


def test_server_args_of_dynamic_lora(tiny_model: str, adapters: Dict[str, str]) -> None:
    one = f"one={adapters['one']}"
    with pytest.raises(ValueError, match="--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules"):
        ServerArgs(enable_lora=True, max_lora_rank=8)
    for flags in ({"max_lora_rank": 8}, {"lora_target_modules": ("q_proj",)}, {"max_loaded_loras": 2}):
        flag = "--" + next(iter(flags)).replace("_", "-")
        with pytest.raises(ValueError, match=f"{flag} set without --lora-paths or --enable-lora"):
            ServerArgs(**flags)
    with pytest.raises(ValueError, match=r"--lora-target-modules \['qkv'\]: LoRA applies to q_proj"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_target_modules=("q_proj", "qkv"))
    with pytest.raises(ValueError, match="all stands alone"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_target_modules=("all", "q_proj"))
    with pytest.raises(ValueError, match="--max-lora-rank must be an integer >= 1, got 0"):
        ServerArgs(enable_lora=True, max_lora_rank=0, lora_target_modules=("q_proj",))
    with pytest.raises(ValueError, match="--lora-paths names 2 adapters, more than --max-loaded-loras 1"):
        ServerArgs(lora_paths=(one, f"two={adapters['two']}"), max_loaded_loras=1)
    with pytest.raises(ValueError, match="--speculative-algorithm"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_target_modules=("q_proj",), speculative_algorithm="NGRAM")
    for lora in ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ("q_proj",)}, {"lora_paths": (one,)}):
        with pytest.raises(ValueError, match=r"LoRA \(--lora-paths, --enable-lora\) needs --tp-size 1: .* with --tp-size 2 each rank holds only a slice"):
            ServerArgs(tp_size=2, **lora)
    # the CLI: `all` resolves to every module LoRA applies to; --lora-paths turns LoRA on
    args = ServerArgs.from_argv(["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "--max-loaded-loras", "3"])
    resolved = resolve_server_args(dataclasses.replace(args, device="cpu", model_path=tiny_model))
    assert resolved.enable_lora and resolved.max_lora_rank == 8 and resolved.max_loaded_loras == 3
    assert resolved.lora_target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert resolve_server_args(ServerArgs(device="cpu", model_path=tiny_model, lora_paths=(one,))).enable_lora
    assert not resolve_server_args(ServerArgs(device="cpu", model_path=tiny_model)).enable_lora
    # a start-up adapter outside the flags given fails the start, naming the flag
    with pytest.raises(ValueError, match="LoRA adapter 'r8' has rank 8, above --max-lora-rank 4: restart the server with --max-lora-rank 8"):
        Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=[f"r8={adapters['r8']}"], max_lora_rank=4)
    with pytest.raises(ValueError, match=r"LoRA adapter 'one' targets \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'up_proj'\], outside --lora-target-modules"):
        Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=[one], lora_target_modules=["q_proj", "v_proj"])


@contextlib.contextmanager
def _http(tiny_model: str, tmp_path: Any, **args: Any) -> Iterator[Tuple[Any, List[Any]]]:
    """A TestClient on the HTTP app and its TokenizerManager, no scheduler: what would reach one is
    listed, and a load or unload that did is answered "reached the scheduler" (not left waiting)."""
    from fastapi.testclient import TestClient

    from minisgl.entrypoints.http_server import create_app
    from minisgl.managers.tokenizer_manager import TokenizerManager
    from minisgl.server_args import PortArgs
    from minisgl.utils import get_tokenizer

    tokenizer = get_tokenizer(tiny_model)
    tm = TokenizerManager(resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", **args)), PortArgs.init_new(str(tmp_path)), tokenizer, 64, len(tokenizer))
    sent: List[Any] = []

    def scheduler(msg: Any) -> None:
        sent.append(msg)
        if isinstance(msg, (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)):
            asyncio.get_running_loop().call_soon(tm._dispatch, LoRAUpdateOutput(False, "reached the scheduler"))

    tm._send_to_scheduler = scheduler  # type: ignore[method-assign]
    try:
        with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as client:
            yield client, sent
    finally:
        tm.close()


def test_the_routes_on_a_server_without_lora_are_400s_saying_how_to_turn_it_on(tiny_model: str, tmp_path: Any) -> None:
    """The TokenizerManager answers before anything reaches a scheduler."""
    with _http(tiny_model, tmp_path) as (client, sent):
        for route, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}), ("/unload_lora_adapter", {"lora_name": "a"})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["message"] == LORA_NOT_ENABLED, r.text
        r = client.post("/v1/completions", json={"model": f"{tiny_model}:a", "prompt": "hi", "max_tokens": 1})  # (served as its path)
        assert r.status_code == 400 and "or --enable-lora, then /load_lora_adapter" in r.json()["error"]["message"]
    assert sent == []


def test_bad_load_bodies_are_400s_that_never_reach_the_scheduler(tiny_model: str, tmp_path: Any) -> None:
    """The route and the Engine share one check of a load's fields (lora_registry.check_lora_load_args):
    a name with whitespace around it (never reachable as "BASE:NAME"), an over-long name, an empty
    path, a NUL; each a 400 with the Engine's message, before anything reaches the scheduler."""
    lora = {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ("all",)}
    with _http(tiny_model, tmp_path, **lora) as (client, sent):
        for body, message in (
            ({"lora_name": " a", "lora_path": str(tmp_path)}, "lora_name ' a' starts or ends with whitespace; name the adapter without it"),
            ({"lora_name": "a\t", "lora_path": str(tmp_path)}, "starts or ends with whitespace"),
            ({"lora_name": "x" * 257, "lora_path": str(tmp_path)}, "lora_name takes at most 256 characters, got 257"),
            ({"lora_name": "a", "lora_path": ""}, "lora_path must be the adapter's directory (a PEFT save_pretrained directory), got ''"),
            ({"lora_name": "a\0", "lora_path": str(tmp_path)}, "holds a NUL character"),
            ({"lora_name": "", "lora_path": str(tmp_path)}, "lora_name must be a non-empty string"),
        ):  # fmt: skip
            r = client.post("/load_lora_adapter", json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    assert sent == []
