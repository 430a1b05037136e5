"""return_hidden_states in process: the Engine's meta_info["hidden_states"] against transformers.

The oracle is the Hugging Face model on the same random weights: `output_hidden_states[-1]`, the
final-norm hidden state of every position, over the prompt and the output the Engine generated.
SGLang's layout (Req.hidden_states): entry 0 holds the prompt's rows, [n, H], for the positions
the prefill computed (after a radix hit only the uncached ones); then one [H] row per decode
step, the hidden state of the output token that step fed in. So a request with k output tokens
has k entries, and output k - 1 never has one (nothing fed it back).

Covered: a prompt and greedy decode steps, a prefill-only request, chunked prefill (every
chunk's rows), radix hits, a batch where only one request asks (the others' answers and the
passes without an asking request unchanged), mixed chunks, retraction (no entry twice), n > 1
(the samples find the prompt cached by the warm-up), Engine streams in both modes, refusals.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List

import pytest
import torch

from minisgl import Engine
from minisgl.managers.tokenization import RETURN_HIDDEN_STATES_DISABLED
from minisgl.model_executor.forward_batch_info import ForwardMode
from minisgl.server_args import ServerArgs

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16
ATOL = 1e-5
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Engine]:
    eng = Engine(tiny_model, device="cpu", max_total_tokens=4096, chunked_prefill_size=CHUNK, enable_return_hidden_states=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_rows(hf_model: Any, ids: List[int]) -> torch.Tensor:
    """transformers' final-norm hidden state of every position of `ids`: [len(ids), H]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def check_layout(hf_model: Any, prompt: List[int], out: Dict[str, Any], first: int = 0) -> List[Any]:
    """out's hidden states are SGLang's layout over prompt + output, entry 0 from position `first`
    (the end of a radix hit), and equal transformers'. Returns them."""
    hidden = out["meta_info"]["hidden_states"]
    output_ids = out["output_ids"]
    assert len(hidden) == max(len(output_ids), 1)
    assert len(hidden[0]) == len(prompt) - first and all(isinstance(row, list) for row in hidden[0])
    assert all(isinstance(row[0], float) for row in hidden[1:])  # one [H] row per decode step
    ref = hf_rows(hf_model, prompt + output_ids[:-1])  # (the last output token was never fed back)
    got = torch.tensor(hidden[0] + hidden[1:])  # [positions, H]
    assert got.shape == ref[first:].shape, (got.shape, ref.shape)
    assert torch.allclose(got, ref[first:], atol=ATOL), (got - ref[first:]).abs().max()
    return hidden


def generate(engine: Engine, ids: Any, max_new_tokens: int, **kw: Any) -> Any:
    return engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": max_new_tokens}, **kw)


class ForwardSpy:
    """Records, per forward pass: its mode, whether it handed back hidden states, and whether a
    request of its batch asked for them."""

    def __init__(self, engine: Engine) -> None:
        self.runner = engine.model_runner
        self.scheduler = engine.scheduler
        self.passes: List[tuple] = []
        self.original = self.runner.forward

    def __enter__(self) -> "ForwardSpy":
        def forward(forward_batch: Any) -> Any:
            out = self.original(forward_batch)
            asked = any(r.return_hidden_states for r in self.scheduler.cur_batch.reqs)
            self.passes.append((forward_batch.forward_mode, out.hidden_states is not None, asked))
            return out

        self.runner.forward = forward  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.forward = self.original  # type: ignore[method-assign]


# --------------------------------------------------------------------------- numerics
def test_a_prompt_and_its_greedy_decode_steps_equal_transformers(engine: Engine, hf_model: Any) -> None:
    engine.flush_cache()
    prompt = list(range(200, 211))  # (one pass)
    out = generate(engine, prompt, 6, return_hidden_states=True)
    hidden = check_layout(hf_model, prompt, out)
    assert len(hidden) == 6 and len(hidden[0]) == len(prompt)
    assert len(hidden[1]) == engine.model_runner.model_config.hidden_size
    # the generation is the one a request that does not ask gets; its result has no such key
    engine.flush_cache()
    plain = generate(engine, prompt, 6)
    assert plain["output_ids"] == out["output_ids"] and "hidden_states" not in plain["meta_info"]


def test_async_generate_returns_them_too(engine: Engine, hf_model: Any) -> None:
    import asyncio

    engine.flush_cache()
    prompt = list(range(210, 222))
    out = asyncio.run(engine.async_generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3}, return_hidden_states=True))
    check_layout(hf_model, prompt, out)


