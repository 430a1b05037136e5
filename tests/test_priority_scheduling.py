"""--enable-priority-scheduling (SGLang's): the waiting queue ordered by priority, and preemption."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest

from minisgl.managers.tokenization import check_priority

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.fixture
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    # one request runs at a time, so the order is visible
    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, enable_priority_scheduling=True) as e:
        yield e


def _finish_order(engine: Any, rids: List[str]) -> List[str]:
    order: List[str] = []
    while engine.has_unfinished_requests():
        snap = engine.step()
        order += [e["rid"] for e in snap["events"] if e["type"] == "finish" and e["rid"] in rids]
    return order


def test_the_most_important_waiting_request_runs_first_then_arrival_order(engine: Any) -> None:
    for rid, priority in [("a", 0), ("b", 5), ("c", 1), ("d", 5)]:
        engine.add_request(f"prompt {rid}", GREEDY, rid=rid, priority=priority)
    engine.add_request("prompt e", GREEDY, rid="e")  # (none given: the least important, SGLang's default)
    assert _finish_order(engine, list("abcde")) == ["b", "d", "c", "a", "e"]


def test_low_priority_values_first_reverses_the_order(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, enable_priority_scheduling=True,
                schedule_low_priority_values_first=True) as e:  # fmt: skip
        for rid, priority in [("a", 3), ("b", 1), ("c", 2)]:
            e.add_request(f"prompt {rid}", GREEDY, rid=rid, priority=priority)
        assert _finish_order(e, list("abc")) == ["b", "c", "a"]


def test_a_much_more_important_request_preempts_a_running_one_which_resumes_unchanged(engine: Any) -> None:
    alone = engine.generate("prompt a", {**GREEDY, "max_new_tokens": 12})["output_ids"]
    engine.add_request("prompt a", {**GREEDY, "max_new_tokens": 12}, rid="a", priority=0)
    engine.step()
    engine.step()  # a is decoding, and holds the only request slot
    engine.add_request("prompt c", GREEDY, rid="c", priority=10)  # (not more important by more than 10: waits)
    snap = engine.step()
    assert [r["rid"] for r in snap["batch"]["reqs"]] == ["a"]
    engine.add_request("prompt b", GREEDY, rid="b", priority=11)
    snap = engine.step()
    retracts = [e for e in snap["events"] if e["type"] == "retract"]
    assert [(e["rid"], e["detail"]) for e in retracts] == [("a", "preempted by b (priority 11 over 0)")]
    assert [r["rid"] for r in snap["batch"]["reqs"]] == ["b"]
    order = _finish_order(engine, list("abc"))
    assert order == ["b", "c", "a"]  # (then by priority again: c's 10 before a's 0)
    assert engine.get_result("a")["output_ids"] == alone  # re-prefilled with its output, it goes on as before
    engine.scheduler.check_memory_when_idle()


def test_a_request_does_not_preempt_when_that_would_not_make_room(tiny_model: str) -> None:
    """Preemption frees what the running request holds and reserves; a waiting one too big even then
    preempts nobody (the preempted would only be prefilled again for nothing)."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=256, enable_priority_scheduling=True) as e:
        e.add_request(input_ids=list(range(10, 40)), sampling_params={**GREEDY, "max_new_tokens": 40}, rid="a", priority=0)
        e.add_request(input_ids=list(range(50, 150)), sampling_params={**GREEDY, "max_new_tokens": 60}, rid="c", priority=45)
        e.step()
        # a (0) could be preempted for it, c (45) not: freeing a's share is not enough for big
        e.add_request(input_ids=list(range(10, 210)), sampling_params={**GREEDY, "max_new_tokens": 40}, rid="big", priority=50)
        snap = e.step()
        assert not [ev for ev in snap["events"] if ev["type"] == "retract"]
        assert sorted(r["rid"] for r in snap["batch"]["reqs"]) == ["a", "c"]
        e.run_until_idle()
        assert e.get_result("big")["meta_info"]["completion_tokens"] == 40  # (after them, when they finished)
        e.scheduler.check_memory_when_idle()


