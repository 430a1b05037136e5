// minisgl live scheduler visualizer (docs/visualizer.md).
// In: scheduler snapshots (docs/snapshot.md) from SSE /visualizer/events, each possibly a
// merge of several steps (merge_snapshots: newest state + every event/finished of the steps
// it stands for + `steps`, one timeline summary per step). Out: the panels of the page.
// Owns: `frames` (what step back / forward walk through) and the accumulated timeline
// and finished list. Plain JS, no libraries, no network beyond this server.
"use strict";

const CONFIG = JSON.parse(document.getElementById("viz-config").textContent);
const MAX_TIMELINE = 240;   // steps kept in the timeline strip
const MAX_FINISHED = 60;    // finished requests listed
const MAX_EVENTS = 200;     // events kept for the next drawing (a hidden tab draws nothing for a while)
const state = {
  live: true,
  frames: [],      // snapshots, oldest first (live: SSE updates; paused: the server's ring buffer)
  cursor: -1,      // index in frames of the snapshot on screen
  timeline: [],    // step summaries, oldest first, one per step
  finished: [],    // finished records, newest first
  lastSeq: null,   // hub sequence number of the last update (the SSE id)
  instance: null,  // the hub instance of the last update (the SSE id's prefix)
  drawPending: false,  // a live drawing is booked for the next animation frame
};

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
// " · lora NAME · key TAG" for a request row or a tree node outside the default namespace: its
// adapter (--lora-paths) and the tag of its extra_key / cache_salt (the snapshot never holds the key)
const namespace = (r) => (r.lora_id != null ? ` · lora ${esc(r.lora_id)}` : "") + (r.cache_key != null ? ` · key ${esc(r.cache_key)}` : "");
const fmtMs = (ms) => (ms == null ? "–" : ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(1) + " ms");
const pct = (x, total) => (total > 0 ? Math.max(0, Math.min(100, (100 * x) / total)) : 0);
const seg = (cls, x, total, title) => `<div class="seg ${cls}" style="width:${pct(x, total)}%" title="${esc(title)}"></div>`;

// ------------------------------------------------------------------ panels
function renderWaiting(snap) {
  const q = snap.waiting_queue;
  const g = snap.grammar_queue || [];  // structured output: not waiting yet, its grammar still compiles
  $("waiting-count").textContent = g.length ? `${q.length} + ${g.length} compiling` : q.length;
  // (no "since": nothing is published while only compiles run, so a duration would stand still)
  const compiling = g.map((r) => `
    <div class="req-card" data-rid="${esc(r.rid)}" data-grammar="${esc(r.grammar)}">
      <div><span class="rid">${esc(r.rid)}</span><span class="badge">compiling ${esc(r.grammar)}</span></div>
      <div class="detail">its grammar is compiling; then it waits here</div>
    </div>`).join("");
  $("waiting-queue").innerHTML = q.length + g.length === 0 ? '<p class="empty">empty</p>' : compiling + q.map((r) => `
    <div class="req-card" data-rid="${esc(r.rid)}" data-retracted="${r.retracted ? 1 : 0}">
      <div><span class="rid">${esc(r.rid)}</span>${r.retracted ? `<span class="badge">retracted ×${r.retraction_count}</span>` : ""}${r.priority != null ? `<span class="badge">priority ${esc(String(r.priority))}</span>` : ""}${r.lora_id != null ? `<span class="badge">lora ${esc(r.lora_id)}</span>` : ""}${r.cache_key != null ? `<span class="badge">key ${esc(r.cache_key)}</span>` : ""}</div>
      <div title="the prefix the radix tree held when the scheduler last matched this request (at an admission attempt, or lpm's ordering)">prompt ${r.input_len} tok · matched ${r.prefix_len}</div>
      <div class="detail">waited ${fmtMs(r.waited_ms)}${r.output_len ? ` · ${r.output_len} out` : ""}</div>
    </div>`).join("");
}

