"""Online serving: throughput and latency of an OpenAI-compatible server under load.

The client (plain asyncio streams, streaming `/v1/completions`) sends N requests with random
prompts, all at once or as Poisson arrivals at --request-rate, at most
--max-concurrency in flight, and measures per request: TTFT (first streamed text), ITL
(gaps between streamed chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e.
Every request generates exactly its output length (minisgl: `ignore_eos`; transformers:
a `generation_config` with no EOS), so both servers do the same work.

    --base-url URL            benchmark a server that is already running
    --backend minisgl,hf      (default) start `minisgl serve`, then
                              `transformers serve --continuous-batching`, on the same model
                              and requests, one after the other; print both and the ratio

Why a hand-written HTTP client: the client shares the machine with the server it measures.
Through httpx it spent ~160 us of CPU per streamed chunk (0.85 s of a 10 s run on 2 cores),
time taken from the server's matmul threads; reading the chunked SSE stream straight off an
asyncio socket costs a fraction of that (SGLang's bench_serving uses aiohttp for the same
reason). It speaks just enough HTTP/1.1 for this: one POST per connection (TLS for
https://), a chunked or sized response body, `data:` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import common

READY_TIMEOUT_S = 300.0


def request_body(backend: str, model: str, prompt: str, max_tokens: int) -> Dict[str, Any]:
    body: Dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}  # the token count each server says it generated
    if backend == "hf":
        # transformers serve rejects unknown fields (422); its own escape hatch is a GenerationConfig
        body["generation_config"] = json.dumps({"do_sample": False, "eos_token_id": -1, "max_new_tokens": max_tokens})
    else:
        body["ignore_eos"] = True
    return body


class HTTPStatusError(RuntimeError):
    pass


async def _read_head(reader: asyncio.StreamReader) -> Tuple[int, Dict[str, str]]:
    """Status code and lower-cased headers of an HTTP/1.1 response."""
    status_line = await reader.readuntil(b"\r\n")
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise RuntimeError(f"not an HTTP response: {status_line[:100]!r}")
    headers: Dict[str, str] = {}
    while True:
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            return int(parts[1]), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def _body_pieces(reader: asyncio.StreamReader, headers: Dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: de-chunked, sized, or read to EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                return  # (trailers, if any, are not needed)
            piece = await reader.readexactly(size + 2)  # the chunk and its CRLF
            yield piece[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def post_stream_lines(url: str, body: Dict[str, Any]) -> AsyncIterator[bytes]:
    """POST `body` as JSON to `url` and yield the response body's lines as they arrive."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise ValueError(f"--base-url must be an http:// or https:// URL, got {url!r}")
    payload = json.dumps(body).encode()
    tls = u.scheme == "https"
    reader, writer = await asyncio.open_connection(
        u.hostname, u.port or (443 if tls else 80), ssl=True if tls else None, limit=1 << 20
    )
    try:
        writer.write(
            f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        status, headers = await _read_head(reader)
        pieces = _body_pieces(reader, headers)
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {b''.join([p async for p in pieces])[:300]!r}")
        pending = b""
        async for piece in pieces:
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                yield line
        if pending:
            yield pending
    finally:
        writer.close()


async def one_request(url: str, body: Dict[str, Any]) -> Dict[str, Any]:
    """Stream one completion; return its chunk arrival times relative to the send."""
    t0 = time.perf_counter()
    arrivals: List[float] = []
    usage: Optional[Dict[str, Any]] = None
    async for line in post_stream_lines(url, body):
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if any(c.get("text") for c in chunk.get("choices", [])):
            arrivals.append(time.perf_counter() - t0)
        usage = chunk.get("usage") or usage
    completion_tokens = usage.get("completion_tokens") if usage else None
    return {"arrivals": arrivals, "e2e": time.perf_counter() - t0, "output_len": body["max_tokens"],
            "completion_tokens": completion_tokens}  # fmt: skip


async def run_load(base_url: str, backend: str, model: str, prompts: List[str], output_lens: List[int],
                   request_rate: float, max_concurrency: int, seed: int) -> Dict[str, Any]:  # fmt: skip
    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency)

    async def limited(body: Dict[str, Any], delay: float) -> Dict[str, Any]:
        await asyncio.sleep(delay)
        async with sem:
            return await one_request(url, body)

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)  # Poisson arrivals
    t0 = time.perf_counter()
    bodies = [request_body(backend, model, p, o) for p, o in zip(prompts, output_lens)]
    results = await asyncio.gather(*(limited(b, d) for b, d in zip(bodies, delays)))
    wall = time.perf_counter() - t0
    return {"results": results, "wall": wall}


