"""ModelRunner and loader: sizing, config parsing, checkpoint formats, errors, forward + sample."""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, Optional

import pytest
import torch

from forward_helpers import BatchDriver, copy_model_with, make_runner
from kernel_helpers import cpu_kernels_unavailable
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from minisgl.model_executor.model_runner import CPU_MAX_RUNNING_REQUESTS, CPU_POOL_CONTEXTS, ModelRunner
from minisgl.models.loader import resolve_model_path, safetensors_files
from minisgl.models.model_config import ModelConfig, parse_rope
from minisgl.sampling.sampling_batch_info import SamplingBatchInfo
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.server_args import ServerArgs, resolve_server_args


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


def test_kv_pool_and_request_slots_follow_the_args(tiny_model: str) -> None:
    r = make_runner(tiny_model, page_size=16, max_total_tokens=1000, max_running_requests=8)
    mc = r.model_config
    assert r.max_total_num_tokens == 992  # floored to whole pages
    assert r.token_to_kv_pool_allocator.available_size() == 992
    assert r.token_to_kv_pool.k_buffer[0].shape == (992 + 16, mc.num_kv_heads, mc.head_dim)
    assert len(r.token_to_kv_pool.k_buffer) == mc.num_layers
    assert r.max_running_requests == 8 and r.req_to_token_pool.size == 8
    assert r.req_to_token_pool.req_to_token.shape[1] == mc.context_len + 16
    assert mc.context_len == 2048  # max_position_embeddings of the tiny config


def test_cpu_pool_from_budget_and_cap(tiny_model: str) -> None:
    cell = make_runner(tiny_model, max_total_tokens=64).cell_size
    small = make_runner(tiny_model, max_total_tokens=None, cpu_kv_cache_gb=300 * cell / 2**30, page_size=4)
    assert small.max_total_num_tokens == 300  # budget / cell size, a multiple of page_size
    capped = make_runner(tiny_model, max_total_tokens=None, cpu_kv_cache_gb=1.0, context_length=256)
    assert capped.model_config.context_len == 256
    assert capped.max_total_num_tokens == CPU_POOL_CONTEXTS * 256
    assert capped.max_running_requests == min(CPU_POOL_CONTEXTS * 256 // 2, CPU_MAX_RUNNING_REQUESTS)
    # a value given by flag is used as given, as SGLang does (it was capped at 4096 silently)
    big = make_runner(tiny_model, max_running_requests=5000, context_length=16)
    assert big.max_running_requests == 5000 and big.req_to_token_pool.size == 5000


def test_a_context_longer_than_the_model_was_trained_for_is_refused_unless_allowed(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang refuses it (it was accepted with a warning); its environment switch allows it."""
    with pytest.raises(ValueError, match="longer than the model.s context \\(2048: its max_position_embeddings, times its rope scaling.s factor if it has one\\)"):
        make_runner(tiny_model, context_length=4096)  # the tiny config's max_position_embeddings is 2048
    monkeypatch.setenv("MINISGL_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert make_runner(tiny_model, context_length=4096).model_config.context_len == 4096


def test_a_linear_rope_scaling_extends_the_models_context_as_sglang_derives_it(
    tiny_model_factory: Callable[..., str], tmp_path: Any
) -> None:
    """SGLang's get_context_length multiplies by a scaled rope's factor (not llama3's, which names
    its original length): a linear x4 model of 2048 positions has 8192, and --context-length 8192
    must not be refused (nor the default left at 2048)."""
    def linear(d: dict) -> None:
        d.pop("rope_parameters", None)
        d.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})

    path = copy_model_with(tiny_model_factory("llama"), str(tmp_path / "m"), linear)
    assert ModelConfig.from_pretrained(path).context_len == 8192
    assert ModelConfig.from_pretrained(path, 8192).context_len == 8192
    with pytest.raises(ValueError, match="longer than the model's context \\(8192"):
        ModelConfig.from_pretrained(path, 8193)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 512}  # fmt: skip
    path3 = copy_model_with(tiny_model_factory("llama"), str(tmp_path / "l3"), lambda d: d.update(rope_scaling=llama3))
    assert ModelConfig.from_pretrained(path3).context_len == 2048  # max_position_embeddings, already extended


def test_one_rope_table_for_the_model_sized_by_the_context(tiny_model: str) -> None:
    """Every layer reads the same cos/sin table, [context_len, D]: memory a long-context model would lose to the KV pool."""
    runner = make_runner(tiny_model, context_length=256)
    tables = {m.self_attn.rotary_emb.cos_sin_cache.data_ptr() for m in runner.model.model.layers}
    assert len(runner.model.model.layers) > 1 and len(tables) == 1
    assert tuple(runner.model.model.rotary_emb.cos_sin_cache.shape) == (256, runner.model_config.head_dim)


def test_bfloat16_kv_pool_halves_the_cell_and_doubles_the_budgeted_tokens(tiny_model: str) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: the pool, not the model, is bf16: half the bytes per token."""
    budget = 300 * make_runner(tiny_model, max_total_tokens=64).cell_size / 2**30  # 300 float32 tokens
    full = make_runner(tiny_model, max_total_tokens=None, cpu_kv_cache_gb=budget)
    half = make_runner(tiny_model, max_total_tokens=None, cpu_kv_cache_gb=budget, kv_cache_dtype="bf16")
    assert half.server_args.kv_cache_dtype == "bfloat16" and full.server_args.kv_cache_dtype == "float32"
    assert half.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16 and half.dtype == torch.float32
    assert half.cell_size * 2 == full.cell_size
    assert (full.max_total_num_tokens, half.max_total_num_tokens) == (300, 600)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    bool(cpu_kernels_unavailable()), reason=str(cpu_kernels_unavailable())))])  # fmt: skip
