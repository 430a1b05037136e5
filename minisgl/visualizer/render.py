"""Snapshot -> panel HTML (visualizer, notebook side). In: snapshot dicts (docs/snapshot.md). Out: HTML strings.

The ipywidgets `SchedulerWidget` shows the same panels as the browser page
(web/static/visualizer.js) with the same CSS classes, colours and data attributes,
rendered here in Python because a notebook has no SSE stream and nbval has no
browser. Every function is pure: snapshot in, HTML string out, so a notebook can
assert on the text it would show.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from minisgl.visualizer.snapshot import kv_segments


def web_dir() -> Path:
    """The visualizer's templates/ and static/: the `minisgl.web` package (the repo's web/,
    installed or found in a checkout by minisgl/__init__.py)."""
    from importlib.resources import files

    return Path(str(files("minisgl.web")))


_CSS_RULE = re.compile(r"([^{}]+)\{([^{}]*)\}")  # selectors { declarations }, inside an @media block too
_PAGE_SELECTORS = (":root", "html", "body")


def scope_css(css: str, scope: str) -> str:
    """The page's stylesheet with every rule confined to `scope` (a selector), for embedding in
    someone else's page: in a notebook, its `body`, `*`, `code` and `.row` rules restyled the
    whole notebook. `:root`/`body` rules (the colour variables, the font) apply to `scope` itself."""

    def scoped(rule: re.Match) -> str:
        head = rule.group(1)
        selectors = [s.strip() for s in head.split(",")]
        if selectors[0].startswith("@"):  # (no bare @-rule here; an @media's inner rules match alone)
            return rule.group(0)
        out = [scope if s in _PAGE_SELECTORS else f"{scope} {s}" for s in selectors]
        return f"{head[: len(head) - len(head.lstrip())]}{', '.join(out)} {{{rule.group(2)}}}"

    return _CSS_RULE.sub(scoped, re.sub(r"/\*.*?\*/", "", css, flags=re.S))


PANEL_NAMES = ("waiting", "batch", "running", "adder", "memory", "events", "timeline", "finished")


def _pct(x: float, total: float) -> float:
    return max(0.0, min(100.0, 100.0 * x / total)) if total > 0 else 0.0


def _seg(cls: str, x: float, total: float, title: str, attrs: str = "") -> str:
    return f'<div class="seg {cls}" {attrs} style="width:{_pct(x, total):.2f}%" title="{escape(title)}"></div>'


def _ms(ms: Optional[float]) -> str:
    if ms is None:
        return "–"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def _panel(name: str, title: str, body: str) -> str:
    return f'<section class="panel" id="panel-{name}" data-panel="{name}"><h2>{title}</h2>{body}</section>'


_LAST_MATCH = "the prefix the radix tree held when the scheduler last matched this request (at an admission attempt, or lpm's ordering)"


def render_waiting(snap: Mapping[str, Any]) -> str:
    # structured output: requests whose grammar still compiles come first, then the queue
    compiling = [
        f'<div class="req-card" data-rid="{escape(r["rid"])}" data-grammar="{escape(r["grammar"])}">'
        f'<div><span class="rid">{escape(r["rid"])}</span><span class="badge">compiling {escape(r["grammar"])}</span></div>'
        f'<div class="detail">its grammar is compiling; then it waits here</div></div>'
        for r in snap.get("grammar_queue", [])
    ]
    cards = [
        f'<div class="req-card" data-rid="{escape(r["rid"])}" data-retracted="{int(r["retracted"])}">'
        f'<div><span class="rid">{escape(r["rid"])}</span>'
        + (f'<span class="badge">retracted ×{r.get("retraction_count", 1)}</span>' if r["retracted"] else "")
        + (f'<span class="badge">priority {r["priority"]}</span>' if r.get("priority") is not None else "")
        + (f'<span class="badge">lora {escape(r["lora_id"])}</span>' if r.get("lora_id") is not None else "")
        + (f'<span class="badge">key {escape(r["cache_key"])}</span>' if r.get("cache_key") is not None else "")
        + f'</div><div title="{_LAST_MATCH}">prompt {r["input_len"]} tok · matched {r["prefix_len"]}</div>'
        f'<div class="detail">waited {_ms(r["waited_ms"])}</div></div>'
        for r in snap["waiting_queue"]
    ]
    body = f'<div class="cards">{"".join(compiling + cards) or "<p class=empty>empty</p>"}</div>'
    count = f"{len(cards)} + {len(compiling)} compiling" if compiling else str(len(cards))
    return _panel("waiting", f'waiting_queue <span class="count">{count}</span>', body)


# the mode tag's text (its data-mode stays the ForwardMode name, which the CSS colours by)
MODE_LABELS = {"TARGET_VERIFY": "VERIFY"}


def mode_label(mode: str) -> str:
    return MODE_LABELS.get(mode, mode)


def _draft_segs(r: Mapping[str, Any], total: float) -> str:
    """A verify row's drafts after its decode token, one segment each: the ones the request took
    solid, the rest hatched (their K/V slots went back)."""
    accepted = r.get("accepted_len", 0)
    return "".join(
        _seg(f"draft {'accepted' if k < accepted else 'rejected'}", 1, total,
             f"draft {k + 1}: {'accepted' if k < accepted else 'rejected'}", f'data-draft="{k + 1}"')
        for k in range(r.get("draft_len", 0))
    )  # fmt: skip


def _batch_row(r: Mapping[str, Any], mode: str = "") -> str:
    verify = mode == "TARGET_VERIFY"
    drafts = r.get("draft_len", 0)
    total = r["prefix_len"] + r["extend_len"]
    cached, extend = r["cached_len"], r["extend_len"] - drafts  # (a verify row extends by its last token and drafts)
    computed = r["prefix_len"] - cached  # KV of its own: earlier chunks, or a decoding request's context
    own = "context" if r["is_decode"] else "earlier chunks"
    kind = "decode" if r["is_decode"] else "extend"
    progress = f'{r.get("output_len", 0)}/{r.get("max_new_tokens", "?")}'
    if verify:
        # (short: the label column is narrow, and the mode tag already says VERIFY)
        got = f'+{r.get("accepted_len", 0)}/{drafts} drafts' if drafts else "no drafts"
        label = f'<span class="drafts" title="drafts taken / drafts checked">{got}</span> · {progress}'
    elif r["is_decode"]:
        label = f"decode · out {progress}"
    else:
        chunk = f'<span class="chunk">chunk {r["chunk_index"]}/{r["num_chunks"]}</span> ' if r["num_chunks"] > 1 else ""
        label = f'{chunk}+{r["extend_len"]} on {r["prefix_len"]}'
    return (
        f'<div class="row batch-req" data-rid="{escape(r["rid"])}" data-decode="{int(r["is_decode"])}" '
        f'data-chunk-index="{r["chunk_index"]}" data-num-chunks="{r["num_chunks"]}" '
        f'data-draft-len="{drafts}" data-accepted-len="{r.get("accepted_len", 0)}">'
        f'<span class="rid">{escape(r["rid"])}</span><div class="stackbar">'
        f'{_seg("prefix", cached, total, f"cached prefix (radix hit) {cached}")}'
        f'{_seg("computed", computed, total, f"{own} {computed}")}{_seg(kind, extend, total, f"{kind} {extend}")}'
        f'{_draft_segs(r, total)}</div>'
        f'<span class="label">{label}{_namespace(r)}</span></div>'
    )


def _accept_length(snap: Mapping[str, Any]) -> str:
    """The batch panel's note under --speculative-algorithm: tokens per request per verify pass so far."""
    spec = snap.get("speculative")
    if spec is None:
        return ""
    value = "–" if spec["accept_length"] is None else f'{spec["accept_length"]:.2f}'
    return f'<span class="detail spec-accept" title="tokens a request got per verify pass, since start">accept len {value}</span>'


