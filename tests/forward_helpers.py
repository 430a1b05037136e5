"""Test helper: build ForwardBatches the way ScheduleBatch does, to drive a ModelRunner directly.

Used by the model-execution tests before (and independently of) the scheduler: each
request gets a req_to_token row, its KV slots come from the runner's allocator
(alloc_extend / alloc_decode, so paged layouts are real), and req_to_token is written
exactly as SGLang's write_cache_indices / alloc_for_decode do (sglang-facts.md §4.5).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, List, Sequence

import torch

from minisgl.layers.logits_processor import LogitsProcessorOutput
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from minisgl.model_executor.model_runner import ModelRunner
from minisgl.server_args import ServerArgs, resolve_server_args


def make_runner(
    model_path: str,
    page_size: int = 1,
    max_total_tokens: int = 4096,
    dtype: str = "float32",
    attention_backend: str = "torch",
    device: str = "cpu",
    **kw: Any,
) -> ModelRunner:
    args = ServerArgs(
        model_path=model_path, device=device, dtype=dtype, attention_backend=attention_backend,
        page_size=page_size, max_total_tokens=max_total_tokens, **kw,
    )  # fmt: skip
    return ModelRunner(resolve_server_args(args), show_progress=False)


@dataclass
class DriverReq:
    row: int
    slots: List[int] = field(default_factory=list)  # KV slot of every position so far

    @property
    def seq_len(self) -> int:
        return len(self.slots)


class BatchDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def new_req(self) -> DriverReq:
        rows = self.runner.req_to_token_pool.alloc(1)
        assert rows is not None
        return DriverReq(rows[0])

    def fragment(self, seed: int = 0) -> None:
        """Shuffle the allocator's free list so that consecutive allocations land far apart."""
        alloc = self.runner.token_to_kv_pool_allocator
        alloc.merge_and_sort_free()
        g = torch.Generator().manual_seed(seed)
        alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages), generator=g)]

    def extend(self, reqs: Sequence[DriverReq], new_ids: Sequence[Sequence[int]], return_all_logits: bool = False) -> LogitsProcessorOutput:
        r = self.runner
        dev = r.device  # (on a GPU every input must be on the model's device)
        prefix_lens = [q.seq_len for q in reqs]
        extend_lens = [len(ids) for ids in new_ids]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        last_loc = [q.slots[-1] if q.slots else -1 for q in reqs]
        out_cache_loc = r.token_to_kv_pool_allocator.alloc_extend(prefix_lens, seq_lens, last_loc, sum(extend_lens))
        assert out_cache_loc is not None, "KV pool too small for the test"
        pt = 0
        for q, e in zip(reqs, extend_lens):
            locs = out_cache_loc[pt : pt + e]
            r.req_to_token_pool.write(q.row, q.seq_len, locs)
            q.slots.extend(locs.tolist())
            pt += e
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(reqs),
            input_ids=torch.tensor([t for ids in new_ids for t in ids], dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(p, s, device=dev) for p, s in zip(prefix_lens, seq_lens)]),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor([q.row for q in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=dev),
            extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int64, device=dev),
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            return_all_logits=return_all_logits,
        )
        return r.forward(fb)

    def decode(self, reqs: Sequence[DriverReq], next_ids: Sequence[int]) -> LogitsProcessorOutput:
        r = self.runner
        dev = r.device
        old_lens = [q.seq_len for q in reqs]
        seq_lens = [n + 1 for n in old_lens]
        out_cache_loc = r.token_to_kv_pool_allocator.alloc_decode(seq_lens, [q.slots[-1] for q in reqs])
        assert out_cache_loc is not None, "KV pool too small for the test"
        for q, loc in zip(reqs, out_cache_loc.tolist()):
            r.req_to_token_pool.req_to_token[q.row, q.seq_len] = loc  # written at the OLD seq_len
            q.slots.append(loc)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(reqs),
            input_ids=torch.tensor(list(next_ids), dtype=torch.int64, device=dev),
            positions=torch.tensor(old_lens, dtype=torch.int64, device=dev),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor([q.row for q in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
        )
        return r.forward(fb)

    def release(self, req: DriverReq) -> None:
        self.runner.token_to_kv_pool_allocator.free(torch.tensor(req.slots, dtype=torch.int64, device=self.runner.device))
        self.runner.req_to_token_pool.free(req.row)
        req.slots = []


def greedy_generate(driver: BatchDriver, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> List[List[int]]:
    """Batched greedy decoding: one extend of all prompts, then batched decode steps."""
    reqs = [driver.new_req() for _ in prompts]
    logits = driver.extend(reqs, prompts).next_token_logits
    outputs: List[List[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = torch.argmax(logits, dim=-1).tolist()
        for out, t in zip(outputs, next_ids):
            out.append(t)
        if step + 1 < max_new_tokens:
            logits = driver.decode(reqs, next_ids).next_token_logits
    for q in reqs:
        driver.release(q)
    return outputs


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: the parity metric of the model tests."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def copy_model_with(src: str, dst: str, config_edits: Any = None, gen_edits: Any = None) -> str:
    """A copy of the model directory `src` at `dst`, its config.json / generation_config.json
    edited in place by the given functions (each gets the parsed dict)."""
    shutil.copytree(src, dst)
    for name, edits in (("config.json", config_edits), ("generation_config.json", gen_edits)):
        if edits:
            path = os.path.join(dst, name)
            with open(path) as f:
                data = json.load(f)
            edits(data)
            with open(path, "w") as f:
                json.dump(data, f)
    return dst
