"""Snapshot helpers (visualizer, stage 6). In: `Scheduler.snapshot()` dicts. Out: checked, merged, summarised dicts.

The scheduler describes itself after every step with one JSON-ready dict
(docs/snapshot.md). Everything the visualizer shows (the browser page, the
ipywidgets `SchedulerWidget`, the notebooks) reads only that dict; this module
holds the pure functions they share:

- `validate_snapshot` / `check_snapshot`: does a dict follow the schema?
- `kv_segments`: the KV memory bar (used by requests, protected, evictable, free).
- `step_summary`: one line of the timeline strip.
- `merge_snapshots`: coalescing. A browser renders ~20 updates/s while the
  scheduler may run hundreds of steps/s; the merged snapshot is the newest state
  plus every event and finished request of the steps it stands for, so a
  retract, finish or abort is never lost to coalescing.

No I/O here, so the SSE hub, the widget and the tests can all call it directly.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

FORWARD_MODES = ("EXTEND", "DECODE", "MIXED", "TARGET_VERIFY", "IDLE")
STOP_REASONS = ("NO_TOKEN", "OTHER", "BATCH_FULL", "QUEUE_EMPTY", None)
EVENT_TYPES = ("arrive", "chunk", "prefill_done", "retract", "finish", "abort")

# Top-level keys and the Python types their values must have (docs/snapshot.md).
_NUMBER = (int, float)
_TOP_LEVEL: Dict[str, Any] = {
    "step": int,
    "time": _NUMBER,
    "forward_mode": str,
    "log_line": str,
    "waiting_queue": list,
    "grammar_queue": list,
    "chunked_req": (dict, type(None)),
    "batch": (dict, type(None)),
    "running_batch": list,
    "adder": (dict, type(None)),
    "memory": dict,
    "radix": dict,
    "new_token_ratio": _NUMBER,
    "speculative": (dict, type(None)),
    "events": list,
    "finished": list,
}
_MEMORY_KEYS = ("total", "available", "evictable", "protected", "used")
_WAITING_KEYS = ("rid", "input_len", "prefix_len", "waited_ms", "retracted", "lora_id", "cache_key")
_BATCH_REQ_KEYS = ("rid", "extend_len", "prefix_len", "cached_len", "chunk_index", "num_chunks", "is_decode",
                   "draft_len", "accepted_len", "lora_id", "cache_key")  # fmt: skip
_RUNNING_KEYS = ("rid", "input_len", "output_len", "max_new_tokens", "lora_id", "cache_key")
_SPECULATIVE_KEYS = ("algorithm", "num_draft_tokens", "decode_rows", "decode_tokens", "accept_length")
_FINISHED_KEYS = ("rid", "finish_reason", "queue_ms", "schedule_ms", "forward_ms", "ttft_ms")
# None = that part never happened (an abort while waiting has no forward, so no TTFT)
_FINISHED_MS_KEYS = ("queue_ms", "schedule_ms", "forward_ms", "ttft_ms", "e2e_ms")


def _missing(record: Mapping[str, Any], keys: Sequence[str], where: str) -> List[str]:
    return [f"{where}: missing key {k!r}" for k in keys if k not in record]


def validate_snapshot(snap: Any) -> List[str]:
    """Every way `snap` departs from docs/snapshot.md, as readable messages ([] = valid)."""
    if not isinstance(snap, dict):
        return [f"snapshot must be a dict, got {type(snap).__name__}"]
    problems: List[str] = []
    for key, types in _TOP_LEVEL.items():
        if key not in snap:
            problems.append(f"missing key {key!r}")
        elif isinstance(snap[key], bool) or not isinstance(snap[key], types):
            problems.append(f"{key!r} has type {type(snap[key]).__name__}")
    if problems:
        return problems
    if snap["forward_mode"] not in FORWARD_MODES:
        problems.append(f"forward_mode {snap['forward_mode']!r} is not one of {FORWARD_MODES}")
    problems += _missing(snap["memory"], _MEMORY_KEYS, "memory")
    for i, req in enumerate(snap["waiting_queue"]):
        problems += _missing(req, _WAITING_KEYS, f"waiting_queue[{i}]")
    for i, req in enumerate(snap["running_batch"]):
        problems += _missing(req, _RUNNING_KEYS, f"running_batch[{i}]")
    if snap["batch"] is not None:
        for i, req in enumerate(snap["batch"].get("reqs", [])):
            problems += _missing(req, _BATCH_REQ_KEYS, f"batch.reqs[{i}]") or _draft_problems(req, snap["forward_mode"], i)
    if snap["speculative"] is not None:
        problems += _missing(snap["speculative"], _SPECULATIVE_KEYS, "speculative")
        accept = snap["speculative"].get("accept_length")
        if accept is not None and (isinstance(accept, bool) or not isinstance(accept, _NUMBER)):
            problems.append(f"speculative.accept_length must be a number or null, got {type(accept).__name__}")
    if snap["adder"] is not None and snap["adder"].get("stop_reason") not in STOP_REASONS:
        problems.append(f"adder.stop_reason {snap['adder'].get('stop_reason')!r} is not one of {STOP_REASONS}")
    for i, ev in enumerate(snap["events"]):
        if ev.get("type") not in EVENT_TYPES:
            problems.append(f"events[{i}].type {ev.get('type')!r} is not one of {EVENT_TYPES}")
    for i, fin in enumerate(snap["finished"]):
        problems += _missing(fin, _FINISHED_KEYS, f"finished[{i}]")
        for k in _FINISHED_MS_KEYS:
            v = fin.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, _NUMBER)):
                problems.append(f"finished[{i}].{k} must be a number or null, got {type(v).__name__}")
    return problems


def _draft_problems(req: Mapping[str, Any], mode: str, i: int) -> List[str]:
    """A batch row's drafts: whole counts, the accepted ones among the carried ones, and none
    outside a TARGET_VERIFY step (only a verify pass checks drafts)."""
    draft, accepted = req["draft_len"], req["accepted_len"]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (draft, accepted)):
        return [f"batch.reqs[{i}]: draft_len and accepted_len must be ints >= 0, got {draft!r} and {accepted!r}"]
    if accepted > draft:
        return [f"batch.reqs[{i}]: accepted_len {accepted} exceeds draft_len {draft}"]
    if draft and mode != "TARGET_VERIFY":
        return [f"batch.reqs[{i}]: draft_len {draft} in a {mode} step (only TARGET_VERIFY carries drafts)"]
    return []


def check_snapshot(snap: Any) -> Dict[str, Any]:
    """Return `snap` if it follows the schema, else raise ValueError listing what is wrong."""
    problems = validate_snapshot(snap)
    if problems:
        raise ValueError("invalid scheduler snapshot: " + "; ".join(problems))
    return snap


def kv_segments(memory: Mapping[str, int]) -> Dict[str, int]:
    """Split the KV pool into the four bar segments; they always sum to `total`.

    The scheduler counts `used = total - available - evictable`, which includes the
    locked (protected) radix nodes, as SGLang's token usage does. The bar shows the
    protected part on its own, so `used` here is what requests hold outside the tree.
    """
    total = int(memory["total"])
    free = int(memory["available"])
    evictable = int(memory["evictable"])
    protected = min(int(memory["protected"]), max(total - free - evictable, 0))
    used = max(total - free - evictable - protected, 0)
    return {"used": used, "protected": protected, "evictable": evictable, "free": free, "total": total}


def step_summary(snap: Mapping[str, Any]) -> Dict[str, Any]:
    """One timeline entry: what kind of step it was and how big, plus its log line."""
    batch = snap.get("batch") or {}
    reqs = batch.get("reqs", [])
    return {
        "step": snap["step"],
        "time": snap["time"],
        "forward_mode": snap["forward_mode"],
        "batch_size": len(reqs),
        "num_extend_tokens": sum(r["extend_len"] for r in reqs if not r.get("is_decode")),
        "num_decode_reqs": sum(1 for r in reqs if r.get("is_decode")),
        "num_drafts": sum(r.get("draft_len", 0) for r in reqs),  # (a TARGET_VERIFY step's; 0 otherwise)
        "num_accepted_drafts": sum(r.get("accepted_len", 0) for r in reqs),
        "has_chunked": any(r.get("num_chunks", 0) > 1 for r in reqs if not r.get("is_decode")),
        "num_waiting": len(snap.get("waiting_queue", [])) + len(snap.get("grammar_queue", [])),  # (as get_load counts)
        "event_types": sorted({ev["type"] for ev in snap.get("events", [])}),
        "log_line": snap.get("log_line", ""),
    }


def merge_snapshots(snaps: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Coalesce consecutive snapshots (oldest first) into one.

    The result is the newest snapshot's state, with
      events   = every step's events in order, each tagged with its `step`,
      finished = every step's finished requests in order, each tagged with its `step`,
      steps    = the `step_summary` of every merged step (the timeline needs them all),
      coalesced_steps = how many scheduler steps this one update stands for.
    """
    if not snaps:
        raise ValueError("merge_snapshots needs at least one snapshot")
    merged = dict(snaps[-1])
    merged["events"] = [{**ev, "step": s["step"]} for s in snaps for ev in s.get("events", [])]
    merged["finished"] = [{**fin, "step": s["step"]} for s in snaps for fin in s.get("finished", [])]
    merged["steps"] = merge_step_summaries([], [step_summary(s) for s in snaps])
    merged["coalesced_steps"] = len(snaps)
    return merged


def merge_step_summaries(timeline: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Append step summaries to a timeline (both oldest first), one entry per step.

    The scheduler may publish a step twice: after it ran, and again (no batch, so IDLE)
    when a request arrives or is aborted before the next one. The second is the same step
    on the timeline, not a new bar: it keeps the batch of the step that ran, takes the
    newer queue length and adds its event types. visualizer.js `addStep` does the same.
    """
    out = [dict(s) for s in timeline]
    for s in new:
        if out and s["step"] == out[-1]["step"]:
            prev = out[-1]
            base = s if prev["forward_mode"] == "IDLE" else prev
            events = sorted(set(prev["event_types"]) | set(s["event_types"]))
            out[-1] = {**base, "num_waiting": s["num_waiting"], "event_types": events}
        elif not out or s["step"] > out[-1]["step"]:
            out.append(dict(s))
    return out