// The mode tag's text (its data-mode stays the ForwardMode name, which the CSS colours by).
// Mirrors render.py's mode_label.
const modeLabel = (mode) => (mode === "TARGET_VERIFY" ? "VERIFY" : mode);

// A verify row's drafts after its decode token, one segment each: the ones the request took
// solid, the rest hatched (their K/V slots went back). Mirrors render.py's _draft_segs.
function draftSegs(r, total) {
  const out = [];
  for (let k = 0; k < (r.draft_len || 0); k++) {
    const kind = k < r.accepted_len ? "accepted" : "rejected";
    out.push(`<div class="seg draft ${kind}" data-draft="${k + 1}" style="width:${pct(1, total)}%" title="draft ${k + 1}: ${kind}"></div>`);
  }
  return out.join("");
}

function batchRow(r, mode) {
  const verify = mode === "TARGET_VERIFY";
  const drafts = r.draft_len || 0, accepted = r.accepted_len || 0;
  const total = r.prefix_len + r.extend_len;
  const own = r.extend_len - drafts;  // (a verify row extends by its last token and its drafts)
  const kind = r.is_decode ? "decode" : "extend";
  const chunk = !r.is_decode && r.num_chunks > 1 ? `<span class="chunk">chunk ${r.chunk_index}/${r.num_chunks}</span> ` : "";
  const progress = `${r.output_len}/${r.max_new_tokens}`;
  // (a verify row's label is short: the label column is narrow, and the mode tag already says VERIFY)
  const label = verify ? `<span class="drafts" title="drafts taken / drafts checked">${drafts ? `+${accepted}/${drafts} drafts` : "no drafts"}</span> · ${progress}`
    : r.is_decode ? `decode · out ${progress}` : `${chunk}+${r.extend_len} on ${r.prefix_len}`;
  return `<div class="row batch-req" data-rid="${esc(r.rid)}" data-decode="${r.is_decode ? 1 : 0}"
      data-chunk-index="${r.chunk_index}" data-num-chunks="${r.num_chunks}" data-extend-len="${r.extend_len}" data-prefix-len="${r.prefix_len}" data-cached-len="${r.cached_len}"
      data-draft-len="${drafts}" data-accepted-len="${accepted}">
    <span class="rid">${esc(r.rid)}</span>
    <div class="stackbar">${seg("prefix", r.cached_len, total, `cached prefix (radix hit) ${r.cached_len}`)}${seg("computed",
      r.prefix_len - r.cached_len, total, `${r.is_decode ? "context" : "earlier chunks"} ${r.prefix_len - r.cached_len}`)}${seg(kind,
      own, total, `${kind} ${own}`)}${draftSegs(r, total)}</div>
    <span class="label">${label}${namespace(r)}</span></div>`;
}

function renderBatch(snap) {
  const mode = snap.forward_mode;
  for (const el of [$("forward-mode"), $("batch-mode")]) { el.dataset.mode = mode; el.textContent = modeLabel(mode); }
  const spec = snap.speculative;  // null unless --speculative-algorithm
  $("spec-accept").textContent = spec ? `accept len ${spec.accept_length == null ? "–" : spec.accept_length.toFixed(2)}` : "";
  const reqs = snap.batch ? snap.batch.reqs : [];
  $("batch").dataset.size = reqs.length;
  $("batch").innerHTML = reqs.length === 0 ? '<p class="empty">no batch ran</p>' : reqs.map((r) => batchRow(r, mode)).join("");
  const c = snap.chunked_req;
  $("chunked-req").innerHTML = c ? `<p class="detail" data-rid="${esc(c.rid)}">chunked_req <b>${esc(c.rid)}</b>:
      ${c.done_tokens}/${c.total_tokens} tokens prefilled, chunk ${c.chunk_index}/${c.num_chunks}</p>` : "";
}

