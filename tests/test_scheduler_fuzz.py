"""Scheduler fuzz: random configs and workloads, the memory checked after every step.

What it drives: `minisgl.Engine` in-process, one scheduler iteration at a time. Each seed
draws a config (page size, chunked prefill, mixed chunk, radix cache on or off, a KV pool
and request-row pool small enough to force eviction and retraction, policy,
max_running_requests, conservativeness, prefill caps; for some seeds priority scheduling, with
preemption, priority retraction and a full queue that evicts) and a workload (shared system
prefixes, prompts that are prefixes, copies or continuations of earlier ones, n > 1
copies under several rids, stop token ids / stop strings / min_new_tokens picked so they
fire, seeded sampling, logprobs (prompt logprobs from a random position too), streaming,
prompts at the length limit, staggered
arrivals in waves with idle gaps between them, aborts after a delay or once a request is
seen waiting, mid-chunk, just prefilled, decoding, retracted or riding a mixed batch, an
abort of everything at once, flush_cache while idle and refused while busy). About 40% of
the seeds are "pressure" runs: admission overcommits and running requests are retracted.

What it checks, and why:
- After every step and every abort, `check_memory_ownership`: every KV page is exactly
  one of free / in the radix tree / owned by one live request, and every request row is
  either free or held by one live request. It is computed from the allocator's free
  list, the request pool's free rows, the tree's nodes and the requests' rows, not from
  the sizes the scheduler keeps (a bug that corrupts those would fool a check built on
  them the same way it fools the scheduler), and it also checks the lock counts, the
  rows' page layout and that a running request's cached prefix reads the tree's slots.
  `Scheduler.check_integrity` runs too: the scheduler's own view must agree.
- Every request finishes within a step bound, and no step runs nothing while requests
  are unfinished: a wedged scheduler fails the test instead of hanging it (and a loop
  inside one step hits the test's timeout).
- Greedy outputs and finish reasons equal the same request run alone on an unchunked,
  cache-less reference engine (seeded sampling too); a request aborted while unfinished
  ends as an abort, its output a prefix of the solo one, and so does one a full queue refused
  or evicted (a 503). Prompt logprobs, gathered over
  chunks, pages and cache hits (a cached token's logits are gone: the prefix cap), equal
  the reference engine's, once, in SGLang's layout.
- When idle, `Scheduler.check_memory_when_idle`; at the end `flush_cache` frees every
  page and row and the engine still serves a new request (a stale `batch_is_full` kept
  across a flush once left every later request waiting forever).

The seeds are fixed, so a failure reproduces alone with `pytest tests/test_scheduler_fuzz.py
-k seed7`; to hunt for new failures, widen SEEDS locally (a seed takes well under a second).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from minisgl import Engine
from minisgl.managers.io_struct import AbortReq
from minisgl.managers.schedule_batch import Req
from minisgl.managers.scheduler import Scheduler
from minisgl.mem_cache.radix_cache import TreeNode
from minisgl.server_args import SCHEDULE_POLICIES

from engine_helpers import GREEDY

# seeds that once failed, kept: 336 (priority preemption in a mixed batch, whose victims' decode
# rows were still charged to the chunk budget: preempted for a request it then could not admit)
SEEDS = list(range(32)) + [336]
TOKEN_LO, TOKEN_HI = 10, 500  # ordinary tokens of the tiny model's 512-token vocabulary
HIDDEN = 64  # the tiny model's hidden size: a hidden-state row's length
ABORT_STATES = ("waiting", "chunked", "just_prefilled", "decoding", "retracted", "mixed")

FinishReason = Dict[str, Any]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


# --------------------------------------------------------------------------- the oracle
class SoloRuns:
    """Each request alone on an unchunked engine without a prefix cache and with room to
    spare: whatever the fuzzed engine batches, shares, chunks or retracts must not change
    a single token (greedy and seeded sampling are per-request deterministic)."""

    def __init__(self, model: str) -> None:
        self.engine = Engine(
            model, device="cpu", max_total_tokens=4096, chunked_prefill_size=-1, disable_radix_cache=True
        )
        self._cache: Dict[Tuple[Tuple[int, ...], str], Tuple[List[int], FinishReason]] = {}

    def __call__(self, prompt: List[int], params: Dict[str, Any]) -> Tuple[List[int], FinishReason]:
        key = (tuple(prompt), repr(sorted(params.items())))
        if key not in self._cache:
            out = self.engine.generate(input_ids=prompt, sampling_params=dict(params))
            self._cache[key] = (out["output_ids"], out["meta_info"]["finish_reason"])
        return self._cache[key]

    def prompt_logprobs(self, prompt: List[int], start: int) -> List[Any]:
        """The prompt's (logprob, id, text) entries from `start`, scored alone."""
        params = {"max_new_tokens": 0}
        return self.engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True,
                                    logprob_start_len=start)["meta_info"]["input_token_logprobs"]  # fmt: skip


