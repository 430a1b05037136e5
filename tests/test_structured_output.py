"""Structured output: json_schema / regex / ebnf constrain what a request samples.

The tiny model has random weights, so without the grammar its text is noise: every check
that the text matches its grammar fails if the mask is not applied.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest
import torch

from minisgl.constrained.xgrammar_backend import allocate_vocab_mask, apply_vocab_mask, apply_vocab_mask_reference
from minisgl.sampling.sampling_params import SamplingParams

xgr = pytest.importorskip("xgrammar")  # (in the test extra: CI runs all of these)
pytestmark = pytest.mark.usefixtures("one_thread")

PHONE = r"[0-9]{3}-[a-z]{2,5}"
SCHEMA = {
    "type": "object",
    "properties": {
        # (not maxLength: xgrammar 0.2.9's length-bounded strings let raw control characters through)
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "color", "ok"],
    "additionalProperties": False,
}
# (a random model may spell an answer a character per token: SCHEMA's longest is ~70)
SAMPLED = {"temperature": 1.0, "max_new_tokens": 96}


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    # compact JSON: with free whitespace a random model wanders through blanks until max_new_tokens
    with Engine(tiny_model, device="cpu", max_total_tokens=4096, constrained_json_disable_any_whitespace=True) as e:
        yield e


# --------------------------------------------------------------------------- the mask
# (cuda: xgrammar's GPU kernel, run by benchmarks/gpu_check.sh; the mask is filled on the host)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("vocab_size", [4096, 1000, 33])
def test_apply_vocab_mask_matches_its_torch_reference_on_the_grammar_rows(vocab_size: int, device: str) -> None:
    g = torch.Generator().manual_seed(vocab_size)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab_size + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab_size, generator=g).to(device)
    expected = logits.clone()
    apply_vocab_mask_reference(expected, mask)
    kernel = logits.clone()
    apply_vocab_mask(kernel, mask, rows=[0, 2])
    assert torch.equal(kernel[[0, 2]], expected[[0, 2]])
    assert torch.equal(kernel[1], logits[1])  # a row without a grammar is not touched
    assert torch.isinf(expected).any() and not torch.isinf(logits).any()


def test_the_reference_keeps_exactly_the_allowed_ids() -> None:
    mask = allocate_vocab_mask(100, 2)
    mask[0] = 0
    for token in (0, 31, 32, 99):  # the ends of a word, the start of the next, the last id
        mask[0, token // 32] |= torch.tensor(1 << token % 32, dtype=torch.int64).to(torch.int32)
    logits = torch.zeros(2, 100)
    apply_vocab_mask_reference(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 32, 99]
    assert torch.isfinite(logits[1]).all()  # allocate_vocab_mask's rows allow everything


# --------------------------------------------------------------------------- SamplingParams
def test_sampling_params_take_one_grammar_as_text() -> None:
    p = SamplingParams.from_dict({"regex": PHONE})
    p.verify()
    assert p.grammar_key == ("regex", PHONE)
    assert SamplingParams().grammar_key is None
    with pytest.raises(ValueError, match=r"json_schema must be a string \(its JSON text: json.dumps\(schema\)\)"):
        SamplingParams.from_dict({"json_schema": SCHEMA})
    with pytest.raises(ValueError, match=r"Only one of regex, json_schema, ebnf, or structural_tag can be set, got \['json_schema', 'regex'\]"):
        SamplingParams.from_dict({"regex": "a", "json_schema": "{}"}).verify()
    with pytest.raises(ValueError, match="json_schema must be the JSON text of a JSON schema"):
        SamplingParams.from_dict({"json_schema": "{'single': 'quotes'}"}).verify()
    with pytest.raises(ValueError, match="structural_tag must be the JSON text of an object, got list"):
        SamplingParams.from_dict({"structural_tag": "[]"}).verify()


# --------------------------------------------------------------------------- the Engine
def test_regex_json_schema_and_ebnf_outputs_match_their_grammars(engine: Any) -> None:
    outs = engine.generate(["My number is"] * 4, {**SAMPLED, "regex": PHONE})
    texts = [o["text"] for o in outs]
    assert all(re.fullmatch(PHONE, t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not a fixed string
    eos = engine.tokenizer.eos_token_id
    assert all(o["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos} for o in outs)

    outs = engine.generate(["Describe it:"] * 4, {**SAMPLED, "json_schema": json.dumps(SCHEMA)})
    for o in outs:
        doc = json.loads(o["text"])
        assert list(doc) == ["name", "count", "color", "ok"] and doc["color"] in SCHEMA["properties"]["color"]["enum"]
        assert isinstance(doc["ok"], bool) and re.fullmatch("[a-z]{1,8}", doc["name"]) and 0 <= doc["count"] <= 99

    out = engine.generate("Answer:", {**SAMPLED, "ebnf": 'root ::= "yes" | "no"'})
    assert out["text"] in ("yes", "no")


# what follows "<" must be <f>{"a": <integer>}</f>; anything else is free text
TAG = {
    "structures": [{"begin": "<f>", "end": "</f>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                              "required": ["a"], "additionalProperties": False}}],
    "triggers": ["<"],
}  # fmt: skip


def test_a_structural_tag_constrains_what_follows_its_trigger(engine: Any) -> None:
    """SGLang's structural_tag (its tool-call constraint for strict tools under "auto"): free text,
    but from a trigger on, one of the structures. A logit bias makes "<" the first token; the
    random model then writes the structure, which it would never do on its own."""
    lt = engine.tokenizer.convert_tokens_to_ids("<")
    params = {**SAMPLED, "max_new_tokens": 48, "logit_bias": {str(lt): 100}}
    free = engine.generate("Call:", params)["text"]
    assert not free.startswith("<f>")  # (without the tag: "<<<<...")
    for tag in (TAG, {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
            {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": TAG["structures"][0]["schema"]},
             "end": "</f>"}]}}):  # fmt: skip
        for text in (o["text"] for o in engine.generate(["Call:"] * 3, {**params, "structural_tag": json.dumps(tag)})):
            assert text.startswith("<f>"), text
            if "</f>" in text:  # (a random model may not close it within max_new_tokens)
                assert isinstance(json.loads(text[3 : text.index("</f>")])["a"], int), text


def test_a_bad_structural_tag_is_a_400_that_says_what_is_wrong(engine: Any) -> None:
    for tag, message in [
        ({"structures": [{"begin": "<f>", "end": "</f>"}]}, 'Invalid structural_tag: needs "structures" (a list of'),
        ({"structures": [{"begin": "<f>"}], "triggers": ["<"]}, 'Invalid structural_tag: each structure needs a "begin" and an "end"'),
        ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["#"]}, "One tag does not match any trigger"),
        ({"type": "structural_tag", "format": {"type": "bogus"}}, "Format type not recognized: bogus"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.generate("a", {**SAMPLED, "structural_tag": json.dumps(tag)})


def test_greedy_grammar_output_is_the_best_allowed_token_at_each_step(engine: Any) -> None:
    """Greedy under a grammar: each token is the argmax of the model's logits over the allowed ids."""
    params = {"temperature": 0, "max_new_tokens": 8, "regex": "(cat|dog|bird)"}
    out = engine.generate("Pick:", params, return_logprob=True, top_logprobs_num=3)
    assert out["text"] in ("cat", "dog", "bird")
    meta = out["meta_info"]
    for (logprob, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == token and top[0][0] == logprob  # the chosen token is the best of what was allowed
        assert logprob > -1e30  # and was allowed: its logprob is finite


def test_a_bad_grammar_is_a_400_for_that_request_only(engine: Any) -> None:
    """In the scheduler, the bad requests end with a 400 and the good one runs; generate()
    raises the ValueError the server's 400 is (SGLang's Engine does), stream or not."""
    params = [{**SAMPLED, "regex": "[0-9"}, {**SAMPLED, "regex": PHONE}, {**SAMPLED, "json_schema": '{"type": "nope"}'}]
    rids = [engine.add_request(p, sp) for p, sp in zip("abc", params)]
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.get_result(r) for r in rids]
    bad_regex, good, bad_schema = (o["meta_info"]["finish_reason"] for o in outs)
    assert bad_regex["type"] == "abort" and bad_regex["status_code"] == 400
    assert bad_regex["message"].startswith("Invalid regex:") and "/project/" not in bad_regex["message"]
    assert bad_schema["type"] == "abort" and bad_schema["message"].startswith("Invalid json_schema:")
    assert good["type"] == "stop" and re.fullmatch(PHONE, outs[1]["text"])
    assert outs[0]["output_ids"] == [] and outs[2]["output_ids"] == []
    with pytest.raises(ValueError, match="Invalid regex: Regex parsing error"):
        engine.generate(["a", "b"], [params[1], params[0]])
    with pytest.raises(ValueError, match="Invalid json_schema"):
        list(engine.generate("c", params[2], stream=True))
    with pytest.raises(ValueError, match="Invalid regex"):
        asyncio.run(engine.async_generate("a", params[0]))
    assert engine.scheduler.is_idle() and not engine.rid_to_state


