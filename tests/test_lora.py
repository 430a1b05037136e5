"""Multi-LoRA serving (--lora-paths): numerics against PEFT, mixed batches, the radix namespaces,
admission under max_loras_per_batch, and every refusal.

Adapters are PEFT's own: a LoraConfig on a tiny random model, lora_B randomised (PEFT
initialises it to zero, which would make every delta zero and the parity test unable to fail),
saved with save_pretrained. PEFT's merged-free forward is the oracle.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from minisgl import Engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 42, 99, 7, 300, 12], [8, 9, 10, 11, 250, 251, 252, 253, 254, 3, 4]]
GREEDY = {"temperature": 0, "ignore_eos": True}


def make_adapter(base: str, path: str, seed: int, targets: Optional[List[str]] = None, **config: Any) -> str:
    """A PEFT adapter of `base` with random A and B (std 0.1: deltas that change the greedy tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=config.pop("r", 4), lora_alpha=config.pop("lora_alpha", 8), target_modules=targets or ALL_TARGETS, **config)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str, prompt: List[int], n: int) -> tuple[List[int], List[float]]:
    """PEFT's greedy continuation of `prompt` and each chosen token's logprob (float32, eager)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, adapter).eval()
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(logp))
            out.append(tok)
            lps.append(float(logp[tok]))
            ids.append(tok)
    return out, lps


@pytest.fixture(scope="module")
def adapters(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": make_adapter(tiny_model, str(root / "a"), seed=1),
        "b": make_adapter(tiny_model, str(root / "b"), seed=2, targets=["q_proj", "v_proj", "down_proj"], r=2),
    }


@pytest.fixture(scope="module")
def engine(tiny_model: str, adapters: Dict[str, str]) -> Any:
    with Engine(tiny_model, device="cpu", max_total_tokens=4096, lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as e:
        yield e


def _generate(engine: Any, prompt: List[int], lora: Optional[str], n: int = 8) -> Dict[str, Any]:
    return engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n}, return_logprob=True, lora_path=lora)


def _logprobs(out: Dict[str, Any]) -> List[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


# ---------------------------------------------------------------------------- 1. parity with PEFT
@pytest.mark.parametrize("arch,extra", [("qwen3", {}), ("llama", {}), ("qwen3", {"use_rslora": True})], ids=["qwen3", "llama", "qwen3-rslora"])
def test_greedy_tokens_and_logprobs_match_peft(arch: str, extra: Dict[str, Any], tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    base = tiny_model_factory(arch)
    adapter = make_adapter(base, str(tmp_path / "ad"), seed=3, **extra)
    with Engine(base, device="cpu", max_total_tokens=2048, lora_paths=[f"ad={adapter}"]) as e:
        for prompt in PROMPTS:
            want_ids, want_lps = peft_greedy(base, adapter, prompt, 8)
            out = _generate(e, prompt, "ad")
            assert out["output_ids"] == want_ids
            assert torch.allclose(torch.tensor(_logprobs(out)), torch.tensor(want_lps), atol=1e-4)
            # and the adapter matters: the base model's answer differs (else this test could not fail)
            assert _generate(e, prompt, None)["output_ids"] != want_ids


def peft_prompt_logprobs(base: str, adapter: str, ids: List[int]) -> torch.Tensor:
    """PEFT's log_softmax at every position of `ids`, teacher-forced (float32, eager): [len(ids), vocab]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_partial_target_adapters_match_peft_with_prompt_logprobs_across_chunks(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Adapters on some modules only (an untargeted slice between targeted ones of a fused qkv or
    gate_up layer), each with its own rank and an alpha that is not 2r, served together: every
    prompt logprob (logprob_start_len=0, the prompt cut by a chunk boundary) and every generated
    token's logprob is PEFT's."""
    root = tmp_path_factory.mktemp("lora-partial")
    partial = {
        "qvdown": make_adapter(tiny_model, str(root / "qvdown"), seed=11, targets=["q_proj", "v_proj", "down_proj"], r=2, lora_alpha=16),
        "ogate": make_adapter(tiny_model, str(root / "ogate"), seed=12, targets=["o_proj", "gate_proj"], r=3, lora_alpha=5),
        "kup": make_adapter(tiny_model, str(root / "kup"), seed=13, targets=["k_proj", "up_proj"], r=6, lora_alpha=3),
    }
    prompt = list(range(40, 63))  # 23 tokens: chunks of 8 end inside it
    paths = [f"{n}={p}" for n, p in partial.items()]
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, chunked_prefill_size=8, lora_paths=paths) as e:
        for name, path in partial.items():
            out = e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                             logprob_start_len=0, lora_path=name)  # fmt: skip
            ids = prompt + out["output_ids"]
            ref = peft_prompt_logprobs(tiny_model, path, ids)
            got_prompt = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]  # (the first token has none)
            want_prompt = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
            assert torch.allclose(torch.tensor(got_prompt), torch.tensor(want_prompt), atol=1e-4), name
            assert out["output_ids"] == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(4)], name
            want_out = [float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(out["output_ids"])]
            assert torch.allclose(torch.tensor(_logprobs(out)), torch.tensor(want_out), atol=1e-4), name
            # the adapter matters: the base model's prompt logprobs differ (else this test could not fail)
            base = e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
            got_base = [entry[0] for entry in base["meta_info"]["input_token_logprobs"][1:]]
            assert max(abs(a - b) for a, b in zip(got_base, want_prompt)) > 1e-3, name


# ---------------------------------------------------------------------------- 2. mixed batches
def test_one_batch_of_base_a_and_b_gives_each_what_it_gets_alone(engine: Any) -> None:
    loras = [None, "a", "b", "a", None, "b"]
    prompts = [PROMPTS[i % 2] for i in range(len(loras))]
    alone = [_generate(engine, p, lora) for p, lora in zip(prompts, loras)]
    assert len({tuple(o["output_ids"]) for o in alone[:3]}) == 3  # three models, three answers
    engine.flush_cache()
    together = engine.generate(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8}, return_logprob=True, lora_path=loras
    )
    for got, want in zip(together, alone):
        assert got["output_ids"] == want["output_ids"]
        assert torch.allclose(torch.tensor(_logprobs(got)), torch.tensor(_logprobs(want)), atol=1e-4)


def test_decode_steps_mix_adapters_in_one_pass(engine: Any) -> None:
    """The batch above really shares passes: a step runs requests of several adapters at once."""
    rids = [engine.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 4}, lora_path=lora) for lora in (None, "a", "b")]
    seen = set()
    while engine.has_unfinished_requests():
        engine.step(snapshot=False)
        seen.add(frozenset(r.lora_id for r in engine.scheduler.running_batch.reqs))
    assert frozenset({None, "a", "b"}) in seen
    for rid in rids:
        engine.get_result(rid)


# ---------------------------------------------------------------------------- 3. radix namespaces
def test_radix_never_shares_kv_between_adapters(engine: Any) -> None:
    prompt = list(range(20, 60))
    engine.flush_cache()
    first = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path="a")
    assert first["meta_info"]["cached_tokens"] == 0
    other = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path="b")
    assert other["meta_info"]["cached_tokens"] == 0  # same tokens, another adapter: nothing reused
    base = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
    assert base["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path="a")
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # same adapter: all but the last token
    assert again["output_ids"] == first["output_ids"]
    engine.scheduler.check_integrity()
    radix = engine.snapshot()["radix"]
    json.dumps(radix)  # (the visualizer's tree still serialises)
    assert sorted(str(c["lora_id"]) for c in radix["tree"]["children"]) == ["None", "a", "b"]


def test_n_samples_under_an_adapter_reuse_its_prompt(engine: Any) -> None:
    """n > 1: the prompt is prefilled once (the prefix warm-up) under the samples' adapter, so they find it cached."""
    prompt = list(range(200, 230))
    engine.flush_cache()
    outs = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2, "n": 2}, lora_path="b")
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1] * 2