def report(name: str, run: Dict[str, Any]) -> Dict[str, float]:
    results, wall = run["results"], run["wall"]
    n_out = sum(r["output_len"] for r in results)
    # Both servers must do the same work: check each request's count against its server's usage.
    reported = [r["completion_tokens"] for r in results]
    if None in reported or sum(reported) != n_out:
        print(f"WARNING {name}: the server reported {reported.count(None)} requests without usage and "
              f"{sum(x or 0 for x in reported)} completion tokens for {n_out} requested", flush=True)
    common.print_result(f"{name}_completion_tokens", sum(x or 0 for x in reported), "tokens", f"server-reported; {n_out} requested")
    no_text = sum(not r["arrivals"] for r in results)
    if no_text:  # e.g. a server that never flushes text held back for an incomplete character
        common.print_result(f"{name}_requests_without_text", no_text, "requests", "left out of TTFT, ITL and TPOT")
    chunks = sum(len(r["arrivals"]) for r in results)
    ttft = [r["arrivals"][0] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tpot = [(r["e2e"] - r["arrivals"][0]) / (r["output_len"] - 1) for r in results if r["arrivals"] and r["output_len"] > 1]
    # credit what the server says it produced when it says it for every request (a server that
    # stopped short must not be paid for the tokens asked), else what was asked
    produced = sum(reported) if None not in reported else n_out
    tps = produced / wall
    common.print_result(f"{name}_output_tok_s", tps, "tok/s", f"wall {wall:.2f} s, {chunks} text chunks for {produced} tokens")
    common.print_result(f"{name}_req_s", len(results) / wall, "req/s")
    out = {"tok_s": tps}
    for metric, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", [r["e2e"] for r in results])):
        lat = common.print_latency(f"{name}_{metric}", xs)
        out.update({f"{metric}_{k}": v for k, v in lat.items()})
    return out


def start_server(backend: str, model_path: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if backend == "minisgl":
        cmd = [sys.executable, "-m", "minisgl", "serve", "--model", model_path, "--port", str(port),
               "--device", args.device, "--dtype", args.dtype, "--log-level", "warning"]  # fmt: skip
        env["PYTHONPATH"] = common.REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", model_path,
               "--device", args.device, "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--continuous-batching"]  # fmt: skip
    log = open(os.path.join(args.log_dir, f"{backend}-server.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, base_url: str) -> None:
    import httpx

    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready (see --log-dir)")
        try:
            if httpx.get(base_url + "/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {base_url} not ready after {READY_TIMEOUT_S:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (its children too)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def process_tree_cpu_s(root_pid: int) -> Dict[int, float]:
    """CPU seconds (user + system) of `root_pid` and of every process below it, from /proc ({} off Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parent, cpu = {}, {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # gone meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    tree, frontier = set(), {root_pid}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree}
    return {pid: cpu[pid] for pid in tree if pid in cpu}


def report_cpu(name: str, before: Dict[int, float], after: Dict[int, float], roles: Dict[int, str],
               client_s: float, wall: float) -> None:  # fmt: skip
    """Where the machine's CPU went during the load: the server's processes and this client.

    On a machine with few cores this is the cost that decides throughput: every second the
    HTTP process, the detokenizer or the client runs is taken from the scheduler's threads.
    """
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    by_role: Dict[str, float] = {}
    for pid, sec in used.items():
        role = roles.get(pid, "other")
        by_role[role] = by_role.get(role, 0.0) + sec
    parts = ", ".join(f"{role} {sec:.2f}" for role, sec in sorted(by_role.items(), key=lambda kv: -kv[1]) if sec >= 0.01)
    total = sum(used.values())
    common.print_result(f"{name}_server_cpu_s", total, "s", f"{total / wall:.2f} cores over the run: {parts}")
    common.print_result(f"{name}_client_cpu_s", client_s, "s", "this benchmark client")


def server_roles(backend: str, args: argparse.Namespace, root_pid: int) -> Dict[int, str]:
    """pid -> role: minisgl prints `minisgl <role> pid=N` for each child; the root serves HTTP."""
    roles = {root_pid: "http" if backend == "minisgl" else "server"}
    try:
        with open(os.path.join(args.log_dir, f"{backend}-server.log")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "minisgl" and parts[2].startswith("pid="):
                    roles[int(parts[2][4:])] = parts[1]
    except (OSError, ValueError):
        pass
    return roles


def bench_backend(backend: str, model_path: str, prompts: List[str], output_lens: List[int], args: argparse.Namespace,
                  base_url: Optional[str] = None) -> Dict[str, float]:  # fmt: skip
    proc = None
    if base_url is None:
        from minisgl.utils import free_port

        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        proc = start_server(backend, model_path, port, args)
    try:
        wait_ready(proc, base_url) if proc is not None else None
        # warm-up: one short request (HF builds its paged cache on the first one)
        asyncio.run(run_load(base_url, backend, model_path, prompts[:1], [2], float("inf"), 1, args.seed))
        cpu_before = process_tree_cpu_s(proc.pid) if proc is not None else {}
        client_before = time.process_time()
        run = asyncio.run(run_load(base_url, backend, model_path, prompts, output_lens, args.request_rate, args.max_concurrency, args.seed))
        client_s = time.process_time() - client_before
        stats = report(backend, run)
        if proc is not None:
            after = process_tree_cpu_s(proc.pid)
            report_cpu(backend, cpu_before, after, server_roles(backend, args, proc.pid), client_s, run["wall"])
        return stats
    finally:
        if proc is not None:
            stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_runtime_args(p)
    p.add_argument("--base-url", default=None, help="Benchmark this running server (model id: --served-model).")
    p.add_argument("--served-model", default=None, help="Model id to send with --base-url.")
    p.add_argument("--backend", default="minisgl,hf", help="Comma list of servers to start: minisgl, hf.")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("LO", "HI"))
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once).")
    p.add_argument("--max-concurrency", type=int, default=32, help="Clients in flight at once.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp", help="Where server logs go.")
    args = p.parse_args()
    model_path, shape = common.model_from_args(args, flops_floor=False)
    from minisgl.utils import get_tokenizer

    tok = get_tokenizer(model_path)
    ids, output_lens = common.random_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), shape.vocab, args.seed)
    prompts, prompt_tokens = common.text_prompts(tok, ids)  # the same text goes to both servers
    backends = ["url"] if args.base_url else [b.strip() for b in args.backend.split(",") if b.strip()]
    common.print_header(
        "online serving (OpenAI /v1/completions, streaming)",
        {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
         "prompt_tokens": prompt_tokens, "output_tokens": sum(output_lens), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency},
        # --base-url: the server's own settings apply; only the prompts come from this script's model
        {"base_url": args.base_url, "served_model": args.served_model or model_path, "prompts_tokenized_by": model_path}
        if args.base_url else
        {"model": model_path, "params": common.params_label(model_path, shape), "device": args.device, "dtype": args.dtype,
         "backends": backends, "server_threads": args.threads},
    )  # fmt: skip
    stats: Dict[str, Dict[str, float]] = {}
    for backend in backends:
        if backend == "url":
            stats[backend] = bench_backend("minisgl", args.served_model or model_path, prompts, output_lens, args, args.base_url)
        else:
            stats[backend] = bench_backend(backend, model_path, prompts, output_lens, args)
    if "minisgl" in stats and "hf" in stats:
        m, h = stats["minisgl"], stats["hf"]
        common.print_result("minisgl_vs_hf_throughput", common.ratio(m["tok_s"], h["tok_s"]), "x", "target >= 5")
        common.print_result("minisgl_vs_hf_ttft_p50", common.ratio(m["ttft_p50"], h["ttft_p50"]), "x", "target < 1")
        common.print_result("minisgl_vs_hf_ttft_p99", common.ratio(m["ttft_p99"], h["ttft_p99"]), "x", "target < 1")


if __name__ == "__main__":
    main()
