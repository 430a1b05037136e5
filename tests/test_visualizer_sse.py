"""The visualizer's data path: Scheduler PUB -> SnapshotHub (SUB thread) -> SSE at /visualizer/events.

Snapshots here are synthetic but follow docs/snapshot.md (`make_snapshot`); they travel
through a real ZMQ PUB socket and a real uvicorn server, as in `minisgl serve --visualize`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import httpx
import pytest
import zmq
from fastapi import FastAPI

from minisgl.managers.io_struct import SchedulerSnapshotOut, encode
from minisgl.server_args import PortArgs, ServerArgs
from minisgl.visualizer.snapshot import check_snapshot, kv_segments, merge_snapshots, step_summary, validate_snapshot
from minisgl.visualizer.sse import SnapshotHub, register_visualizer_routes


def make_snapshot(step: int, mode: str = "DECODE", events: Sequence[Dict[str, Any]] = (),
                  finished: Sequence[Dict[str, Any]] = (), num_radix_nodes: int = 4) -> Dict[str, Any]:  # fmt: skip
    """A schema-conforming snapshot: one waiting request, two running ones, a small tree."""
    children = [{"id": i, "len": 8, "lock_ref": i % 2, "children": []} for i in range(1, num_radix_nodes)]
    reqs = [{"rid": r, "extend_len": 1, "prefix_len": 40 + step, "cached_len": 0, "is_chunked": 0, "chunk_index": 0, "num_chunks": 0,
             "is_decode": True, "output_len": step, "max_new_tokens": 64, "draft_len": 0, "accepted_len": 0, "lora_id": None, "cache_key": None}
            for r in ("a", "b")]  # fmt: skip
    return {
        "step": step, "time": 1.7e9 + step, "forward_mode": mode,
        "log_line": f"Decode batch, #running-req: 2, step {step}",
        "waiting_queue": [{"rid": "w", "input_len": 300, "prefix_len": 0, "output_len": 0,
                           "waited_ms": 1.0 * step, "retracted": False, "retraction_count": 0, "priority": None, "lora_id": None, "cache_key": None}],
        "grammar_queue": [],
        "chunked_req": None,
        "batch": {"forward_mode": mode, "reqs": reqs},
        "running_batch": [{"rid": r["rid"], "input_len": 40, "output_len": step, "max_new_tokens": 64, "lora_id": None, "cache_key": None} for r in reqs],
        "adder": None,
        "memory": {"total": 4096, "available": 3000, "evictable": 500, "protected": 96, "used": 596,
                   "page_size": 1, "req_slots_total": 64, "req_slots_free": 62},
        "radix": {"num_nodes": num_radix_nodes, "total_tokens": 8 * (num_radix_nodes - 1), "evictable": 500,
                  "protected": 96, "tree": {"id": 0, "len": 0, "lock_ref": 1, "children": children}},
        "new_token_ratio": 0.7,
        "speculative": None,
        "events": list(events),
        "finished": list(finished),
    }  # fmt: skip


def _finished(rid: str) -> Dict[str, Any]:
    return {"rid": rid, "finish_reason": {"type": "length", "length": 16}, "output_len": 16,
            "queue_ms": 0.1, "schedule_ms": 2.0, "forward_ms": 30.0, "ttft_ms": 32.1, "e2e_ms": 120.0}  # fmt: skip


# Steps that carry an event the page must show even when the step itself is coalesced away.
SPECIAL_EVENTS = {
    37: {"type": "retract", "rid": "b", "detail": "KV cache full"},
    90: {"type": "finish", "rid": "a", "detail": "length"},
    141: {"type": "abort", "rid": "w", "detail": "client gone"},
}


def scenario(num_steps: int, radix_nodes: int = 4) -> List[Dict[str, Any]]:
    snaps = []
    for step in range(1, num_steps + 1):
        ev = SPECIAL_EVENTS.get(step)
        fin = [_finished(ev["rid"])] if ev and ev["type"] == "finish" else []
        snaps.append(make_snapshot(step, events=[ev] if ev else [], finished=fin, num_radix_nodes=radix_nodes))
    return snaps


# --------------------------------------------------------------------------- fixtures
class Publisher:
    """The scheduler's side: a PUB socket bound at visualizer_ipc_name, sending NOBLOCK."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.send_times: List[float] = []

    def send(self, snap: Dict[str, Any]) -> None:
        t0 = time.perf_counter()
        # (a PUB socket drops silently past its high-water mark: tests check the ring is whole)
        self.sock.send(encode(SchedulerSnapshotOut(snap["step"], json.dumps(snap))), zmq.NOBLOCK)
        self.send_times.append(time.perf_counter() - t0)

    def wait_subscribed(self, hub: SnapshotHub) -> None:
        """PUB drops messages until the SUB has joined: send step-0 probes until one arrives."""
        deadline = time.monotonic() + 10
        while hub.last_seq == 0:
            assert time.monotonic() < deadline, "the hub never subscribed"
            self.send(make_snapshot(0, mode="IDLE"))
            time.sleep(0.02)