def test_a_prefill_only_request_gets_its_prompt_rows(engine: Engine, hf_model: Any) -> None:
    """max_new_tokens 0: the prompt's entry alone (the rows a reward head or a probe reads)."""
    engine.flush_cache()
    prompt = list(range(230, 240))
    out = generate(engine, prompt, 0, return_hidden_states=True)
    assert out["output_ids"] == [] and len(out["meta_info"]["hidden_states"]) == 1
    check_layout(hf_model, prompt, out)


def test_chunked_prefill_keeps_every_chunk_s_rows(engine: Engine, hf_model: Any) -> None:
    """A 37-token prompt runs in 3 chunks; entry 0 holds all 37 rows (SGLang keeps only the last
    chunk's: docs/server.md), then the decode steps."""
    engine.flush_cache()
    prompt = list(range(100, 100 + 2 * CHUNK + 5))
    with ForwardSpy(engine) as spy:
        out = generate(engine, prompt, 4, return_hidden_states=True)
    extends = [mode for mode, _, _ in spy.passes if mode.is_extend()]
    assert len(extends) == 3 and all(captured for _, captured, _ in spy.passes)
    hidden = check_layout(hf_model, prompt, out)
    assert len(hidden[0]) == len(prompt)


def test_a_radix_hit_returns_the_rows_of_the_uncached_tokens_only(engine: Engine, hf_model: Any) -> None:
    """SGLang's answer for a cached prefix: its tokens were not computed, so they have no rows;
    entry 0 starts at cached_tokens (the same prompt again: the last token alone)."""
    engine.flush_cache()
    prompt = list(range(300, 320))
    generate(engine, prompt, 2)  # (not asking: the prompt enters the tree all the same)
    longer = prompt + [7, 8, 9, 10]
    out = generate(engine, longer, 3, return_hidden_states=True)
    assert out["meta_info"]["cached_tokens"] == len(prompt)
    check_layout(hf_model, longer, out, first=len(prompt))
    again = generate(engine, longer, 3, return_hidden_states=True)
    assert again["meta_info"]["cached_tokens"] == len(longer) - 1
    assert len(again["meta_info"]["hidden_states"][0]) == 1
    check_layout(hf_model, longer, again, first=len(longer) - 1)


def test_in_a_batch_only_the_asking_request_gets_them_and_passes_without_one_keep_nothing(engine: Engine, hf_model: Any) -> None:
    engine.flush_cache()
    prompts = [list(range(10, 19)), list(range(40, 70)), list(range(80, 92))]  # the second takes 2 chunks
    with ForwardSpy(engine) as spy:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 5}, return_hidden_states=[False, True, False])
    assert ["hidden_states" in out["meta_info"] for out in outs] == [False, True, False]
    check_layout(hf_model, prompts[1], outs[1])
    # a pass keeps the hidden states exactly when its batch has the asking request (the first
    # prompt decodes alone while the second is still in its chunks)
    assert all(captured == asked for _, captured, asked in spy.passes)
    assert {asked for _, _, asked in spy.passes} == {True, False}
    engine.flush_cache()
    with ForwardSpy(engine) as spy:
        plain = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 5})
    assert [o["output_ids"] for o in plain] == [o["output_ids"] for o in outs]
    assert spy.passes and not any(captured for _, captured, _ in spy.passes)  # no request asked: nothing kept


def test_mixed_chunks_give_the_riding_decode_rows(tiny_model: str, hf_model: Any) -> None:
    """--enable-mixed-chunk: a decoding request rides the chunks of a long prompt as 1-token extends;
    its row in each mixed pass is its decode step's, and the prompt's chunks are all kept."""
    eng = Engine(
        tiny_model, device="cpu", max_total_tokens=4096, chunked_prefill_size=CHUNK, enable_mixed_chunk=True,
        enable_return_hidden_states=True,
    )  # fmt: skip
    try:
        short, long = list(range(150, 158)), list(range(160, 160 + 3 * CHUNK))
        a = eng.add_request(input_ids=short, sampling_params={**GREEDY, "max_new_tokens": 8}, return_hidden_states=True)
        eng.step(snapshot=False)  # a's prefill
        b = eng.add_request(input_ids=long, sampling_params={**GREEDY, "max_new_tokens": 3}, return_hidden_states=True)
        with ForwardSpy(eng) as spy:
            eng.run_until_idle()
        assert sum(mode == ForwardMode.MIXED for mode, _, _ in spy.passes) >= 2
        check_layout(hf_model, short, eng.get_result(a))
        check_layout(hf_model, long, eng.get_result(b))
    finally:
        eng.shutdown()


