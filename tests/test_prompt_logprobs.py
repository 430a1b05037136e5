"""Prompt logprobs (`logprob_start_len`), through the whole chain: the LM head rows, chunked
and prefix-cached prefills, retraction, streaming, the Engine's checks. The oracle is
transformers' own forward on the same weights (float32, eager attention).

Layout (SGLang's): for prompt[s:], the first entry is None, then log p(prompt[j] | prompt[:j])
for j = s + 1 .. len - 1; top-k lists likewise, None first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, List, Optional

import pytest
import torch

from minisgl import Engine
from minisgl.layers import logits_processor
from minisgl.layers.linear import linear, pack_weight_for_cpu
from minisgl.layers.logits_processor import LogitsProcessor

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = list(range(40, 90))  # 50 tokens: through 16-token chunks, four passes
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_all_logprobs(tiny_model: str) -> torch.Tensor:
    """[len(PROMPT) - 1, V]: transformers' log p(. | PROMPT[:j]) for j = 1.."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.fixture(scope="module")
def hf_logprobs(hf_all_logprobs: torch.Tensor) -> torch.Tensor:
    """[len(PROMPT) - 1]: transformers' log p(PROMPT[j] | PROMPT[:j]) for j = 1.."""
    return hf_all_logprobs.gather(-1, torch.tensor(PROMPT[1:])[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    eng = Engine(tiny_model, device="cpu", max_total_tokens=2048, chunked_prefill_size=16, context_length=256)
    yield eng
    eng.shutdown()


def _values(meta: dict) -> List[Optional[float]]:
    return [lp for lp, _, _ in meta["input_token_logprobs"]]


# --------------------------------------------------------------------------- the LM head rows
@pytest.mark.parametrize("packed", [False, True])
def test_input_logprobs_equal_a_whole_log_softmax_in_any_slicing(monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    """The torch reference: log_softmax over all logits at once, read at the targets; the
    processor's slices (3 rows each here) and the oneDNN-packed head give the same numbers."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden_size, rows = 97, 16, 10
    weight = torch.randn(vocab, hidden_size, generator=g)
    hidden = torch.randn(rows, hidden_size, generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    packed_weight = pack_weight_for_cpu(weight) if packed else None
    if packed and packed_weight is None:
        pytest.skip("this torch build has no oneDNN packing")
    monkeypatch.setattr(logits_processor, "INPUT_LOGPROB_SLICE_ELEMENTS", 3 * vocab)
    out = LogitsProcessor(vocab).input_logprobs(hidden, targets, 4, weight, packed_weight)
    ref = torch.log_softmax(hidden @ weight.T, dim=-1)  # [rows, V]
    torch.testing.assert_close(out.token_logprobs, ref.gather(-1, targets[:, None]).squeeze(-1), rtol=TOL, atol=TOL)
    values, indices = ref.topk(4, dim=-1)
    assert out.top_val is not None and out.top_idx is not None
    torch.testing.assert_close(out.top_val, values, rtol=TOL, atol=TOL)
    assert torch.equal(out.top_idx, indices)
    no_top = LogitsProcessor(vocab).input_logprobs(hidden, targets, 0, weight, packed_weight)
    assert no_top.top_val is None and no_top.top_idx is None
    # (the reference itself: linear() is the head every other row goes through)
    torch.testing.assert_close(linear(hidden, weight, packed=packed_weight), hidden @ weight.T, rtol=TOL, atol=TOL)


def test_the_packed_lm_head_meets_few_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN keeps a primitive per row count: prompt-logprob slices of every length (65..600
    rows here) run at a power of two, so the scheduler's memory stops growing with the lengths
    it meets (+230 MB over a sweep of prompt lengths on the built-in model, before)."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden_size = 64, 16
    weight = torch.randn(vocab, hidden_size, generator=g)
    packed = pack_weight_for_cpu(weight)
    if packed is None:
        pytest.skip("this torch build has no oneDNN packing")
    seen: List[int] = []
    real = logits_processor.linear
    monkeypatch.setattr(logits_processor, "linear", lambda x, *a, **k: seen.append(x.shape[0]) or real(x, *a, **k))
    processor = LogitsProcessor(vocab)
    for rows in range(65, 600, 13):
        hidden = torch.randn(rows, hidden_size, generator=g)
        targets = torch.randint(0, vocab, (rows,), generator=g)
        out = processor.input_logprobs(hidden, targets, 0, weight, packed)
        ref = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        torch.testing.assert_close(out.token_logprobs, ref, rtol=TOL, atol=TOL)  # the padding is cut off again
    assert set(seen) == {128, 256, 512, 1024}


# --------------------------------------------------------------------------- through the Engine
@pytest.mark.parametrize("start", [0, 7, 16, 49, 50])
def test_prompt_logprobs_match_transformers_through_chunks_and_the_cache(
    engine: Any, hf_logprobs: torch.Tensor, hf_all_logprobs: torch.Tensor, start: int
) -> None:
    engine.flush_cache()
    params = {**GREEDY, "max_new_tokens": 3}
    first = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=2, logprob_start_len=start)
    meta = first["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT[start:]
    values = _values(meta)
    if start < len(PROMPT):
        assert values[0] is None and meta["input_top_logprobs"][0] is None  # nothing scores the first token
        torch.testing.assert_close(torch.tensor(values[1:]), hf_logprobs[start:], rtol=TOL, atol=TOL)
        assert len(meta["input_top_logprobs"]) == len(values)
        top_values, top_ids = hf_all_logprobs[start:].topk(2, dim=-1)  # [len - 1 - start, 2] each
        ours = meta["input_top_logprobs"][1:]
        assert [[t for _, t, _ in top] for top in ours] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([[v for v, _, _ in top] for top in ours]).reshape(-1, 2), top_values, rtol=TOL, atol=TOL)
    else:
        assert values == [] and meta["input_top_logprobs"] == []  # output logprobs only
    assert len(meta["output_token_logprobs"]) == 3
    # Again, with the prompt in the radix cache: only what lies before `start` may be reused (a
    # cached token's logits are gone), and the numbers are the same.
    again = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=2, logprob_start_len=start)
    assert again["meta_info"]["cached_tokens"] == min(start, len(PROMPT) - 1)
    torch.testing.assert_close(
        torch.tensor([v for v in _values(again["meta_info"]) if v is not None]),
        torch.tensor([v for v in values if v is not None]),
        rtol=TOL, atol=TOL,
    )  # fmt: skip
    assert again["output_ids"] == first["output_ids"]


def test_requests_with_and_without_prompt_logprobs_share_a_batch(engine: Any, hf_logprobs: torch.Tensor) -> None:
    """Each request gets its own rows of the pass, and asking changes no generated token."""
    engine.flush_cache()
    plain = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 4})
    engine.flush_cache()
    starts = {"a": 0, "b": None, "c": 30, "d": 3}
    for rid, start in starts.items():
        kwargs = {} if start is None else {"return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 1}
        engine.add_request(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 4}, rid=rid, **kwargs)
    engine.run_until_idle()
    for rid, start in starts.items():
        out = engine.get_result(rid)
        assert out["output_ids"] == plain["output_ids"], rid
        if start is None:
            assert out["meta_info"]["input_token_logprobs"] == [] and out["meta_info"]["output_token_logprobs"] == []
            continue
        torch.testing.assert_close(torch.tensor(_values(out["meta_info"])[1:]), hf_logprobs[start:], rtol=TOL, atol=TOL)


def test_token_ids_logprob_reports_the_named_ids_at_every_position(engine: Any, hf_all_logprobs: torch.Tensor) -> None:
    """SGLang's token_ids_logprob (scoring class labels): at each output token and each scored
    prompt position, the logprobs of the ids asked for, in their order."""
    engine.flush_cache()
    ids = [100, 3, 7]
    out = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                          logprob_start_len=5, token_ids_logprob=ids, top_logprobs_num=engine.vocab_size)  # fmt: skip
    meta = out["meta_info"]
    prompt_side = meta["input_token_ids_logprobs"]
    assert len(prompt_side) == len(PROMPT) - 5 and prompt_side[0] is None
    for j, entries in enumerate(prompt_side[1:]):
        assert [t for _, t, _ in entries] == ids
        expected = hf_all_logprobs[5 + j][ids].tolist()  # the logits at position 5 + j score position 6 + j
        assert [lp for lp, _, _ in entries] == pytest.approx(expected, abs=TOL)
    output_side = meta["output_token_ids_logprobs"]
    assert len(output_side) == len(out["output_ids"]) == 4
    for entries, everything in zip(output_side, meta["output_top_logprobs"]):
        by_id = {t: lp for lp, t, _ in everything}  # every token's logprob at that step
        assert [(lp, t) for lp, t, _ in entries] == [(by_id[t], t) for t in ids]
    plain = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True)
    assert plain["meta_info"]["output_token_ids_logprobs"] == plain["meta_info"]["input_token_ids_logprobs"] == []
    assert plain["output_ids"] == out["output_ids"]


def test_a_batch_takes_the_logprob_fields_one_per_prompt(engine: Any, hf_logprobs: torch.Tensor) -> None:
    """SGLang's batch shapes: logprob_start_len, top_logprobs_num and token_ids_logprob as one
    value for all prompts or a list of one per prompt (n > 1 samples share their prompt's)."""
    params = {**GREEDY, "max_new_tokens": 2}
    outs = engine.generate(input_ids=[PROMPT, PROMPT[:20]], sampling_params=params, return_logprob=True,
                           logprob_start_len=[3, -1], top_logprobs_num=[0, 2], token_ids_logprob=[[7], None])  # fmt: skip
    first, second = (o["meta_info"] for o in outs)
    torch.testing.assert_close(torch.tensor(_values(first)[1:]), hf_logprobs[3:], rtol=TOL, atol=TOL)
    assert first["output_top_logprobs"] == [] and [[t for _, t, _ in e] for e in first["output_token_ids_logprobs"]] == [[7], [7]]
    assert second["input_token_logprobs"] == [] and [len(top) for top in second["output_top_logprobs"]] == [2, 2]
    assert second["output_token_ids_logprobs"] == []
    shared = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=params, return_logprob=True, logprob_start_len=40)
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in shared] == [10, 10]  # one value for all


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"input_ids": [[5, 6], [7, 8]], "logprob_start_len": [0]}, "`logprob_start_len` must have 2 entries"),
        ({"input_ids": [[5, 6], [7, 8]], "token_ids_logprob": [[3]]}, "`token_ids_logprob` must have 2 lists"),
        ({"input_ids": [5, 6], "logprob_start_len": [0]}, "lists are per prompt of a batch"),
        ({"input_ids": [5, 6], "token_ids_logprob": [[3]]}, "lists are per prompt of a batch"),
        ({"input_ids": [[5, 6], [7, 8]], "logprob_start_len": [0, 5]}, "logprob_start_len=5 is higher"),
    ],
)
def test_per_prompt_logprob_fields_of_the_wrong_shape_say_what_to_change(engine: Any, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        engine.generate(sampling_params={"max_new_tokens": 1}, return_logprob=True, **kwargs)
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_stream_whole_from_the_first_chunk(engine: Any, monkeypatch: Any) -> None:
    params = {**GREEDY, "max_new_tokens": 5}
    whole = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, logprob_start_len=0)
    chunks = list(engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, logprob_start_len=0, stream=True))
    assert len(chunks) > 1  # cumulative: every chunk has all of them
    assert all(c["meta_info"]["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"] for c in chunks)
    monkeypatch.setattr(engine, "server_args", dataclasses.replace(engine.server_args, incremental_streaming_output=True))  # deltas: once, in the first
    chunks = list(engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, logprob_start_len=0, stream=True))
    assert chunks[0]["meta_info"]["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
    assert all(c["meta_info"]["input_token_logprobs"] == [] for c in chunks[1:])


def test_max_new_tokens_zero_scores_the_prompt_alone(engine: Any, hf_logprobs: torch.Tensor) -> None:
    """Score a prompt, generate nothing (echo + logprobs with max_tokens 0)."""
    out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    torch.testing.assert_close(torch.tensor(_values(out["meta_info"])[1:]), hf_logprobs, rtol=TOL, atol=TOL)


def test_a_retracted_request_reports_its_prompt_logprobs_once(tiny_model: str, hf_logprobs: torch.Tensor) -> None:
    # A pool too small for both outputs (10 + 60 + 50 + 40 > 120): the request that asked for
    # prompt logprobs, having the fewer outputs, is retracted and prefilled again (prompt + its
    # output). Its prompt logprobs were complete before: not recomputed, not doubled. (No radix
    # cache: the re-prefill then starts at position 0, where the prompt logprobs start.)
    engine = Engine(tiny_model, device="cpu", max_total_tokens=120, chunked_prefill_size=-1, schedule_conservativeness=0.01,
                    disable_radix_cache=True)  # fmt: skip
    try:
        other = engine.add_request(input_ids=list(range(200, 210)), sampling_params={**GREEDY, "max_new_tokens": 60})
        engine.step(snapshot=False)
        params = {**GREEDY, "max_new_tokens": 40}
        rid = engine.add_request(input_ids=PROMPT, sampling_params=params, return_logprob=True, logprob_start_len=0)
        retracted = []
        while engine.has_unfinished_requests():
            retracted += [e["rid"] for e in engine.step()["events"] if e["type"] == "retract"]
        assert rid in retracted
        out = engine.get_result(rid)
        engine.get_result(other)
        meta = out["meta_info"]
        assert len(meta["input_token_logprobs"]) == len(PROMPT) and len(meta["output_token_logprobs"]) == 40
        torch.testing.assert_close(torch.tensor(_values(meta)[1:]), hf_logprobs, rtol=TOL, atol=TOL)
        assert out["output_ids"] == engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"logprob_start_len": 0}, "logprob_start_len needs return_logprob to be true"),
        ({"logprob_start_len": -2, "return_logprob": True}, "logprob_start_len must be -1"),
        ({"logprob_start_len": "0", "return_logprob": True}, "logprob_start_len must be -1"),
        ({"logprob_start_len": 51, "return_logprob": True}, "logprob_start_len=51 is higher than the number of input tokens 50"),
        ({"token_ids_logprob": [3]}, "token_ids_logprob needs return_logprob to be true"),
        ({"token_ids_logprob": [3, 10_000], "return_logprob": True}, r"token_ids_logprob \[10000\] are outside the vocabulary"),
        ({"token_ids_logprob": "3", "return_logprob": True}, "token_ids_logprob must be a list of token ids"),
    ],
)
def test_a_bad_logprob_start_len_says_what_to_change(engine: Any, kwargs: dict, needle: str) -> None:
    for call in (engine.generate, engine.add_request):
        with pytest.raises(ValueError, match=needle):
            call(input_ids=PROMPT, sampling_params={"max_new_tokens": 1}, **kwargs)
    assert not engine.has_unfinished_requests()


