"""Decode steps replayed from CUDA graphs (model_executor/cuda_graph_runner.py).

Every test runs on both devices. On a GPU (benchmarks/gpu_check.sh) the graphs are captured and
replayed. On the CPU the runner's eager mode (`capture=False`) runs the same static-buffer forward a
graph records, with the Triton kernels in the interpreter: the padding, the buckets, the eager
tokens and what must run eagerly are all checked there too.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any, Dict, List, Optional

import pytest
from engine_helpers import assert_shutdown_frees_the_kv_pool
from forward_helpers import BatchDriver, make_runner

from minisgl import Engine
from minisgl.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes, cuda_graph_disabled_reason
from minisgl.models.model_config import ModelConfig
from minisgl.server_args import ServerArgs

ON_GPU = torch.cuda.is_available()


def test_buckets_are_sglangs_and_end_at_the_largest_batch() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 12, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:7] == [1, 2, 4, 8, 12, 16, 24] and sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[5:], sizes[6:]))
    above = capture_batch_sizes(600)[len(sizes):]
    assert above[:2] == [272, 288] and above[-4:] == [512, 544, 576, 600]
    with pytest.raises(ValueError, match=">= 1"):
        capture_batch_sizes(0)


def test_the_flags_are_checked_and_said_when_unused(tiny_model: str, caplog: Any) -> None:
    import logging

    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="--cuda-graph-max-bs must be"):
            ServerArgs(cuda_graph_max_bs=bad)
    # as in SGLang launch lines, both flags together are taken; the size is then said to be unused
    ServerArgs(disable_cuda_graph=True, cuda_graph_max_bs=8)
    with caplog.at_level(logging.WARNING, logger="minisgl"):
        runner = make_runner(tiny_model, cuda_graph_max_bs=8)  # the CPU captures nothing
    assert runner.cuda_graph_runner is None
    assert any("--cuda-graph-max-bs 8 has no effect: no CUDA graph is captured (CUDA graphs need --device cuda)" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    with pytest.raises(ValueError, match="captured on a GPU, not on cpu"):
        CudaGraphRunner(make_runner(tiny_model, attention_backend="triton"), max_bs=2, capture=True)
    with pytest.raises(ValueError, match="use --attention-backend triton"):
        CudaGraphRunner(runner, max_bs=2, capture=False)


def test_graphs_are_off_with_a_reason_where_they_cannot_be_replayed(tiny_model: str, tiny_model_factory: Any) -> None:
    dense = ModelConfig.from_pretrained(tiny_model)
    moe = ModelConfig.from_pretrained(tiny_model_factory("qwen3_moe"))
    gpu = ServerArgs(model_path=tiny_model, device="cuda", dtype="bfloat16", attention_backend="triton", kv_cache_dtype="bfloat16")
    assert cuda_graph_disabled_reason(gpu, dense) is None
    assert "MoE" in str(cuda_graph_disabled_reason(gpu, moe))
    assert "use triton" in str(cuda_graph_disabled_reason(dataclasses.replace(gpu, attention_backend="torch"), dense))
    assert "--disable-cuda-graph" == cuda_graph_disabled_reason(dataclasses.replace(gpu, disable_cuda_graph=True), dense)
    assert "embedding" in str(cuda_graph_disabled_reason(dataclasses.replace(gpu, is_embedding=True), dense))
    assert "--tp-size 2: the ranks' all_reduce" in str(cuda_graph_disabled_reason(dataclasses.replace(gpu, tp_size=2), dense))
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
    assert graphs.num_replays == 1
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


def _engine(model_path: str, graphs: Optional[int], **server_args: Any) -> Engine:
    """An Engine on the triton backend whose decode steps replay graphs of up to `graphs` requests
    (None: eagerly). On a GPU they are captured; on the CPU the runner runs the same static-buffer
    forward eagerly (capture=False)."""
    common = dict(max_total_tokens=2048, dtype="float32", attention_backend="triton", **server_args)
    if ON_GPU:
        graph_args = {"disable_cuda_graph": True} if graphs is None else {"cuda_graph_max_bs": graphs}
        return Engine(model_path, device="cuda", **common, **graph_args)
    engine = Engine(model_path, device="cpu", **common)
    if graphs is not None:
        engine.model_runner.cuda_graph_runner = CudaGraphRunner(engine.model_runner, max_bs=graphs, capture=False)
    return engine


def _greedy(model_path: str, prompts: List[List[int]], max_new: List[int], graphs: Optional[int], **server_args: Any) -> Dict[str, Any]:
    engine = _engine(model_path, graphs, **server_args)
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


@pytest.mark.parametrize(
    "extra", [{}, {"page_size": 16 if ON_GPU else 4}, {"speculative_algorithm": "NGRAM"}, {"speculative_algorithm": "NGRAM", "page_size": 4}],
    ids=["page1", "paged", "ngram", "ngram-paged"],
)
def test_replays_give_the_eager_tokens_as_the_batch_shrinks(tiny_model: str, extra: Dict[str, Any]) -> None:
    """Decode steps replayed (padded to a bucket) give the tokens of eager ones; with NGRAM the
    verify passes run eagerly between replayed decode steps."""
    want = _greedy(tiny_model, PROMPTS, MAX_NEW, None, **extra)
    got = _greedy(tiny_model, PROMPTS, MAX_NEW, 8, **extra)
    assert got["tokens"] == want["tokens"]
    assert want["replays"] == 0 and got["replays"] > 0


def test_batches_above_the_largest_graph_run_eagerly(tiny_model: str) -> None:
    prompts, max_new = PROMPTS * 2, MAX_NEW * 2  # 14 requests, graphs up to 4
    want = _greedy(tiny_model, prompts, max_new, None)
    got = _greedy(tiny_model, prompts, max_new, 4)
    assert got["tokens"] == want["tokens"] and 0 < got["replays"] < max(max_new) - 1


def test_hidden_states_passes_run_eagerly(tiny_model: str) -> None:
    """A graph records no hidden states: a decode pass that must hand them back runs eagerly (a
    replay would leave the request without its decode steps' rows, and no error)."""
    engine = _engine(tiny_model, 8, enable_return_hidden_states=True)
    try:
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 4}, return_hidden_states=True)
        assert engine.model_runner.cuda_graph_runner.num_replays == 0
    finally:
        engine.shutdown()
    assert len(out["meta_info"]["hidden_states"]) == 1 + 3  # the prompt's pass, then three decode steps