def test_a_retracted_request_recomputes_without_recording_anything_twice(tiny_model: str, hf_model: Any) -> None:
    """A pool too small for two requests retracts one; its re-prefill computes its prompt and
    output again, and only the position it had not reached is added (SGLang would append a second
    prompt entry)."""
    eng = Engine(
        tiny_model, device="cpu", max_total_tokens=64, chunked_prefill_size=-1, schedule_conservativeness=0.01,
        enable_return_hidden_states=True,
    )  # fmt: skip
    try:
        prompts = [list(range(10, 20)), list(range(30, 40))]
        params = {**GREEDY, "max_new_tokens": 40}
        rids = [eng.add_request(input_ids=prompts[0], sampling_params=params, return_hidden_states=True)]
        eng.step(snapshot=False)
        rids.append(eng.add_request(input_ids=prompts[1], sampling_params=params, return_hidden_states=True))
        eng.run_until_idle()
        assert eng.scheduler.num_retracted_reqs_total >= 1
        for prompt, rid in zip(prompts, rids):
            out = eng.get_result(rid)
            assert len(out["output_ids"]) == 40
            check_layout(hf_model, prompt, out)
    finally:
        eng.shutdown()


def test_a_preempted_request_resumes_without_recording_anything_twice(tiny_model: str, hf_model: Any) -> None:
    """Priority preemption sends a running request back to the queue as a retraction does."""
    eng = Engine(
        tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, enable_priority_scheduling=True,
        enable_return_hidden_states=True,
    )  # fmt: skip
    try:
        prompt = list(range(50, 62))
        eng.add_request(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12}, rid="a", priority=0, return_hidden_states=True)
        eng.step(snapshot=False)
        eng.step(snapshot=False)  # a decodes, holding the only request slot
        eng.add_request(input_ids=[70, 71, 72], sampling_params={**GREEDY, "max_new_tokens": 2}, rid="b", priority=20)
        snap = eng.step()
        assert ("retract", "a") in [(e["type"], e["rid"]) for e in snap["events"]]
        eng.run_until_idle()
        eng.get_result("b")
        check_layout(hf_model, prompt, eng.get_result("a"))
    finally:
        eng.shutdown()


def test_n_samples_each_get_theirs_after_the_prefix_warm_up(engine: Engine, hf_model: Any) -> None:
    """n > 1: the prompt is prefilled once alone first (SGLang's warm-up), so each sample finds it
    cached and its entry 0 is the last prompt token's row (the radix rule above)."""
    engine.flush_cache()
    prompt = list(range(420, 434))
    outs = engine.generate(
        input_ids=prompt, sampling_params={"temperature": 1.0, "seed": 5, "n": 2, "max_new_tokens": 6, "ignore_eos": True},
        return_hidden_states=True,
    )  # fmt: skip
    assert len(outs) == 2 and outs[0]["output_ids"] != outs[1]["output_ids"]
    for out in outs:
        assert out["meta_info"]["cached_tokens"] == len(prompt) - 1
        check_layout(hf_model, prompt, out, first=len(prompt) - 1)


# --------------------------------------------------------------------------- streams
def test_a_stream_carries_everything_so_far(engine: Engine, hf_model: Any) -> None:
    """SGLang's stream chunks are cumulative: each chunk's hidden states extend the last one's,
    and the last chunk's are the non-stream answer's."""
    engine.flush_cache()
    prompt = list(range(240, 260))
    chunks = list(engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 5}, stream=True, return_hidden_states=True))
    seen = [c["meta_info"]["hidden_states"] for c in chunks]
    assert len(chunks) >= 2
    for before, after in zip(seen, seen[1:]):
        assert after[: len(before)] == before and len(after) > len(before)
    assert len(seen[0][0]) == len(prompt)  # the prompt's entry comes with the first chunk
    check_layout(hf_model, prompt, chunks[-1])