function renderRunning(snap) {
  const rs = snap.running_batch;
  $("running-count").textContent = rs.length;
  $("running-batch").innerHTML = rs.length === 0 ? '<p class="empty">nothing decoding</p>' : rs.map((r) => `
    <div class="row running-req" data-rid="${esc(r.rid)}">
      <span class="rid">${esc(r.rid)}</span>
      <div class="stackbar">${seg("progress", r.output_len, r.max_new_tokens, "generated")}</div>
      <span class="label">${r.output_len} / ${r.max_new_tokens} tok${namespace(r)}</span></div>`).join("");
}

// Each budget: what is left of what limit (null = unlimited).
function budgetRows(a, memory) {
  const b = a.budgets || {};
  const slotsTotal = memory.req_slots_total;
  return [
    ["rem_total_tokens", b.rem_total_tokens, b.total_tokens],
    ["rem_input_tokens", b.rem_input_tokens, b.max_prefill_tokens],
    ["rem_chunk_tokens", b.rem_chunk_tokens, b.chunked_prefill_size],
    ["requests", b.prefill_max_requests == null ? null : b.prefill_max_requests - b.num_admitted, b.prefill_max_requests],
    ["slots", b.request_slots_left, slotsTotal],
  ];
}

function renderAdder(snap) {
  const a = snap.adder;
  const reason = a ? a.stop_reason || "" : "";
  $("stop-reason").dataset.reason = reason;
  $("stop-reason").textContent = a ? reason || "no stop" : "no prefill attempt";
  $("stop-detail").textContent = a ? a.stop_detail || "" : "";
  $("admitted").textContent = a && a.admitted && a.admitted.length ? "admitted: " + a.admitted.join(", ") : "";
  $("budgets").innerHTML = !a ? "" : budgetRows(a, snap.memory).map(([name, left, limit]) => {
    // null limit = no such limit; null left under a real limit = no PrefillAdder ran this step
    const unlimited = limit == null || limit <= 0;
    const unknown = !unlimited && left == null;
    const text = unlimited ? (left == null ? "unlimited" : `${left} left`) : unknown ? "– (not computed)" : `${left} / ${limit}`;
    const exhausted = !unlimited && !unknown && left <= 0 ? 1 : 0;
    return `<div class="budget" data-budget="${name}" data-left="${left ?? ""}" data-exhausted="${exhausted}">
      <span class="name">${name}</span>
      <div class="stackbar">${unlimited || unknown ? "" : seg("left", Math.max(left, 0), limit, `${name} left`)}</div>
      <span class="label">${text}</span></div>`;
  }).join("");
}

// Mirrors minisgl.visualizer.snapshot.kv_segments: `used` there includes protected nodes.
function kvSegments(m) {
  const protectedTok = Math.min(m.protected, Math.max(m.total - m.available - m.evictable, 0));
  const used = Math.max(m.total - m.available - m.evictable - protectedTok, 0);
  return { used, protected: protectedTok, evictable: m.evictable, free: m.available, total: m.total };
}

function radixNode(n, depth) {
  // (a node outside the default namespace says whose K/V it holds: --lora-paths' adapter, a key's tag)
  const label = n.id === 0 ? "root" : `#${n.id} · ${n.len} tok${namespace(n)}`;
  const kids = n.children && n.children.length ? `<ul>${n.children.map((c) => radixNode(c, depth + 1)).join("")}</ul>` : "";
  return `<li><span class="rnode" data-node="${n.id}" data-len="${n.len}" data-locked="${n.lock_ref > 0 && n.id !== 0 ? 1 : 0}"
    data-root="${n.id === 0 ? 1 : 0}" title="lock_ref ${n.lock_ref} · hits ${n.hits || 0}${n.tokens_preview ? " · tokens " + n.tokens_preview.join(" ") : ""}">${label}</span>${kids}</li>`;
}