@pytest.fixture(scope="module")
def solo(tiny_model: str) -> SoloRuns:
    return SoloRuns(tiny_model)


# --------------------------------------------------------------------------- config and workload
def draw_case(seed: int) -> Tuple[random.Random, bool, Dict[str, Any]]:
    """The seed's rng, whether it is a pressure run, and its Engine kwargs; the workload is
    drawn next from the same rng, once the engine tells its length limits."""
    rng = random.Random(seed)
    pressure = rng.random() < 0.4
    return rng, pressure, draw_config(rng, pressure)


def draw_config(rng: random.Random, pressure: bool) -> Dict[str, Any]:
    """Engine kwargs. Pools of 64..256 tokens with prompts up to the limit force eviction;
    max_running_requests also sizes the request-row pool. Under `pressure` admission
    overcommits on purpose (a tiny initial new_token_ratio), so that running requests
    outgrow the pool and must be retracted."""
    page_size = rng.choice([1, 1, 2, 4, 16])
    chunk = rng.choice([-1, 8, 16, 32, 64])
    chunk = max(chunk, page_size) if chunk > 0 else chunk  # a chunk holds at least one page
    config: Dict[str, Any] = dict(
        device="cpu",
        page_size=page_size,
        context_length=rng.choice([128, 256, 512]),
        max_total_tokens=max(rng.choice([64, 96, 128] if pressure else [64, 96, 128, 256]), 4 * page_size),
        chunked_prefill_size=chunk,
        enable_mixed_chunk=chunk > 0 and rng.random() < 0.5,
        disable_radix_cache=rng.random() < 0.25,
        max_running_requests=rng.choice([4, 8, 16] if pressure else [1, 2, 3, 4, 8]),
        schedule_policy=rng.choice(SCHEDULE_POLICIES),
        schedule_conservativeness=0.01 if pressure else rng.choice([0.05, 0.3, 1.0]),
    )
    if rng.random() < 0.2:
        config["max_prefill_tokens"] = rng.choice([16, 48, 100])
    if rng.random() < 0.15:
        config["prefill_max_requests"] = rng.choice([1, 2])
    return config


@dataclass
class Job:
    """One submitted prompt: `copies` rids share it (the engine's n > 1)."""

    prompt: List[int]
    params: Dict[str, Any]
    copies: int
    wave: int  # waves run one after another: wave k + 1 starts once the engine is idle after wave k
    arrive: int  # steps after the start of its wave at which it is submitted
    abort_after: Optional[int]  # abort this many steps after arrival ...
    abort_in: Optional[str]  # ... or the first time it is seen in this state (ABORT_STATES)
    return_logprob: bool
    stream: bool
    logprob_start_len: int = -1  # drawn apart (test body), so the workloads of the seeds stay as they were
    priority: Optional[int] = None  # drawn apart too (draw_priorities)
    return_hidden_states: bool = False  # drawn apart too (draw_hidden_states)


