"""Speculative decoding (--speculative-algorithm NGRAM): the drafts, the verify pass, and that the
output is what decoding one token at a time gives.

The n-gram index is checked against a brute-force search; the engine tests run the same requests
with and without speculation and compare outputs, finish reasons, logprobs and hidden states,
with the scheduler's memory checked after every step. Each also asserts that drafts were accepted,
so a verify path that silently stopped speculating would fail them.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl import Engine
from minisgl.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin, _reached
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.server_args import ServerArgs
from minisgl.speculative.ngram_worker import NGRAMWorker, NgramIndex

from engine_helpers import GREEDY, run_all

SPEC = {"speculative_algorithm": "NGRAM"}
# prompts that repeat themselves (a tiny random model's greedy output loops as well)
PROMPTS = [
    [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12],
    [21, 22, 23, 21, 22, 23, 21],
    list(range(30, 80)),
    [40] * 16,
]


# --------------------------------------------------------------------------- the n-gram index
def brute_force_draft(tokens: List[int], max_len: int, min_n: int, max_n: int) -> List[int]:
    """What NgramIndex.propose must give, searched directly: the longest suffix (max_n down to
    min_n) that occurred earlier, its latest occurrence, the tokens after it, repeated with the
    match's period when they run into the end."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        ends = [e for e in range(n - 1, length - 1) if tokens[e + 1 - n : e + 1] == suffix]
        if ends:
            start = ends[-1] + 1
            draft = tokens[start : start + max_len]
            while len(draft) < max_len:
                draft.append(draft[len(draft) - (length - start)])
            return draft
    return []


def draft(tokens: List[int], max_len: int, min_n: int = 1, max_n: int = 12) -> List[int]:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index.propose(max_len)


def test_the_longest_suffix_match_wins_then_the_latest_occurrence() -> None:
    # [1, 2, 3] occurred once (followed by 9); [2, 3] later too (followed by 7): the longer match wins
    assert draft([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], 3, max_n=4) == [9, 5, 2]
    # [1] occurred twice: the latest occurrence's continuation
    assert draft([1, 5, 1, 6, 1], 2) == [6, 1]
    # nothing repeats: no draft; a match shorter than the minimum window does not count
    assert draft([1, 2, 3, 4], 3) == []
    assert draft([1, 5, 1, 6, 1], 2, min_n=2) == []


def test_a_loop_is_drafted_with_its_period() -> None:
    """The latest occurrence of a loop's suffix is one period back, so the tokens after it run
    into the end of the sequence: the draft repeats the period instead of stopping there."""
    assert draft([4, 5, 4, 5, 4], 5) == [5, 4, 5, 4, 5]
    assert draft([7, 7, 7], 4) == [7, 7, 7, 7]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_the_incremental_index_drafts_what_a_brute_force_search_finds(tokens: List[int], min_n: int, extra: int, max_len: int) -> None:
    """The index grows with the sequence (as a request's output does), and at every length it
    drafts what searching the whole sequence again would (these short sequences stay within the
    index's bound of 64 latest occurrences a token)."""
    index = NgramIndex(min_n, min_n + extra)
    for end in range(1, len(tokens) + 1):
        index.extend(tokens[end - 1 : end])
        assert index.propose(max_len) == brute_force_draft(tokens[:end], max_len, min_n, min_n + extra)


def test_the_index_holds_one_position_per_token() -> None:
    """The index is built at a request's first draft, inside a scheduler step, and lives as long as
    the request: one entry per token, not one per n-gram length (a table of every n-gram up to 12
    took 0.3-0.8 s and 7 MB for a 4,000-token prompt)."""
    rng = random.Random(0)
    tokens = [rng.randrange(4096) for _ in range(8000)]
    index = NgramIndex(1, 12)
    index.extend(tokens)
    assert sum(map(len, index.positions.values())) == len(tokens) - 1 and index.tokens == tokens


def test_accepted_counts_the_drafts_the_samples_confirm() -> None:
    assert NGRAMWorker.accepted([5, 6, 7], [5, 6, 7, 8]) == 3  # all taken, and the bonus token after them
    assert NGRAMWorker.accepted([5, 6, 7], [5, 9, 7, 8]) == 1  # row 1 sampled 9: drafts 6 and 7 go
    assert NGRAMWorker.accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert NGRAMWorker.accepted([], [4]) == 0


class StandInReq:
    """The fields NGRAMWorker.propose reads."""

    def __init__(self, output_ids: List[int], **params: Any) -> None:
        self.origin_input_ids = [1, 2, 1, 2, 1, 2]
        self.output_ids = output_ids
        self.sampling_params = SamplingParams(**params)
        self.grammar = None
        self.custom_logit_processor = None
        self.to_finish = None
        self.ngram_index = None
        self.spec_hit_rate = NGRAMWorker.HIT_RATE_START