def test_priority_is_refused_where_priority_scheduling_is_off(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024) as e:
        with pytest.raises(ValueError, match="priority needs priority scheduling, which this server does not run"):
            e.generate("a", GREEDY, priority=1)
        assert not e.has_unfinished_requests()
    check_priority(None, False)
    with pytest.raises(ValueError, match=r"priority must be an integer, got True \(bool\)"):
        check_priority(True, True)


def test_the_openai_routes_and_generate_pass_priority_down(tiny_model: str, tmp_path: Any) -> None:
    from test_openai_protocol import _out, _scripted_client

    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, {"type": "length", "length": 1})])
    body: Dict[str, Any] = {"model": client.model, "priority": 7}
    with client:
        assert client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        assert client.post("/v1/completions", json={**body, "prompt": "hi"}).status_code == 200
        assert client.post("/generate", json={"text": "hi", "priority": 7}).status_code == 200
    assert [obj.priority for obj in seen] == [7, 7, 7]


def test_a_more_important_request_short_of_kv_memory_preempts_for_it(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=256, enable_priority_scheduling=True) as e:
        e.add_request(input_ids=list(range(10, 130)), sampling_params={**GREEDY, "max_new_tokens": 100}, rid="a", priority=0)
        e.step()
        e.add_request(input_ids=list(range(20, 140)), sampling_params={**GREEDY, "max_new_tokens": 100}, rid="b", priority=50)
        snap = e.step()
        assert [(ev["rid"], ev["detail"]) for ev in snap["events"] if ev["type"] == "retract"] == [("a", "preempted by b (priority 50 over 0)")]
        assert [r["rid"] for r in snap["batch"]["reqs"]] == ["b"]
        e.run_until_idle()
        assert e.get_result("a")["meta_info"]["completion_tokens"] == 100 and e.get_result("b")["meta_info"]["completion_tokens"] == 100
        e.scheduler.check_memory_when_idle()


def test_a_request_that_used_up_the_budget_as_it_was_admitted_is_not_admitted_twice(tiny_model: str) -> None:
    """add_one_req answers NO_TOKEN also after admitting a request whose pages used up the budget
    (17 prompt tokens take 32 at page size 16): preempting for it then admitted it a second time,
    two rows and two KV allocations for one request."""
    from test_scheduler_fuzz import check_memory_ownership

    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=256, page_size=16, chunked_prefill_size=-1, enable_priority_scheduling=True) as e:
        e.add_request(input_ids=list(range(20, 60)), sampling_params={**GREEDY, "max_new_tokens": 150}, rid="L", priority=0)
        e.step()
        e.step()
        e.add_request(input_ids=list(range(50, 67)), sampling_params={**GREEDY, "max_new_tokens": 73}, rid="H", priority=100)
        snap = e.step()
        assert [r["rid"] for r in snap["batch"]["reqs"]] == ["H"]
        check_memory_ownership(e.scheduler)
        e.run_until_idle()
        assert [e.get_result(r)["meta_info"]["completion_tokens"] for r in "HL"] == [73, 150]
        e.scheduler.check_memory_when_idle()