def _tokens(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def draw_prompt(rng: random.Random, jobs: List[Job], systems: List[List[int]], max_prompt: int, solo: SoloRuns,
                pressure: bool) -> List[int]:  # fmt: skip
    """Mostly shared-prefix prompts, so the radix tree fills, splits, shares and evicts
    (under pressure short ones: a long prompt leaves no room to admit a second request)."""
    shape = rng.random()
    if jobs and shape < 0.1:  # a strict prefix of an earlier prompt: matches inside a node
        prev = rng.choice(jobs).prompt
        prompt = prev[: rng.randrange(1, len(prev) + 1)]
    elif jobs and shape < 0.2:  # the same prompt again, or one token longer
        prompt = rng.choice(jobs).prompt + _tokens(rng, rng.randrange(0, 2))
    elif jobs and shape < 0.3:  # a continuation: prompt + part of its answer (a multi-turn chat)
        prev = rng.choice(jobs)
        answer, _ = solo(prev.prompt, prev.params)
        prompt = prev.prompt + answer[: rng.randrange(0, len(answer) + 1)] + _tokens(rng, 1)
    elif shape < 0.38 and not pressure:  # at the length limit
        prompt = _tokens(rng, max_prompt - rng.randrange(0, 8))
    else:
        head = rng.choice(systems)[: rng.randrange(0, 12 if pressure else 40)] if rng.random() < 0.6 else []
        prompt = head + _tokens(rng, rng.randrange(1, 12 if pressure else 16))
    return prompt[: max(1, max_prompt)]


def draw_params(rng: random.Random, prompt: List[int], room: int, engine: Engine, solo: SoloRuns,
                pressure: bool) -> Dict[str, Any]:  # fmt: skip
    """Greedy (sometimes seeded sampling) params; stop conditions taken from the solo answer so they fire."""
    if pressure:  # a quarter to half the pool each: several are admitted, together they outgrow it
        max_new = rng.randrange(room // 4, room // 2 + 1)
    else:  # never more than room: the engine would clamp it, the oracle (a larger pool) would not
        max_new = min(rng.choice([0, 1, 3, 8, 16, 32, 64]), room)
    params: Dict[str, Any] = {"temperature": 0, "max_new_tokens": max_new}
    if rng.random() < 0.5:
        params["ignore_eos"] = True
    if rng.random() < 0.15:
        params.update(temperature=rng.choice([0.7, 1.3]), seed=rng.randrange(1 << 20), top_k=rng.choice([-1, 20]))
    if max_new > 3 and rng.random() < 0.4:
        answer, _ = solo(prompt, params)
        if len(answer) > 2:
            token = answer[rng.randrange(len(answer))]
            text = engine.tokenizer.decode([token])
            if rng.random() < 0.5:
                params["stop_token_ids"] = [token]
            elif text.strip():
                params["stop"] = [text[: rng.randrange(1, len(text) + 1)]]
            if rng.random() < 0.5:  # holds a stop back until enough tokens were generated
                params["min_new_tokens"] = rng.randrange(0, max_new + 1)
    return params


def draw_workload(rng: random.Random, engine: Engine, solo: SoloRuns, pressure: bool) -> List[Job]:
    max_req_len = engine.scheduler.max_req_len
    max_prompt = engine.scheduler.max_req_input_len - 1  # the longest prompt the front gate accepts
    systems = [_tokens(rng, rng.randrange(8, 48)) for _ in range(rng.randrange(1, 3))]
    jobs: List[Job] = []
    for _ in range(rng.randrange(6, 11) if pressure else rng.randrange(3, 10)):
        prompt = draw_prompt(rng, jobs, systems, max_prompt, solo, pressure)
        params = draw_params(rng, prompt, max_req_len - len(prompt) - 1, engine, solo, pressure)
        # Under pressure staggered: requests that arrive together stop admission at the first
        # that does not fit (NO_TOKEN marks the batch full until one finishes); one at a time,
        # each is admitted against a budget that counts the running ones' outputs at ~1%.
        arrive = rng.randrange(0, 12) if pressure else rng.choice([0, 0, 0, rng.randrange(1, 20)])
        abort = rng.random()
        # rarer states more often where they can happen
        abort_states = ABORT_STATES + ("retracted",) * pressure + ("mixed",) * engine.scheduler.is_mixed_chunk
        jobs.append(Job(
            prompt=prompt, params=params, copies=rng.choice([1, 1, 1, 2, 3]),
            wave=rng.choice([0, 0, 0, 1] if pressure else [0, 0, 1, 2]), arrive=arrive,
            abort_after=rng.randrange(0, 30) if abort < 0.1 else None,
            abort_in=rng.choice(abort_states) if 0.1 <= abort < 0.45 else None,
            return_logprob=rng.random() < 0.15, stream=rng.random() < 0.2,
        ))  # fmt: skip
    return jobs


def draw_priorities(seed: int, jobs: List[Job]) -> Dict[str, Any]:
    """Priority scheduling for some seeds, from an rng of its own (the seeds' configs and
    workloads stay as they were): the Engine kwargs it adds, and each job's priority (some
    none: the least important). Close priorities and low thresholds, so that requests preempt
    running ones and a full queue (when drawn) evicts queued ones."""
    rng = random.Random(7_000_003 * (seed + 1))
    if rng.random() >= 0.4:
        return {}
    config: Dict[str, Any] = dict(
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=rng.random() < 0.5,
        priority_scheduling_preemption_threshold=rng.choice([0, 1, 3, 10]),
        retraction_policy=rng.choice(["length", "priority"]),
    )
    if rng.random() < 0.5:
        config["max_queued_requests"] = rng.choice([1, 2, 4])
    for job in jobs:
        job.priority = rng.choice([None, 0, 1, 2, 5, 12, 20])
    return config


def draw_eviction_policy(seed: int, priorities: Dict[str, Any]) -> Dict[str, Any]:
    """--radix-eviction-policy for some seeds, from an rng of its own: which cached prefix goes
    first changes what later requests find, never what they output (priority: with priority
    scheduling only)."""
    rng = random.Random(11_000_003 * (seed + 1))
    if rng.random() >= 0.4:
        return {}
    return {"radix_eviction_policy": rng.choice(["mru", "lfu", "fifo", "filo"] + ["priority"] * bool(priorities))}


def draw_hidden_states(seed: int, jobs: List[Job]) -> Dict[str, Any]:
    """return_hidden_states for some jobs of some seeds, from an rng of its own: the rows a request
    records go through chunks, mixed passes, radix hits, retraction, preemption and aborts, and a
    request gets one entry per returned token (the other draws stay as they were)."""
    rng = random.Random(13_000_019 * (seed + 1))
    if rng.random() >= 0.3:
        return {}
    for job in jobs:
        job.return_hidden_states = rng.random() < 0.5
    return {"enable_return_hidden_states": True}


def draw_speculative(seed: int, config: Dict[str, Any]) -> Dict[str, Any]:
    """--speculative-algorithm NGRAM for some seeds (not with mixed chunks, which it refuses), from
    an rng of its own: verify passes take K/V slots for drafts and give back the rejected ones,
    across pages, retraction, aborts and finishes mid-draft, and the outputs stay the solo runs'."""
    rng = random.Random(17_000_023 * (seed + 1))
    if rng.random() >= 0.35 or config["enable_mixed_chunk"]:
        return {}
    return {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": rng.choice([2, 4, 8]),
        "speculative_ngram_min_match_window_size": rng.choice([1, 2]),
        "speculative_ngram_max_match_window_size": rng.choice([2, 12]),
    }


def queue_refused(finish: FinishReason) -> bool:
    """A 503 of --max-queued-requests: refused on arrival, or evicted from the queue for a more important one."""
    return finish.get("status_code") == 503 and finish["message"] in (
        "The request queue is full.", "The request is aborted by a higher priority request."
    )  # fmt: skip


# --------------------------------------------------------------------------- the memory check
def reachable_reqs(scheduler: Scheduler) -> List[Req]:
    """Every Req the scheduler can still reach, once each."""
    reqs: Dict[int, Req] = {}
    batches = (scheduler.running_batch, scheduler.last_batch, scheduler.cur_batch)
    for req in [r for b in batches if b is not None for r in b.reqs] + list(scheduler.waiting_queue):
        reqs[id(req)] = req
    if scheduler.chunked_req is not None:
        reqs[id(scheduler.chunked_req)] = scheduler.chunked_req
    return list(reqs.values())


def tree_nodes(root: TreeNode, page_size: int) -> List[TreeNode]:
    """All non-root nodes, checking the shape on the way: linked both ways, keyed by first
    token (or first page), key and value of equal length in whole, aligned pages."""
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        for child_key, child in node.children.items():
            assert child.parent is node, f"node {child.id}'s parent link is wrong"
            first = child.key[0] if page_size == 1 else tuple(child.key[:page_size])
            assert child_key == first, f"node {child.id} is filed under {child_key}, its key starts {first}"
            n = len(child.key)
            assert 0 < n == len(child.value) and n % page_size == 0, f"node {child.id}: bad length"
            offsets = [int(s) % page_size for s in child.value.tolist()]
            assert offsets == [i % page_size for i in range(n)], f"node {child.id}: slots off their page offsets"
            nodes.append(child)
            stack.append(child)
    return nodes


def tree_path(root: TreeNode, tokens: List[int], page_size: int) -> Tuple[List[int], TreeNode]:
    """The tree's slots for `tokens`, which must end on a node boundary (a locked prefix does)."""
    node, slots, i = root, [], 0
    while i < len(tokens):
        child = node.children.get(tokens[i] if page_size == 1 else tuple(tokens[i : i + page_size]))
        assert child is not None and child.key == tokens[i : i + len(child.key)], f"prefix not in the tree at {i}"
        slots += child.value.tolist()
        node, i = child, i + len(child.key)
    return slots, node


def check_memory_ownership(scheduler: Scheduler) -> None:
    """Every KV page is exactly one of free / in the tree / owned by one live request, and
    every request row is free or held by one live request; locks count the holders."""
    P = scheduler.page_size
    allocator, rows_pool, tree = scheduler.token_to_kv_pool_allocator, scheduler.req_to_token_pool, scheduler.tree_cache
    num_pages = scheduler.max_total_num_tokens // P

    assert allocator.is_not_in_free_group, "a free group was left open after the step"
    free_list = allocator.free_pages.tolist() + allocator.release_pages.tolist()  # page ids (slot ids when P == 1)
    free = set(free_list)
    assert len(free) == len(free_list), "a page is in the free list twice (double free)"
    assert all(1 <= p <= num_pages for p in free), "the free list holds page 0 or a page past the pool"

    nodes = tree_nodes(tree.root_node, P)
    assert not (tree.disable and nodes), "the tree holds nodes while the radix cache is disabled"
    tree_slots = [s for n in nodes for s in n.value.tolist()]
    assert len(set(tree_slots)) == len(tree_slots), "a KV slot is in the tree twice"
    tree_pages = {s // P for s in tree_slots}
    assert tree_pages.isdisjoint(free), f"tree pages {sorted(tree_pages & free)[:8]} are free (use after free)"

    held_rows = set(range(rows_pool.size)) - set(rows_pool.free_slots)
    assert len(set(rows_pool.free_slots)) == len(rows_pool.free_slots), "a request row is free twice"
    owned: Dict[int, str] = {}  # page -> rid of the request that owns it outside the tree
    row_owner: Dict[int, str] = {}
    holders: List[Req] = []
    for req in reachable_reqs(scheduler):
        if req.req_pool_idx is None:
            continue
        rid, row_idx = req.rid, req.req_pool_idx
        assert not req.finished(), f"{rid} finished but still holds row {row_idx}"
        assert row_idx in held_rows, f"{rid} uses row {row_idx}, which is free"
        assert row_idx not in row_owner, f"row {row_idx} is held by {row_owner[row_idx]} and {rid}"
        row_owner[row_idx] = rid
        holders.append(req)
        committed, protected = req.kv_committed_len, req.cache_protected_len
        assert protected <= committed <= req.seqlen, f"{rid}: protected {protected} committed {committed}"
        row = rows_pool.req_to_token[row_idx, :committed].tolist()
        # position i sits at offset i % P of a page this row uses for its whole page of positions
        for i, slot in enumerate(row):
            assert slot % P == i % P and slot // P == row[i - i % P] // P, f"{rid}: position {i} at slot {slot}"
        if not tree.disable:
            # the cached prefix reads the tree's slots, and the lock sits exactly where it ends
            prefix_slots, end = tree_path(tree.root_node, (req.origin_input_ids + req.output_ids)[:protected], P)
            assert row[:protected] == prefix_slots, f"{rid}: row does not read the tree's slots for its prefix"
            assert end is req.last_node, f"{rid}: last_node is not where its cached prefix ends"
        for slot in row[protected:]:
            page = slot // P
            assert page != 0, f"{rid} uses the padding page"
            assert page not in free, f"{rid}'s slot {slot} is free (use after free)"
            assert page not in tree_pages, f"{rid}'s own slot {slot} is also in the tree"
            assert owned.setdefault(page, rid) == rid, f"page {page} is owned by {owned[page]} and {rid}"
    assert held_rows == set(row_owner), f"rows {sorted(held_rows - set(row_owner))} are held by no live request (leak)"
    for req in scheduler.waiting_queue:
        assert req.req_pool_idx is None, f"waiting {req.rid} holds a row"

    leaked = num_pages - len(free) - len(tree_pages) - len(owned)
    assert leaked == 0, f"pages: free {len(free)} + tree {len(tree_pages)} + owned {len(owned)} != {num_pages}"

    # lock_ref of a node == the live requests whose locked prefix passes through it
    expected_locks: Dict[int, int] = {}
    for req in holders if not tree.disable else []:
        node = req.last_node
        while node is not tree.root_node:
            expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
            node = node.parent
    for node in nodes:
        assert node.lock_ref == expected_locks.get(id(node), 0), f"node {node.id}: lock_ref {node.lock_ref}"
    protected_tokens = sum(len(n.key) for n in nodes if n.lock_ref > 0)
    assert (tree.evictable_size(), tree.protected_size()) == (len(tree_slots) - protected_tokens, protected_tokens)


def check_after_change(engine: Engine) -> None:
    check_memory_ownership(engine.scheduler)
    engine.scheduler.check_integrity()  # the scheduler's own books must balance too


def check_flushed(engine: Engine) -> None:
    scheduler = engine.scheduler
    check_after_change(engine)
    assert scheduler.token_to_kv_pool_allocator.available_size() == scheduler.max_total_num_tokens
    assert not scheduler.tree_cache.root_node.children
    assert scheduler.req_to_token_pool.available_size() == scheduler.req_to_token_pool.size


# --------------------------------------------------------------------------- the run
def in_state(scheduler: Scheduler, rid: str, state: str, rng: random.Random) -> bool:
    """Whether request `rid` is in `state` right now (between steps)."""
    last = scheduler.last_batch
    if state == "waiting":
        return any(r.rid == rid for r in scheduler.waiting_queue)
    if state == "chunked":
        return scheduler.chunked_req is not None and scheduler.chunked_req.rid == rid
    if state == "just_prefilled":  # prefilled, not yet merged into running_batch
        just_prefilled = last.reqs if last is not None and last.forward_mode.is_extend() else []
        return any(r.rid == rid and not r.finished() for r in just_prefilled)
    if state == "decoding":  # not at its first decode step every time
        return any(r.rid == rid for r in scheduler.running_batch.reqs) and rng.random() < 0.3
    if state == "retracted":
        reqs = scheduler.waiting_queue + scheduler.running_batch.reqs
        return any(r.rid == rid and r.retraction_count > 0 for r in reqs)
    assert state == "mixed"
    return last is not None and last.forward_mode.is_mixed() and any(r.rid == rid for r in last.reqs)


def step_bound(jobs: List[Job]) -> int:
    """Generous: every token of every copy as its own step, twice (retraction re-prefills)."""
    return 100 + 2 * sum(j.copies * (len(j.prompt) + j.params["max_new_tokens"] + 2) for j in jobs)


def run_workload(engine: Engine, jobs: List[Job], rng: random.Random,
                 abort_all_at: Optional[int]) -> Tuple[Dict[str, Job], Set[str]]:  # fmt: skip
    """Submit, abort and flush as the jobs say, step to the end; returns rid -> job and the aborted rids.

    `clock` counts steps and the idle gaps before an arrival; `steps` counts Engine.step calls.
    At step `abort_all_at` everything in flight is aborted at once (the server's abort_all).
    """
    scheduler = engine.scheduler
    rid_job: Dict[str, Job] = {}
    abort_at: Dict[str, int] = {}
    aborted: Set[str] = set()
    pending = sorted(jobs, key=lambda j: (j.wave, j.arrive))
    wave, wave_start, clock, steps, bound = pending[0].wave, 0, 0, 0, step_bound(jobs)
    while True:
        while pending and pending[0].wave == wave and wave_start + pending[0].arrive <= clock:
            job = pending.pop(0)
            for copy in range(job.copies):
                rid = engine.add_request(
                    input_ids=job.prompt, sampling_params=job.params, rid=f"r{len(rid_job)}",
                    return_logprob=job.return_logprob, stream=job.stream, logprob_start_len=job.logprob_start_len,
                    priority=job.priority, return_hidden_states=job.return_hidden_states,
                )  # fmt: skip
                rid_job[rid] = job
                if job.abort_after is not None:
                    abort_at[rid] = clock + job.abort_after
        outputs_in_flight = False
        if abort_all_at is not None and steps >= abort_all_at:
            abort_all_at = None
            scheduler.abort_request(AbortReq(abort_all=True))
            aborted.update(r for r, state in engine.rid_to_state.items() if not state.finished)
            outputs_in_flight = True  # the Engine sees the aborts only when the next step drains them
            check_after_change(engine)
        for rid, job in rid_job.items():
            if engine.rid_to_state[rid].finished or rid in aborted:
                continue
            due = abort_at.get(rid, clock + 1) <= clock
            if due or (job.abort_in is not None and in_state(scheduler, rid, job.abort_in, rng)):
                engine.abort(rid)
                aborted.add(rid)
                check_after_change(engine)

        if not engine.has_unfinished_requests():
            scheduler.check_memory_when_idle()
            if not pending:
                return rid_job, aborted
            if pending[0].wave == wave:  # nothing to run until the next arrival of this wave
                clock = max(clock + 1, wave_start + pending[0].arrive)
                continue
            if rng.random() < 0.5:  # idle between waves: flush, and the next wave must still run
                assert engine.flush_cache(), "flush_cache refused while idle"
                check_flushed(engine)
            wave, wave_start = pending[0].wave, clock
            continue
        if rng.random() < 0.05 and not outputs_in_flight:
            assert not engine.flush_cache(), "flush_cache accepted while requests run"

        engine.step(snapshot=False)
        clock, steps = clock + 1, steps + 1
        check_after_change(engine)
        unfinished = [r for r, s in engine.rid_to_state.items() if not s.finished]
        assert scheduler.last_batch is not None or not unfinished, f"step {steps} ran nothing; unfinished: {unfinished}"
        assert steps <= bound, f"no end after {steps} steps; unfinished: {unfinished}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_random_workload_matches_solo_runs_and_never_leaks(tiny_model: str, solo: SoloRuns, seed: int) -> None:
    rng, pressure, config = draw_case(seed)
    engine = Engine(tiny_model, **config)
    jobs = draw_workload(rng, engine, solo, pressure)
    priorities = draw_priorities(seed, jobs)
    eviction = draw_eviction_policy(seed, priorities)
    hidden = draw_hidden_states(seed, jobs)
    speculative = draw_speculative(seed, config)
    if priorities or eviction or hidden or speculative:  # (the workload was drawn against the same limits: these change none)
        engine.shutdown()
        engine = Engine(tiny_model, **config, **priorities, **eviction, **hidden, **speculative)
    lp_rng = random.Random(1_000_003 * (seed + 1))
    for job in jobs:
        if job.return_logprob and lp_rng.random() < 0.7:
            job.logprob_start_len = lp_rng.randrange(0, len(job.prompt) + 1)
    abort_all_at = rng.randrange(1, 80) if rng.random() < 0.2 else None
    rid_job, aborted = run_workload(engine, jobs, rng, abort_all_at)

    for rid, job in rid_job.items():
        result = engine.get_result(rid)
        output, finish = result["output_ids"], result["meta_info"]["finish_reason"]
        expected_output, expected_finish = solo(job.prompt, job.params)
        # refused by a full queue, or evicted from it (a retracted request may have output by then)
        refused = priorities.get("max_queued_requests") is not None and queue_refused(finish)
        if rid in aborted:  # aborted while unfinished: it ends as an abort, whatever state it was in
            assert finish["type"] == "abort", f"{rid}: aborted, but it finished with {finish}"
            assert output == expected_output[: len(output)], f"{rid}: aborted output is not a prefix of the solo run"
        elif refused:
            assert output == expected_output[: len(output)], f"{rid}: evicted output is not a prefix of the solo run"
        else:
            assert (output, finish) == (expected_output, expected_finish), f"{rid}: differs from the solo run"
        if job.return_hidden_states and output:  # (a request refused before it ran has none)
            entries = result["meta_info"]["hidden_states"]
            assert len(entries) == len(output), f"{rid}: {len(entries)} hidden-state entries for {len(output)} tokens"
            assert all(len(row) == HIDDEN for row in entries[0]) and all(len(row) == HIDDEN for row in entries[1:]), rid
        scored = result["meta_info"]["input_token_logprobs"]
        if job.logprob_start_len >= 0 and (scored or (rid not in aborted and not refused)):  # (an abort mid-prompt has none)
            expected = solo.prompt_logprobs(job.prompt, job.logprob_start_len)
            assert [t for _, t, _ in scored] == [t for _, t, _ in expected] == job.prompt[job.logprob_start_len :], rid
            assert [lp is None for lp, _, _ in scored] == [lp is None for lp, _, _ in expected], rid
            ours, theirs = ([lp for lp, _, _ in entries if lp is not None] for entries in (scored, expected))
            assert ours == pytest.approx(theirs, abs=1e-4), f"{rid}: prompt logprobs differ from the solo run"
        else:
            assert scored == [], rid

    # flushed at the end, the engine is empty and still serves
    assert engine.flush_cache()
    check_flushed(engine)
    prompt, params = jobs[0].prompt, {**GREEDY, "max_new_tokens": 4}
    rid = engine.add_request(input_ids=prompt, sampling_params=params)
    for _ in range(len(prompt) + 8):  # a wedged engine fails here instead of spinning
        if not engine.has_unfinished_requests():
            break
        engine.step(snapshot=False)
        check_after_change(engine)
    assert not engine.has_unfinished_requests(), "the engine serves nothing after flush_cache"
    assert engine.get_result(rid)["output_ids"] == solo(prompt, params)[0]
    engine.scheduler.check_memory_when_idle()


def test_the_seeds_cover_every_config_feature() -> None:
    """The fixed seeds are only as good as what they draw: keep each feature in the set."""
    configs = [draw_case(seed)[2] for seed in SEEDS]
    assert {c["page_size"] for c in configs} >= {1, 4, 16}
    assert any(c["chunked_prefill_size"] > 0 and c["enable_mixed_chunk"] for c in configs)
    assert any(c["chunked_prefill_size"] > 0 and not c["enable_mixed_chunk"] for c in configs)
    assert any(c["chunked_prefill_size"] == -1 for c in configs)
    assert any(c["disable_radix_cache"] for c in configs) and not all(c["disable_radix_cache"] for c in configs)
    assert any(c["max_running_requests"] == 1 for c in configs)
    assert any(c["max_total_tokens"] == 64 for c in configs)
    assert len({c["schedule_policy"] for c in configs}) >= 4
    jobs = [Job(prompt=[TOKEN_LO], params={}, copies=1, wave=0, arrive=0, abort_after=None, abort_in=None,
                return_logprob=False, stream=False)]  # fmt: skip
    drawn = [(draw_case(seed)[1], draw_priorities(seed, jobs)) for seed in SEEDS]
    assert any(pressure and p.get("retraction_policy") == "priority" for pressure, p in drawn)
    assert any(p.get("max_queued_requests") for _, p in drawn) and any(p and p["priority_scheduling_preemption_threshold"] == 0 for _, p in drawn)
    policies = {draw_eviction_policy(seed, p).get("radix_eviction_policy", "lru") for seed, (_, p) in zip(SEEDS, drawn)}
    assert policies == {"lru", "mru", "lfu", "fifo", "filo", "priority"}
    speculative = [seed for seed in SEEDS if draw_speculative(seed, draw_case(seed)[2])]
    assert any(draw_case(seed)[1] for seed in speculative)  # (with memory pressure: retraction, no room for drafts)
    assert {draw_case(seed)[2]["page_size"] for seed in speculative} & {2, 4, 16}
    hidden = [seed for seed in SEEDS if draw_hidden_states(seed, [replace(jobs[0])])]
    assert hidden and any(draw_case(seed)[1] for seed in hidden)  # (with memory pressure too: retraction)