def test_drafts_stop_short_of_max_new_tokens_and_skip_what_a_row_cannot_sample() -> None:
    worker = NGRAMWorker(num_draft_tokens=6, min_window=1, max_window=4, max_total_drafts=100)
    # 5 guesses at most; with max_new_tokens 4 and one token out, two more guesses and the bonus token
    assert worker.propose([StandInReq([1], max_new_tokens=100)]) == [[2, 1, 2, 1, 2]]
    assert worker.propose([StandInReq([1], max_new_tokens=4)]) == [[2, 1]]
    assert worker.propose([StandInReq([1], max_new_tokens=2)]) == [[]]
    # penalties count the output so far, min_new_tokens masks stops until enough tokens: no drafts
    for params in ({"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2}, {"min_new_tokens": 3}):
        assert worker.propose([StandInReq([1], max_new_tokens=100, **params)]) == [[]], params
    assert worker.propose([StandInReq([1, 2, 1], max_new_tokens=100, min_new_tokens=3)]) != [[]]  # (reached)
    grammar = StandInReq([1], max_new_tokens=100)
    grammar.grammar = object()
    assert worker.propose([grammar]) == [[]]


def test_all_drafts_of_a_pass_stay_within_the_cap() -> None:
    worker = NGRAMWorker(num_draft_tokens=6, min_window=1, max_window=4, max_total_drafts=7)
    assert [len(d) for d in worker.propose([StandInReq([1], max_new_tokens=100) for _ in range(3)])] == [5, 2, 0]


def test_a_request_whose_drafts_keep_failing_stops_drafting_and_probes_now_and_then() -> None:
    """Text that does not repeat: each draft costs a verify row and is rejected. Two failed passes
    stop a fresh request's drafts; it drafts again once every PROBE_INTERVAL passes, and a probe
    that is accepted brings it back."""
    worker = NGRAMWorker(num_draft_tokens=4, min_window=1, max_window=4, max_total_drafts=100)
    req = StandInReq([1], max_new_tokens=10_000)
    for _ in range(2):
        assert worker.propose([req]) != [[]]
        worker.record(req, 3, 0)
    # every request probes on the same passes (the worker's 16th, 32nd, ...): one probe, one verify pass
    drafted = [worker.num_passes for _ in range(3 * NGRAMWorker.PROBE_INTERVAL) if worker.propose([req]) != [[]]]
    assert drafted and all(n % NGRAMWorker.PROBE_INTERVAL == 0 for n in drafted) and len(drafted) == 3
    worker.record(req, 3, 3)  # the probe's drafts were all accepted: the text repeats now
    assert all(worker.propose([req]) != [[]] for _ in range(4))


def test_stream_points_are_not_skipped_when_a_step_adds_several_tokens() -> None:
    # one token a step: the old rule (the 1st, 5th, 9th ... token with an interval of 4)
    assert [n for n in range(1, 14) if _reached(n - 1, n, 4, 1)] == [1, 5, 9, 13]
    # a verify pass that goes from 3 to 6 tokens passed the 5th: due
    assert _reached(3, 6, 4, 1) and not _reached(5, 8, 4, 1) and _reached(48, 52, 50, 0)


class Emitter(SchedulerOutputProcessorMixin):
    def __init__(self) -> None:
        self.server_args = SimpleNamespace(stream_interval=4)


def test_should_stream_sends_when_a_pass_steps_over_a_send_point() -> None:
    """A streaming request at interval 4 sends at its 1st, 5th, 9th ... token; a pass that takes it
    from 3 to 6 tokens stepped over the 5th, so that check sends (at 6), and the next pass to 8 does
    not; the 9th is passed on the way to 10."""
    emitter, req = Emitter(), SimpleNamespace(finished=lambda: False, stream=True, output_ids=[], stream_checked_len=0,
                                              sampling_params=SimpleNamespace(stream_interval=None),
                                              check_match_stop_str_prefix=lambda: False)  # fmt: skip
    sent = []
    for n in (1, 3, 6, 8, 10):
        req.output_ids = [7] * n
        sent.append(emitter._should_stream(req))
    assert sent == [True, False, True, False, True]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"speculative_algorithm": "EAGLE"}, "must be one of NGRAM"),
        ({**SPEC, "speculative_num_draft_tokens": 1}, r"must be in \[2, 64\]"),
        ({**SPEC, "speculative_num_draft_tokens": 65}, r"must be in \[2, 64\]"),
        ({"speculative_num_draft_tokens": 8}, "set without --speculative-algorithm"),
        ({"speculative_ngram_max_match_window_size": 4}, "set without --speculative-algorithm"),
        ({**SPEC, "speculative_ngram_min_match_window_size": 3, "speculative_ngram_max_match_window_size": 2}, "1 <= min <= max"),
        ({**SPEC, "enable_mixed_chunk": True}, "does not combine with --speculative-algorithm"),
        ({**SPEC, "is_embedding": True}, "embedding server"),
    ],
)
def test_settings_that_cannot_speculate_are_refused(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


# --------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def engines(tiny_model: str, one_thread: None) -> Iterator[Dict[Tuple[str, int], Engine]]:
    made = {
        (kind, page): Engine(tiny_model, page_size=page, **(SPEC if kind == "spec" else {}))
        for kind in ("plain", "spec")
        for page in (1, 4)
    }
    yield made
    for engine in made.values():
        engine.shutdown()


def run(engine: Engine, prompts: List[List[int]], params: Dict[str, Any], **kwargs: Any) -> List[Dict[str, Any]]:
    """Each prompt to the end, the memory checked after every step and when idle."""
    rids = [engine.add_request(input_ids=p, sampling_params=dict(params), **kwargs) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step(snapshot=False)
        engine.scheduler.check_integrity()
    engine.scheduler.check_memory_when_idle()
    return [engine.get_result(r) for r in rids]


def accepted_drafts(engine: Engine, before: Tuple[int, int]) -> int:
    """Drafts accepted since `before` (verify rows, tokens they gave)."""
    s = engine.scheduler
    return (s.spec_num_verify_tokens - before[1]) - (s.spec_num_verify_rows - before[0])


def counters(engine: Engine) -> Tuple[int, int]:
    return engine.scheduler.spec_num_verify_rows, engine.scheduler.spec_num_verify_tokens


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize(
    "params",
    [
        {**GREEDY, "max_new_tokens": 40},
        # seeded: the same draws (a low temperature: the tiny random model's distribution is nearly flat,
        # so a draft is rarely a sample's pick above it)
        {"temperature": 0.2, "seed": 7, "ignore_eos": True, "max_new_tokens": 40},
        {"temperature": 0.2, "top_p": 0.8, "top_k": 20, "seed": 3, "ignore_eos": True, "max_new_tokens": 40},
    ],
    ids=["greedy", "seeded", "top-p-top-k"],
)
def test_outputs_equal_decoding_one_token_at_a_time(engines: Dict[Tuple[str, int], Engine], page: int, params: Dict[str, Any]) -> None:
    plain, spec = engines["plain", page], engines["spec", page]
    steps_before, before = spec.scheduler.forward_ct_decode, counters(spec)
    expected = [r["output_ids"] for r in run(plain, PROMPTS, params)]
    got = run(spec, PROMPTS, params)
    assert [r["output_ids"] for r in got] == expected
    assert accepted_drafts(spec, before) > (20 if params.get("temperature") == 0 else 5), "few drafts were accepted: nothing was speculated"
    if params.get("temperature") == 0:  # fewer passes than tokens: the point of it (the greedy loops repeat most)
        assert spec.scheduler.forward_ct_decode - steps_before < 40 - 1
    meta = got[0]["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.0


def test_a_stop_inside_the_accepted_drafts_ends_the_output_where_decoding_would(engines: Dict[Tuple[str, int], Engine]) -> None:
    plain, spec = engines["plain", 1], engines["spec", 1]
    full = run(plain, PROMPTS[:1], {**GREEDY, "max_new_tokens": 40})[0]["output_ids"]
    # a stop token from the middle of the output, a stop string, and a short max_new_tokens
    for params in (
        {**GREEDY, "max_new_tokens": 40, "stop_token_ids": [full[9]]},
        {**GREEDY, "max_new_tokens": 40, "stop": [plain.tokenizer.decode(full[12:14])]},
        {**GREEDY, "max_new_tokens": 3},
    ):
        before = counters(spec)
        expected = run(plain, PROMPTS[:1], params)[0]
        got = run(spec, PROMPTS[:1], params)[0]
        assert (got["output_ids"], got["text"], got["meta_info"]["finish_reason"]) == (
            expected["output_ids"], expected["text"], expected["meta_info"]["finish_reason"],
        ), params  # fmt: skip
        assert params["max_new_tokens"] == 3 or accepted_drafts(spec, before) > 0, params


def test_logprobs_and_hidden_states_are_those_of_each_token(tiny_model: str, one_thread: None) -> None:
    """Every token a verify pass gives has the logprobs and the hidden-state entry its decode step
    would have had (rows of one pass, read per token)."""
    params = {**GREEDY, "max_new_tokens": 24}
    kwargs = {"return_logprob": True, "top_logprobs_num": 3, "return_hidden_states": True}
    results = []
    for extra in ({}, SPEC):
        engine = Engine(tiny_model, enable_return_hidden_states=True, **extra)
        try:
            before = counters(engine) if extra else (0, 0)
            results.append(run(engine, PROMPTS[:2], params, **kwargs))
            if extra:
                assert accepted_drafts(engine, before) > 5
        finally:
            engine.shutdown()
    for expected, got in zip(*results):
        assert got["output_ids"] == expected["output_ids"]
        ours, theirs = got["meta_info"], expected["meta_info"]
        assert [t for _, t, _ in ours["output_token_logprobs"]] == got["output_ids"]
        assert [lp for lp, _, _ in ours["output_token_logprobs"]] == pytest.approx([lp for lp, _, _ in theirs["output_token_logprobs"]], abs=1e-4)
        assert [[t for _, t, _ in top] for top in ours["output_top_logprobs"]] == [[t for _, t, _ in top] for top in theirs["output_top_logprobs"]]
        hidden, expected_hidden = ours["hidden_states"], theirs["hidden_states"]
        assert len(hidden) == len(expected_hidden) == len(got["output_ids"])
        for row, expected_row in zip(hidden[1:], expected_hidden[1:]):
            assert row == pytest.approx(expected_row, abs=1e-4)


def test_requests_that_cannot_speculate_ride_along_one_token_a_pass(engines: Dict[Tuple[str, int], Engine]) -> None:
    """A penalised request in a batch that verifies drafts: it gets one token per pass (its
    accept length stays 1), and its output is the one-token-at-a-time output."""
    plain, spec = engines["plain", 1], engines["spec", 1]
    penalised = {**GREEDY, "max_new_tokens": 30, "frequency_penalty": 0.8}
    expected = [run(plain, [p], penalised)[0]["output_ids"] for p in PROMPTS[:2]]
    rids = [spec.add_request(input_ids=PROMPTS[0], sampling_params=penalised),
            spec.add_request(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 30})]  # fmt: skip
    while spec.has_unfinished_requests():
        spec.step(snapshot=False)
        spec.scheduler.check_integrity()
    first, second = (spec.get_result(r) for r in rids)
    assert first["output_ids"] == expected[0]
    # SGLang's meta_info: a pass per token after the prefill's for the penalised one, fewer for the other
    assert first["meta_info"]["spec_verify_ct"] == len(first["output_ids"]) - 1
    assert second["meta_info"]["spec_verify_ct"] < len(second["output_ids"]) - 1
    assert second["meta_info"]["spec_accept_length"] == len(second["output_ids"]) / second["meta_info"]["spec_verify_ct"]


def test_a_full_kv_pool_retracts_and_skips_drafts_without_leaking(tiny_model: str, one_thread: None) -> None:
    """With a pool too small for every request, decode steps retract and drafts often find no
    room: the outputs stay the same, and no slot is lost."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(12)] for _ in range(64)]
    max_new = [rng.randrange(4, 36) for _ in prompts]  # (requests finish apart, others are admitted meanwhile)
    outputs = []
    for extra in ({}, SPEC):
        # (test_scheduler_retract's setting: admission overcommits, running requests outgrow the pool)
        engine = Engine(tiny_model, max_total_tokens=200, chunked_prefill_size=-1, schedule_conservativeness=0.1, **extra)
        try:
            before = counters(engine)
            outputs.append(run_all(engine, prompts, max_new, check_every_step=True)[0])
            engine.scheduler.check_memory_when_idle()
            assert engine.scheduler.num_retracted_reqs_total > 0
            assert not extra or accepted_drafts(engine, before) > 0
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


def test_no_speculation_keeps_meta_info_as_it_was(engines: Dict[Tuple[str, int], Engine]) -> None:
    meta = run(engines["plain", 1], PROMPTS[:1], {**GREEDY, "max_new_tokens": 4})[0]["meta_info"]
    assert "spec_verify_ct" not in meta and "spec_accept_length" not in meta


def test_a_request_that_ends_with_its_prefill_has_no_accept_length(engines: Dict[Tuple[str, int], Engine]) -> None:
    """No decoding pass ran: no ratio (null, as the snapshot's), not a made-up 1.0."""
    meta = run(engines["spec", 1], PROMPTS[:1], {**GREEDY, "max_new_tokens": 1})[0]["meta_info"]
    assert meta["spec_verify_ct"] == 0 and meta["spec_accept_length"] is None
