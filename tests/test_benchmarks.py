"""The benchmark scripts keep working: each runs at a tiny size (seconds) and must print
its header and the RESULT lines that docs/benchmarks.md quotes, with sane values."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from typing import Any, Dict, List

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = ["--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
              "--inter", "128", "--vocab", "512", "--max-pos", "1024", "--threads", "1"]  # fmt: skip


def run_script(name: str, args: List[str], cache: str, timeout: float = 240) -> Dict[str, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    env.pop("TRITON_INTERPRET", None)  # the CPU path needs no kernels
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", name), *TINY_MODEL, "--model-cache", cache, *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "machine:" in proc.stdout and "workload:" in proc.stdout and "config:" in proc.stdout
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, key, value = line.split()[:3]
            results[key] = float(value)
    return results


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("bench-models"))


def test_offline_reports_throughput_floor_and_hf_ratio(cache: str) -> None:
    r = run_script("bench_offline.py", ["--num-requests", "4", "--input-len", "16", "32", "--output-len", "4", "8",
                                        "--decode-batch", "4", "--compare", "hf", "--visualize-overhead"], cache)  # fmt: skip
    for key in ("minisgl_output_tok_s", "minisgl_prefill_tok_s", "minisgl_decode_tok_s", "floor_output_tok_s",
                "minisgl_vs_floor", "decode_step_ms", "decode_step_floor_ms", "hf_static_output_tok_s",
                "hf_cb_output_tok_s", "minisgl_vs_best_hf", "minisgl_visualize_output_tok_s"):  # fmt: skip
        assert r[key] > 0 and math.isfinite(r[key]), key
    assert math.isfinite(r["visualize_overhead_pct"])
    assert r["decode_step_batch"] == 4
    # each ratio is the quotient of the numbers printed beside it (RESULT lines keep 4 digits)
    approx = lambda x: pytest.approx(x, rel=2e-3)  # noqa: E731
    assert r["minisgl_vs_floor"] == approx(r["minisgl_output_tok_s"] / r["floor_output_tok_s"])
    assert r["minisgl_vs_best_hf"] == approx(r["minisgl_output_tok_s"] / max(r["hf_static_output_tok_s"], r["hf_cb_output_tok_s"]))
    assert r["decode_step_vs_floor"] == approx(r["decode_step_ms"] / r["decode_step_floor_ms"])


def test_chunked_prefill_reports_itl_for_every_config(cache: str) -> None:
    r = run_script("bench_chunked_prefill.py", ["--num-decode", "3", "--long-len", "200", "--chunk-sizes", "64", "128",
                                                "--pre-steps", "2", "--post-steps", "2"], cache)  # fmt: skip
    for name in ("off", "chunk64", "chunk128", "mixed64", "mixed128"):
        assert r[f"{name}_itl_p50"] > 0 and r[f"{name}_itl_p99"] >= r[f"{name}_itl_p50"]
    assert r["mixed64_itl_p99_vs_off"] == pytest.approx(r["mixed64_itl_p99"] / r["off_itl_p99"], rel=2e-3)


def test_prefix_cache_hits_and_keeps_outputs(cache: str) -> None:
    r = run_script("bench_prefix_cache.py", ["--num-requests", "3", "--prefix-len", "128", "--output-len", "4"], cache)
    assert r["cache_off_hit_rate"] == 0
    assert r["cache_on_hit_rate"] > 0.5  # 128 of ~170 prompt tokens are the shared prefix
    assert r["same_outputs"] == 1  # the cache must not change greedy outputs
    assert r["cache_on_vs_off_throughput"] > 0


def test_speculative_keeps_outputs_and_reports_every_point(cache: str) -> None:
    """Speculation on and off on the same greedy requests: every output identical, and the random
    model's loops accepted (more than one token per verify pass, fewer decode passes)."""
    r = run_script("bench_speculative.py", ["--workloads", "loop", "text", "--batch-sizes", "1", "3", "--min-requests", "2",
                                            "--output-len", "12", "--num-draft-tokens", "4", "--repeats", "1"], cache)  # fmt: skip
    for tag in ("loop_bs1", "loop_bs3", "text_bs1", "text_bs3"):
        assert r[f"{tag}_ngram4_same_outputs"] == 1, tag  # speculation must not change a greedy output
        for key in ("off_output_tok_s", "ngram4_output_tok_s", "off_pass_ms", "ngram4_pass_ms"):
            assert r[f"{tag}_{key}"] > 0 and math.isfinite(r[f"{tag}_{key}"]), (tag, key)
        assert 1 <= r[f"{tag}_ngram4_accept_len"] <= 4  # at most the 3 drafts + the bonus token
        assert r[f"{tag}_off_decode_passes"] == 11 * (2 if tag.endswith("bs1") else 1)  # 11 decode steps per round
        assert r[f"{tag}_ngram4_decode_passes"] <= r[f"{tag}_off_decode_passes"]
        assert r[f"{tag}_ngram4_vs_off"] == pytest.approx(r[f"{tag}_ngram4_output_tok_s"] / r[f"{tag}_off_output_tok_s"], rel=2e-3)
    assert r["loop_bs1_ngram4_accept_len"] > 1.5 and r["loop_bs1_ngram4_decode_passes"] < 22


def test_scheduler_overhead_splits_the_step(cache: str) -> None:
    r = run_script("bench_scheduler_overhead.py", ["--batch-sizes", "1", "4", "--target-batch", "4", "--steps", "3"], cache)
    for tag in ("tiny_bs1", "tiny_bs4", "model_bs4"):
        assert r[f"{tag}_model_ms"] > 0 and r[f"{tag}_scheduler_ms"] > 0
        assert 0 < r[f"{tag}_overhead_share"] < 1