def test_an_incremental_stream_carries_what_each_chunk_adds(tiny_model: str, hf_model: Any) -> None:
    eng = Engine(
        tiny_model, device="cpu", max_total_tokens=4096, incremental_streaming_output=True, enable_return_hidden_states=True
    )
    try:
        prompt = list(range(260, 275))
        chunks = list(eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 5}, stream=True, return_hidden_states=True))
        assert len(chunks) == 5 and all(len(c["meta_info"]["hidden_states"]) == 1 for c in chunks)
        assert len(chunks[0]["meta_info"]["hidden_states"][0]) == len(prompt)  # the prompt's entry, then one row each
        whole = {"output_ids": [t for c in chunks for t in c["output_ids"]],
                 "meta_info": {"hidden_states": [e for c in chunks for e in c["meta_info"]["hidden_states"]]}}  # fmt: skip
        check_layout(hf_model, prompt, whole)
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- refusals
def test_without_the_flag_a_request_is_refused_with_sglang_s_message(tiny_model: str) -> None:
    eng = Engine(tiny_model, device="cpu", max_total_tokens=1024)
    try:
        message = "The server is not configured to return the hidden states. Please set `--enable-return-hidden-states`"
        assert RETURN_HIDDEN_STATES_DISABLED.startswith(message)
        for call in (
            lambda: eng.generate("hello", {"max_new_tokens": 2}, return_hidden_states=True),
            lambda: eng.generate(["a", "b"], {"max_new_tokens": 2}, return_hidden_states=[False, True]),
            lambda: eng.add_request("hello", {"max_new_tokens": 2}, return_hidden_states=True),
        ):
            with pytest.raises(ValueError, match="enable_return_hidden_states=True") as info:
                call()
            assert str(info.value).startswith(RETURN_HIDDEN_STATES_DISABLED)
        assert not eng.has_unfinished_requests() and eng.scheduler.is_idle()
        assert eng.generate("hello", {"max_new_tokens": 2}, return_hidden_states=False)["output_ids"]  # (not asking: fine)
    finally:
        eng.shutdown()


def test_bad_values_say_what_to_change(engine: Engine) -> None:
    with pytest.raises(ValueError, match="return_hidden_states must be true or false, got 'yes'"):
        engine.generate("hello", {"max_new_tokens": 1}, return_hidden_states="yes")
    with pytest.raises(ValueError, match="lists are per prompt of a batch"):
        engine.generate("hello", {"max_new_tokens": 1}, return_hidden_states=[True])
    with pytest.raises(ValueError, match="must have 2 entries"):
        engine.generate(["a", "b"], {"max_new_tokens": 1}, return_hidden_states=[True])
    assert not engine.has_unfinished_requests()


def test_an_embedding_server_refuses_the_flag() -> None:
    """SGLang accepts the pair and the flag does nothing there (an embedding request has no such
    field); here it is refused rather than ignored. The embedding itself is the hidden state."""
    with pytest.raises(ValueError, match="--enable-return-hidden-states is for generation requests"):
        ServerArgs(is_embedding=True, enable_return_hidden_states=True)


# --------------------------------------------------------------------------- what the scheduler keeps
def test_an_abort_mid_decode_returns_one_entry_per_token(engine: Engine, hf_model: Any) -> None:
    """The token sampled in the step the abort came in is not returned, and neither is its row:
    k tokens, k entries, each still transformers' (the OpenAI choice reads the last)."""
    prompt = list(range(20, 32))
    rid = engine.add_request(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 50}, return_hidden_states=True)
    for _ in range(5):
        engine.step(snapshot=False)
    engine.abort(rid)
    engine.run_until_idle()
    out = engine.get_result(rid)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 1 < len(out["output_ids"]) < 50
    check_layout(hf_model, prompt, out)


def test_the_scheduler_keeps_no_row_it_sent(engine: Engine) -> None:
    """Each output sends the entries added since the last (deltas): the request keeps none of them
    (Python floats, 32 bytes a value, held for its whole life)."""
    rid = engine.add_request(input_ids=list(range(40, 70)), sampling_params={**GREEDY, "max_new_tokens": 8},
                             return_hidden_states=True, stream=True)  # fmt: skip
    for _ in range(4):
        engine.step(snapshot=False)
    (req,) = [r for r in engine.scheduler.running_batch.reqs if r.rid == rid]
    assert req.send_hidden_states_offset == len(req.hidden_states) >= 3
    assert all(entry is None for entry in req.hidden_states)
    engine.run_until_idle()
    chunks = engine.get_result(rid)
    assert len(chunks["meta_info"]["hidden_states"]) == len(chunks["output_ids"]) == 8


def test_a_non_finite_hidden_state_is_null_not_an_error(tiny_model_factory: Any, tmp_path: Any) -> None:
    """JSON has no NaN or inf: such a value is null (SGLang's orjson writes null), so a valid request
    still gets its answer (the server's JSONResponse refused it, a 400)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model_factory("qwen3")
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), tmp_path / name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    eng = Engine(str(tmp_path), device="cpu", max_total_tokens=1024, enable_return_hidden_states=True)
    try:
        out = generate(eng, list(range(20, 26)), 2, return_hidden_states=True)
    finally:
        eng.shutdown()
    hidden = out["meta_info"]["hidden_states"]
    assert hidden[0][0][0] is None and all(isinstance(v, float) for v in hidden[0][0][1:])
    json.dumps(out["meta_info"], allow_nan=False)  # (what a strict JSON writer needs)