def test_preempting_for_a_request_keeps_the_prefix_it_matched_in_the_tree(tiny_model: str) -> None:
    """The victims' release evicts from the radix tree, and took the nodes the preempting request
    had just matched: it was admitted on freed KV slots (later "KV slots appear twice in the tree")."""
    from test_scheduler_fuzz import check_memory_ownership

    from minisgl import Engine

    prefix = list(range(100, 111))
    with Engine(tiny_model, device="cpu", max_total_tokens=128, chunked_prefill_size=-1, enable_priority_scheduling=True) as e:
        e.generate(input_ids=prefix, sampling_params={**GREEDY, "max_new_tokens": 1})  # (cached)
        for k in range(4):  # important ones that stay running
            e.add_request(input_ids=[400 + k] * 4, sampling_params={**GREEDY, "max_new_tokens": 13}, rid=f"K{k}", priority=100)
        e.add_request(input_ids=list(range(300, 319)), sampling_params={**GREEDY, "max_new_tokens": 35}, rid="L", priority=0)
        for _ in range(4):
            e.step()
        e.add_request(input_ids=prefix + [7, 8, 9, 10, 11], sampling_params={**GREEDY, "max_new_tokens": 27}, rid="H", priority=100)
        snap = e.step()
        assert ("retract", "L") in [(ev["type"], ev["rid"]) for ev in snap["events"]]
        check_memory_ownership(e.scheduler)
        e.run_until_idle()
        out = e.get_result("H")["output_ids"]
        e.scheduler.check_memory_when_idle()
    with Engine(tiny_model, device="cpu", max_total_tokens=1024, disable_radix_cache=True) as alone:
        assert out == alone.generate(input_ids=prefix + [7, 8, 9, 10, 11], sampling_params={**GREEDY, "max_new_tokens": 27})["output_ids"]


def test_preemption_takes_as_many_as_needed_in_one_pass(tiny_model: str) -> None:
    """A victim's release gives back its output budget and its KV past the tree prefix (a shared
    prompt stays): counted as its whole length, one victim per pass was preempted for nothing."""
    from minisgl import Engine

    shared = list(range(10, 50))
    with Engine(tiny_model, device="cpu", max_total_tokens=256, chunked_prefill_size=-1, enable_priority_scheduling=True) as e:
        for k in range(3):
            e.add_request(input_ids=shared + [60 + k], sampling_params={**GREEDY, "max_new_tokens": 40}, rid=f"L{k}", priority=0)
        e.step()
        e.step()
        e.add_request(input_ids=list(range(100, 160)), sampling_params={**GREEDY, "max_new_tokens": 40}, rid="H", priority=50)
        snap = e.step()
        assert "H" in [r["rid"] for r in snap["batch"]["reqs"]]  # admitted in the pass that preempted for it
        e.run_until_idle()
        e.scheduler.check_memory_when_idle()


def _finish(engine: Any, rid: str) -> Dict[str, Any]:
    return engine.get_result(rid)["meta_info"]["finish_reason"]


def test_a_full_queue_aborts_its_least_important_request_for_a_more_important_one(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, max_queued_requests=2,
                enable_priority_scheduling=True) as e:  # fmt: skip
        e.add_request("prompt run", GREEDY, rid="run", priority=0)
        e.step()  # run holds the only slot; the queue is empty
        e.add_request("prompt w1", GREEDY, rid="w1", priority=1)
        e.add_request("prompt w2", GREEDY, rid="w2", priority=1)  # the queue is full
        e.add_request("prompt hi", GREEDY, rid="hi", priority=5)  # w2 goes: as unimportant as w1, queued later
        e.add_request("prompt eq", GREEDY, rid="eq", priority=1)  # not strictly more important than w1: refused
        e.add_request("prompt lo", GREEDY, rid="lo")  # (none given: the least important) refused
        evicted = {"type": "abort", "message": "The request is aborted by a higher priority request.", "status_code": 503,
                   "err_type": "ServiceUnavailableError"}  # fmt: skip
        assert _finish(e, "w2") == evicted
        assert _finish(e, "eq")["message"] == _finish(e, "lo")["message"] == "The request queue is full."
        assert [r.rid for r in e.scheduler.waiting_queue] == ["w1", "hi"]
        assert e.scheduler.num_rejected_queue_full == 3
        e.run_until_idle()
        assert [_finish(e, rid)["type"] for rid in ("run", "hi", "w1")] == ["length"] * 3
        e.scheduler.check_memory_when_idle()


def test_a_full_queue_without_priority_scheduling_refuses_whatever_arrives(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, max_queued_requests=1) as e:
        e.add_request("prompt run", GREEDY, rid="run")
        e.step()
        e.add_request("prompt w1", GREEDY, rid="w1")
        e.add_request("prompt w2", GREEDY, rid="w2")
        assert _finish(e, "w2")["message"] == "The request queue is full."
        e.run_until_idle()
        assert _finish(e, "w1")["type"] == "length"