def test_bfloat16_kv_pool_changes_decode_logits_only_by_rounding(tiny_model: str, backend: str) -> None:
    """Decoding on top of a cached prompt reads the pool: bf16 K/V move the logits a little, never a lot."""
    prompt, logits = [[(7 * i + 5) % 300 for i in range(40)]], {}  # >= FRESH_MIN_TOKENS: the cpu backend's SDPA path
    for kv in ("auto", "bfloat16"):
        d = BatchDriver(make_runner(tiny_model, attention_backend=backend, kv_cache_dtype=kv))
        req = d.new_req()
        first = d.extend([req], prompt).next_token_logits
        logits[kv] = (first, d.decode([req], [int(first.argmax())]).next_token_logits)
    if backend == "cpu":  # a fresh prompt attends to this pass's own float32 K/V, not to the pool
        torch.testing.assert_close(logits["auto"][0], logits["bfloat16"][0], atol=1e-5, rtol=1e-5)
    for full, rounded in zip(logits["auto"], logits["bfloat16"]):
        diff = (full - rounded).abs().max().item()
        assert diff < 0.05 * full.abs().max().item()  # only rounded
    assert (logits["auto"][1] - logits["bfloat16"][1]).abs().max().item() > 0  # the decode step read the bf16 pool


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(dtype="float32", attention_backend="triton", kv_cache_dtype="bfloat16"), "cpu or torch, not triton"),
        (dict(dtype="bfloat16", attention_backend="torch", kv_cache_dtype="auto"), None),
        (dict(dtype="bfloat16", attention_backend="torch", kv_cache_dtype="bf16"), None),  # the model's own dtype
        (dict(kv_cache_dtype="fp8_e5m2"), "--kv-cache-dtype must be one of"),
    ],
)
def test_kv_cache_dtype_is_resolved_or_refused(args: Dict[str, Any], message: Optional[str]) -> None:
    if message is None:
        resolved = resolve_server_args(ServerArgs(device="cpu", **args))
        assert resolved.kv_cache_dtype == resolved.dtype and resolved.is_resolved
        return
    with pytest.raises(ValueError, match=message):
        resolve_server_args(ServerArgs(device="cpu", **args))


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(page_size=16, chunked_prefill_size=8), "--chunked-prefill-size \\(8\\) must be at least --page-size \\(16\\)"),
        (dict(prefill_max_requests=0), "--prefill-max-requests must be >= 1"),
        (dict(max_running_requests=0), "--max-running-requests must be >= 1"),
    ],
)
def test_settings_that_could_never_schedule_a_request_are_refused(args: Dict[str, Any], message: str) -> None:
    """Each of these ran and never finished a request (a busy scheduler, no error)."""
    with pytest.raises(ValueError, match=message):
        ServerArgs(device="cpu", **args)
    ServerArgs(device="cpu", page_size=16, chunked_prefill_size=-1)  # chunking off: any page size


