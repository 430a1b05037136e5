"""The whole engine with --attention-backend triton gives the torch backend's greedy tokens (issue 6).

On CPU the Triton kernels (store_kv, decode/extend attention, fused_add_rmsnorm,
rotary) run through the interpreter, so the model and the workload are tiny. The
second configuration uses page_size 16, chunked prefill and mixed chunks, so extend
batches carry cached prefixes (radix hits, earlier chunks) and decodes riding as
1-token extends.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any, Dict, List

import pytest
from engine_helpers import assert_shutdown_frees_the_kv_pool

from minisgl import Engine  # noqa: E402

PROMPTS = [
    "hello world, this is a test",
    "a",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
]
SAMPLING = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


def greedy_tokens(model_path: str, **server_args: Any) -> List[List[int]]:
    """Generate PROMPTS twice (the second round hits the radix cache) and return every output."""
    # float32 on every device: bf16 rounding could flip a near-tie argmax between backends
    engine = Engine(model_path, max_total_tokens=1024, dtype="float32", **server_args)
    try:
        outs: List[Dict[str, Any]] = engine.generate(PROMPTS, SAMPLING) + engine.generate(PROMPTS, SAMPLING)
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def torch_tokens(tiny_model: str) -> List[List[int]]:
    return greedy_tokens(tiny_model, attention_backend="torch")


@pytest.mark.parametrize(
    "server_args",
    [
        dict(page_size=1),
        dict(page_size=16, chunked_prefill_size=16, enable_mixed_chunk=True),
    ],
    ids=["page1", "page16-chunked-mixed"],
)
def test_triton_backend_matches_torch_greedy(
    tiny_model: str, torch_tokens: List[List[int]], server_args: Dict[str, Any]
) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = greedy_tokens(tiny_model, attention_backend="triton", device=device, **server_args)
    assert all(len(t) == SAMPLING["max_new_tokens"] for t in tokens)
    assert tokens == torch_tokens


def test_triton_backend_verifies_drafts_as_the_torch_backend_decodes(tiny_model: str) -> None:
    """--speculative-algorithm NGRAM through the triton extend kernel (a verify pass: each request's
    last token and drafts over its own prefix, pages of 4): the torch backend's one-token-at-a-time
    greedy tokens, with drafts accepted (on a GPU, benchmarks/gpu_check.sh runs this on CUDA)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[11, 12, 13, 14, 15] * 4, [40] * 12]
    params = {**SAMPLING, "max_new_tokens": 16}
    outputs = []
    for server_args in (dict(attention_backend="torch"), dict(attention_backend="triton", device=device, page_size=4, speculative_algorithm="NGRAM")):
        engine = Engine(tiny_model, max_total_tokens=1024, dtype="float32", **server_args)
        try:
            outputs.append([o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)])
            scheduler = engine.scheduler
            accepted = scheduler.spec_num_verify_tokens - scheduler.spec_num_verify_rows
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
    assert accepted > 4, "no drafts were accepted: the verify path did not run"


def test_triton_backend_refuses_a_head_dim_its_kernels_cannot_tile_at_start_up(tmp_path: Any) -> None:
    """head_dim 24 (open_llama_3b has 100): a clear start-up error, not a dead scheduler at the first request."""
    from forward_helpers import make_runner
    from minisgl.test_utils import make_tiny_model

    path = make_tiny_model(str(tmp_path / "hd24"), arch="llama", hidden_size=48, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=24)  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on a GPU the interpreter is off)
    with pytest.raises(ValueError, match="power of two >= 16.*got 24.*--attention-backend torch"):
        make_runner(path, attention_backend="triton", device=device)
    assert make_runner(path, attention_backend="torch").model_config.head_dim == 24


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_shutdown_frees_the_kv_pool_without_waiting_for_the_cycle_collector(tiny_model: str, backend: str) -> None:
    """The backend's metadata held its ForwardBatch, which holds the backend: a cycle that kept the
    KV pool alive after shutdown() until gc ran, so a second Engine on a GPU found no memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on a GPU the interpreter is off)
    engine = Engine(tiny_model, device=device, attention_backend=backend, max_total_tokens=256, dtype="float32")
    engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 2})
    assert_shutdown_frees_the_kv_pool(engine)