def test_radix_namespaces_with_pages(tiny_model: str, adapters: Dict[str, str]) -> None:
    with Engine(tiny_model, device="cpu", max_total_tokens=1024, page_size=4, lora_paths=[f"a={adapters['a']}"]) as e:
        prompt = list(range(30, 55))
        e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
        assert e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path="a")["meta_info"]["cached_tokens"] == 0
        assert e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path="a")["meta_info"]["cached_tokens"] == 24
        assert e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})["meta_info"]["cached_tokens"] == 24
        e.scheduler.check_integrity()


# ---------------------------------------------------------------------------- 4. admission
def test_max_loras_per_batch_one_never_runs_two_adapters(tiny_model: str, adapters: Dict[str, str], engine: Any) -> None:
    loras = ["a", "b", None, "a", "b", None]
    prompts = [PROMPTS[i % 2] for i in range(len(loras))]
    want = [_generate(engine, p, lora)["output_ids"] for p, lora in zip(prompts, loras)]
    paths = [f"{n}={p}" for n, p in adapters.items()]
    with Engine(tiny_model, device="cpu", max_total_tokens=4096, lora_paths=paths, max_loras_per_batch=1) as e:
        rids = [e.add_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 8}, lora_path=lora) for p, lora in zip(prompts, loras)]
        passes: List[set] = []  # each forward pass's adapters (None: the base model)
        forward = e.model_runner.forward
        e.model_runner.forward = lambda fb: (passes.append(set(fb.lora_ids or [None])), forward(fb))[1]
        while e.has_unfinished_requests():
            e.step(snapshot=False)
        assert passes and all(len(p) == 1 for p in passes), [p for p in passes if len(p) > 1]
        assert set().union(*passes) == {"a", "b", None}
        assert [e.get_result(r)["output_ids"] for r in rids] == want