class LiveApp:
    """A uvicorn server in a thread serving only the visualizer routes (`hub=None`: a reverse
    proxy whose server is down, answering every path with a 502)."""

    def __init__(self, hub: Optional[SnapshotHub], port: int = 0) -> None:
        import uvicorn
        from fastapi.responses import PlainTextResponse

        app = FastAPI()
        self.hits: List[str] = []  # the paths the 502 proxy answered

        def bad_gateway(path: str) -> PlainTextResponse:
            self.hits.append(path)
            return PlainTextResponse("Bad Gateway", status_code=502)

        if hub is None:
            app.add_api_route("/{path:path}", bad_gateway)
        else:
            args = ServerArgs(visualize=True, chunked_prefill_size=64, model_path="tiny")
            register_visualizer_routes(app, args, port_args=None, hub=hub)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # `port`: a restart on the same port
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(timeout=5)


@pytest.fixture()
def hub_pub(tmp_path: Any) -> Iterator[tuple]:
    port_args = PortArgs.init_new(str(tmp_path))
    hub = SnapshotHub(port_args.visualizer_ipc_name)
    hub.start()
    pub = Publisher(port_args.visualizer_ipc_name)
    pub.wait_subscribed(hub)
    yield hub, pub
    hub.close()
    pub.sock.close()


def read_sse(url: str, until_step: int, timeout: float = 20.0, connected: Optional[threading.Event] = None) -> List[Dict[str, Any]]:
    """Read /visualizer/events until an update for `until_step` arrives (`connected` is set at the first)."""
    updates: List[Dict[str, Any]] = []
    with httpx.stream("GET", url + "/visualizer/events", timeout=timeout) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        event_id: Optional[str] = None
        for line in resp.iter_lines():
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                update = json.loads(line[5:].strip())
                if connected is not None:
                    connected.set()
                assert event_id == f"{event_id.split('-')[0]}-{update['seq']}"  # "<hub instance>-<seq>"
                updates.append(update)
                if update["step"] >= until_step:
                    break
    return updates


# --------------------------------------------------------------------------- pure helpers
def test_synthetic_snapshots_follow_the_schema_and_broken_ones_are_named() -> None:
    assert validate_snapshot(make_snapshot(3)) == []
    broken = make_snapshot(3)
    del broken["memory"]
    broken["forward_mode"] = "PREFILL"
    with pytest.raises(ValueError, match="missing key 'memory'"):
        check_snapshot(broken)
    bad_event = make_snapshot(4, events=[{"type": "explode", "rid": "a"}])
    assert any("explode" in p for p in validate_snapshot(bad_event))


def test_kv_segments_sum_to_total_and_split_protected_out_of_used() -> None:
    # scheduler: used = total - available - evictable = 4096 - 3000 - 500 = 596, of which 96 are locked nodes
    seg = kv_segments({"total": 4096, "available": 3000, "evictable": 500, "protected": 96, "used": 596})
    assert seg == {"used": 500, "protected": 96, "evictable": 500, "free": 3000, "total": 4096}