def render_batch(snap: Mapping[str, Any]) -> str:
    mode = snap["forward_mode"]
    reqs = (snap["batch"] or {}).get("reqs", [])
    rows = "".join(_batch_row(r, mode) for r in reqs) or '<p class="empty">no batch ran</p>'
    c = snap["chunked_req"]
    if c:
        rows += (f'<p class="detail">chunked_req <b>{escape(c["rid"])}</b>: {c["done_tokens"]}/{c["total_tokens"]} '
                 f'tokens prefilled, chunk {c["chunk_index"]}/{c["num_chunks"]}</p>')  # fmt: skip
    title = f'batch of this step <span class="mode-tag" data-mode="{mode}">{mode_label(mode)}</span>{_accept_length(snap)}'
    return _panel("batch", title, rows)


def render_running(snap: Mapping[str, Any]) -> str:
    rows = "".join(
        f'<div class="row running-req" data-rid="{escape(r["rid"])}"><span class="rid">{escape(r["rid"])}</span>'
        f'<div class="stackbar">{_seg("progress", r["output_len"], r["max_new_tokens"], "generated")}</div>'
        f'<span class="label">{r["output_len"]} / {r["max_new_tokens"]} tok'
        f'{_namespace(r)}</span></div>'
        for r in snap["running_batch"]
    )
    count = len(snap["running_batch"])
    return _panel("running", f'running_batch <span class="count">{count}</span>', rows or '<p class="empty">nothing decoding</p>')