def test_the_adder_record_names_requests_skipped_for_their_adapter(tiny_model: str, adapters: Dict[str, str]) -> None:
    paths = [f"{n}={p}" for n, p in adapters.items()]
    with Engine(tiny_model, device="cpu", max_total_tokens=4096, lora_paths=paths, max_loras_per_batch=1) as e:
        e.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 4}, rid="base-1")
        e.add_request(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 4}, lora_path="b", rid="b-1")
        e.add_request(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 4}, rid="base-2")
        adder = e.step()["adder"]
        assert adder["admitted"] == ["base-1", "base-2"]  # the skip held back no one behind it
        assert adder["stop_reason"] == "QUEUE_EMPTY"
        assert "admitted" not in adder["stop_detail"]  # (b-1 was not)
        assert "skipped for their LoRA adapter" in adder["stop_detail"] and "b-1 (adapter 'b')" in adder["stop_detail"]
        assert "max_loras_per_batch=1" in adder["stop_detail"]
        e.run_until_idle()
        assert e.get_result("b-1")["output_ids"]


def test_adapters_kept_through_chunked_prefill_and_retraction(tiny_model: str, adapters: Dict[str, str], engine: Any) -> None:
    """Chunks, mixed chunks and retraction keep each request's adapter: the answers are what it gets alone."""
    loras = ["a", "b", None] * 4
    prompts = [list(range(20 + 13 * i, 32 + 13 * i)) for i in range(len(loras))]  # 12 tokens: two chunks of 8
    want = [_generate(engine, p, lora, n=30)["output_ids"] for p, lora in zip(prompts, loras)]
    paths = [f"{n}={p}" for n, p in adapters.items()]
    # a low schedule_conservativeness overcommits the 200-token pool on purpose: requests get retracted
    with Engine(
        tiny_model, device="cpu", max_total_tokens=200, chunked_prefill_size=8, enable_mixed_chunk=True,
        schedule_conservativeness=0.1, lora_paths=paths,
    ) as e:
        rids = [e.add_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 30}, lora_path=lora) for p, lora in zip(prompts, loras)]
        events: List[str] = []
        mixed: List[set] = []  # the adapters of each MIXED pass (a chunk with decode rows riding along)
        forward = e.model_runner.forward
        e.model_runner.forward = lambda fb: (fb.forward_mode.is_mixed() and mixed.append(set(fb.lora_ids or [None])), forward(fb))[1]
        while e.has_unfinished_requests():
            events += [ev["type"] for ev in e.step()["events"]]
        assert "retract" in events and "chunk" in events
        assert any(len(adapters_of_pass - {None}) >= 2 for adapters_of_pass in mixed), mixed  # two adapters in one mixed pass
        assert [e.get_result(r)["output_ids"] for r in rids] == want


# ---------------------------------------------------------------------------- 5. refusals
def _edited_adapter(src: str, dst: Any, **fields: Any) -> str:
    """A copy of adapter `src` whose adapter_config.json has `fields` changed."""
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"target_modules": ".*proj"}, "regex form is not supported"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "['embed_tokens'] are not supported"),
        ({"target_modules": ["lm_head"]}, "['lm_head'] are not supported"),
        ({"peft_type": "IA3"}, "only LORA adapters"),
        ({"r": 8}, "the adapter was trained for another base model"),  # (its weights are r=4)
        ({"init_lora_weights": "pissa"}, "path_initial_model_for_weight_conversion"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
        ({"init_lora_weights": "olora"}, "convert the adapter with PEFT"),
        ({"init_lora_weights": "corda"}, "init_lora_weights='corda'"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq'"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_unsupported_adapter_configs_are_refused(tiny_model: str, adapters: Dict[str, str], tmp_path: Any, fields: Dict[str, Any], message: str) -> None:
    bad = _edited_adapter(adapters["a"], tmp_path / "bad", **fields)
    with pytest.raises(ValueError, match="adapter 'bad'|adapter '" + str(tmp_path)) as info:
        Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=[f"bad={bad}"])
    assert message in str(info.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal"])
def test_inits_that_leave_the_base_model_alone_are_served(tiny_model: str, adapters: Dict[str, str], tmp_path: Any, init: Any) -> None:
    ok = _edited_adapter(adapters["b"], tmp_path / "ok", init_lora_weights=init)
    with Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=[f"ok={ok}"]) as e:
        assert e.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path="ok")["output_ids"]