def test_merge_keeps_newest_state_and_every_event_in_step_order() -> None:
    merged = merge_snapshots(scenario(100)[30:95])  # steps 31..95: the retract at 37, the finish at 90
    assert merged["step"] == 95 and merged["running_batch"][0]["output_len"] == 95
    assert [(e["type"], e["step"]) for e in merged["events"]] == [("retract", 37), ("finish", 90)]
    assert [f["rid"] for f in merged["finished"]] == ["a"] and merged["finished"][0]["step"] == 90
    assert [s["step"] for s in merged["steps"]] == list(range(31, 96))
    assert merged["coalesced_steps"] == 65


# --------------------------------------------------------------------------- through ZMQ and SSE
def test_hub_receives_every_published_step_in_order_and_keeps_a_bounded_ring(hub_pub: tuple) -> None:
    hub, pub = hub_pub
    for snap in scenario(600):
        pub.send(snap)
    deadline = time.monotonic() + 10
    while (hub.latest() or {}).get("step") != 600:
        assert time.monotonic() < deadline, f"hub stuck at {hub.latest()['step']}"
        time.sleep(0.02)
    steps = [snap["step"] for _, snap in hub.entries_after(0)]
    assert len(steps) == hub.history_size == 512  # the oldest fell out of the ring
    assert steps == list(range(600 - 511, 601))