def test_unresolved_args_are_refused(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="resolve_server_args"):
        ModelRunner(ServerArgs(model_path=tiny_model))


def test_eos_ids_are_the_union_of_config_and_generation_config(tiny_model: str, tmp_path: Any) -> None:
    def gen(d: dict) -> None:
        d["eos_token_id"] = [2, 7]

    def cfg(d: dict) -> None:
        d["eos_token_id"] = 5

    path = copy_model_with(tiny_model, str(tmp_path / "m"), cfg, gen)
    assert ModelConfig.from_pretrained(path).hf_eos_token_ids == {2, 5, 7}


def test_legacy_and_transformers5_rope_spellings_agree() -> None:
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    v5 = {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}}
    theta_legacy, scaling_legacy = parse_rope(legacy)
    theta_v5, scaling_v5 = parse_rope(v5)
    assert theta_legacy == theta_v5 == 500000.0
    assert scaling_legacy is not None and scaling_v5 is not None
    assert scaling_legacy["rope_type"] == scaling_v5["rope_type"] == "linear"
    assert scaling_legacy["factor"] == scaling_v5["factor"] == 4.0
    assert parse_rope({"rope_theta": 1e6}) == (1e6, None)
    assert parse_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}) == (10.0, None)
    with pytest.raises(ValueError, match="yarn"):
        parse_rope({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0}})


@pytest.mark.parametrize(
    "cfg",
    [
        # a transformers-5 config with rope_scaling added by hand (how model cards extend context)
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 5e5,
         "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "rope_scaling": None},
    ],
)  # fmt: skip
def test_rope_spelling_precedence_follows_transformers(cfg: dict) -> None:
    """When both spellings are present, the numbers must be the ones transformers computes with."""
    import transformers as tf

    hf = tf.LlamaConfig.from_dict(dict(cfg)).rope_parameters
    theta, scaling = parse_rope(cfg)
    assert theta == hf["rope_theta"]
    assert scaling is not None and scaling["rope_type"] == hf["rope_type"] and scaling["factor"] == hf["factor"]


def test_llama3_rope_without_original_max_position_embeddings_defaults_as_transformers() -> None:
    cfg = {"max_position_embeddings": 4096, "rope_theta": 5e5,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}  # fmt: skip
    _, scaling = parse_rope(cfg)
    assert scaling is not None and scaling["original_max_position_embeddings"] == 4096  # (a KeyError before)
    with pytest.raises(ValueError, match=r"rope_scaling of type 'llama3' needs \['low_freq_factor'\]"):
        parse_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}})


