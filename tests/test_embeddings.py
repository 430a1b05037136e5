"""Embedding models (--is-embedding) in process: Engine.encode against transformers, and the
scheduler's prefill-only path.

The oracle is the Hugging Face model on the same random weights: its final-norm hidden state
(`output_hidden_states[-1]`) at the prompt's last token, L2-normalised, for single prompts,
batches of different lengths, prompts split by chunked prefill and prompts that hit the
radix cache. The scheduler is driven step by step for what the visualizer is shown and for
the admission budgets (an embedding request reserves no output tokens).
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator, List

import pytest
import torch
import torch.nn.functional as F

from minisgl import Engine
from minisgl.managers.io_struct import AbortReq, TokenizedEmbeddingReqInput
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.visualizer.render import render_panels
from minisgl.visualizer.snapshot import validate_snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16
TEXTS = [
    "Text into vectors",
    "A",
    "The quick brown fox jumps over the lazy dog, and then it keeps running through the forest until night falls",
]
ATOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Engine]:
    eng = Engine(tiny_model, device="cpu", is_embedding=True, max_total_tokens=4096, chunked_prefill_size=CHUNK)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def reference(hf_model: Any, ids: List[int], dimensions: Any = None) -> torch.Tensor:
    """transformers' final-norm hidden state at the last token, cut to `dimensions`, L2-normalised."""
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]  # [H]
    return F.normalize(hidden[:dimensions], dim=-1)


def ids_of(engine: Engine, text: str) -> List[int]:
    return engine.tokenizer.encode(text)


def assert_matches(out: Any, expected: torch.Tensor) -> None:
    got = torch.tensor(out["embedding"])
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()
    assert math.isclose(float(got.norm()), 1.0, rel_tol=1e-5)


# --------------------------------------------------------------------------- numerics
def test_one_prompt_text_or_ids_equals_transformers(engine: Engine, hf_model: Any) -> None:
    ids = ids_of(engine, TEXTS[0])
    assert len(ids) < CHUNK  # (one pass)
    out = engine.encode(TEXTS[0])
    assert_matches(out, reference(hf_model, ids))
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["finish_reason"] == {"type": "length", "length": 0}
    assert set(out) == {"embedding", "meta_info"}
    assert_matches(engine.encode(input_ids=ids), reference(hf_model, ids))


def test_a_batch_of_different_lengths_equals_transformers_in_order(engine: Engine, hf_model: Any) -> None:
    engine.flush_cache()
    outs = engine.encode(TEXTS)
    assert isinstance(outs, list) and len(outs) == len(TEXTS)
    for text, out in zip(TEXTS, outs):
        ids = ids_of(engine, text)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert_matches(out, reference(hf_model, ids))
    # the same as token ids, a list of lists
    id_lists = [ids_of(engine, t)[::-1] for t in TEXTS]  # (other prompts: no cache hits)
    for ids, out in zip(id_lists, engine.encode(input_ids=id_lists)):
        assert_matches(out, reference(hf_model, ids))


def test_chunked_prefill_gives_the_last_chunk_s_row(engine: Engine, hf_model: Any) -> None:
    """A 3-chunk prompt runs 3 passes (CHUNK tokens each at most), and only the last one's row
    (the prompt's last token) is its embedding; the other chunks' rows were other tokens'."""
    ids = list(range(100, 100 + 2 * CHUNK + 5))  # 37 tokens
    engine.flush_cache()
    before = engine.scheduler.forward_ct
    out = engine.encode(input_ids=ids)
    assert engine.scheduler.forward_ct - before == 3
    assert_matches(out, reference(hf_model, ids))
    # not what the first chunk's last token gives (the premise: a wrong row would be caught)
    assert not torch.allclose(torch.tensor(out["embedding"]), reference(hf_model, ids[:CHUNK]), atol=1e-3)


