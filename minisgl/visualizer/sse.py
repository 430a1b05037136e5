"""Live visualizer transport (stage 6, HTTP side). In: SchedulerSnapshotOut over ZMQ PUB. Out: SSE to browsers.

    Scheduler --PUB (visualizer_ipc_name, NOBLOCK)--> SnapshotHub (thread, SUB) --SSE--> browsers
                                                       latest + ring buffer of recent steps

`SnapshotHub` owns the snapshots the HTTP process has seen: the latest one and a
ring buffer of the last `history_size` steps (the page steps back through it).
A background thread drains the SUB socket as fast as the scheduler publishes, so
nothing a browser does can push back on the scheduler: the PUB side sends with
NOBLOCK and a slow reader only makes *its own* SSE stream skip ahead.

Each SSE client gets at most `max_rate_hz` updates per second. An update that
stands for several scheduler steps is `merge_snapshots` of them: the newest state
plus every event (arrive, chunk, retract, finish, abort) and finished request of
the steps in between, so coalescing never loses one.

`register_visualizer_routes(app, server_args, port_args)` adds, only when the
server runs with `--visualize`:
    GET /visualizer            the page (jinja2 template, web/templates/visualizer.html)
    GET /visualizer/events     SSE; each event is one (merged) snapshot, id = "<hub instance>-<seq>"
    GET /visualizer/snapshot   the latest snapshot as JSON (null before the first step)
    GET /visualizer/history    the ring buffer (?after=<seq>&limit=<n>)
    /visualizer/static/...     plain JS + CSS, no external network
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import threading
from collections import deque
from typing import Any, AsyncIterator, Deque, Dict, List, Optional, Tuple

from fastapi import Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from minisgl.visualizer.render import web_dir
from minisgl.visualizer.snapshot import merge_snapshots, validate_snapshot

logger = logging.getLogger("minisgl.visualizer")

DEFAULT_HISTORY_SIZE = 512
# The ring is bounded by bytes too: at 250 running requests the 512 snapshots held 123 MB
# and /history (what Pause loads) was a 44 MB answer that took seconds to build.
DEFAULT_HISTORY_BYTES = 32 * 2**20
DEFAULT_MAX_RATE_HZ = 20.0
_SUB_POLL_MS = 100  # how often the receiver thread checks for close()
_EVENT_ID = re.compile(r"([0-9a-f]{8})-([0-9]{1,18})")  # "<hub instance>-<seq>", as `event_id` writes it
_SUB_RCVHWM = 10000  # snapshots queued in ZMQ before the SUB side drops (never reached in practice)


class SnapshotHub:
    """Latest snapshot + ring buffer of recent ones, fed by a ZMQ SUB thread or by `add`.

    Entries are `(seq, snapshot)`; `seq` counts snapshots received (1, 2, ...). It is not
    the scheduler's `step`: the scheduler may publish twice for one step (a request arrives
    while nothing runs), and the page needs a key that always grows. The SSE event id is
    `instance-seq`: a restarted server's hub counts from 1 again, and a browser's
    Last-Event-ID from the old one must not pass for a seq of the new one.
    """

    def __init__(self, ipc_name: Optional[str] = None, history_size: int = DEFAULT_HISTORY_SIZE,
                 max_rate_hz: float = DEFAULT_MAX_RATE_HZ, history_bytes: int = DEFAULT_HISTORY_BYTES) -> None:  # fmt: skip
        if history_size < 1:
            raise ValueError(f"history_size must be >= 1 (the latest snapshot is always kept), got {history_size}")
        self.ipc_name = ipc_name
        self.history_size = history_size
        self.history_bytes = history_bytes
        self.min_interval = 1.0 / max_rate_hz
        self._entries: Deque[Tuple[int, Dict[str, Any]]] = deque(maxlen=history_size)
        self._texts: Deque[str] = deque(maxlen=history_size)  # each entry's JSON, beside it (/history)
        self._total_bytes = 0
        self._seq = 0
        self.instance = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ feeding
    def add(self, snap: Dict[str, Any], text: Optional[str] = None) -> int:
        """Record one snapshot and its JSON `text` (encoded here if not given); returns its
        sequence number (0 if it was rejected). The oldest entries leave the ring when it
        holds more than `history_size` of them or `history_bytes` of JSON in all; the newest
        stays."""
        problems = validate_snapshot(snap)
        if problems:
            logger.warning("dropping an invalid scheduler snapshot: %s", "; ".join(problems[:3]))
            return 0
        if text is None:
            text = json.dumps(snap)
        with self._lock:
            if len(self._entries) == self.history_size:
                self._total_bytes -= len(self._texts[0])  # append() below drops it
            self._seq += 1
            self._entries.append((self._seq, snap))
            self._texts.append(text)
            self._total_bytes += len(text)
            while self._total_bytes > self.history_bytes and len(self._entries) > 1:
                self._entries.popleft()
                self._total_bytes -= len(self._texts.popleft())
            return self._seq

    def start(self) -> None:
        """Start the SUB receiver thread (needs `ipc_name`)."""
        if self.ipc_name is None:
            raise ValueError("SnapshotHub.start() needs the scheduler's visualizer_ipc_name")
        self._thread = threading.Thread(target=self._receive_loop, name="minisgl-visualizer-sub", daemon=True)
        self._thread.start()

    def _receive_loop(self) -> None:
        import zmq

        from minisgl.managers.io_struct import SchedulerSnapshotOut, decode

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, _SUB_RCVHWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.ipc_name)
        try:
            while not self._closed.is_set():
                if not sock.poll(_SUB_POLL_MS):
                    continue
                msg = decode(sock.recv())
                if isinstance(msg, SchedulerSnapshotOut):
                    self.add(json.loads(msg.snapshot_json), msg.snapshot_json)
        finally:
            sock.close()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # ------------------------------------------------------------------ reading
    @property
    def last_seq(self) -> int:
        return self._seq

    def event_id(self, seq: int) -> str:
        return f"{self.instance}-{seq}"

    def seq_of_event_id(self, event_id: str) -> Optional[int]:
        """The seq of a Last-Event-ID this hub sent; None for any other (another server's,
        or junk), which makes the browser a fresh page."""
        m = _EVENT_ID.fullmatch(event_id)
        return int(m.group(2)) if m and m.group(1) == self.instance else None

    def latest(self) -> Optional[Dict[str, Any]]:
        with self._lock:
            return self._entries[-1][1] if self._entries else None

    def history_json(self, after: int, limit: Optional[int] = None) -> str:
        """/history's body, `{"last_seq", "entries": [snapshot + "seq", ...]}`, joined from the
        JSON each snapshot arrived as: a 32 MiB answer re-encoded held the GIL (and so every
        other request, worker thread or not) for over half a second."""
        with self._lock:
            picked = [(seq, text) for (seq, _), text in zip(self._entries, self._texts) if seq > after]
            last_seq = self._seq
        picked = picked[:limit] if limit is not None else picked
        entries = ",".join(f'{{"seq": {seq}, {text[1:]}' if text != "{}" else f'{{"seq": {seq}}}' for seq, text in picked)
        return f'{{"last_seq": {last_seq}, "entries": [{entries}]}}'

    def entries_after(self, seq: int, limit: Optional[int] = None) -> List[Tuple[int, Dict[str, Any]]]:
        """Ring-buffer entries with sequence number > seq, oldest first (at most `limit`, the oldest)."""
        with self._lock:
            out = [e for e in self._entries if e[0] > seq]
        return out[:limit] if limit is not None else out

    async def updates(self, after_seq: Optional[int] = None) -> AsyncIterator[Dict[str, Any]]:
        """Merged snapshots for one SSE client, at most `max_rate_hz` per second, in step order.

        `after_seq=None` (a fresh page) starts from the latest snapshot; a reconnecting
        browser passes the seq of its Last-Event-ID and gets everything it missed that is
        still in the ring buffer (`missed_steps` counts what fell out of it). A seq past
        this hub's last one cannot be waited for: that browser is a fresh page too.
        """
        if after_seq is not None and after_seq > self._seq:
            after_seq = None
        last = max(self._seq - 1, 0) if after_seq is None else after_seq
        while not self._closed.is_set():
            pending = self.entries_after(last)
            if not pending:
                await asyncio.sleep(self.min_interval)
                continue
            update = merge_snapshots([snap for _, snap in pending])
            update["seq"] = pending[-1][0]
            update["missed_steps"] = max(pending[0][0] - last - 1, 0)
            last = pending[-1][0]
            yield update
            await asyncio.sleep(self.min_interval)  # the rate limit: later steps merge into the next update


# --------------------------------------------------------------------------- routes
def _page_config(server_args: Any, hub: SnapshotHub) -> Dict[str, Any]:
    """What the page needs to know about the server (sizes of the demo workload, labels)."""
    return {
        "chunked_prefill_size": server_args.chunked_prefill_size,
        "page_size": server_args.page_size,
        "max_running_requests": server_args.max_running_requests,
        "schedule_policy": server_args.schedule_policy,
        "enable_mixed_chunk": server_args.enable_mixed_chunk,
        "speculative_algorithm": server_args.speculative_algorithm,  # (the legend's draft and VERIFY swatches)
        "model": server_args.served_model_name or server_args.model_path,
        "history_size": hub.history_size,
        "max_rate_hz": round(1.0 / hub.min_interval, 3),
    }


def register_visualizer_routes(app: Any, server_args: Any, port_args: Any, hub: Optional[SnapshotHub] = None) -> SnapshotHub:
    """Add the /visualizer routes to `app` and start a hub on `port_args.visualizer_ipc_name`.

    Pass `hub` to serve an existing one (tests feed it directly); it is then not started here.
    The hub stops when the app's lifespan ends.
    """
    if hub is None:
        hub = SnapshotHub(port_args.visualizer_ipc_name)
        hub.start()
    web = web_dir()
    templates = Jinja2Templates(directory=str(web / "templates"))
    config = _page_config(server_args, hub)
    # embedded in a <script> tag: "<" escaped so no value can close it
    config_json = json.dumps(config).replace("<", "\\u003c")
    app.state.visualizer_hub = hub

    @app.get("/visualizer", response_class=HTMLResponse)
    async def visualizer_page(request: Request) -> Any:
        return templates.TemplateResponse(request, "visualizer.html", {"config": config, "config_json": config_json})

    @app.get("/visualizer/snapshot")
    async def visualizer_snapshot() -> Any:
        return JSONResponse(hub.latest())

    @app.get("/visualizer/history")
    async def visualizer_history(after: int = 0, limit: int = Query(DEFAULT_HISTORY_SIZE, ge=0)) -> Any:
        return Response(hub.history_json(after, limit), media_type="application/json")

    @app.get("/visualizer/events")
    async def visualizer_events(request: Request) -> Any:
        after = hub.seq_of_event_id(request.headers.get("last-event-id", ""))

        async def events() -> AsyncIterator[ServerSentEvent]:
            async for update in hub.updates(after):
                yield ServerSentEvent(data=json.dumps(update), event="snapshot", id=hub.event_id(update["seq"]))

        return EventSourceResponse(events(), ping=15)

    app.mount("/visualizer/static", StaticFiles(directory=str(web / "static")), name="visualizer_static")
    _close_with_lifespan(app, hub)
    return hub


def _close_with_lifespan(app: Any, hub: SnapshotHub) -> None:
    """Stop the hub's thread when the app shuts down (Starlette 1.x has only lifespans)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        try:
            async with inner(app_) as state:
                yield state
        finally:
            hub.close()

    app.router.lifespan_context = lifespan