def _budget_rows(adder: Mapping[str, Any], memory: Mapping[str, Any]) -> List[tuple]:
    b = adder.get("budgets") or {}
    max_reqs = b.get("prefill_max_requests")
    return [
        ("rem_total_tokens", b.get("rem_total_tokens"), b.get("total_tokens")),
        ("rem_input_tokens", b.get("rem_input_tokens"), b.get("max_prefill_tokens")),
        ("rem_chunk_tokens", b.get("rem_chunk_tokens"), b.get("chunked_prefill_size")),
        ("requests", None if max_reqs is None else max_reqs - b.get("num_admitted", 0), max_reqs),
        ("slots", b.get("request_slots_left"), memory.get("req_slots_total")),
    ]


def render_adder(snap: Mapping[str, Any]) -> str:
    a = snap["adder"]
    if a is None:
        return _panel("adder", 'PrefillAdder <span class="reason" data-reason="">no prefill attempt</span>', "")
    rows = []
    for name, left, limit in _budget_rows(a, snap["memory"]):
        # a null limit is no limit; a null budget under a real limit means no PrefillAdder ran
        unlimited = limit is None or limit <= 0
        unknown = not unlimited and left is None
        if unlimited:
            text = "unlimited" if left is None else f"{left} left"
        else:
            text = "– (not computed)" if unknown else f"{left} / {limit}"
        bar = "" if unlimited or unknown else _seg("left", max(left, 0), limit, f"{name} left")
        exhausted = int(not unlimited and not unknown and left <= 0)
        rows.append(f'<div class="budget" data-budget="{name}" data-exhausted="{exhausted}">'
                    f'<span class="name">{name}</span><div class="stackbar">{bar}</div><span class="label">{text}</span></div>')  # fmt: skip
    reason = a.get("stop_reason") or ""
    admitted = ", ".join(a.get("admitted") or [])
    body = (f'<p class="detail stop-detail">{escape(a.get("stop_detail") or "")}</p>{"".join(rows)}'
            + (f'<p class="detail">admitted: {escape(admitted)}</p>' if admitted else ""))  # fmt: skip
    return _panel("adder", f'PrefillAdder <span class="reason" data-reason="{reason}">{reason or "no stop"}</span>', body)


def _namespace(row: Mapping[str, Any]) -> str:
    """' · lora NAME · key TAG' for a request row or a tree node outside the default namespace: the
    adapter (--lora-paths) and the tag of its extra_key / cache_salt (never the key itself)."""
    return ((f' · lora {escape(row["lora_id"])}' if row.get("lora_id") is not None else "")
            + (f' · key {escape(row["cache_key"])}' if row.get("cache_key") is not None else ""))  # fmt: skip


def _radix_node(node: Mapping[str, Any]) -> str:
    is_root = node["id"] == 0
    label = "root" if is_root else f'#{node["id"]} · {node["len"]} tok'
    if not is_root:  # (whose K/V it holds: --lora-paths' adapter, a request's cache key)
        label += _namespace(node)
    kids = "".join(_radix_node(c) for c in node.get("children", []))
    locked = int(node["lock_ref"] > 0 and not is_root)
    title = (f'lock_ref {node["lock_ref"]} · hits {node.get("hits", 0)} · '
             f'tokens {" ".join(map(str, node.get("tokens_preview", [])))}')
    return (f'<li><span class="rnode" data-node="{node["id"]}" data-locked="{locked}" data-root="{int(is_root)}" '
            f'title="{escape(title)}">'
            f'{label}</span>{f"<ul>{kids}</ul>" if kids else ""}</li>')  # fmt: skip