def test_a_radix_prefix_hit_gives_the_same_embedding(engine: Engine, hf_model: Any) -> None:
    """The radix cache stays on (SGLang keeps it for causal embedding models): a prompt seen
    before computes only its last token, a longer one only what follows the cached prefix."""
    engine.flush_cache()
    prompt = list(range(300, 320))
    first = engine.encode(input_ids=prompt)
    assert first["meta_info"]["cached_tokens"] == 0
    again = engine.encode(input_ids=prompt)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # all but the last token, whose row is needed
    assert torch.allclose(torch.tensor(again["embedding"]), torch.tensor(first["embedding"]), atol=ATOL)
    longer = prompt + [7, 8, 9, 10]
    out = engine.encode(input_ids=longer)
    assert out["meta_info"]["cached_tokens"] == len(prompt)
    assert_matches(out, reference(hf_model, longer))


def test_bad_prompts_raise_and_leave_nothing_behind(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.encode("")
    with pytest.raises(ValueError, match="non-empty list"):
        engine.encode([])
    with pytest.raises(ValueError, match="longer than"):
        engine.encode(input_ids=[5] * 5000)  # past the KV pool and the context
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.encode(input_ids=[[1, 2], [10**6]])  # a batch fails whole: nothing of it queued
    assert not engine.has_unfinished_requests() and engine.scheduler.is_idle()


# --------------------------------------------------------------------------- the two kinds of Engine
def test_each_kind_of_engine_refuses_the_other_kind_of_call(engine: Engine, tiny_model: str) -> None:
    with pytest.raises(ValueError, match="encode\\(\\) for embeddings"):
        engine.generate("hi", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="encode\\(\\) for embeddings"):
        engine.add_request("hi")
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        engine.encode("hi", dimensions=8)  # (no Matryoshka sizes in this model's config)
    gen = Engine(tiny_model, device="cpu", max_total_tokens=1024)
    try:
        with pytest.raises(ValueError, match="is_embedding=True"):
            gen.encode("hi")
        assert gen.generate("hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
    finally:
        gen.shutdown()


def test_a_bare_decoder_checkpoint_without_lm_head_serves_embeddings(tiny_model_factory: Any, tmp_path: Any) -> None:
    """Qwen3-Embedding's layout: the decoder's tensors without the causal LM's "model." prefix and
    no lm_head.weight (its config still names Qwen3ForCausalLM, untied at 4B/8B). An embedding model
    loads it; a generation model refuses it, naming the head it lacks."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    source = tiny_model_factory("qwen3", tie_word_embeddings=False)
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), tmp_path / name)
    (shard,) = [n for n in os.listdir(source) if n.endswith(".safetensors")]
    tensors = load_file(os.path.join(source, shard))
    assert "lm_head.weight" in tensors
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}, str(tmp_path / shard))

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    eng = Engine(str(tmp_path), device="cpu", is_embedding=True, max_total_tokens=1024)
    try:
        ids = eng.tokenizer.encode(TEXTS[0])
        assert_matches(eng.encode(input_ids=ids), reference(hf_model, ids))
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match=r"checkpoint is missing tensors \['lm_head.weight'\]"):
        Engine(str(tmp_path), device="cpu", max_total_tokens=1024)


def test_an_over_long_input_is_refused_without_talk_of_generating(tiny_model: str) -> None:
    eng = Engine(tiny_model, device="cpu", is_embedding=True, context_length=64, max_total_tokens=1024)
    try:
        with pytest.raises(ValueError, match=r"accepts \(57 tokens: the context length of 64 tokens or the KV pool, less a margin of"):
            eng.encode(input_ids=list(range(10, 68)))
    finally:
        eng.shutdown()


def test_encode_raises_when_a_prompt_of_its_batch_was_refused(tiny_model: str) -> None:
    """A batch longer than --max-queued-requests loses its tail to the queue's 503: encode() raises
    with that message rather than hand back vectors of None."""
    eng = Engine(tiny_model, device="cpu", is_embedding=True, max_total_tokens=1024, max_queued_requests=2)
    try:
        with pytest.raises(RuntimeError, match="The embedding of prompt 2 was not computed: .*queue"):
            eng.encode(["a b", "c d", "e f", "g h"])
        assert len(eng.encode(["a b", "c d"])) == 2  # nothing was left behind
        eng.scheduler.check_memory_when_idle()
    finally:
        eng.shutdown()


def test_dimensions_cut_a_matryoshka_model_s_embedding(tiny_model_factory: Any) -> None:
    """config.json's matryoshka_dimensions (SGLang's way to declare it): dimensions=d keeps the
    first d numbers and normalises them again; sizes the model does not declare are refused."""
    import transformers

    path = tiny_model_factory("qwen3", matryoshka_dimensions=[8, 16])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(path, device="cpu", is_embedding=True, max_total_tokens=1024, enable_priority_scheduling=True)
    try:
        ids = ids_of(eng, TEXTS[0])
        cut = eng.encode(TEXTS[0], dimensions=8)
        assert len(cut["embedding"]) == 8
        assert_matches(cut, reference(hf, ids, 8))
        both = eng.encode([TEXTS[0], TEXTS[2]], dimensions=16)
        assert [len(o["embedding"]) for o in both] == [16, 16]
        assert_matches(both[1], reference(hf, ids_of(eng, TEXTS[2]), 16))
        assert_matches(eng.encode(TEXTS[0]), reference(hf, ids))  # no dimensions: all of it
        with pytest.raises(ValueError, match="only supports \\[8, 16\\] matryoshka dimensions"):
            eng.encode(TEXTS[0], dimensions=12)
        with pytest.raises(ValueError, match="greater than 0"):
            eng.encode(TEXTS[0], dimensions=0)
        with pytest.raises(ValueError, match="must be an integer"):
            eng.encode(TEXTS[0], dimensions=8.0)  # type: ignore[arg-type]
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- the scheduler, step by step
def _queue(engine: Engine, rid: str, ids: List[int]) -> None:
    """An embedding request straight into the scheduler (encode() would run it to the end)."""
    params = SamplingParams.from_dict({"max_new_tokens": 0})
    engine.scheduler.process_input_requests([TokenizedEmbeddingReqInput(rid=rid, input_text=None, input_ids=ids, sampling_params=params)])


def test_prefill_only_steps_reserve_no_output_and_show_in_the_snapshot(engine: Engine) -> None:
    engine.flush_cache()
    sched = engine.scheduler
    _queue(engine, "short", list(range(20, 30)))  # 10 tokens
    _queue(engine, "long", list(range(40, 80)))  # 40 tokens: chunks of 6 (after short's 10), 16, 16, 2
    _queue(engine, "gone", list(range(90, 95)))
    sched.abort_request(AbortReq(rid="gone"))  # aborted while waiting: finishes without an embedding
    outputs = sched.pop_outputs()
    assert [(o.rids, o.embeddings) for o in outputs] == [(["gone"], [None])]
    assert outputs[0].finished_reasons[0]["type"] == "abort"

    snaps = []
    while not sched.is_idle():  # (the scheduler's own steps: Engine.step would take the outputs)
        sched.run_step()
        snaps.append(sched.snapshot())
        assert validate_snapshot(snaps[-1]) == []
        render_panels(snaps[-1], [], snaps[-1]["finished"])  # the page draws it
        outputs += sched.pop_outputs()
    first = snaps[0]
    assert [(r["rid"], r["extend_len"], r["max_new_tokens"], r["output_len"]) for r in first["batch"]["reqs"]] == [
        ("short", 10, 0, 0), ("long", 6, 0, 0)]  # (output_len: the token that finishes it is no output)
    # admission charged the extend tokens only: no output reservation (max_new_tokens 0)
    assert first["adder"]["budgets"]["rem_total_tokens"] == sched.max_total_num_tokens - 16
    assert first["running_batch"] == []  # nothing ever decodes
    assert all(s["forward_mode"] == "EXTEND" for s in snaps) and len(snaps) == 4
    assert first["chunked_req"]["rid"] == "long"
    finished = {f["rid"]: f for s in snaps for f in s["finished"]}
    assert finished["short"]["output_len"] == 0 and finished["short"]["finish_reason"]["type"] == "length"
    assert finished["long"]["ttft_ms"] is not None
    events = [(e["type"], e["rid"]) for s in snaps for e in s["events"]]
    assert ("prefill_done", "long") in events and ("finish", "long") in events
    # one message per request, sent when it finished, the long one after its last chunk
    sent = [(rid, len(emb or [])) for o in outputs for rid, emb in zip(o.rids, o.embeddings)]
    assert sent == [("gone", 0), ("short", 64), ("long", 64)]
    # idle: every KV slot back in the pool or in the tree (the scheduler's own check, not raising)
    sched.check_memory_when_idle()