function renderMemory(snap) {
  const m = snap.memory, k = kvSegments(m);
  $("kv-bar").innerHTML = ["used", "protected", "evictable", "free"].map((kind) =>
    `<div class="seg kv-seg ${kind}" data-kind="${kind}" data-tokens="${k[kind]}" style="width:${pct(k[kind], k.total)}%"
      title="${kind} ${k[kind]} tokens"></div>`).join("");
  $("kv-numbers").textContent = `used ${k.used} · protected ${k.protected} · evictable ${k.evictable} · free ${k.free} / ${k.total} tokens`;
  $("new-token-ratio").textContent = snap.new_token_ratio.toFixed(3);
  $("req-slots").textContent = `${m.req_slots_total - m.req_slots_free} / ${m.req_slots_total}`;
  const r = snap.radix;
  $("radix-info").textContent = `${r.num_nodes} nodes · ${r.total_tokens} tokens (locked = protected)`;
  $("radix-tree").innerHTML = r.tree ? `<ul>${radixNode(r.tree, 0)}</ul>` : "";
}

function renderEvents(snap) {
  const evs = snap.events;
  $("events").innerHTML = evs.length === 0 ? '<li class="empty">none</li>' : evs.map((e) => `
    <li class="event" data-type="${esc(e.type)}" data-rid="${esc(e.rid)}"><span class="etype">${esc(e.type)}</span>
      <b>${esc(e.rid)}</b> <span class="detail">${e.step != null ? `step ${e.step} · ` : ""}${esc(e.detail || "")}</span></li>`).join("");
}

function renderTimeline(snap) {
  const maxBs = Math.max(1, ...state.timeline.map((s) => s.batch_size));
  $("timeline").innerHTML = state.timeline.map((s) => `<div class="tl-step${s.step === snap.step ? " current" : ""}"
      data-step="${s.step}" data-mode="${s.forward_mode}" data-bs="${s.batch_size}" data-chunked="${s.has_chunked ? 1 : 0}"
      data-waiting="${s.num_waiting}" data-events="${s.event_types.join(" ")}" data-drafts="${s.num_drafts || 0}"
      data-accepted="${s.num_accepted_drafts || 0}" style="height:${10 + (44 * s.batch_size) / maxBs}px"
      title="${esc(`step ${s.step} ${modeLabel(s.forward_mode)} bs=${s.batch_size} +${s.num_extend_tokens} tok${s.num_drafts
        ? ` · ${s.num_accepted_drafts}/${s.num_drafts} drafts accepted` : ""}\n${s.log_line}`)}"></div>`).join("");
  $("timeline").scrollLeft = $("timeline").scrollWidth;
  $("log-line").textContent = snap.log_line || `(step ${snap.step}: ${modeLabel(snap.forward_mode)}, no log line)`;
}

function finishedRow(f) {
  // null = that part never happened: a request aborted while waiting has no forward, no TTFT
  const total = (f.queue_ms ?? 0) + (f.schedule_ms ?? 0) + (f.forward_ms ?? 0);
  const type = f.finish_reason ? f.finish_reason.type : "?";
  const ttft = f.ttft_ms == null ? "" : f.ttft_ms.toFixed(3);
  return `<div class="row finished-req" data-rid="${esc(f.rid)}" data-ttft="${ttft}" data-finish="${esc(type)}">
    <span class="rid">${esc(f.rid)}</span>
    <div class="stackbar">${seg("queue", f.queue_ms ?? 0, total, `queue ${fmtMs(f.queue_ms)}`)}${seg("schedule", f.schedule_ms ?? 0,
      total, `schedule ${fmtMs(f.schedule_ms)}`)}${seg("forward", f.forward_ms ?? 0, total, `forward ${fmtMs(f.forward_ms)}`)}</div>
    <span class="label">TTFT ${fmtMs(f.ttft_ms)} <span class="finish-type">${esc(type)}</span></span>
    <span></span><span class="label" style="grid-column: 2 / 4">queue ${fmtMs(f.queue_ms)} + schedule ${fmtMs(f.schedule_ms)}
      + forward ${fmtMs(f.forward_ms)} · ${f.output_len} tok · e2e ${fmtMs(f.e2e_ms)}</span></div>`;
}

