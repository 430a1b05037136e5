"""Model numerics against transformers (the oracle): prefill, paged decode, greedy text.

Each variant is a tiny random-weight model written by `make_tiny_model`; transformers
loads the same directory in float32 with eager attention. Our side runs through the
real ModelRunner, paged KV pool and torch attention backend (tests/forward_helpers.py).
The mixture-of-experts variants also generate through the Engine (scheduler, cpu backend).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from forward_helpers import BatchDriver, greedy_generate, make_runner, relative_error

TOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip
# name -> (architecture, config overrides). transformers 5 stores `rope_scaling` as rope_parameters.
VARIANTS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "qwen2-qkv-bias-linear-rope": ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen3-qk-norm-tied": ("qwen3", {}),
    "mistral": ("mistral", {}),
    # test_utils.MOE_OVERRIDES: 4 experts, top-2; a dense middle layer; a shared expert
    "qwen3-moe-dense-layer-norm-topk": ("qwen3_moe", {}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
}
MOE_VARIANTS = [name for name, (arch, _) in VARIANTS.items() if arch in ("qwen3_moe", "qwen2_moe", "mixtral")]


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 40) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (n_,), generator=g).tolist() for n_ in lens]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def variant(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> Tuple[str, Any]:
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[request.param]
    path = tiny_model_factory(arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, hf


def _hf_logits(hf: Any, ids: List[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len, V]


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_config_flags_reach_the_model(variant: Tuple[str, Any]) -> None:
    path, hf = variant
    cfg = make_runner(path, max_total_tokens=64).model_config
    assert cfg.architecture == hf.config.architectures[0]
    expected_rope = (hf.config.rope_parameters or {}).get("rope_type", "default")
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == expected_rope
    # read off transformers' own module, so a new architecture needs no case here
    attn = hf.model.layers[0].self_attn
    assert cfg.qkv_bias == (attn.q_proj.bias is not None)
    assert cfg.qk_norm == hasattr(attn, "q_norm")
    assert cfg.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    hf_sparse = {i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}
    assert (cfg.moe.sparse_layers if cfg.moe else set()) == hf_sparse  # dense layers where transformers has them
    if cfg.moe is not None:
        block = next(layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "experts"))
        assert (cfg.moe.num_experts, cfg.moe.top_k) == (block.experts.num_experts, block.gate.top_k)
        assert cfg.moe.renormalize == getattr(block.gate, "norm_topk_prob", True)  # Mixtral's has no flag: always
        assert (cfg.moe.shared_expert_intermediate_size is not None) == hasattr(block, "shared_expert")


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_prefill_logits_match_transformers(variant: Tuple[str, Any]) -> None:
    path, hf = variant
    driver = BatchDriver(make_runner(path))
    prompts = _prompts(3, seed=1)
    out = driver.extend([driver.new_req() for _ in prompts], prompts, return_all_logits=True)
    assert out.full_logits is not None
    start = 0
    for i, ids in enumerate(prompts):
        ref = _hf_logits(hf, ids)
        ours = out.full_logits[start : start + len(ids)]
        assert relative_error(ours, ref) < TOL
        assert relative_error(out.next_token_logits[i], ref[-1]) < TOL
        start += len(ids)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_paged_decode_logits_match_transformers(variant: Tuple[str, Any], page_size: int) -> None:
    path, hf = variant
    driver = BatchDriver(make_runner(path, page_size=page_size, max_total_tokens=2048))
    driver.fragment(seed=page_size)
    prompts = _prompts(3, seed=2, lo=3, hi=30)
    reqs = [driver.new_req() for _ in prompts]
    logits = driver.extend(reqs, prompts).next_token_logits  # [3, V]
    step_logits = [logits]
    seqs = [list(p) for p in prompts]
    for _ in range(16):
        next_ids = torch.argmax(logits, dim=-1).tolist()
        for s, t in zip(seqs, next_ids):
            s.append(t)
        logits = driver.decode(reqs, next_ids).next_token_logits
        step_logits.append(logits)
    # the slots really are scattered: a request's KV is not one contiguous run
    assert any(any(b != a + 1 for a, b in zip(q.slots, q.slots[1:])) for q in reqs)
    for i, (req, seq, prompt) in enumerate(zip(reqs, seqs, prompts)):
        ref = _hf_logits(hf, seq)  # [len(prompt) + 16, V]
        ours = torch.stack([step[i] for step in step_logits])  # [17, V]
        assert relative_error(ours, ref[len(prompt) - 1 :]) < TOL


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_greedy_continuation_is_token_identical(variant: Tuple[str, Any]) -> None:
    from transformers import AutoTokenizer

    path, hf = variant
    driver = BatchDriver(make_runner(path, page_size=4, max_total_tokens=4096))
    driver.fragment(seed=3)
    prompts = _prompts(8, seed=3)
    ours = greedy_generate(driver, prompts, max_new_tokens=32)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # one batched generate; pads are masked out of attention
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=32, do_sample=False)[:, enc["input_ids"].shape[1] :].tolist()
    eos = hf.generation_config.eos_token_id
    for mine, ref in zip(ours, out):
        if eos in ref:  # transformers stops at EOS and pads the rest; compare up to it
            ref = ref[: ref.index(eos) + 1]
        assert mine[: len(ref)] == ref


def test_batched_extend_with_cached_prefixes_equals_one_at_a_time(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen3")
    driver = BatchDriver(make_runner(path, page_size=1))
    driver.fragment(seed=4)
    prompts = _prompts(3, seed=4, lo=20, hi=30)
    prefix_lens = [0, 7, 15]

    def run(batched: bool) -> List[torch.Tensor]:
        reqs = [driver.new_req() for _ in prompts]
        for q, p, n in zip(reqs, prompts, prefix_lens):
            if n:
                driver.extend([q], [p[:n]])  # the prefix is in the pool before the batch runs
        suffixes = [p[n:] for p, n in zip(prompts, prefix_lens)]
        if batched:
            full = driver.extend(reqs, suffixes, return_all_logits=True).full_logits
            assert full is not None
            out = list(full.split([len(s) for s in suffixes]))
        else:
            out = [driver.extend([q], [s], return_all_logits=True).full_logits for q, s in zip(reqs, suffixes)]
        for q in reqs:
            driver.release(q)
        return out

    batched, single = run(batched=True), run(batched=False)
    for b, s in zip(batched, single):
        assert relative_error(b, s) < 1e-5


def test_extend_only_last_token_reaches_lm_head(tiny_model_factory: Callable[..., str]) -> None:
    driver = BatchDriver(make_runner(tiny_model_factory("qwen3")))
    prompts = _prompts(3, seed=5)
    out = driver.extend([driver.new_req() for _ in prompts], prompts)
    assert out.full_logits is None
    assert out.next_token_logits.shape == (3, driver.runner.model_config.vocab_size)
    assert out.next_token_logits.dtype == torch.float32


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_bfloat16_stays_close_to_float32(tiny_model_factory: Callable[..., str], arch: str) -> None:
    path = tiny_model_factory(arch)
    prompts = _prompts(2, seed=6)
    results = []
    for dtype in ("float32", "bfloat16"):
        driver = BatchDriver(make_runner(path, dtype=dtype))
        assert driver.runner.token_to_kv_pool.dtype == getattr(torch, dtype)
        reqs = [driver.new_req() for _ in prompts]
        logits = [driver.extend(reqs, prompts).next_token_logits]
        logits.append(driver.decode(reqs, torch.argmax(logits[0], -1).tolist()).next_token_logits)
        results.append(torch.cat(logits))
    err = relative_error(results[1], results[0])
    print(f"bfloat16 vs float32 relative logit error: {err:.4f}")
    assert results[1].dtype == torch.float32  # logits leave the LM head in float32 either way
    assert err < 0.05


def test_triton_layer_hooks_match_the_torch_layers(tiny_model_factory: Callable[..., str]) -> None:
    """kernels="triton" routes RMSNorm and RoPE to minisgl.kernels; the model's logits must not change."""
    pytest.importorskip("minisgl.kernels.fused_add_rmsnorm")
    pytest.importorskip("minisgl.kernels.rotary_embedding")
    from minisgl.models.loader import load_model

    path = tiny_model_factory("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    prompts = _prompts(2, seed=7, lo=4, hi=12)
    logits = []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on the CPU, else the GPU
    for kernels in ("torch", "triton"):
        runner = make_runner(path, device=device)
        runner.model = load_model(runner.model_config, device, torch.float32, kernels=kernels, show_progress=False)
        driver = BatchDriver(runner)
        logits.append(driver.extend([driver.new_req() for _ in prompts], prompts, return_all_logits=True).full_logits)
    assert relative_error(logits[1], logits[0]) < 1e-5


@pytest.mark.parametrize("variant", MOE_VARIANTS, indirect=True)
def test_engine_greedy_generation_matches_transformers(variant: Tuple[str, Any]) -> None:
    """The whole serving path (scheduler, radix cache, the default cpu backend and its C
    kernels, the MoE layers) generates what transformers' greedy generate does."""
    from minisgl import Engine

    path, hf = variant
    prompts = _prompts(4, seed=8)
    with torch.no_grad():  # one prompt at a time: no padding in the reference
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    with Engine(path, device="cpu", max_total_tokens=2048) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    eos = hf.generation_config.eos_token_id
    for out, ref in zip(outs, refs):
        if eos in ref:  # transformers stops at EOS; compare up to it
            ref = ref[: ref.index(eos) + 1]
        assert out["output_ids"][: len(ref)] == ref