def test_weights_of_a_module_the_config_does_not_target_are_refused(tiny_model: str, adapters: Dict[str, str], tmp_path: Any) -> None:
    bad = _edited_adapter(adapters["a"], tmp_path / "fewer", target_modules=["q_proj", "k_proj"])  # its weights cover all 7
    with pytest.raises(ValueError, match=r"is for (v|o|gate|up|down)_proj, which its adapter_config.json's target_modules \['k_proj', 'q_proj'\] does not list"):
        Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=[f"fewer={bad}"])


@pytest.mark.parametrize("lora_paths", ["a=/p", {"a": "/p"}], ids=["str", "dict"])
def test_engine_lora_paths_must_be_a_list_of_strings(tiny_model: str, lora_paths: Any) -> None:
    with pytest.raises(ValueError, match=r"lora_paths must be a list \(or tuple\) of NAME=PATH strings, e.g. \['a=/path/to/a'\]"):
        Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=lora_paths)


def test_an_adapter_of_another_base_model_is_refused(tiny_model: str, tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    other = tiny_model_factory("qwen3", intermediate_size=80)  # the same but for its MLP width
    adapter = make_adapter(other, str(tmp_path / "other"), seed=4)
    with pytest.raises(ValueError, match="trained for another base model"):
        Engine(tiny_model, device="cpu", max_total_tokens=1024, lora_paths=[f"other={adapter}"])


def test_a_moe_model_takes_attention_adapters_only(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    base = tiny_model_factory("qwen3_moe")
    adapter = make_adapter(base, str(tmp_path / "attn"), seed=5, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    with Engine(base, device="cpu", max_total_tokens=1024, lora_paths=[f"attn={adapter}"]) as e:
        want_ids, want_lps = peft_greedy(base, adapter, PROMPTS[0], 6)
        out = _generate(e, PROMPTS[0], "attn", n=6)
        assert out["output_ids"] == want_ids
        assert torch.allclose(torch.tensor(_logprobs(out)), torch.tensor(want_lps), atol=1e-4)
    mlp = _edited_adapter(adapter, tmp_path / "mlp", target_modules=["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match="targets MLP modules of a mixture-of-experts model"):
        Engine(base, device="cpu", max_total_tokens=1024, lora_paths=[f"mlp={mlp}"])


def test_server_args_refusals(tiny_model: str, adapters: Dict[str, str], tmp_path: Any) -> None:
    import dataclasses

    from minisgl import ServerArgs
    from minisgl.server_args import resolve_server_args

    a = f"a={adapters['a']}"
    with pytest.raises(ValueError, match="--speculative-algorithm: a verify pass would have to apply each request's adapter"):
        ServerArgs(lora_paths=(a,), speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="--is-embedding"):
        ServerArgs(lora_paths=(a,), is_embedding=True)
    with pytest.raises(ValueError, match="--max-loras-per-batch must be >= 1, got 0"):
        ServerArgs(lora_paths=(a,), max_loras_per_batch=0)
    with pytest.raises(ValueError, match="--max-loras-per-batch set without --lora-paths"):
        ServerArgs(max_loras_per_batch=2)
    with pytest.raises(ValueError, match="names adapter 'a' twice"):
        ServerArgs(lora_paths=(a, f"a={adapters['b']}"))
    with pytest.raises(ValueError, match="adapter 'gone' directory .* does not exist"):
        ServerArgs(lora_paths=(f"gone={tmp_path / 'nope'}",))
    with pytest.raises(ValueError, match="needs a name and a path"):
        ServerArgs(lora_paths=("=x",))
    # a bare PATH names itself; the CLI's nargs="+" list becomes the frozen tuple
    args = ServerArgs.from_argv(["--lora-paths", a, adapters["b"], "--max-loras-per-batch", "2"])
    assert args.lora_paths == (a, adapters["b"]) and args.max_loras_per_batch == 2
    resolved = resolve_server_args(dataclasses.replace(args, device="cpu", model_path=tiny_model))
    assert resolved.lora_adapters == (("a", adapters["a"]), (adapters["b"], adapters["b"]))  # parsed once, in order
    assert not args.is_resolved and resolved.is_resolved
    with pytest.raises(ValueError, match="filled from lora_paths by resolve_server_args"):
        ServerArgs(lora_paths=(a,), lora_adapters=(("x", adapters["a"]),))
    with pytest.raises(SystemExit):
        ServerArgs.from_argv(["--lora-adapters", "x"])


def test_request_refusals(engine: Any, tiny_model: str) -> None:
    with pytest.raises(ValueError, match="LoRA adapter 'zzz' is not loaded; the loaded adapters are: a, b"):
        engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2}, lora_path="zzz")
    with pytest.raises(ValueError, match="not loaded"):  # one bad entry of a batch: nothing is queued
        engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 2}, lora_path=["a", "zzz"])
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="`lora_path` must have 2 entries"):
        engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 2}, lora_path=["a"])
    with pytest.raises(ValueError, match="lora_path must be an adapter name"):
        engine.add_request(input_ids=PROMPTS[0], lora_path=3)  # type: ignore[arg-type]
    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as plain:
        with pytest.raises(ValueError, match="LoRA is not enabled: start the server with --lora-paths"):
            plain.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2}, lora_path="a")