def test_n_samples_stream_and_the_cache_each_keep_their_grammar(engine: Any) -> None:
    params = {**SAMPLED, "regex": PHONE, "n": 3}
    outs = engine.generate("Call me at", params)
    assert len(outs) == 3 and all(re.fullmatch(PHONE, o["text"]) for o in outs)
    chunks = list(engine.generate("Call me at", {**SAMPLED, "regex": PHONE}, stream=True))
    assert len(chunks) > 1 and re.fullmatch(PHONE, chunks[-1]["text"])
    assert all(chunks[-1]["text"].startswith(c["text"]) for c in chunks)  # cumulative, each a prefix of the answer
    again = engine.generate("Call me at", {**SAMPLED, "regex": PHONE})  # the prompt now comes from the radix cache
    assert again["meta_info"]["cached_tokens"] > 0 and re.fullmatch(PHONE, again["text"])


def test_min_new_tokens_that_outlasts_the_grammar_aborts_without_the_forced_token(engine: Any) -> None:
    out = engine.generate("Answer:", {**SAMPLED, "ebnf": 'root ::= "yes" | "no"', "min_new_tokens": 10})
    finish = out["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["message"] == (
        "Structured output stopped: no token continues the output inside its grammar "
        "(min_new_tokens held back the stop token the finished output needed)"
    )  # (no token id: which one the sampler picked among all -inf logits depends on the batch)
    assert out["text"] in ("yes", "no")  # the token the grammar refused is not part of the answer