def test_lpm_does_not_hold_back_a_request_that_can_reuse_no_prefix(tiny_model: str) -> None:
    """lpm's in-batch prefix check waits for an earlier queued request to fill the cache; a request
    whose prompt logprobs start at 0 can reuse nothing, so it keeps its turn (SGLang checks
    max_prefix_ids; the whole prompt sent C behind B)."""
    engine = Engine(tiny_model, device="cpu", max_total_tokens=2048, context_length=256, schedule_policy="lpm",
                    prefill_max_requests=1)  # fmt: skip
    try:
        shared = list(range(100, 150))
        params = {**GREEDY, "max_new_tokens": 1}
        engine.add_request(input_ids=shared + [7], sampling_params=params, rid="A", return_logprob=True, logprob_start_len=0)
        engine.add_request(input_ids=shared + [8], sampling_params=params, rid="C", return_logprob=True, logprob_start_len=0)
        engine.add_request(input_ids=list(range(400, 410)), sampling_params=params, rid="B")
        order: List[str] = []
        while engine.has_unfinished_requests():
            order += [e["rid"] for e in engine.step()["events"] if e["type"] == "prefill_done"]
        assert order == ["A", "C", "B"]
        assert engine.get_result("C")["meta_info"]["cached_tokens"] == 0
    finally:
        engine.shutdown()