def test_the_decode_log_line_says_when_a_step_replayed(tiny_model: str, caplog: Any) -> None:
    import logging

    label = "cuda graph" if ON_GPU else "cpu graph"
    for graphs, said in ((8, True), (None, False)):
        caplog.clear()
        engine = _engine(tiny_model, graphs, decode_log_interval=1)
        try:
            with caplog.at_level(logging.INFO, logger="minisgl"):
                engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 3})
        finally:
            engine.shutdown()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch")]
        assert lines and all(f"{label}: {said}," in line for line in lines), lines


def test_the_runner_does_not_keep_the_kv_pool_alive_after_shutdown(tiny_model: str) -> None:
    """ModelRunner -> CudaGraphRunner -> ModelRunner was a cycle: the KV pool (and on a GPU the
    graphs' memory) outlived Engine.shutdown() until the cycle collector ran."""
    engine = Engine(tiny_model, device="cuda" if ON_GPU else "cpu", attention_backend="triton", max_total_tokens=256,
                    dtype="float32", disable_cuda_graph=True)  # fmt: skip
    engine.model_runner.cuda_graph_runner = CudaGraphRunner(engine.model_runner, max_bs=2, capture=ON_GPU)
    engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert engine.model_runner.cuda_graph_runner.num_replays == 2
    assert_shutdown_frees_the_kv_pool(engine)