def test_a_grammar_that_allows_no_token_aborts_saying_so(engine: Any) -> None:
    out = engine.generate("Answer:", {**SAMPLED, "ebnf": "root ::= root"})
    finish = out["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "the grammar allows no token here" in finish["message"] and out["output_ids"] == []


def test_ignore_eos_still_ends_at_the_grammars_end(engine: Any) -> None:
    out = engine.generate("Answer:", {**SAMPLED, "ebnf": 'root ::= "yes" | "no"', "ignore_eos": True})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_grammar_requests_survive_retraction_with_their_state(tiny_model: str) -> None:
    """A small pool forces retractions (test_scheduler_retract.py's workload); a retracted
    request keeps its output and its grammar's place, so after the re-prefill it goes on from
    there: a grammar restarted at a retraction would write a second "x"."""
    from minisgl import Engine

    rng = random.Random(0)
    regex = "x[0-9]+"
    with Engine(tiny_model, device="cpu", max_total_tokens=200, chunked_prefill_size=-1, schedule_conservativeness=0.1) as e:
        lengths = [rng.randrange(4, 36) for _ in range(48)]  # (min_new_tokens: the stop token waits till the end)
        rids = [
            e.add_request(input_ids=[rng.randrange(10, 400) for _ in range(12)],
                          sampling_params={**SAMPLED, "max_new_tokens": n, "min_new_tokens": n, "regex": regex})
            for n in lengths
        ]  # fmt: skip
        retracted = 0
        while e.has_unfinished_requests():
            retracted += sum(ev["type"] == "retract" for ev in e.step()["events"])
            e.scheduler.check_integrity()
        outs = [e.get_result(r) for r in rids]
    assert retracted > 0
    assert [len(o["output_ids"]) for o in outs] == lengths
    assert all(re.fullmatch(regex, o["text"]) for o in outs), [o["text"] for o in outs]


def _gate_compiles(engine: Any) -> threading.Event:
    """Hold every compile of the engine's grammar backend until the returned event is set."""
    backend = engine.scheduler.get_grammar_backend()
    gate, compile_ = threading.Event(), backend._compile
    backend._compile = lambda kind, text: (gate.wait(30), compile_(kind, text))[1]
    return gate


def test_a_compiling_grammar_holds_up_only_its_own_request(tiny_model: str) -> None:
    """SGLang's grammar queue: the request waits there while its grammar compiles on the
    backend's thread, and every other request runs meanwhile (a nested schema can take
    seconds; compiled in the scheduler's pass, it stalled everyone)."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as e:
        gate = _gate_compiles(e)
        slow = e.add_request("a", {**SAMPLED, "regex": "(ab)+c"})
        free = e.add_request("b", {"max_new_tokens": 8, "temperature": 0})
        for _ in range(20):
            snap = e.step()
        assert [g["rid"] for g in snap["grammar_queue"]] == [slow] and snap["grammar_queue"][0]["grammar"] == "regex"
        assert e.get_result(free)["meta_info"]["finish_reason"]["type"] == "length"  # it finished meanwhile
        gate.set()
        while e.has_unfinished_requests():
            e.step()
        assert re.fullmatch("(ab)+c", e.get_result(slow)["text"])


def test_a_grammar_that_does_not_compile_in_time_or_is_aborted_ends_cleanly(tiny_model: str, monkeypatch: Any) -> None:
    from minisgl import Engine
    from minisgl.managers import scheduler as scheduler_module

    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as e:
        gate = _gate_compiles(e)
        aborted = e.add_request("a", {**SAMPLED, "regex": "x+"})
        e.step()
        e.abort(aborted)
        e.step()
        assert e.get_result(aborted)["meta_info"]["finish_reason"]["type"] == "abort"
        monkeypatch.setattr(scheduler_module, "GRAMMAR_TIMEOUT", 0.05)
        late = e.add_request("b", {**SAMPLED, "regex": "y+"})
        time.sleep(0.1)
        while e.has_unfinished_requests():
            e.step()
        finish = e.get_result(late)["meta_info"]["finish_reason"]
        assert finish["status_code"] == 400 and "did not compile within 0.05 s" in finish["message"]
        gate.set()
        e.scheduler.check_integrity()
        assert e.scheduler.is_idle()


def test_a_slow_grammar_does_not_hold_up_a_small_one_and_an_abandoned_compile_is_skipped(tiny_model: str) -> None:
    """Two compile threads: a small grammar compiles while a huge one still does. A request
    aborted before its compile started leaves nothing to compile (its job is skipped)."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as e:
        backend = e.scheduler.get_grammar_backend()
        gate, compile_, compiled = threading.Event(), backend._compile, []

        def gated(kind: str, text: str) -> Any:
            if text.startswith("slow"):
                gate.wait(30)
            compiled.append(text)
            return compile_(kind, text)

        backend._compile = gated
        slow = [e.add_request("a", {**SAMPLED, "regex": "slow0"})]
        assert e.generate("c", {**SAMPLED, "regex": "(yes|no)"})["text"] in ("yes", "no")
        assert [r.rid for r in e.scheduler.grammar_queue] == slow  # (one thread would have waited for it)
        slow.append(e.add_request("a", {**SAMPLED, "regex": "slow1"}))  # now both threads are busy
        queued = e.add_request("b", {**SAMPLED, "regex": "queued"})
        e.abort(queued)
        e.step()
        gate.set()
        while e.has_unfinished_requests():
            e.step()
        assert [e.get_result(r)["text"] for r in slow] == ["slow0", "slow1"]
        assert "queued" not in compiled and e.get_result(queued)["meta_info"]["finish_reason"]["type"] == "abort"


def test_grammar_backend_none_and_a_broken_xgrammar_refuse_with_what_to_do(tiny_model: str, monkeypatch: Any) -> None:
    from minisgl import Engine
    from minisgl.constrained import xgrammar_backend

    with Engine(tiny_model, device="cpu", max_total_tokens=1024, grammar_backend="none") as e:
        with pytest.raises(ValueError, match="--grammar-backend none"):
            e.generate("a", {"regex": "a"})

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("libstdc++.so.6: version `GLIBCXX_3.4.32' not found")  # (a native library that does not load)

    monkeypatch.setattr(xgrammar_backend.XGrammarGrammarBackend, "__init__", broken)
    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as e:
        with pytest.raises(ValueError, match=r"the grammar backend failed to load \(OSError: libstdc\+\+"):
            e.generate("a", {"regex": "a"})
        assert e.generate("a", {"max_new_tokens": 2})["meta_info"]["finish_reason"]["type"] == "length"


EXIT_WHILE_COMPILING = """
import sys, time
from minisgl import Engine
e = Engine(sys.argv[1], device="cpu", max_total_tokens=512)
deep = '{"type": "array", "items": ' * 150 + '{"type": "integer"}' + '}' * 150
e.add_request("a", {"json_schema": deep, "max_new_tokens": 2})
e.step()
time.sleep(float(sys.argv[2]))
"""


def test_a_process_that_exits_while_a_grammar_compiles_exits_cleanly(tiny_model: str) -> None:
    """The compile threads are joined at exit: a daemon thread coming back from xgrammar's C++
    while the interpreter finalized aborted the process (exit 134, "terminate called without
    an active exception")."""
    for delay in ("0.0", "0.1"):
        out = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING, tiny_model, delay], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]