def test_cuda_graphs_never_replay_an_adapter_pass(tiny_model: str, adapters: Dict[str, str]) -> None:
    """The graphs are captured on the base model: a decode pass with an adapter runs eagerly, a base
    one replays (on this CPU the runner's eager mode, capture=False, with Triton's interpreter)."""
    from minisgl.model_executor.cuda_graph_runner import CudaGraphRunner

    on_gpu = torch.cuda.is_available()  # (on a CPU conftest.py has set TRITON_INTERPRET)
    with Engine(tiny_model, device="cuda" if on_gpu else "cpu", attention_backend="triton", max_total_tokens=1024,
                dtype="float32", lora_paths=[f"a={adapters['a']}"], disable_cuda_graph=True) as e:  # fmt: skip
        graphs = CudaGraphRunner(e.model_runner, max_bs=4, capture=on_gpu)
        e.model_runner.cuda_graph_runner = graphs
        with_adapter = e.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 3}, lora_path="a")
        assert graphs.num_replays == 0
        base = e.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 3})
        assert graphs.num_replays == 2
    assert with_adapter["output_ids"] == _generate_alone(tiny_model, adapters, PROMPTS[0], "a")
    assert base["output_ids"] != with_adapter["output_ids"]


def _generate_alone(tiny_model: str, adapters: Dict[str, str], prompt: List[int], lora: str) -> List[int]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with Engine(tiny_model, device=device, attention_backend="triton", max_total_tokens=1024, dtype="float32",
                lora_paths=[f"{lora}={adapters[lora]}"]) as e:  # fmt: skip
        return e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3}, lora_path=lora)["output_ids"]


def test_the_visualizer_shows_each_request_s_adapter(engine: Any) -> None:
    from minisgl.visualizer.render import render_batch, render_memory, render_running, render_waiting
    from minisgl.visualizer.snapshot import validate_snapshot

    engine.flush_cache()
    rids = [engine.add_request(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 2}, lora_path=lora) for lora in ("a", None)]
    waiting = engine.snapshot()
    assert [r["lora_id"] for r in waiting["waiting_queue"]] == ["a", None]
    assert render_waiting(waiting).count("lora a") == 1
    snap = engine.step()
    assert validate_snapshot(snap) == [] and json.dumps(snap)
    assert [r["lora_id"] for r in snap["batch"]["reqs"]] == ["a", None]
    assert render_batch(snap).count("lora a") == 1
    assert [r["lora_id"] for r in snap["running_batch"]] == ["a", None]  # (decoding next)
    assert render_running(snap).count("lora a") == 1
    unnamed = {**snap, "running_batch": [{k: v for k, v in r.items() if k != "lora_id"} for r in snap["running_batch"]]}
    assert "running_batch[0]: missing key 'lora_id'" in validate_snapshot(unnamed)
    engine.run_until_idle()
    for rid in rids:
        engine.get_result(rid)
    radix = engine.snapshot()["radix"]["tree"]
    assert sorted(str(c["lora_id"]) for c in radix["children"]) == ["None", "a"]
    def nodes_of(node: Dict[str, Any]) -> List[Dict[str, Any]]:
        return [node] + [n for c in node.get("children", []) for n in nodes_of(c)]

    under_a = sum(n["lora_id"] == "a" for n in nodes_of(radix))
    page = render_memory(engine.snapshot())
    assert under_a >= 1 and page.count("· lora a<") == under_a and "· lora None" not in page  # adapter nodes labelled, base ones not