def _retracted(tiny_model: str, **flags: Any) -> List[str]:
    """A pool too small for both outputs: the request with more outputs (a, priority 0) started
    first; b (priority 5, not enough over a's to preempt it) came later. Who is retracted?"""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=120, chunked_prefill_size=-1, schedule_conservativeness=0.01,
                enable_priority_scheduling=True, **flags) as e:  # fmt: skip
        e.add_request(input_ids=list(range(200, 210)), sampling_params={**GREEDY, "max_new_tokens": 60}, rid="a", priority=0)
        e.step()
        e.step()
        e.add_request(input_ids=list(range(300, 310)), sampling_params={**GREEDY, "max_new_tokens": 60}, rid="b", priority=5)
        retracted: List[str] = []
        while e.has_unfinished_requests():
            retracted += [ev["rid"] for ev in e.step()["events"] if ev["type"] == "retract"]
        assert [_finish(e, rid)["type"] for rid in "ab"] == ["length"] * 2
        e.scheduler.check_memory_when_idle()
        return retracted


def test_the_retraction_policy_priority_retracts_the_least_important_first(tiny_model: str) -> None:
    assert _retracted(tiny_model)[0] == "b"  # (length: b has the fewer outputs)
    assert _retracted(tiny_model, retraction_policy="priority")[0] == "a"


def test_the_retraction_policy_priority_needs_priority_scheduling() -> None:
    from minisgl.server_args import ServerArgs

    with pytest.raises(ValueError, match="--retraction-policy priority requires --enable-priority-scheduling"):
        ServerArgs(model_path="m", retraction_policy="priority")
    with pytest.raises(ValueError, match="--retraction-policy must be one of length, priority"):
        ServerArgs(model_path="m", retraction_policy="lru")


def test_a_request_carrying_its_error_neither_evicts_nor_is_evicted_nor_fills_the_queue(tiny_model: str) -> None:
    """A grammar that does not compile is a 400 reported through the queue: it must not take a
    valid request's place (a 503 for nothing), nor lose its 400 to an eviction's 503."""
    import json

    from minisgl import Engine

    bad = {**GREEDY, "json_schema": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})}
    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, max_queued_requests=1,
                enable_priority_scheduling=True) as e:  # fmt: skip
        e.add_request("prompt run", GREEDY, rid="run", priority=0)
        e.step()
        e.add_request("prompt valid", GREEDY, rid="valid", priority=1)
        e.add_request("prompt bad", bad, rid="bad", priority=5)  # (more important than valid)
        e.add_request("prompt bad2", bad, rid="bad2", priority=0)  # (less important than valid)
        e.add_request("prompt hi", GREEDY, rid="hi", priority=9)  # evicts valid, not bad2
        e.run_until_idle()
        assert _finish(e, "bad")["status_code"] == _finish(e, "bad2")["status_code"] == 400
        assert _finish(e, "valid")["message"] == "The request is aborted by a higher priority request."
        assert [_finish(e, rid)["type"] for rid in ("run", "hi")] == ["length"] * 2
        assert e.scheduler.num_rejected_queue_full == 1


def test_events_name_a_priority_no_one_gave_as_none(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, max_queued_requests=1,
                enable_priority_scheduling=True) as e:  # fmt: skip
        e.add_request("prompt run", GREEDY, rid="run", priority=0)
        e.step()
        e.add_request("prompt plain", GREEDY, rid="plain")  # (named none: the least important)
        e.add_request("prompt hi", GREEDY, rid="hi", priority=3)
        snap = e.step()
        aborts = [(ev["rid"], ev["detail"]) for ev in snap["events"] if ev["type"] == "abort"]
        assert aborts == [("plain", "queue full: evicted by hi (priority 3 over none)")]
        e.run_until_idle()