def render_memory(snap: Mapping[str, Any]) -> str:
    mem = snap["memory"]
    k = kv_segments(mem)
    bar = "".join(
        _seg(f"kv-seg {kind}", k[kind], k["total"], f"{kind} {k[kind]} tokens", f'data-kind="{kind}" data-tokens="{k[kind]}"')
        for kind in ("used", "protected", "evictable", "free")
    )
    radix = snap["radix"]
    tree = f'<ul>{_radix_node(radix["tree"])}</ul>' if radix.get("tree") else ""
    body = (
        f'<p class="detail">used {k["used"]} · protected {k["protected"]} · evictable {k["evictable"]} · '
        f'free {k["free"]} / {k["total"]} tokens</p><div class="stackbar" id="kv-bar">{bar}</div>'
        f'<p class="detail">new_token_ratio <b class="new-token-ratio">{snap["new_token_ratio"]:.3f}</b> · req slots '
        f'<b class="req-slots">{mem["req_slots_total"] - mem["req_slots_free"]} / {mem["req_slots_total"]}</b></p>'
        f'<h3>radix tree <span class="detail">{radix["num_nodes"]} nodes · {radix["total_tokens"]} tokens</span></h3>'
        f'<div id="radix-tree">{tree}</div>'
    )
    return _panel("memory", "KV memory", body)


def render_events(snap: Mapping[str, Any]) -> str:
    items = "".join(
        f'<li class="event" data-type="{escape(e["type"])}" data-rid="{escape(e["rid"])}"><span class="etype">'
        f'{escape(e["type"])}</span> <b>{escape(e["rid"])}</b> <span class="detail">{escape(e.get("detail", ""))}</span></li>'
        for e in snap["events"]
    )
    return _panel("events", "events of this step", f'<ul id="events">{items or "<li class=empty>none</li>"}</ul>')


def _step_title(s: Mapping[str, Any]) -> str:
    """A timeline bar's tooltip: its log line, and for a verify step the drafts it checked."""
    if s.get("num_drafts"):
        return f'{s["num_accepted_drafts"]}/{s["num_drafts"]} drafts accepted\n{s["log_line"]}'
    return s["log_line"]


def render_timeline(snap: Mapping[str, Any], timeline: Sequence[Mapping[str, Any]]) -> str:
    max_bs = max([1] + [s["batch_size"] for s in timeline])
    bars = "".join(
        f'<div class="tl-step{" current" if s["step"] == snap["step"] else ""}" data-step="{s["step"]}" '
        f'data-mode="{s["forward_mode"]}" data-bs="{s["batch_size"]}" data-chunked="{int(s["has_chunked"])}" '
        f'data-events="{escape(" ".join(s.get("event_types", [])))}" '
        f'data-drafts="{s.get("num_drafts", 0)}" data-accepted="{s.get("num_accepted_drafts", 0)}" '
        f'style="height:{10 + 44 * s["batch_size"] / max_bs:.0f}px" title="{escape(_step_title(s))}"></div>'
        for s in timeline
    )
    log = escape(snap["log_line"] or f'(step {snap["step"]}: {mode_label(snap["forward_mode"])}, no log line)')
    return _panel("timeline", "timeline", f'<div id="timeline">{bars}</div><pre id="log-line">{log}</pre>')


def render_finished(finished: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for f in finished:
        # None = that part never happened: a request aborted while waiting has no forward, no TTFT
        parts = [(name, f.get(f"{name}_ms")) for name in ("queue", "schedule", "forward")]
        total = sum(ms or 0.0 for _, ms in parts)
        bar = "".join(_seg(name, ms or 0.0, total, name) for name, ms in parts)
        ttft = f.get("ttft_ms")
        finish = (f.get("finish_reason") or {}).get("type", "?")
        rows.append(
            f'<div class="row finished-req" data-rid="{escape(f["rid"])}" '
            f'data-ttft="{"" if ttft is None else f"{ttft:.3f}"}" data-finish="{escape(finish)}">'
            f'<span class="rid">{escape(f["rid"])}</span><div class="stackbar">{bar}</div>'
            f'<span class="label">TTFT {_ms(ttft)} = '
            + " + ".join(f"{name} {_ms(ms)}" for name, ms in parts)
            + f' <span class="finish-type">{escape(finish)}</span></span></div>'
        )
    return _panel("finished", "finished requests (TTFT split)", "".join(rows) or '<p class="empty">none yet</p>')


def render_panels(snap: Mapping[str, Any], timeline: Sequence[Mapping[str, Any]] = (),
                  finished: Sequence[Mapping[str, Any]] = ()) -> Dict[str, str]:  # fmt: skip
    """Every panel of the page for one snapshot; `timeline` and `finished` accumulate across steps."""
    return {
        "waiting": render_waiting(snap),
        "batch": render_batch(snap),
        "running": render_running(snap),
        "adder": render_adder(snap),
        "memory": render_memory(snap),
        "events": render_events(snap),
        "timeline": render_timeline(snap, timeline),
        "finished": render_finished(finished),
    }
