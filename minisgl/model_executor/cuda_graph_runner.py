"""CudaGraphRunner: decode steps replayed from captured CUDA graphs (SGLang's cuda_graph_runner.py).

Where it sits: Scheduler -> ModelRunner.forward(ForwardBatch) -> here, for DECODE batches of at
most `--cuda-graph-max-bs` requests; every other pass runs eagerly (ModelRunner.forward_eager).

Why: a decode step of a small model is hundreds of small kernels, and on a GPU launching them from
Python costs more than running them. benchmarks/bench_offline.py's 33.5M-parameter model on an H200
took 7.5 ms per decode step at batch 64 against a 0.43 ms matmul floor; with graphs, 1.1 ms
(docs/kernels.md, "GPU results"). A CUDA graph records the launches of one step once; a replay
sends them all in one call.

How (the CUDA graph contract: fixed addresses, fixed shapes, no host work inside):
- Static buffers sized for the largest batch hold what a decode pass reads: input_ids, positions,
  out_cache_loc, req_pool_indices, seq_lens. Each captured batch size `bs` runs the model on the
  first `bs` rows of these buffers, so its graph reads them in place.
- Batch sizes are captured in SGLang's buckets (1, 2, 4, 8, 12, then every 8 to 256, every 16 to
  512, every 32 beyond), up to --cuda-graph-max-bs, which is itself a bucket here (SGLang stops at
  the last bucket below it). A batch of 5 replays the graph of 8: its own rows are copied in, and the 3 padding rows are reset each replay to a request of
  one token at position 0 whose K/V goes to slot 0, the pool's padding slot, which no request
  owns. (Left as the last larger batch wrote them, they would write K/V into live slots.)
- One rank only: with --tp-size N > 1 every step runs eagerly (the collectives between the
  ranks are not captured).
- Only the triton backend: its decode metadata is built on the device (the torch backend reads
  host lists that a graph would freeze). A MoE model's decode steps all run eagerly: its expert
  loop reads the token count of each expert on the host.
- The logits come back as a copy: the graph's output buffer is overwritten by the next replay.

`capture=False` runs the same static-buffer forward eagerly instead of recording it: what a graph
would replay, and how the padding is tested on a machine without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Union

import torch

from minisgl.layers.logits_processor import LogitsProcessorOutput
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from minisgl.models.model_config import ModelConfig
    from minisgl.server_args import ServerArgs

logger = logging.getLogger("minisgl")

DEFAULT_CUDA_GRAPH_MAX_BS = 256  # largest bucket by default (also at most --max-running-requests)


def cuda_graph_disabled_reason(server_args: "ServerArgs", model_config: "ModelConfig") -> Optional[str]:
    """Why decode steps run eagerly on this setup, or None when they are captured."""
    if server_args.device != "cuda":
        return "CUDA graphs need --device cuda"
    if server_args.disable_cuda_graph:
        return "--disable-cuda-graph"
    if server_args.is_embedding:
        return "an embedding server (--is-embedding) runs no decode steps"
    if server_args.tp_size > 1:
        # SGLang captures its collectives (custom all-reduce kernels, pynccl) in the graphs;
        # minisgl's go through torch.distributed's process groups, never captured or run on GPUs here
        return f"--tp-size {server_args.tp_size}: the ranks' all_reduce / all_gather are not captured in CUDA graphs"
    if server_args.attention_backend != "triton":
        return f"--attention-backend {server_args.attention_backend} builds its metadata on the host (use triton)"
    if model_config.moe is not None:
        return "MoE layers read their expert counts on the host"
    return None


def capture_batch_sizes(max_bs: int) -> List[int]:
    """SGLang's buckets up to max_bs, and max_bs itself: a batch of any size up to it replays."""
    if max_bs < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {max_bs}")
    # (SGLang's get_batch_sizes_to_capture: dense where most decode batches are, sparse above)
    buckets = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [bs for bs in buckets if bs <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class GraphOwner(Protocol):
    """What the runner needs of its owner, the ModelRunner (named by shape, so that this module does
    not import the one that imports it)."""

    device: str
    server_args: "ServerArgs"
    req_to_token_pool: Any
    token_to_kv_pool: Any
    attn_backend: Any

    def forward_eager(self, forward_batch: ForwardBatch) -> Union[LogitsProcessorOutput, Any]: ...


class CudaGraphRunner:
    """One captured decode pass per bucket of batch sizes, over shared static input buffers."""

    def __init__(self, model_runner: GraphOwner, max_bs: int, capture: bool = True) -> None:
        if model_runner.server_args.attention_backend != "triton":
            raise ValueError("CudaGraphRunner replays the triton backend's decode pass; use --attention-backend triton")
        if capture and model_runner.device != "cuda":
            raise ValueError(f"CUDA graphs are captured on a GPU, not on {model_runner.device} (capture=False runs the same forward eagerly)")
        # A weak reference: the ModelRunner holds this runner, and a strong one back made a cycle that
        # kept the KV pool and the graphs' memory alive after Engine.shutdown() until gc ran
        self._model_runner = weakref.ref(model_runner)
        self.capture_bs = capture_batch_sizes(max_bs)
        self.max_bs = self.capture_bs[-1]
        self.num_replays = 0  # decode steps served from a graph (tests, the benchmark)
        device = model_runner.device
        with torch.inference_mode():  # the forward reads them in inference mode
            self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # [max_bs]
            self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # [max_bs]
            self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # [max_bs], 0: padding slot
            self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # [max_bs]
            self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)  # [max_bs]
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, LogitsProcessorOutput] = {}  # each graph's output buffers ([bs, V] logits)
        if capture:
            try:
                self.capture()
            except (RuntimeError, torch.OutOfMemoryError) as e:  # (SGLang also says what to change here)
                raise RuntimeError(
                    f"Capturing the CUDA graphs of decode steps failed: {e}. Start with --disable-cuda-graph, a smaller "
                    "--cuda-graph-max-bs, or a smaller --mem-fraction-static (the graphs' memory comes out of what it leaves)"
                ) from e

    @property
    def model_runner(self) -> GraphOwner:
        mr = self._model_runner()
        assert mr is not None, "the ModelRunner of this CudaGraphRunner was freed"
        return mr

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A decode ForwardBatch over the first bs rows of the static buffers."""
        mr = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,  # (the triton backend reads seq_lens on the device only)
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool, attn_backend=mr.attn_backend,
        )  # fmt: skip

    def capture(self) -> None:
        """Record one graph per batch size, largest first, all in one memory pool: a smaller
        batch's activations fit in the blocks the largest one left, so the pool is sized once."""
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.capture_bs):
                fb = self._static_batch(bs)
                # warm-up outside the graph: Triton compiles its kernels and cuBLAS picks its
                # algorithms here (neither may happen during a capture); K/V go to padding slot 0
                for _ in range(2):
                    self.model_runner.forward_eager(fb)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model_runner.forward_eager(fb)
                assert isinstance(out, LogitsProcessorOutput)
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize()
        logger.info(
            "Capture cuda graph end. bs %s, time elapsed: %.2f s, mem usage: %.2f GiB",
            self.capture_bs, time.perf_counter() - t0, (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
        )  # fmt: skip

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """A plain decode pass that fits a bucket, over the pools the graphs read: nothing the graph
        did not record (all logits, hidden states, prompt logprobs, a LoRA adapter's deltas: the graphs
        are captured on the base model) is asked for."""
        mr = self.model_runner
        return (
            forward_batch.forward_mode == ForwardMode.DECODE
            and 0 < forward_batch.batch_size <= self.max_bs
            and not forward_batch.return_all_logits
            and not forward_batch.capture_hidden_mode.need_capture()
            and forward_batch.input_logprob_indices is None
            and forward_batch.token_to_kv_pool is mr.token_to_kv_pool
            and forward_batch.req_to_token_pool is mr.req_to_token_pool
            and not any(lora_id is not None for lora_id in forward_batch.lora_ids or ())
        )

    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Copy the batch into the static buffers, reset the padding rows, replay the bucket's graph,
        and return a copy of its logits ([bs, V])."""
        mr = self.model_runner  # (alive: the graphs write into its pools)
        bs = forward_batch.batch_size
        padded = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        with torch.inference_mode():
            self.input_ids[:bs].copy_(forward_batch.input_ids)
            self.positions[:bs].copy_(forward_batch.positions)
            self.out_cache_loc[:bs].copy_(forward_batch.out_cache_loc)
            self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
            self.seq_lens[:bs].copy_(forward_batch.seq_lens)
            if padded > bs:  # padding rows: one token at position 0, K/V into padding slot 0
                self.input_ids[bs:padded].zero_()
                self.positions[bs:padded].zero_()
                self.out_cache_loc[bs:padded].zero_()
                self.req_pool_indices[bs:padded].zero_()
                self.seq_lens[bs:padded].fill_(1)
            if padded in self.graphs:
                self.graphs[padded].replay()
                out = self.outputs[padded]
            else:  # capture=False: the same forward, run eagerly
                out = mr.forward_eager(self._static_batch(padded))
                assert isinstance(out, LogitsProcessorOutput)
            self.num_replays += 1
            return LogitsProcessorOutput(next_token_logits=out.next_token_logits[:bs].clone())