def test_shutdown_stops_the_compile_threads_and_flush_forgets_the_grammars(tiny_model: str) -> None:
    from minisgl import Engine
    from minisgl.visualizer.render import render_waiting

    e = Engine(tiny_model, device="cpu", max_total_tokens=1024)
    e.generate("a", {**SAMPLED, "regex": "(yes|no)"})
    backend = e.scheduler.get_grammar_backend()
    assert len(backend._cache) == 1 and all(t.is_alive() for t in backend._threads)
    assert e.flush_cache() and len(backend._cache) == 0  # (SGLang's flush resets the grammar backend too)
    gate = _gate_compiles(e)
    rid = e.add_request("a", {**SAMPLED, "regex": "x+"})
    snap = e.step()
    html = render_waiting(snap)  # the notebook widget's panel shows it, as the page does
    assert f'data-rid="{rid}" data-grammar="regex"' in html and "0 + 1 compiling" in html
    gate.set()
    e.shutdown()
    for thread in backend._threads:
        thread.join(10)  # (shutdown does not wait; each thread ends at its next job)
    assert not any(t.is_alive() for t in backend._threads) and not backend._cache


def test_requests_sharing_a_compile_and_a_timed_out_one_leave_the_right_jobs(tiny_model: str, monkeypatch: Any) -> None:
    """Two requests wait for one compile: aborting one must not cancel it for the other. A request
    that timed out before its compile started leaves that job skipped."""
    from minisgl import Engine
    from minisgl.managers import scheduler as scheduler_module

    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as e:
        backend = e.scheduler.get_grammar_backend()
        gates, compile_, compiled = [threading.Event(), threading.Event()], backend._compile, []

        def gated(kind: str, text: str) -> Any:
            gates[int(text[-1]) if text[-1].isdigit() else 0].wait(30)
            compiled.append(text)
            return compile_(kind, text)

        backend._compile = gated
        busy = [e.add_request("a", {**SAMPLED, "regex": "busy0"}) for _ in range(2)]  # one compile, both threads...
        busy.append(e.add_request("a", {**SAMPLED, "regex": "other0"}))  # ...held
        first, second = (e.add_request("b", {**SAMPLED, "regex": "shared"}) for _ in range(2))
        e.abort(first)
        e.abort(busy[0])
        gates[0].set()
        while e.has_unfinished_requests():
            e.step()
        assert e.get_result(second)["text"] == "shared" and e.get_result(busy[1])["text"] == "busy0"
        assert e.get_result(first)["meta_info"]["finish_reason"]["type"] == "abort"

        monkeypatch.setattr(scheduler_module, "GRAMMAR_TIMEOUT", 0.05)
        held = [e.add_request("c", {**SAMPLED, "regex": f"held{i}1"}) for i in range(2)]  # both threads held again
        late = e.add_request("c", {**SAMPLED, "regex": "late"})
        time.sleep(0.1)
        e.step()
        assert "(it was still waiting for a compile thread" in e.get_result(late)["meta_info"]["finish_reason"]["message"]
        gates[1].set()
        for r in held:
            e.abort(r)
        while e.has_unfinished_requests():
            e.step()
        time.sleep(0.2)
        assert "late" not in compiled  # (its job was released: nobody waits for it)