function renderFinished() {
  $("finished").innerHTML = state.finished.length === 0 ? '<p class="empty">none yet</p>' : state.finished.map(finishedRow).join("");
}

function render(snap) {
  $("step-num").textContent = snap.step;
  document.body.dataset.step = snap.step;
  renderWaiting(snap); renderBatch(snap); renderRunning(snap); renderAdder(snap);
  renderMemory(snap); renderEvents(snap); renderTimeline(snap); renderFinished();
  const vs = $("view-status");
  vs.dataset.live = state.live ? 1 : 0;
  vs.textContent = state.live ? "LIVE" : `PAUSED · ${state.cursor + 1}/${state.frames.length}`;
}

// ------------------------------------------------------------------ data
// One bar per step. The scheduler may publish a step twice: after it ran, and again (no
// batch, IDLE) when a request arrives or is aborted before the next step. That is the same
// bar: keep the batch of the step that ran, take the newer queue length, add the event types.
// Mirrors minisgl.visualizer.snapshot.merge_step_summaries.
function addStep(s) {
  const tl = state.timeline, prev = tl[tl.length - 1];
  if (prev && s.step === prev.step) {
    const base = prev.forward_mode === "IDLE" ? s : prev;
    const events = [...new Set(prev.event_types.concat(s.event_types))].sort();
    tl[tl.length - 1] = { ...base, num_waiting: s.num_waiting, event_types: events };
  } else if (!prev || s.step > prev.step) {
    tl.push(s);
  }
}

// A restarted server is another hub instance (the SSE id's prefix) and counts seq (and
// step) from 1 again: the page starts over, or every new step would look older than what it
// has and the view would freeze. (seq/step going backwards covers updates fed without an id.)
function isFromNewServer(update, instance) {
  if (instance && state.instance && instance !== state.instance) return true;
  const prev = state.timeline[state.timeline.length - 1];
  const first = update.steps && update.steps.length ? update.steps[0].step : update.step;
  return (state.lastSeq != null && update.seq <= state.lastSeq) || (prev != null && first < prev.step);
}

function absorb(update, instance) {
  // Timeline and finished list accumulate across updates, whatever is on screen.
  if (isFromNewServer(update, instance)) {
    state.timeline = [];
    state.finished = [];
    if (state.live) { state.frames = []; state.cursor = -1; }
  }
  state.lastSeq = update.seq;
  if (instance) state.instance = instance;
  for (const s of update.steps || []) addStep(s);
  state.timeline.splice(0, Math.max(0, state.timeline.length - MAX_TIMELINE));
  for (const f of update.finished || []) state.finished.unshift(f);
  state.finished.length = Math.min(state.finished.length, MAX_FINISHED);
}

function onUpdate(update, instance) {
  // a fresh stream from the same hub (reopened after an HTTP error) repeats its latest update
  if (instance && instance === state.instance && state.lastSeq != null && update.seq <= state.lastSeq) return;
  absorb(update, instance);
  if (!state.live) return;  // paused: keep accumulating, do not move the view
  // Draw at most once per animation frame: at a few hundred requests a drawing costs more
  // than the 50 ms between updates, and drawing each one queued a backlog that left the
  // "LIVE" view seconds behind. An update not drawn hands its events on to the next one.
  const prev = state.frames[state.frames.length - 1];
  if (state.drawPending && prev) update = { ...update, events: prev.events.concat(update.events).slice(-MAX_EVENTS) };
  state.frames.push(update);
  state.frames.splice(0, Math.max(0, state.frames.length - CONFIG.history_size));
  state.cursor = state.frames.length - 1;
  if (state.drawPending) return;
  state.drawPending = true;
  requestAnimationFrame(() => {
    state.drawPending = false;
    if (state.live && state.frames.length) render(state.frames[state.frames.length - 1]);
  });
}