def test_serving_against_minisgl_server(cache: str) -> None:
    """Only minisgl here (transformers serve takes ~10 s to start); the HF path shares the client."""
    r = run_script("bench_serving.py", ["--backend", "minisgl", "--num-requests", "4", "--input-len", "16", "32",
                                        "--output-len", "4", "8", "--max-concurrency", "4", "--log-dir", cache],
                   cache, timeout=300)  # fmt: skip
    assert r["minisgl_output_tok_s"] > 0
    assert 4 * 4 <= r["minisgl_completion_tokens"] <= 4 * 8  # the server's usage: every request ran to its length
    assert "minisgl_requests_without_text" not in r
    assert 0 < r["minisgl_ttft_p50"] <= r["minisgl_e2e_p99"]
    assert r["minisgl_server_cpu_s"] > 0 and r["minisgl_client_cpu_s"] > 0  # where the machine's CPU went


def test_kernel_bench_smoke_reports_every_kernel() -> None:
    """bench_kernels.py is the GPU check's kernel table; --smoke runs it under the interpreter."""
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_kernels.py"), "--smoke"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "machine:" in proc.stdout and "workload:" in proc.stdout and "config:" in proc.stdout
    keys = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    for kernel in ("decode", "extend", "store_kv", "fused_add_rmsnorm", "rotary"):
        assert {f"{kernel}_gbs", f"{kernel}_vs_torch"} <= keys, kernel


def test_flops_floor_counts_only_the_work_generation_does() -> None:
    """A prompt of 10 tokens and 3 output tokens: 10 + 2 tokens go through the layers, 3 through lm_head."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    shape = common.ModelShape(hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, inter=16, vocab=32)
    head = 8 * 32
    body = shape.matmul_params() - head
    assert shape.workload_flops(10, 3, 1) == 2 * (body * 12 + head * 3)
    assert shape.workload_flops(20, 6, 2) == 2 * shape.workload_flops(10, 3, 1)


def test_a_moe_model_is_refused_only_where_a_flops_floor_is_computed(tmp_path: Any) -> None:
    """ModelShape counts a dense decoder's weights; a MoE config's intermediate_size would give a
    floor off by the expert count, so bench_offline refuses a MoE --model, saying why (also when the
    config leaves the expert count to its class default), and the scripts without a floor take it."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    config = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 2048}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mixture-of-experts model \\(8 experts\\).*benchmark a dense model"):
        common.shape_from_config(str(tmp_path))
    shape = common.shape_from_config(str(tmp_path), flops_floor=False)
    assert shape.vocab == 512 and common.params_label(str(tmp_path), shape) == "n/a (mixture of experts)"
    dense = {**config, "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    shape = common.shape_from_config(str(tmp_path))
    assert common.params_label(str(tmp_path), shape) == shape.matmul_params() > 0


def test_text_prompts_tokenize_back_to_the_workload_lengths() -> None:
    """bench_serving sends text; the servers must prefill the prompt lengths the workload line states."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    from minisgl.test_utils import train_tokenizer

    tok = train_tokenizer(2048)
    ids, _ = common.random_requests(16, (20, 60), (1, 1), 2048, seed=0)
    naive = sum(len(tok.encode(tok.decode(x), add_special_tokens=False)) for x in ids)
    texts, total = common.text_prompts(tok, ids)
    lens = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    assert total == sum(lens)
    assert naive > 1.1 * sum(map(len, ids)) and total <= 1.01 * sum(map(len, ids))
    assert sum(n == len(x) for n, x in zip(lens, ids)) >= 13 and max(abs(n - len(x)) for n, x in zip(lens, ids)) <= 2


def _canned_http_server(response: bytes) -> "tuple[asyncio.AbstractServer, str]":
    """An asyncio server on a free port that answers any request with `response` and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        sizes = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        length = int(sizes[0])
        await reader.readexactly(length)
        for i in range(0, len(response), 7):  # dribble it out: chunk and line boundaries fall anywhere
            writer.write(response[i:i + 7])
            await writer.drain()
        writer.close()

    async def start() -> "tuple[asyncio.AbstractServer, str]":
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"

    return start()  # type: ignore[return-value]


def test_serving_client_reads_chunked_sse_and_reports_http_errors() -> None:
    """bench_serving's own HTTP client: de-chunks the body, splits lines, and raises on a non-200."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import bench_serving
    finally:
        sys.path.pop(0)
    events = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n'
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (events[:10], events[10:45], events[45:])) + b"0\r\n\r\n"
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    error = b'{"error":"too long"}'
    bad = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)

    async def run() -> None:
        server, url = await _canned_http_server(ok)
        async with server:
            lines = [line async for line in bench_serving.post_stream_lines(url, {"x": 1})]
            assert [line for line in lines if line] == events.split(b"\n\n")[:3] and lines[-1] == b""
            out = await bench_serving.one_request(url, {"max_tokens": 2})
            assert len(out["arrivals"]) == 2 and out["output_len"] == 2
        server, url = await _canned_http_server(bad)
        async with server:
            with pytest.raises(bench_serving.HTTPStatusError, match="HTTP 400"):
                [line async for line in bench_serving.post_stream_lines(url, {"x": 1})]
        with pytest.raises(ValueError, match="http:// or https://"):
            [line async for line in bench_serving.post_stream_lines("ftp://127.0.0.1/v1/completions", {"x": 1})]

    asyncio.run(run())