def test_a_repeated_bad_grammar_is_refused_without_keeping_the_requests(engine: Any) -> None:
    """The cached compile error is raised afresh for each request: re-raising the stored exception
    grew its traceback at every refusal, and every refused request stayed alive in it."""
    import gc
    import weakref

    from minisgl.managers.schedule_batch import Req

    bad = {**SAMPLED, "json_schema": '{"type": "object", "properties": {"a": {"type": "nosuchtype"}}}'}
    refs = []
    for _ in range(3):
        rid = engine.add_request("a", bad)
        queued = engine.scheduler.grammar_queue + engine.scheduler.waiting_queue
        refs += [weakref.ref(r) for r in queued if r.rid == rid]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.get_result(rid)["meta_info"]["finish_reason"]["message"].startswith("Invalid json_schema:")
    gc.collect()
    assert len(refs) == 3 and all(isinstance(r(), (Req, type(None))) for r in refs)
    assert [r() for r in refs[:2]] == [None, None]


def test_an_engine_dropped_without_shutdown_lets_its_compile_threads_end(tiny_model: str) -> None:
    """A notebook cell `e = Engine(...)` run again drops the old Engine without shutdown(): its
    grammar backend's threads held the backend (and its compiler and cache) for good, two more
    threads at every run."""
    import gc
    import weakref

    from minisgl import Engine

    e = Engine(tiny_model, device="cpu", max_total_tokens=1024)
    e.generate("a", {**SAMPLED, "regex": "(yes|no)"})
    backend = e.scheduler.get_grammar_backend()
    threads, gone = backend._threads, weakref.ref(backend)
    del e, backend
    gc.collect()
    assert gone() is None
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)