def test_llama3_top_level_original_max_position_embeddings_wins_as_in_transformers(
    tiny_model_factory: Callable[..., str], tmp_path: Any
) -> None:
    """transformers (and SGLang's Llama) take the top-level value over the rope dict's; minisgl
    took the dict's, and every rope frequency came out different (logits off by ~1.5)."""
    import transformers as tf

    def cfg(d: dict) -> None:
        d.pop("rope_scaling", None)
        d["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64, "rope_theta": 5e5}  # fmt: skip
        d["original_max_position_embeddings"] = 16

    path = copy_model_with(tiny_model_factory("llama"), str(tmp_path / "m"), cfg)
    ours = ModelConfig.from_pretrained(path).rope_scaling
    assert ours is not None and ours["original_max_position_embeddings"] == 16
    hf = tf.AutoModelForCausalLM.from_pretrained(path)  # the model standardizes its config's rope
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 16


def test_a_qwen3_config_without_head_dim_has_qwen3s_default(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    """Qwen3Config's head_dim defaults to 128, not hidden / heads (Llama's rule, which minisgl
    applied to every architecture): such a checkpoint failed on a weight shape."""
    import transformers as tf

    path = copy_model_with(tiny_model_factory("qwen3"), str(tmp_path / "m"), lambda d: d.pop("head_dim"))
    assert ModelConfig.from_pretrained(path).head_dim == tf.AutoConfig.from_pretrained(path).head_dim == 128
    llama = copy_model_with(tiny_model_factory("llama"), str(tmp_path / "l"), lambda d: d.pop("head_dim", None))
    assert ModelConfig.from_pretrained(llama).head_dim == tf.AutoConfig.from_pretrained(llama).head_dim


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_keys_a_config_leaves_out_take_the_config_classs_default(tiny_model_factory: Callable[..., str], tmp_path: Any, arch: str) -> None:
    """Mixtral's rope_theta is 1e6 and its rms_norm_eps 1e-5, and max_position_embeddings
    defaults differ per class (2048 for Llama only): minisgl applied Llama's to every one."""
    import transformers as tf

    keys = ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "max_position_embeddings")
    path = copy_model_with(tiny_model_factory(arch), str(tmp_path / "m"), lambda d: [d.pop(k, None) for k in keys])
    ours, hf = ModelConfig.from_pretrained(path), tf.AutoConfig.from_pretrained(path)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (hf.rms_norm_eps, hf.max_position_embeddings)


def test_transformers_spellings_of_supported_settings_are_accepted(tiny_model: str, tmp_path: Any) -> None:
    """hidden_act "swish" is SiLU and partial_rotary_factor null is full rotary in transformers."""
    path = copy_model_with(tiny_model, str(tmp_path / "m"), lambda d: d.update(hidden_act="swish", partial_rotary_factor=None))
    ModelConfig.from_pretrained(path)  # both were refused


def test_a_tied_checkpoints_lm_head_is_the_embedding_or_refused(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    """A tied model's stored lm_head.weight was dropped unseen: a different matrix (transformers 5
    unties the two) is refused now, and a checkpoint storing the tied matrix only under the
    head's name loads (it was "missing model.embed_tokens.weight")."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama", tie_word_embeddings=True)
    prompt = [[5, 9, 200, 31, 7, 77]]
    d = BatchDriver(make_runner(src))
    reference = d.extend([d.new_req()], prompt).next_token_logits

    def rewrite(name: str, edit: Callable[[Dict[str, Any]], None]) -> str:
        path = copy_model_with(src, str(tmp_path / name))
        weights = load_file(os.path.join(path, "model.safetensors"))
        edit(weights)
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path

    embed = "model.embed_tokens.weight"
    distinct = rewrite("distinct", lambda w: w.update({"lm_head.weight": w[embed] + 1.0}))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight; set tie_word_embeddings to false"):
        make_runner(distinct)
    head_only = rewrite("head-only", lambda w: w.update({"lm_head.weight": w.pop(embed)}))
    d = BatchDriver(make_runner(head_only))
    torch.testing.assert_close(d.extend([d.new_req()], prompt).next_token_logits, reference)
    same = rewrite("copy", lambda w: w.update({"lm_head.weight": w[embed].clone()}))
    make_runner(same)  # an equal copy, as most tied checkpoints store, loads as before


def test_quantized_checkpoints_are_refused_by_name(tiny_model: str, tmp_path: Any) -> None:
    def quantized(d: dict) -> None:
        d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}

    path = copy_model_with(tiny_model, str(tmp_path / "m"), quantized)
    with pytest.raises(ValueError, match="Quantized checkpoints are not supported.*'fp8'"):
        ModelConfig.from_pretrained(path)


def test_loader_errors_name_the_checkpoint_tensor(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    wrong_shape = copy_model_with(src, str(tmp_path / "a"), lambda d: d.update(intermediate_size=d["intermediate_size"] - 32))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' does not fit"):
        make_runner(wrong_shape)
    missing = copy_model_with(src, str(tmp_path / "b"))
    weights = load_file(os.path.join(missing, "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.self_attn\.k_proj\.weight'\]"):
        make_runner(missing)


def test_a_checkpoint_with_fused_qkv_and_gate_up_loads_the_same_model(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    """Some checkpoints store q/k/v (and gate/up) already fused, under the fused names: the
    loader splits them into their shards (the fused layers' weight_loader with shard_id None) and
    counts every shard as filled."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    fused = copy_model_with(src, str(tmp_path / "fused"))
    weights = load_file(os.path.join(fused, "model.safetensors"))
    for layer in range(2):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        weights[attn + "qkv_proj.weight"] = torch.cat([weights.pop(f"{attn}{n}_proj.weight") for n in "qkv"])
        weights[mlp + "gate_up_proj.weight"] = torch.cat([weights.pop(f"{mlp}{n}_proj.weight") for n in ("gate", "up")])
    save_file(weights, os.path.join(fused, "model.safetensors"), metadata={"format": "pt"})
    prompt = [[5, 9, 200, 31, 7, 77]]
    logits = []
    for path in (src, fused):
        d = BatchDriver(make_runner(path))
        logits.append(d.extend([d.new_req()], prompt).next_token_logits)
    assert torch.equal(logits[0], logits[1])


def test_unsupported_architecture_names_the_supported_ones(tiny_model: str, tmp_path: Any) -> None:
    def cfg(d: dict) -> None:
        d["architectures"] = ["GPT2LMHeadModel"]

    path = copy_model_with(tiny_model, str(tmp_path / "m"), cfg)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*MixtralForCausalLM.*Qwen2ForCausalLM.*Qwen2MoeForCausalLM.*Qwen3ForCausalLM.*Qwen3MoeForCausalLM"):
        ModelConfig.from_pretrained(path)


def test_missing_models_give_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path("/no/such/model/dir")
    # conftest sets HF_HUB_OFFLINE=1; either way this id is neither local nor cached
    with pytest.raises(ValueError, match="`hf download minisgl-test/no-such-model`"):
        resolve_model_path("minisgl-test/no-such-model")


def test_sharded_and_bf16_checkpoints_load(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("llama")
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="40KB")
    shutil.copy(os.path.join(path, "tokenizer.json"), sharded)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len(safetensors_files(sharded)) > 1

    prompt = [[5, 9, 200, 31, 7, 77]]
    logits = {}
    for name, p, dtype in (("single", path, "float32"), ("sharded", sharded, "float32")):
        d = BatchDriver(make_runner(p, dtype=dtype))
        logits[name] = d.extend([d.new_req()], prompt).next_token_logits
    assert torch.equal(logits["single"], logits["sharded"])

    bf16 = tiny_model_factory("qwen3", dtype="bfloat16")  # stored bf16, like the built-in model
    r = make_runner(bf16, dtype="float32")
    w = r.model.model.embed_tokens.weight
    assert w.dtype == torch.float32
    from safetensors import safe_open

    with safe_open(os.path.join(bf16, "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.embed_tokens.weight")
    assert stored.dtype == torch.bfloat16 and torch.equal(w, stored.float())


def sampling_info(runner: ModelRunner, reqs: Any) -> SamplingBatchInfo:
    mc = runner.model_config
    return SamplingBatchInfo.from_reqs(reqs, mc.vocab_size, runner.device, mc.hf_eos_token_ids)


def test_forward_then_sample_end_to_end(tiny_model: str) -> None:
    runner = make_runner(tiny_model)
    driver = BatchDriver(runner)

    class Req:
        def __init__(self, ids: list, **params: Any) -> None:
            self.origin_input_ids, self.output_ids = ids, []
            self.sampling_params = SamplingParams(**params)
            self.sampling_params.normalize()
            self.return_logprob, self.top_logprobs_num, self.token_ids_logprob = True, 2, [3, 9]

    reqs = [Req([4, 8, 15, 16, 23], temperature=0), Req([42, 7], temperature=0.7, seed=3)]
    out = driver.extend([driver.new_req() for _ in reqs], [r.origin_input_ids for r in reqs])
    info = sampling_info(runner, reqs)
    sampled = runner.sample(out, info)
    assert sampled.next_token_ids.shape == (2,) and sampled.next_token_ids.dtype == torch.int64
    assert int(sampled.next_token_ids[0]) == int(out.next_token_logits[0].argmax())
    assert sampled.top_logprobs_idx is not None and all(len(x) == 2 for x in sampled.top_logprobs_idx)
    # the named ids' logprobs (token_ids_logprob): the greedy row's distribution is at temperature 1
    assert sampled.token_ids_logprobs is not None
    expected = torch.log_softmax(out.next_token_logits[0], dim=-1)[[3, 9]].tolist()
    assert sampled.token_ids_logprobs[0] == pytest.approx(expected, abs=1e-5)
    again = runner.sample(out, sampling_info(runner, reqs))
    assert int(again.next_token_ids[1]) == int(sampled.next_token_ids[1])  # seeded


def test_penalties_do_not_modify_the_model_logits(tiny_model: str) -> None:
    runner = make_runner(tiny_model)
    driver = BatchDriver(runner)
    out = driver.extend([driver.new_req()], [[3, 4, 5]])
    before = out.next_token_logits.clone()

    class Req:
        origin_input_ids, output_ids = [3, 4, 5], [int(before[0].argmax())]
        sampling_params = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
        return_logprob, top_logprobs_num, token_ids_logprob = False, 0, None

    Req.sampling_params.normalize()
    sampled = runner.sample(out, sampling_info(runner, [Req()]))
    assert torch.equal(out.next_token_logits, before)
    assert int(sampled.next_token_ids[0]) != int(before[0].argmax())  # penalised by 4 (random logits spread ~1)


def test_idle_forward_returns_no_logits(tiny_model: str) -> None:
    r = make_runner(tiny_model)
    empty = torch.empty(0, dtype=torch.int64)
    fb = ForwardBatch(ForwardMode.IDLE, 0, empty, empty, empty, empty, empty, [], r.req_to_token_pool, r.token_to_kv_pool, r.attn_backend)
    assert r.forward(fb).next_token_logits.shape == (0, r.model_config.vocab_size)


def test_mistral_sliding_window_caps_the_context(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    path = tiny_model_factory("mistral", sliding_window=128)
    assert ModelConfig.from_pretrained(path).context_len == 128
    # a hand-written config without the key has MistralConfig's default window, 4096 (it had none)
    no_key = copy_model_with(path, str(tmp_path / "no-key"), lambda d: (d.pop("sliding_window"), d.update(max_position_embeddings=8192)))
    assert ModelConfig.from_pretrained(no_key).context_len == 4096
    assert ModelConfig.from_pretrained(tiny_model_factory("qwen3")).context_len == 2048  # use_sliding_window False


@pytest.mark.parametrize(
    "use_sliding_window, max_window_layers, context_len",
    [(None, 0, 2048), (False, 0, 2048), (True, 0, 128), (True, 1, 128), (True, 2, 2048), (True, None, 2048)],
)
def test_qwen2_window_counts_only_when_switched_on_and_some_layer_slides(
    tiny_model_factory: Callable[..., str], tmp_path: Any,
    use_sliding_window: Optional[bool], max_window_layers: Optional[int], context_len: int,
) -> None:  # fmt: skip
    """transformers' Qwen2 ignores sliding_window unless use_sliding_window (default off), and
    then slides only the layers from max_window_layers on (or those `layer_types` names; the
    saved config's, all full attention, for None): with no sliding layer the context is whole."""

    def cfg(d: dict) -> None:
        d["sliding_window"] = 128
        d.pop("use_sliding_window", None)
        if use_sliding_window is not None:
            d["use_sliding_window"] = use_sliding_window
        if max_window_layers is not None:  # 2 layers: 0 and 1 slide some, 2 none
            d.pop("layer_types", None)
            d["max_window_layers"] = max_window_layers

    path = copy_model_with(tiny_model_factory("qwen2"), str(tmp_path / "m"), cfg)
    assert ModelConfig.from_pretrained(path).context_len == context_len


def test_cpu_float32_weights_are_packed_once(tiny_model_factory: Callable[..., str]) -> None:
    """Every matmul weight goes to oneDNN's layout, the dense copy is released, logits unchanged."""
    from minisgl.layers.linear import CpuPackedWeight, pack_weight_for_cpu
    from minisgl.layers.vocab_parallel_embedding import ParallelLMHead

    if pack_weight_for_cpu(torch.ones(4, 4)) is None:
        pytest.skip("this torch build has no oneDNN linear: weights stay dense")
    path = tiny_model_factory("qwen2")  # untied head, qkv bias
    r = make_runner(path)
    linears = [m for m in r.model.modules() if isinstance(m, CpuPackedWeight)]
    assert linears and all(m.packed_weight is not None and m.weight.numel() == 0 for m in linears)
    assert any(isinstance(m, ParallelLMHead) for m in linears)  # the untied head too
    # the same prompt through dense copies of the same weights gives the same logits
    prompt = [[5, 9, 200, 31, 7, 77]]
    d = BatchDriver(r)
    packed_logits = d.extend([d.new_req()], prompt).next_token_logits
    for m in linears:
        m.weight.data = m.dense_weight().clone()
        m.packed_weight = None
    d2 = BatchDriver(r)
    dense_logits = d2.extend([d2.new_req()], prompt).next_token_logits
    torch.testing.assert_close(packed_logits, dense_logits, atol=1e-5, rtol=1e-4)
    # bf16 runs keep dense weights (no packed path for them)
    bf16 = make_runner(path, dtype="bfloat16")
    assert all(m.packed_weight is None for m in bf16.model.modules() if isinstance(m, CpuPackedWeight))


def test_packed_multiplies_meet_a_bounded_set_of_row_counts() -> None:
    """oneDNN keeps a primitive per distinct row count: a server fed every prompt length grew by
    GBs (12.6 GB over the benchmark model's shapes at 1..2,048 rows). Above decode sizes the
    rows are padded to a coarse grid, with the same results for the real rows."""
    import subprocess
    import sys

    import torch.nn.functional as F

    from minisgl.layers.linear import linear, pack_weight_for_cpu, packed_rows

    w = torch.randn(96, 40)
    packed = pack_weight_for_cpu(w)
    if packed is None:
        pytest.skip("this torch build has no oneDNN linear: weights stay dense")
    sizes = range(1, 8193)
    assert all(n <= packed_rows(n) < n + 64 for n in sizes) and all(packed_rows(n) == n for n in range(1, 65))
    assert len({packed_rows(n) for n in sizes}) <= 220
    for n in (1, 64, 65, 71, 256, 257, 300):
        x = torch.randn(n, 40)
        out = linear(x, w, packed=packed)
        assert out.shape == (n, 96)
        torch.testing.assert_close(out, F.linear(x, w), atol=1e-5, rtol=1e-4)
    # the memory itself, in a fresh process (this one's malloc settings are the ModelRunner's)
    probe = (
        "import torch\n"
        "from minisgl.layers.linear import linear, pack_weight_for_cpu\n"
        "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024\n"
        "w = torch.randn(1024, 256); p = pack_weight_for_cpu(w); start = rss()\n"
        "for m in range(1, 1025, 2): linear(torch.randn(m, 256), w, packed=p)\n"
        "print(rss() - start)\n"
    )
    growth_mb = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert growth_mb < 150, f"512 row counts through one packed weight kept {growth_mb} MB"  # (unbucketed: ~310 MB)


def test_the_cuda_kv_pool_is_a_fraction_of_what_was_free_before_the_weights(tiny_model: str, monkeypatch: Any) -> None:
    """SGLang's total_gpu_memory is the memory free before the weights load, not the device's
    size: on a GPU another process holds half of, the pool was a third smaller than SGLang's,
    and with more held the server refused to start where SGLang runs."""
    import dataclasses

    r = make_runner(tiny_model)
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (38 * gib, 80 * gib))  # after the weights
    r.device, r.free_memory_before_load = "cuda", 40 * gib  # 40 of 80 GiB held by someone else
    r.server_args = dataclasses.replace(r.server_args, max_total_tokens=None, mem_fraction_static=0.85)
    assert r._profile_max_num_token() == int(38 * gib - 40 * gib * 0.15) // r.cell_size


def test_cpu_runner_keeps_freed_memory_in_the_heap() -> None:
    """glibc: large activations come from the heap, so a second identical allocation is not page-faulted."""
    from minisgl.utils import keep_freed_memory_in_heap

    if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
        pytest.skip("not glibc")
    assert keep_freed_memory_in_heap()
    import resource

    big = torch.empty(8 << 20).fill_(1.0)  # 32 MiB
    del big
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(4 << 20).fill_(2.0)  # 16 MiB: fits in the freed block, alignment slack included
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 500  # fresh memory would fault ~4,000 4-KiB pages