def test_the_ring_is_bounded_by_bytes_too_and_keeps_the_newest_snapshot() -> None:
    # At 250 running requests 512 snapshots made Pause's /history a 44 MB answer.
    size = len(json.dumps(make_snapshot(1)))
    hub = SnapshotHub(history_size=8, history_bytes=5 * size + size // 2)
    for step in range(1, 21):
        hub.add(make_snapshot(step))
    assert [snap["step"] for _, snap in hub.entries_after(0)] == [16, 17, 18, 19, 20]  # 5 fit, not 8
    hub.history_bytes = 100 * size  # now the count bounds it, and the bytes it forgot are exact
    for step in range(21, 41):
        hub.add(make_snapshot(step))
    assert [snap["step"] for _, snap in hub.entries_after(0)] == list(range(33, 41))
    # /history's body is joined from the JSON the snapshots came as: the same as encoding them
    history = json.loads(hub.history_json(35, limit=3))
    assert history == {"last_seq": 40, "entries": [{**make_snapshot(s), "seq": s} for s in (36, 37, 38)]}
    huge = make_snapshot(41, finished=[_finished("x" * 200) for _ in range(400)])
    hub.history_bytes = size
    hub.add(huge)  # bigger than the whole budget: still the latest, alone in the ring
    assert [snap["step"] for _, snap in hub.entries_after(0)] == [41] and hub.latest() is huge
    with pytest.raises(ValueError, match="history_size must be >= 1"):
        SnapshotHub(history_size=0)  # (its first add() was an IndexError)


def test_sse_stream_is_in_step_order_coalesced_and_keeps_retract_finish_abort(hub_pub: tuple) -> None:
    hub, pub = hub_pub
    app = LiveApp(hub)
    try:
        page = httpx.get(app.url + "/visualizer")
        assert page.status_code == 200 and 'id="waiting-queue"' in page.text and '"chunked_prefill_size": 64' in page.text
        assert httpx.get(app.url + "/visualizer/static/visualizer.js").status_code == 200
        result: Dict[str, Any] = {}
        connected = threading.Event()
        reader = threading.Thread(target=lambda: result.update(updates=read_sse(app.url, 200, connected=connected)))
        reader.start()
        assert connected.wait(20), "the SSE client never got its first update"  # the latest (probe) snapshot
        for snap in scenario(200):
            pub.send(snap)
            time.sleep(0.0005)  # ~2000 steps/s: far faster than the 20 updates/s a browser gets
        reader.join(timeout=20)
        updates = result["updates"]
        seqs = [u["seq"] for u in updates]
        assert seqs == sorted(set(seqs)), "SSE updates out of order or repeated"
        steps = [s["step"] for u in updates for s in u["steps"]]
        assert steps == sorted(steps) and set(range(1, 201)) <= set(steps), "a step is missing from the timeline"
        assert len(updates) < 60, f"not coalesced: {len(updates)} updates for 200 steps"
        kept = [(e["type"], e["rid"], e["step"]) for u in updates for e in u["events"]]
        assert kept == [("retract", "b", 37), ("finish", "a", 90), ("abort", "w", 141)]
        assert [f["rid"] for u in updates for f in u["finished"]] == ["a"]
        latest = httpx.get(app.url + "/visualizer/snapshot").json()
        assert latest["step"] == 200
        history = httpx.get(app.url + "/visualizer/history", params={"after": seqs[-1] - 3}).json()
        assert [e["step"] for e in history["entries"]] == [198, 199, 200]
        bad = httpx.get(app.url + "/visualizer/history", params={"limit": -1})  # (out[:-1] dropped the newest)
        assert bad.status_code in (400, 422) and "limit" in bad.text  # (the server's handler makes a 422 a 400)
    finally:
        app.stop()


def test_a_slow_sse_client_does_not_slow_the_publisher_or_the_hub(hub_pub: tuple) -> None:
    hub, pub = hub_pub
    app = LiveApp(hub)
    slow = socket.create_connection(("127.0.0.1", app.port))
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.sendall(b"GET /visualizer/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        assert b"200" in slow.recv(64)  # connected; from now on it reads nothing while we publish
        big = scenario(1500, radix_nodes=60)  # ~10 KB each: the slow reader's buffers fill quickly
        t0 = time.perf_counter()
        for snap in big:
            pub.send(snap)
        publish_s = time.perf_counter() - t0
        deadline = time.monotonic() + 20
        while (hub.latest() or {}).get("step") != 1500:
            assert time.monotonic() < deadline, "the hub fell behind the publisher"
            time.sleep(0.02)
        steps = [snap["step"] for _, snap in hub.entries_after(0)]
        assert steps == list(range(steps[0], 1501)), "a snapshot was dropped on the way"
        # A NOBLOCK send never waits for readers; the median (not the max, which the OS
        # scheduler of a loaded 2-core machine can inflate) shows sends stayed cheap.
        median_send = sorted(pub.send_times)[len(pub.send_times) // 2]
        assert median_send < 0.005, f"the median send took {median_send * 1e3:.1f} ms"
        assert publish_s < 5.0
        # a fast client connecting now still gets the latest state at once
        fast = read_sse(app.url, until_step=1500, timeout=10)
        assert fast[0]["step"] == 1500
    finally:
        slow.close()
        app.stop()


def _first_update(url: str, last_event_id: str) -> Dict[str, Any]:
    headers = {"Last-Event-ID": last_event_id.encode("latin-1")}
    with httpx.stream("GET", url + "/visualizer/events", headers=headers, timeout=5) as resp:
        assert resp.status_code == 200
        data = next(line for line in resp.iter_lines() if line.startswith("data:"))
    return json.loads(data[5:])


def test_a_browser_reconnecting_to_the_same_server_gets_the_steps_it_missed() -> None:
    hub = SnapshotHub()
    for step in range(1, 10):
        hub.add(make_snapshot(step))
    app = LiveApp(hub)
    try:
        update = _first_update(app.url, hub.event_id(6))
        assert (update["seq"], [s["step"] for s in update["steps"]], update["missed_steps"]) == (9, [7, 8, 9], 0)
        # the same seq from a server that restarted (another instance): a fresh page, not "up to date"
        assert _first_update(app.url, "0badf00d-9")["steps"] == [step_summary(make_snapshot(9))]
    finally:
        app.stop()


@pytest.mark.parametrize("last_event_id", ["00000000-1000", "1000", "\u00b2", "9" * 5000])
def test_a_browser_reconnecting_after_a_server_restart_gets_the_new_stream(last_event_id: str) -> None:
    # The browser's Last-Event-ID comes from the old server (or is junk); this hub counts
    # from 1. "²" passes str.isdigit() and 5,000 digits pass it too, but int() refused both: a 500.
    hub = SnapshotHub()
    for step in range(1, 5):
        hub.add(make_snapshot(step))
    app = LiveApp(hub)
    try:
        update = _first_update(app.url, last_event_id)
        assert (update["seq"], update["step"], update["missed_steps"]) == (4, 4, 0)  # a fresh page: the latest
    finally:
        app.stop()
