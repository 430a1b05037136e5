"""ModelRunner (stage 4): owns the model, the KV memory and the sampler; runs one ForwardBatch.

Where it sits: Scheduler -> ScheduleBatch -> ForwardBatch -> ModelRunner.forward ->
LogitsProcessorOutput -> ModelRunner.sample (logits bias, custom logit processors, Sampler) ->
SampleOutput -> Scheduler. With --is-embedding (`is_generation` False, SGLang's name) forward
returns an EmbeddingPoolerOutput instead, and nothing is sampled.
Owns: model (DecoderForCausalLM), model_config, lora_manager (--lora-paths, --enable-lora), req_to_token_pool,
token_to_kv_pool_allocator, token_to_kv_pool, attn_backend, sampler, and on CUDA the
cuda_graph_runner that replays decode steps (cuda_graph_runner.py; None where they run eagerly).

Sizing (SGLang's formulas, sglang-facts.md §4.1; docs/model_execution.md):
- context_len: --context-length, else the model's max_position_embeddings.
- max_total_num_tokens (KV pool size in tokens): --max-total-tokens if given; on CUDA
  (free memory after loading weights - free memory before * (1 - mem_fraction_static)) / cell_size
  (SGLang's total_gpu_memory is what was free before the weights: a GPU shared with another
  process gives this server its fraction of what is left, not of the whole device);
  on CPU cpu_kv_cache_gb GiB / cell_size, capped at CPU_POOL_CONTEXTS * context_len
  (a CPU never runs more than a few full contexts at once, and torch.zeros would touch
  every byte of a big pool). Floored to a multiple of page_size.
- max_running_requests: --max-running-requests, else SGLang's
  min(max_total // 2, clamp(max_total / context_len * 512, 2048, 4096)); on CPU further
  capped at CPU_MAX_RUNNING_REQUESTS.

Tensor parallelism (--tp-size N, `tp_group` this rank's GroupCoordinator; docs/parallelism.md):
the model holds this rank's slice of every split weight, and the KV pool this rank's KV heads
(cell_size per rank). Both sizes above are then the minimum over the ranks (an all_reduce),
as in SGLang: the N schedulers must admit the same requests into pools of the same size to
stay in step. On CUDA, rank r runs on cuda:r. LoRA is refused with N > 1 (ServerArgs).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, List, Optional, Tuple, Union

import torch

from minisgl.distributed import GroupCoordinator
from minisgl.layers.attention.base import AttentionBackend
from minisgl.layers.logits_processor import LogitsProcessorOutput
from minisgl.layers.pooler import EmbeddingPoolerOutput
from minisgl.layers.sampler import SampleOutput, Sampler
from minisgl.lora.lora_manager import LoRAManager
from minisgl.mem_cache.allocator import make_allocator
from minisgl.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from minisgl.model_executor.cuda_graph_runner import DEFAULT_CUDA_GRAPH_MAX_BS, CudaGraphRunner, cuda_graph_disabled_reason
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from minisgl.models.loader import iterate_weights, load_model, resolve_model_path
from minisgl.models.model_config import ModelConfig
from minisgl.models.weight_update import (
    StagedWeights, check_same_model, commit_weights, get_weights_by_name, stage_weights,
)  # fmt: skip
from minisgl.sampling.custom_logit_processor import apply_custom_logit_processors
from minisgl.sampling.sampling_batch_info import SamplingBatchInfo
from minisgl.server_args import ServerArgs
from minisgl.utils import keep_freed_memory_in_heap

logger = logging.getLogger("minisgl")

CPU_POOL_CONTEXTS = 8
# update_weights_from_disk's load_format values (SGLang's names for what minisgl reads: safetensors)
DISK_LOAD_FORMATS = (None, "auto", "safetensors")
CPU_MAX_RUNNING_REQUESTS = 256


class ModelRunner:
    def __init__(
        self, server_args: ServerArgs, show_progress: bool = True, tp_group: Optional[GroupCoordinator] = None
    ) -> None:
        if not server_args.is_resolved:
            raise ValueError("ModelRunner needs a resolved ServerArgs: call resolve_server_args first")
        if tp_group is None:
            tp_group = GroupCoordinator(0, 1, server_args.device)
        if tp_group.world_size != server_args.tp_size:
            raise ValueError(
                f"--tp-size {server_args.tp_size} needs this rank's tensor-parallel group of {server_args.tp_size} ranks "
                f"(minisgl.distributed.init_tensor_parallel_group), got a group of {tp_group.world_size}"
            )
        self.server_args = server_args
        self.tp_group = tp_group  # this rank's place among --tp-size ranks, and their collectives
        self.tp_rank, self.tp_size = tp_group.rank_in_group, tp_group.world_size
        if server_args.device == "cuda" and self.tp_size > 1:
            torch.cuda.set_device(self.tp_rank)  # (SGLang's gpu_id = tp_rank): before anything is allocated
        self.device: str = server_args.device
        self.dtype: torch.dtype = getattr(torch, server_args.dtype)
        self.kv_cache_dtype: torch.dtype = getattr(torch, server_args.kv_cache_dtype)  # the model's, or bfloat16
        self.page_size = server_args.page_size
        self.is_generation = not server_args.is_embedding
        # The RNG of unseeded sampling, this runner's own: seeding torch's global one made every
        # new Engine restart the draws of the Engines before it, and reset the user's RNG.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(server_args.random_seed)
        if self.device == "cpu" and not keep_freed_memory_in_heap():
            logger.info("malloc tuning unavailable (not glibc): large activations will page-fault each step")

        assert server_args.model_path is not None
        model_dir = resolve_model_path(server_args.model_path)
        self.model_config = ModelConfig.from_pretrained(model_dir, server_args.context_length)
        self.model_config.check_tensor_parallel(self.tp_size)  # (refused before any weight is read)
        # the triton and cpu backends also route RMSNorm and RoPE through their kernels
        self.kernels = server_args.attention_backend if server_args.attention_backend in ("triton", "cpu") else "torch"
        self.free_memory_before_load = self._free_cuda_memory() if self.device == "cuda" else 0
        self.model = load_model(
            self.model_config, self.device, self.dtype, self.kernels, show_progress, not self.is_generation, tp_group
        )
        if self.device == "cpu" and self.dtype == torch.float32:
            n = self.model.pack_linear_weights_for_cpu()  # oneDNN layout: ~2x matmul rate at decode sizes
            logger.info("packed %d linear weights for oneDNN", n)
        self.sampler = Sampler()
        # --tp-size N: agree on every step's sampled ids (an all_reduce MIN), not only on grammar steps
        # (SGLang's environment variable, read the same way: "1" or "true")
        self.sync_token_ids_always = os.environ.get("SYNC_TOKEN_IDS_ACROSS_TP", "").strip().lower() in ("1", "true")
        # --lora-paths / --enable-lora: every adapter's weights, on the model's device and dtype (None: LoRA off)
        self.lora_manager = LoRAManager.from_server_args(server_args, self.model_config, self.device, self.dtype)

        self.max_total_num_tokens = self._profile_max_num_token()
        self.max_running_requests = self._max_running_requests()
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.model_config.context_len + self.page_size, self.device
        )
        self.token_to_kv_pool_allocator = make_allocator(self.max_total_num_tokens, self.page_size, self.device)
        mc = self.model_config
        self.token_to_kv_pool = MHATokenToKVPool(  # this rank's KV heads only
            self.max_total_num_tokens, self.page_size, self.kv_cache_dtype, mc.get_num_kv_heads(self.tp_size),
            mc.head_dim, mc.num_layers, self.device,
        )  # fmt: skip
        self.attn_backend = self._make_attn_backend()
        self.cuda_graph_runner = self._init_cuda_graphs()  # last: it runs the model on the pools above
        logger.info(
            "Load model %s (%s) on %s in %s: context_len=%d, max_total_num_tokens=%d, max_running_requests=%d, "
            "page_size=%d, attention_backend=%s, kv_cache_dtype=%s, tp_rank=%d of tp_size=%d",
            model_dir, mc.architecture, self.device, server_args.dtype, mc.context_len,
            self.max_total_num_tokens, self.max_running_requests, self.page_size, server_args.attention_backend,
            server_args.kv_cache_dtype, self.tp_rank, self.tp_size,
        )  # fmt: skip

    # ------------------------------------------------------------------ sizing
    @property
    def cell_size(self) -> int:
        """Bytes of K and V per token on this rank (its KV heads only)."""
        mc = self.model_config
        return MHATokenToKVPool.cell_size_bytes(mc.get_num_kv_heads(self.tp_size), mc.head_dim, mc.num_layers, self.kv_cache_dtype)

    def _min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' values (SGLang sizes its pools from the least free memory
        among the ranks): every scheduler then has the same pool and makes the same decisions."""
        if self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.tp_group.all_reduce(t, op="min").item())

    def _profile_max_num_token(self) -> int:
        args = self.server_args
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        elif self.device == "cuda":
            free, total = self._free_cuda_memory(), self.free_memory_before_load
            rest = free - total * (1 - args.mem_fraction_static)  # resolved: 0.85 unless set
            tokens = self._min_over_ranks(int(rest) // self.cell_size)  # (before refusing: all ranks refuse alike)
            if tokens <= 0:
                raise RuntimeError(
                    f"No GPU memory left for the KV cache (free {free / 2**30:.2f} GiB of the {total / 2**30:.2f} GiB "
                    "free before the weights loaded); raise --mem-fraction-static or use a smaller model"
                )
        else:
            budget = int(args.cpu_kv_cache_gb * 2**30) // self.cell_size  # (each rank's budget: its own KV heads)
            tokens = self._min_over_ranks(min(budget, CPU_POOL_CONTEXTS * self.model_config.context_len))
        tokens -= tokens % self.page_size
        if tokens < 2 * self.page_size:
            raise ValueError(f"KV pool of {tokens} tokens is too small; raise --max-total-tokens / --cpu-kv-cache-gb")
        logger.info("KV cache: %d tokens, %.3f GiB (%d bytes per token)", tokens, tokens * self.cell_size / 2**30, self.cell_size)
        return tokens

    @staticmethod
    def _free_cuda_memory() -> int:
        # memory a previous Engine freed sits in torch's caching allocator, where mem_get_info
        # counts it as used: hand it back first, as SGLang's get_available_gpu_memory does
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def _max_running_requests(self) -> int:
        requested = self.server_args.max_running_requests
        if requested is not None:  # SGLang sizes the request pool from the flag, uncapped
            return requested
        max_num_reqs = min(max(int(self.max_total_num_tokens / self.model_config.context_len * 512), 2048), 4096)
        n = min(self.max_total_num_tokens // 2, max_num_reqs)
        if self.device == "cpu":
            n = min(n, CPU_MAX_RUNNING_REQUESTS)
        return self._min_over_ranks(max(1, n))

    def _make_attn_backend(self) -> AttentionBackend:
        backend = self.server_args.attention_backend
        if backend == "torch":
            from minisgl.layers.attention.torch_backend import TorchNativeAttnBackend

            return TorchNativeAttnBackend()
        if backend == "cpu":
            from minisgl.layers.attention.cpu_backend import CpuAttnBackend

            return CpuAttnBackend()
        if backend == "triton":
            from minisgl.layers.attention.triton_backend import TritonAttnBackend

            return TritonAttnBackend(str(self.device), self.model_config.head_dim)
        raise ValueError(f"Unknown attention backend {backend!r}; choose cpu, torch or triton")

    def _init_cuda_graphs(self) -> Optional[CudaGraphRunner]:
        args = self.server_args
        reason = cuda_graph_disabled_reason(args, self.model_config)
        if reason is not None:
            if args.cuda_graph_max_bs is not None:  # set by hand and unused here: said, not silently dropped
                logger.warning("--cuda-graph-max-bs %d has no effect: no CUDA graph is captured (%s)", args.cuda_graph_max_bs, reason)
            elif self.device == "cuda":
                logger.info("cuda graph: off, decode steps run eagerly (%s)", reason)
            return None
        max_bs = min(args.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, self.max_running_requests)
        return CudaGraphRunner(self, max_bs)

    def can_run_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether forward(forward_batch) replays a captured graph (SGLang's can_run_cuda_graph, which
        the scheduler's decode log line reports)."""
        return self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch)

    # ------------------------------------------------------------------ running
    def forward(self, forward_batch: ForwardBatch) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        """One forward pass; logits of each request's last token (all tokens with return_all_logits),
        or, for an embedding model, each request's embedding. A decode pass the captured CUDA graphs
        fit is a graph replay; any other runs eagerly."""
        runner = self.cuda_graph_runner
        if runner is not None and runner.can_run(forward_batch):
            return runner.replay(forward_batch)
        return self.forward_eager(forward_batch)

    def forward_eager(self, forward_batch: ForwardBatch) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        """The forward pass launched kernel by kernel from Python (what a CUDA graph records)."""
        if forward_batch.forward_mode == ForwardMode.IDLE:
            width = self.model_config.vocab_size if self.is_generation else self.model_config.hidden_size
            empty = torch.empty((0, width), dtype=torch.float32, device=self.device)
            return LogitsProcessorOutput(next_token_logits=empty) if self.is_generation else EmbeddingPoolerOutput(empty)
        with torch.inference_mode():
            forward_batch.attn_backend.init_forward_metadata(forward_batch)
            if self.lora_manager is not None:  # the pass's tokens grouped by adapter, once for every layer
                fb = forward_batch
                if fb.forward_mode.is_decode():
                    tokens_per_req: List[int] = [1] * fb.batch_size
                else:
                    assert fb.extend_seq_lens_cpu is not None, "an extend pass carries extend_seq_lens_cpu"
                    tokens_per_req = list(fb.extend_seq_lens_cpu)
                fb.lora_batch_info = self.lora_manager.prepare_lora_batch(fb.lora_ids, tokens_per_req, fb.input_ids.device)
            if not self.is_generation:
                return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch, get_embedding=True)
            return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def sample(self, logits_output: LogitsProcessorOutput, sampling_info: SamplingBatchInfo) -> SampleOutput:
        """Penalties, min_new_tokens, the grammars' vocab mask and logit_bias, then the custom logit
        processors, then the Sampler (sglang-facts.md §11). Logprobs come from the processed logits.

        A processor that fails leaves its rows as they were and is named in the result's
        custom_logit_processor_errors: the scheduler aborts those requests alone."""
        with torch.inference_mode():
            logits = logits_output.next_token_logits  # [bs, V] float32
            processors = sampling_info.custom_logit_processor
            if sampling_info.needs_logits_bias or processors is not None:
                logits = logits.clone()  # keep the model's logits intact for the caller
            if sampling_info.needs_logits_bias:
                sampling_info.apply_logits_bias(logits)
            errors = apply_custom_logit_processors(logits, processors) if processors is not None else None
            sync = self._sync_token_ids if self._needs_token_sync(sampling_info) else None
            sampled = self.sampler(logits, sampling_info, self.generator, sync)
            return sampled._replace(custom_logit_processor_errors=errors) if errors else sampled

    def _needs_token_sync(self, sampling_info: SamplingBatchInfo) -> bool:
        """--tp-size N: whether this step's sampled ids go through _sync_token_ids (SGLang's rule).

        The ranks draw the same tokens from bit-identical logits without it (docs/parallelism.md);
        a grammar step syncs anyway, because a grammar's mask and matcher make a disagreement
        costlier (a token one rank's grammar refuses ends the request on that rank alone), and
        SYNC_TOKEN_IDS_ACROSS_TP=1 syncs every step, for kernels that are not deterministic."""
        return self.tp_size > 1 and (self.sync_token_ids_always or sampling_info.vocab_mask is not None)

    def _sync_token_ids(self, next_token_ids: torch.Tensor) -> None:
        """Every rank keeps the smallest of the ranks' ids, per row (SGLang's _sync_token_ids_across_tp)."""
        self.tp_group.all_reduce(next_token_ids, op="min")

    # ------------------------------------------------------------------ weights while serving
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None) -> Tuple[bool, str]:
        """SGLang's: load the checkpoint at `model_path` (a directory or hub id of the served model:
        same config.json, every tensor) into the live parameters. Returns (success, message); on a
        failure, on any rank, every rank keeps the weights it had (models/weight_update.py)."""

        def stage() -> StagedWeights:
            if load_format not in DISK_LOAD_FORMATS:
                raise ValueError(f"load_format {load_format!r} is not supported: minisgl reads safetensors (auto, safetensors)")
            model_dir = resolve_model_path(model_path)
            check_same_model(self.model_config, ModelConfig.from_pretrained(model_dir, self.server_args.context_length))
            return stage_weights(self.model, iterate_weights(model_dir, show_progress=False), require_all=True)

        return self._update_weights(stage)

    def update_weights_from_tensor(
        self, named_tensors: Iterable[Tuple[str, torch.Tensor]], load_format: Optional[str] = None
    ) -> Tuple[bool, str]:
        """SGLang's: (name, tensor) pairs in the checkpoint's names, any subset of the model's (one
        bucket of many), through the start-up loader's mapping. `named_tensors` may be lazy (read
        from safetensors bytes as staging goes: weight_update.deserialize_named_tensors); an error
        reading it refuses the update as any other. Returns (success, message), as above."""

        def stage() -> StagedWeights:
            if load_format is not None:  # (SGLang's "direct" and "flattened_bucket" carry CUDA IPC handles and pickles)
                raise ValueError(f"load_format {load_format!r} is not supported: leave it out (None), minisgl takes safetensors")
            return stage_weights(self.model, named_tensors, require_all=False)

        return self._update_weights(stage)

    def _update_weights(self, stage: Callable[[], StagedWeights]) -> Tuple[bool, str]:
        """Stage this rank's new values, agree with the other ranks that every one staged, then commit.

        The agreement (an all_reduce MIN of "staged" over the ranks) comes before anything changes:
        ranks never serve different weights. A commit that fails half-way (it copies tensors that
        already fit) leaves this rank's model unknown: raised, which stops the scheduler process."""
        try:
            staged, error = stage(), None
        except Exception as e:  # anything reading or fitting the new weights: the old ones stay
            staged, error = {}, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            logger.warning("Weight update refused on tp_rank %d: %s", self.tp_rank, error)
        if self.tp_size > 1:
            staged_here = torch.tensor([int(error is None)], dtype=torch.int64, device=self.device)
            if not self.tp_group.all_reduce(staged_here, op="min").item() and error is None:
                error = "another tensor-parallel rank could not load its slice of the weights (its log says why)"
        if error is not None:
            return False, f"Failed to update weights: {error}. The served weights are unchanged."
        commit_weights(self.model, staged)
        logger.info("Weights updated on tp_rank %d (%d parameters)", self.tp_rank, len(staged))
        return True, "Succeeded to update model weights."

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> List[object]:
        """SGLang's: the first `truncate_size` rows (values) of the parameter of checkpoint tensor
        `name`, as floats (weight_update.get_weights_by_name; with --tp-size N every rank calls it)."""
        with torch.no_grad():
            return get_weights_by_name(self.model, name, truncate_size)