// With `minisgl serve --api-key KEY`, open the page as /visualizer?api_key=KEY: an
// EventSource cannot send an Authorization header, so the key rides in the query string
// for the /visualizer routes and in the header for the API calls of the demo button.
const API_KEY = new URLSearchParams(window.location.search).get("api_key");
const withKey = (url) => (API_KEY ? `${url}${url.includes("?") ? "&" : "?"}api_key=${encodeURIComponent(API_KEY)}` : url);
const authHeaders = (extra = {}) => (API_KEY ? { ...extra, Authorization: `Bearer ${API_KEY}` } : extra);

function connect() {
  const es = new EventSource(withKey("/visualizer/events"));
  es.addEventListener("open", () => { $("conn-status").dataset.state = "open"; $("conn-status").textContent = "connected"; });
  es.addEventListener("error", () => {
    $("conn-status").dataset.state = "error";
    $("conn-status").textContent = "reconnecting…";
    // EventSource retries a dropped connection itself, but an HTTP error (a proxy's 502
    // while the server restarts, a 404) closes it for good: open a new one
    if (es.readyState === EventSource.CLOSED) setTimeout(connect, 3000);
  });
  es.addEventListener("snapshot", (e) => onUpdate(JSON.parse(e.data), e.lastEventId.split("-")[0]));
}

async function loadHistory() {
  // Paused view: every single step still in the server's ring buffer, not the coalesced updates.
  const res = await fetch(withKey("/visualizer/history"));
  if (!res.ok) throw new Error(`/visualizer/history answered ${res.status}`);
  const body = await res.json();
  if (body.entries.length) {
    state.frames = body.entries.map((s) => ({ ...s, events: s.events.map((e) => ({ ...e, step: s.step })) }));
    state.cursor = state.frames.length - 1;
  }
}

// ------------------------------------------------------------------ controls
async function pause() {
  state.live = false;
  $("btn-pause").textContent = "Resume";
  try {
    await loadHistory();
  } catch (e) {  // the server is down or refused: stay live rather than half-paused
    resume();
    $("demo-status").textContent = `cannot pause: ${e.message}`;
    return;
  }
  if (state.frames.length) render(state.frames[state.cursor]);
}

function resume() {
  state.live = true;
  $("btn-pause").textContent = "Pause";
  state.frames = state.frames.slice(-1);
  state.cursor = state.frames.length - 1;
  fetch(withKey("/visualizer/snapshot")).then((r) => (r.ok ? r.json() : null))
    .then((snap) => { if (snap && state.live) render(snap); })
    .catch(() => {});  // the server is down: the event stream draws the next step when it is back
}

async function stepBy(delta) {
  if (state.live) await pause();
  if (state.live || !state.frames.length) return;  // live: the pause failed
  state.cursor = Math.max(0, Math.min(state.frames.length - 1, state.cursor + delta));
  render(state.frames[state.cursor]);
}

async function jumpToStep(step) {
  if (state.live) await pause();  // clicking a bar while live pauses on that step
  if (state.live) return;  // the pause failed
  const i = state.frames.findIndex((f) => f.step === step);  // the first: the step that ran
  if (i >= 0) { state.cursor = i; render(state.frames[i]); }
}

// A mixed workload that shows chunking, prefix hits and decode batching at once.
// Prompts are token ids (ids 10..249 exist in every byte-level vocabulary), so the lengths
// are exact whatever the tokenizer: short ones, one of 2.5 chunks, and two that
// share a prefix with an earlier request (sent after it finished, so the radix cache hits).
function tokens(n, seed) {
  const out = [];
  let x = seed * 7919 + 17;
  for (let i = 0; i < n; i++) { x = (x * 1103515245 + 12345) % 2147483648; out.push(10 + (x % 240)); }
  return out;
}

