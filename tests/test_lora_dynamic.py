"""LoRA adapters loaded and unloaded while serving (SGLang's dynamic LoRA), in-process: an adapter
loaded at run time answers as PEFT does, an unload waits for the adapter's requests and then
refuses it, a name loaded again with other weights never reuses the K/V cached under the old
ones, and every refusal (rank, modules, --max-loaded-loras, a taken name, not an adapter) says
what to change and leaves the rest untouched. The oracle is PEFT (tests/test_lora.py's helpers).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

import pytest
import torch

from minisgl import Engine, ServerArgs
from minisgl.managers.io_struct import UnloadLoRAAdapterReqInput
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


def test_the_scheduler_refuses_to_drop_weights_a_request_still_runs_with(tiny_model: str, adapters: Dict[str, str]) -> None:
    """The last guard: an unload that reaches the scheduler while a request of that adapter is there
    (the TokenizerManager and the Engine wait first) is refused, and the request still finishes right."""
    want = peft_greedy(tiny_model, adapters["one"], PROMPTS[0], 6)[0]
    with _engine(tiny_model) as e:
        e.load_lora_adapter("one", adapters["one"])
        rid = e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 6}, lora_path="one", rid="in-use")
        out = e.scheduler.unload_lora_adapter(UnloadLoRAAdapterReqInput("one", "one"))
        assert not out.success and "LoRA adapter 'one' is still used by 1 request(s) (in-use)" in out.error_message
        assert out.loaded_adapters == {"one": adapters["one"]}
        e.run_until_idle()
        assert e.get_result(rid)["output_ids"] == want


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
        # --max-loaded-loras 2: a second adapter loads, a third is refused until one is unloaded
        e.load_lora_adapter("qv2", adapters["qv"])
        with pytest.raises(ValueError, match=r"the maximum number of loaded LoRA adapters is 2 \(--max-loaded-loras\), loaded: qv, qv2"):
            e.load_lora_adapter("qv3", adapters["qv"])
        e.unload_lora_adapter("qv2")
        e.load_lora_adapter("qv3", adapters["qv"])
        assert _greedy(e, PROMPTS[0], "qv")["output_ids"] == want  # what was loaded answers as before
        assert _greedy(e, PROMPTS[0], "qv3")["output_ids"] == want
    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as off:
        with pytest.raises(ValueError, match="LoRA is off in this Engine: build it with lora_paths"):
            off.load_lora_adapter("one", adapters["one"])
        with pytest.raises(ValueError, match="needs a server started with --lora-paths NAME=PATH ... or --enable-lora"):
            off.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 1}, lora_path="one")


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


def test_the_routes_on_a_server_without_lora_are_400s_saying_how_to_turn_it_on(tiny_model: str, tmp_path: Any) -> None:
    """The TokenizerManager answers before anything reaches a scheduler (none runs here)."""
    from fastapi.testclient import TestClient

    from minisgl.entrypoints.http_server import create_app
    from minisgl.managers.tokenizer_manager import TokenizerManager
    from minisgl.server_args import PortArgs
    from minisgl.utils import get_tokenizer

    tokenizer = get_tokenizer(tiny_model)
    tm = TokenizerManager(resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu")), PortArgs.init_new(str(tmp_path)), tokenizer, 64, len(tokenizer))
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as client:
        for route, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}), ("/unload_lora_adapter", {"lora_name": "a"})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("LoRA is not enabled: start the server with --enable-lora"), r.text
        r = client.post("/v1/completions", json={"model": f"{tm.model_name}:a", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 400 and "or --enable-lora, then /load_lora_adapter" in r.json()["error"]["message"]
    tm.close()