# --------------------------------------------------------------------------- thinking first
def test_a_reasoner_grammar_lets_the_thinking_through_then_holds(tiny_model: str) -> None:
    """SGLang's ReasonerGrammarObject: every token allowed until the output ends with the think-end
    tokens, none fed to the grammar; then the grammar holds from its start."""
    from transformers import AutoTokenizer

    from minisgl.constrained.reasoner_grammar import ReasonerGrammar
    from minisgl.constrained.xgrammar_backend import XGrammarGrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    backend = XGrammarGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        future = backend.get_future(("regex", "(yes|no)"))
        future.result(60)
        # a character per token: another spelling than encode's (as " </think>" is with the built-in
        # tokenizer, whose " <" is one token)
        spelled = tokenizer.encode("I think ", add_special_tokens=False) + tokenizer.convert_tokens_to_ids(list("</think>"))
        assert spelled[-6:] != tokenizer.encode("</think>", add_special_tokens=False)
        grammar = ReasonerGrammar(backend.get_grammar(future), "</think>", tokenizer.decode)
        for token in spelled:
            grammar.accept_token(token)
        assert not grammar.thinking  # (the ids differ; the text is the same)
        grammar = ReasonerGrammar(backend.get_grammar(future), "</think>", tokenizer.decode)
        for token in tokenizer.encode("I think: maybe </think", add_special_tokens=False):
            mask = allocate_vocab_mask(len(tokenizer), 1)
            grammar.fill_vocab_mask(mask, 0)
            assert bool((mask == -1).all())  # thinking: everything allowed
            grammar.accept_token(token)  # (never fed to the regex, which allows none of these)
        grammar.accept_token(tokenizer.encode(">", add_special_tokens=False)[0])
        mask = allocate_vocab_mask(len(tokenizer), 1)
        grammar.fill_vocab_mask(mask, 0)
        logits = torch.zeros(1, len(tokenizer))
        apply_vocab_mask_reference(logits, mask)
        allowed = {tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
        assert allowed and all(text and ("yes".startswith(text) or "no".startswith(text)) for text in allowed), allowed
        for token in tokenizer.encode("no", add_special_tokens=False) + [tokenizer.eos_token_id]:
            grammar.accept_token(token)
        assert grammar.is_terminated()
    finally:
        backend.shutdown()


def test_a_request_that_thinks_first_gets_its_grammar_only_after_the_thinking(engine: Any) -> None:
    """require_reasoning (a chat with --reasoning-parser): the random model never writes the
    think-end tokens, so the grammar never starts and the output is free; without it, yes or no."""
    from minisgl.managers.io_struct import GenerateReqInput

    params = {"temperature": 1.0, "max_new_tokens": 16, "regex": "(yes|no)", "seed": 3}
    obj = GenerateReqInput(text="Answer:", sampling_params=dict(params), rid="thinks", require_reasoning=True)
    obj.normalize_batch_and_arguments()
    engine._enqueue([engine._tokenize(obj)])
    engine.run_until_idle()
    thought = engine.get_result("thinks")
    assert thought["meta_info"]["finish_reason"]["type"] == "length" and thought["text"] not in ("yes", "no")
    assert engine.generate("Answer:", params)["text"] in ("yes", "no")