async function sendDemo() {
  const modelsResponse = await fetch("/v1/models", { headers: authHeaders() });
  const models = await modelsResponse.json();
  if (!modelsResponse.ok) throw new Error(`/v1/models answered ${modelsResponse.status}: ${(models.error || {}).message}`);
  const ctx = models.data[0].max_model_len || 2048;
  const chunk = CONFIG.chunked_prefill_size > 0 ? CONFIG.chunked_prefill_size : 256;
  const maxNew = 24;
  // every prompt, shared prefix and tail together, fits the context with room for its output
  const limit = ctx - maxNew - 1;
  const cap = (n, out = maxNew) => Math.max(4, Math.min(n, ctx - out - 1));
  const sharedLen = cap(Math.min(Math.round(chunk * 0.8), limit - Math.round(chunk * 0.3)));
  const shared = tokens(sharedLen, 1);
  const withShared = (n, seed) => shared.concat(tokens(Math.max(1, Math.min(n, limit - sharedLen)), seed));
  const gen = (ids, rid, n = maxNew) => fetch("/generate", {
    method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ input_ids: ids, rid, sampling_params: { max_new_tokens: n, temperature: 0, ignore_eos: true } }),
  }).then(async (r) => ({ rid, ok: r.ok, body: await r.json() }));
  const tag = Date.now().toString(36).slice(-4);
  $("demo-status").textContent = "sending 7 requests…";
  const wave1 = [
    gen(tokens(cap(Math.round(chunk * 0.3)), 2), `A-short-${tag}`),
    gen(tokens(cap(Math.round(chunk * 2.5)), 3), `B-long-${tag}`),
    gen(tokens(cap(Math.round(chunk * 0.5)), 4), `C-short-${tag}`),
    gen(withShared(Math.round(chunk * 0.2), 5), `D-prefix-${tag}`),
    gen(tokens(cap(Math.round(chunk * 0.4), maxNew * 2), 6), `E-short-${tag}`, maxNew * 2),
  ];
  await wave1[3];  // D finished: its prompt is in the radix tree now
  const wave2 = [
    gen(withShared(Math.round(chunk * 0.2), 7), `F-hit-${tag}`),
    gen(withShared(Math.round(chunk * 0.3), 8), `G-hit-${tag}`),
  ];
  const results = await Promise.all(wave1.concat(wave2));
  // a server with a small pool may still refuse a prompt: say so, do not claim success
  const refused = results.filter((r) => !r.ok);
  // B is 2.5 chunks only where the context holds that many (the default: chunk = context)
  // (B alone fits one chunk then; it still splits if it shares a step's chunk budget with others)
  const hint = Math.round(chunk * 2.5) > limit ? " (B is at most one chunk long here: start the server with --chunked-prefill-size 256 to watch it split into three)" : "";
  $("demo-status").textContent = refused.length === 0 ? "demo done" + hint
    : `demo done; ${refused.length} of 7 refused: ${refused[0].rid}: ${(refused[0].body.error || {}).message}`;
}

function bindControls() {
  $("btn-pause").addEventListener("click", () => (state.live ? pause() : resume()));
  $("btn-back").addEventListener("click", () => stepBy(-1));
  $("btn-forward").addEventListener("click", () => stepBy(1));
  $("btn-demo").addEventListener("click", () => sendDemo().catch((e) => { $("demo-status").textContent = "demo failed: " + e; }));
  $("timeline").addEventListener("click", (e) => { const s = e.target.closest(".tl-step"); if (s) jumpToStep(Number(s.dataset.step)); });
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "INPUT") return;
    if (e.key === "ArrowLeft") { e.preventDefault(); stepBy(-1); }
    else if (e.key === "ArrowRight") { e.preventDefault(); stepBy(1); }
    else if (e.key === " ") { e.preventDefault(); state.live ? pause() : resume(); }
  });
}

bindControls();
connect();  // the first SSE update is the latest snapshot, so the page fills at once
