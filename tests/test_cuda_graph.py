"""Decode steps replayed from CUDA graphs (model_executor/cuda_graph_runner.py).

On the CPU: the flags' checks, the buckets, when graphs are off and why, and the replay's
padding, through the runner's eager mode (`capture=False`: the same static-buffer forward a graph
records, with the Triton kernels in the interpreter). On a GPU (benchmarks/gpu_check.sh): real
captures give the eager forward's greedy tokens, with speculative decoding too.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any, Dict, List

import pytest
from forward_helpers import BatchDriver, make_runner

from minisgl import Engine
from minisgl.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes, cuda_graph_disabled_reason
from minisgl.models.model_config import ModelConfig
from minisgl.server_args import ServerArgs, resolve_server_args

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs are captured on a GPU only (benchmarks/gpu_check.sh runs these)")


def test_buckets_are_sglangs_and_end_at_the_largest_batch() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[4:], sizes[5:]))


def test_the_flags_refuse_what_would_be_ignored(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="--cuda-graph-max-bs sizes the CUDA graphs that --disable-cuda-graph turns off"):
        ServerArgs(disable_cuda_graph=True, cuda_graph_max_bs=8)
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be >= 1"):
        ServerArgs(cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="none is captured: drop it"):
        resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", cuda_graph_max_bs=8))
    # the CPU never captures: asking for none is what already happens
    assert resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", disable_cuda_graph=True)).disable_cuda_graph


def test_graphs_are_off_with_a_reason_where_they_cannot_be_replayed(tiny_model: str, tiny_model_factory: Any) -> None:
    dense = ModelConfig.from_pretrained(tiny_model)
    moe = ModelConfig.from_pretrained(tiny_model_factory("qwen3_moe"))
    gpu = ServerArgs(model_path=tiny_model, device="cuda", dtype="bfloat16", attention_backend="triton", kv_cache_dtype="bfloat16")
    assert cuda_graph_disabled_reason(gpu, dense) is None
    assert "MoE" in str(cuda_graph_disabled_reason(gpu, moe))
    assert "use triton" in str(cuda_graph_disabled_reason(dataclasses.replace(gpu, attention_backend="torch"), dense))
    assert "--disable-cuda-graph" == cuda_graph_disabled_reason(dataclasses.replace(gpu, disable_cuda_graph=True), dense)
    assert "embedding" in str(cuda_graph_disabled_reason(dataclasses.replace(gpu, is_embedding=True), dense))
    assert "--device cuda" in str(cuda_graph_disabled_reason(dataclasses.replace(gpu, device="cpu"), dense))


def _decode_batch_of(driver: BatchDriver, prompts: List[List[int]]) -> Any:
    """Prefill prompts (eagerly) and return the driver's requests and each one's greedy next token."""
    reqs = [driver.new_req() for _ in prompts]
    logits = driver.extend(reqs, prompts).next_token_logits
    return reqs, logits.argmax(-1).tolist()


def test_a_padded_replay_writes_kv_only_to_its_own_slots_and_the_padding_slot(tiny_model: str) -> None:
    """A batch of 3 replays the bucket of 4. The 4th row of the static buffers still names the slot
    a batch of 4 wrote before: left as it was, the replay would write K/V there, into a slot a live
    request owns."""
    runner = make_runner(tiny_model, attention_backend="triton", device="cuda" if ON_GPU else "cpu", max_total_tokens=256)
    graphs = CudaGraphRunner(runner, max_bs=4, capture=ON_GPU)
    runner.cuda_graph_runner = graphs
    driver = BatchDriver(runner)
    reqs, next_ids = _decode_batch_of(driver, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]])
    driver.decode(reqs, next_ids)  # bs 4: the static buffers' 4th row now names reqs[3]'s new slot
    assert runner.used_cuda_graph and graphs.num_replays == 1
    live_slot = reqs[3].slots[-1]
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(0)
    sentinel = 1234.5
    k_buf[live_slot] = sentinel
    v_buf[live_slot] = sentinel
    k_buf[0] = -sentinel
    out = driver.decode(reqs[:3], [1, 2, 3])  # bs 3, padded to 4
    assert graphs.num_replays == 2 and out.next_token_logits.shape[0] == 3
    assert bool((k_buf[live_slot] == sentinel).all()) and bool((v_buf[live_slot] == sentinel).all()), "the padding row wrote into a live slot"
    assert bool(k_buf[0].ne(-sentinel).all()), "the padding row's K/V should go to padding slot 0"


def _greedy(model_path: str, prompts: List[List[int]], max_new: List[int], **server_args: Any) -> Dict[str, Any]:
    engine = Engine(model_path, max_total_tokens=2048, dtype="float32", **server_args)
    try:
        outs = engine.generate(
            input_ids=prompts, sampling_params=[{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in max_new]
        )
        runner = engine.model_runner.cuda_graph_runner
        return {"tokens": [o["output_ids"] for o in outs], "replays": runner.num_replays if runner is not None else 0}
    finally:
        engine.shutdown()


PROMPTS = [[5 + i, 17, 3 * i + 1, 9] * (1 + i % 3) for i in range(7)]
MAX_NEW = [3, 9, 5, 12, 7, 2, 10]  # the batch shrinks 7 -> 6 -> ... -> 1 through every bucket


def test_the_eager_static_forward_gives_the_eager_tokens_as_the_batch_shrinks(tiny_model: str) -> None:
    """What a graph replays (the static-buffer forward, padded to a bucket) gives the tokens of the
    ordinary forward, on any device (on the CPU through the Triton interpreter)."""
    device = "cuda" if ON_GPU else "cpu"
    want = _greedy(tiny_model, PROMPTS, MAX_NEW, device=device, attention_backend="triton", disable_cuda_graph=True)
    engine = Engine(tiny_model, max_total_tokens=2048, dtype="float32", device=device, attention_backend="triton",
                    disable_cuda_graph=True)  # fmt: skip
    try:
        graphs = CudaGraphRunner(engine.model_runner, max_bs=8, capture=False)
        engine.model_runner.cuda_graph_runner = graphs
        outs = engine.generate(
            input_ids=PROMPTS, sampling_params=[{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW]
        )
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in outs] == want["tokens"]
    assert graphs.num_replays >= max(MAX_NEW) - 1


@needs_gpu
@pytest.mark.parametrize("extra", [{}, {"page_size": 16}, {"speculative_algorithm": "NGRAM"}], ids=["page1", "page16", "ngram"])
def test_captured_graphs_give_the_eager_tokens(tiny_model: str, extra: Dict[str, Any]) -> None:
    want = _greedy(tiny_model, PROMPTS, MAX_NEW, device="cuda", disable_cuda_graph=True, **extra)
    got = _greedy(tiny_model, PROMPTS, MAX_NEW, device="cuda", cuda_graph_max_bs=8, **extra)
    assert got["tokens"] == want["tokens"]
    assert want["replays"] == 0 and got["replays"] > 0


@needs_gpu
def test_batches_above_the_largest_graph_run_eagerly(tiny_model: str) -> None:
    prompts, max_new = PROMPTS * 2, MAX_NEW * 2  # 14 requests, graphs up to 4
    want = _greedy(tiny_model, prompts, max_new, device="cuda", disable_cuda_graph=True)
    got = _greedy(tiny_model, prompts, max_new, device="cuda", cuda_graph_max_bs=4)
    assert got["tokens"] == want["tokens"] and 0 < got["replays"] < max(max_new) - 1


def test_the_runner_does_not_keep_the_kv_pool_alive_after_shutdown(tiny_model: str) -> None:
    """ModelRunner -> CudaGraphRunner -> ModelRunner was a cycle: the KV pool (and on a GPU the
    graphs' memory) outlived Engine.shutdown() until the cycle collector ran."""
    import gc
    import weakref

    engine = Engine(tiny_model, device="cuda" if ON_GPU else "cpu", attention_backend="triton", max_total_tokens=256,
                    dtype="float32", disable_cuda_graph=True)  # fmt: skip
    engine.model_runner.cuda_graph_runner = CudaGraphRunner(engine.model_runner, max_bs=2, capture=ON_GPU)
    engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert engine.model_runner.cuda_graph_runner.num_replays == 2
    kv = weakref.ref(engine.model_runner.token_to_kv_pool.k_buffer[0])
    gc.collect()
    gc.disable()
    try:
        engine.shutdown()
        assert kv() is None, "the KV pool outlived Engine.shutdown()"
    finally:
        gc.enable()
