"""Mixture-of-experts: routing against a naive per-token loop, config parsing against
transformers' config classes, and the loader's handling of expert tensors (both layouts,
and the errors that name a missing or misplaced one). Logits and greedy text against
transformers are in test_model_parity.py."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from forward_helpers import BatchDriver, copy_model_with, make_runner
from minisgl.layers.moe import MoeExperts, SparseMoeBlock, run_experts, select_experts
from minisgl.models.model_config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

H, I, E = 16, 24, 6  # hidden, expert intermediate, experts


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (gate_up @ x).chunk(2)  # [I] each
    return down @ (F.silu(gate) * up)  # [H]


def naive_moe(x: torch.Tensor, block: SparseMoeBlock) -> torch.Tensor:
    """One token at a time, one chosen expert at a time: the definition, in float64."""
    gate_up, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    out = []
    for token in x.double():  # [H]
        probs = torch.softmax(block.gate.weight.double() @ token, dim=-1)  # [E]
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[: block.top_k]
        weights = probs[chosen] / (probs[chosen].sum() if block.renormalize else 1.0)
        y = sum(w * _expert(token, gate_up[e], down[e]) for w, e in zip(weights, chosen))
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            shared = block.shared_expert
            g, u = (shared.gate_up_proj.weight.double() @ token).chunk(2)
            scale = torch.sigmoid(block.shared_expert_gate.weight.double() @ token)  # [1]
            y = y + scale * (shared.down_proj.weight.double() @ (F.silu(g) * u))
        out.append(y)
    return torch.stack(out).float()  # [N, H]


def make_block(renormalize: bool, shared: bool, seed: int = 0) -> SparseMoeBlock:
    from minisgl.models.decoder import DecoderMLP

    g = torch.Generator().manual_seed(seed)
    shared_expert = DecoderMLP(H, 2 * I) if shared else None
    block = SparseMoeBlock(H, E, 2, I, renormalize, shared_expert=shared_expert)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


@pytest.mark.parametrize("renormalize,shared", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_moe_block_equals_a_per_token_loop(renormalize: bool, shared: bool, num_tokens: int) -> None:
    block = make_block(renormalize, shared)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        ours = block(x)
        _, ids = select_experts(block.gate(x), 2, renormalize)
    assert ours.shape == (num_tokens, H) and ours.dtype == torch.float32
    if num_tokens <= 3:  # at most 6 of the 6 experts chosen, 1 token: only 2; the rest run no matmul
        assert len(set(ids.flatten().tolist())) < E
    torch.testing.assert_close(ours, naive_moe(x, block), rtol=1e-4, atol=1e-5)


def test_experts_nobody_chose_are_skipped_and_every_pair_lands_on_its_token() -> None:
    """run_experts with hand-made routing: experts 1, 3 and 5 get no token, expert 0 gets every
    token, and a token's two weights differ, so a pair added to the wrong token or with the
    wrong weight shows."""
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, 2], [4, 0], [0, 4], [2, 0], [0, 2]])
    weights = torch.tensor([[0.9, 0.1], [0.3, 0.7], [0.6, 0.4], [0.2, 0.8], [0.5, 0.5]])
    calls: List[int] = []

    def act(h: torch.Tensor) -> torch.Tensor:  # SiluAndMul, counting the rows each call gets
        calls.append(h.shape[0])
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    out = run_experts(x, gate_up, down, weights, ids, act)
    assert calls == [5, 3, 2]  # experts 0, 2, 4 in order, each once on all of its rows
    for t in range(5):
        ref = sum(weights[t, j] * _expert(x[t], gate_up[ids[t, j]], down[ids[t, j]]) for j in range(2))
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-5)


def test_select_experts_softmax_over_all_then_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    probs = torch.softmax(logits, dim=-1)
    w, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(w, torch.stack([probs[0, [0, 1]], probs[1, [2, 3]]]))  # not renormalised: sums < 1
    w_norm, _ = select_experts(logits.to(torch.bfloat16), 2, renormalize=True)
    assert w_norm.dtype == torch.float32  # float32 whatever the model dtype (transformers' routers)
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(2))


def test_expert_weight_loader_fills_slices_and_refuses_an_unknown_expert() -> None:
    experts = MoeExperts(3, H, I)
    gate, up, down = torch.full((I, H), 1.0), torch.full((I, H), 2.0), torch.full((H, I), 3.0)
    experts.weight_loader(experts.gate_up_proj, gate, (2, 0))
    experts.weight_loader(experts.gate_up_proj, up, (2, 1))
    experts.weight_loader(experts.down_proj, down, (2, None))
    assert torch.equal(experts.gate_up_proj[2], torch.cat([gate, up]))  # gate rows, then up rows
    assert torch.equal(experts.down_proj[2], down)
    with pytest.raises(ValueError, match="there is no expert 3: the config has num_experts=3"):
        experts.weight_loader(experts.down_proj, down, (3, None))
    with pytest.raises(ValueError, match="shape mismatch"):
        experts.weight_loader(experts.gate_up_proj, down, (0, 1))


# ---------------------------------------------------------------------- config


def _transformers_sparse_layers(path: str) -> set:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return {i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}


@pytest.mark.parametrize(
    "arch,edit",
    [
        ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}),
        ("qwen3_moe", {"mlp_only_layers": [0, 2]}),
        ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4, "layer_types": None, "mlp_only_layers": [3]}),
        ("qwen2_moe", {"num_experts": 0}),  # transformers' rule: no experts, every layer dense
    ],
)
def test_sparse_layers_follow_transformers(tiny_model_factory: Callable[..., str], tmp_path: Any, arch: str, edit: Dict[str, Any]) -> None:
    path = copy_model_with(tiny_model_factory(arch), str(tmp_path / "m"), lambda d: d.update(edit))
    moe = ModelConfig.from_pretrained(path).moe
    assert moe is not None and set(moe.sparse_layers) == _transformers_sparse_layers(path)


def test_config_keys_and_defaults_match_the_config_classes(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    """Keys config.json leaves out take the config class's default; both spellings of the
    expert count are read (Qwen3MoeConfig's save_pretrained writes num_local_experts)."""
    import transformers as tf

    qwen3 = tiny_model_factory("qwen3_moe")
    with open(os.path.join(qwen3, "config.json")) as f:
        assert "num_local_experts" in json.load(f)  # what transformers 5.24 writes for Qwen3-MoE
    hub_spelling = copy_model_with(qwen3, str(tmp_path / "q3"), lambda d: d.update(num_experts=d.pop("num_local_experts")))
    assert ModelConfig.from_pretrained(hub_spelling).moe.num_experts == 4  # type: ignore[union-attr]

    keys = ("norm_topk_prob", "moe_intermediate_size", "num_experts_per_tok", "shared_expert_intermediate_size",
            "qkv_bias", "decoder_sparse_step", "num_local_experts", "num_experts")  # fmt: skip
    for arch in ("qwen3_moe", "qwen2_moe", "mixtral"):
        bare = copy_model_with(tiny_model_factory(arch), str(tmp_path / arch), lambda d: [d.pop(k, None) for k in keys])
        ours, hf = ModelConfig.from_pretrained(bare), tf.AutoConfig.from_pretrained(bare)
        assert ours.moe is not None
        expert_size = hf.intermediate_size if arch == "mixtral" else hf.moe_intermediate_size
        assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.intermediate_size) == (
            hf.num_local_experts if arch != "qwen2_moe" else hf.num_experts, hf.num_experts_per_tok, expert_size
        )
        assert ours.moe.renormalize == getattr(hf, "norm_topk_prob", True)
        assert ours.moe.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", None)
        assert ours.qkv_bias == (arch == "qwen2_moe")  # Qwen2MoeConfig.qkv_bias defaults to True


@pytest.mark.parametrize(
    "arch,edit,window",
    [
        ("mixtral", {}, None),  # MixtralConfig: no window unless named (Mistral's default is 4096)
        ("mixtral", {"sliding_window": 64}, 64),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}, 64),  # every layer slides
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, 64),  # layer 0
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, None),
    ],
)
def test_sliding_window_rules_of_the_moe_families(
    tiny_model_factory: Callable[..., str], tmp_path: Any, arch: str, edit: Dict[str, Any], window: Optional[int]
) -> None:
    from transformers import AutoConfig

    def apply(d: Dict[str, Any]) -> None:
        d.pop("layer_types", None)  # let the class's rule derive them from max_window_layers
        d.pop("sliding_window", None)
        d.update(edit)

    path = copy_model_with(tiny_model_factory(arch), str(tmp_path / "m"), apply)
    hf = AutoConfig.from_pretrained(path)
    slides = getattr(hf, "layer_types", None)
    hf_window = hf.sliding_window if (slides is None or "sliding_attention" in slides) else None
    assert (hf_window or None) == window  # what transformers' attention masks use
    assert ModelConfig.from_pretrained(path, context_length=128).context_len == (window or 128)


def test_too_many_experts_per_token_is_refused(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    path = copy_model_with(tiny_model_factory("mixtral"), str(tmp_path / "m"), lambda d: d.update(num_experts_per_tok=5))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be between 1 and the number of experts \(4\)"):
        ModelConfig.from_pretrained(path)


# ---------------------------------------------------------------------- loading


def _rewrite_weights(src: str, dst: str, edit: Callable[[Dict[str, torch.Tensor]], None]) -> str:
    from safetensors.torch import load_file, save_file

    path = copy_model_with(src, dst)
    weights = load_file(os.path.join(path, "model.safetensors"))
    edit(weights)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _next_token_logits(path: str) -> torch.Tensor:
    d = BatchDriver(make_runner(path))
    return d.extend([d.new_req()], [[5, 9, 200, 31, 7, 77, 12]]).next_token_logits


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_a_checkpoint_of_stacked_experts_loads_the_same_model(tiny_model_factory: Callable[..., str], tmp_path: Any, arch: str) -> None:
    """save_pretrained writes one tensor per expert (the Hub layout, Mixtral's block_sparse_moe
    w1/w3/w2 included); transformers holds them stacked as mlp.experts.gate_up_proj [E, 2I, H]
    and down_proj [E, H, I]. A checkpoint of its state_dict loads to the same logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src = tiny_model_factory(arch)
    stacked = copy_model_with(src, str(tmp_path / "stacked"))
    state = AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 48 if arch != "mixtral" else 2 * 96, 64)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(stacked, "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(_next_token_logits(stacked), _next_token_logits(src))


@pytest.mark.parametrize(
    "arch,drop,named",
    [
        ("qwen3_moe", "model.layers.2.mlp.experts.3.up_proj.weight", r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"),
        ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight", r"model\.layers\.1\.mlp\.shared_expert_gate\.weight"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.0.w2.weight",
         r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight"),
    ],
)  # fmt: skip
def test_a_missing_expert_tensor_is_named(tiny_model_factory: Callable[..., str], tmp_path: Any, arch: str, drop: str, named: str) -> None:
    path = _rewrite_weights(tiny_model_factory(arch), str(tmp_path / "m"), lambda w: w.pop(drop))
    with pytest.raises(ValueError, match=rf"checkpoint is missing tensors \['{named}'\]"):
        make_runner(path)


def test_expert_tensors_that_fit_nowhere_are_refused(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    src = tiny_model_factory("qwen3_moe")  # 4 experts; layer 1 is dense (mlp_only_layers)
    extra = "model.layers.0.mlp.experts.4.gate_proj.weight"
    beyond = _rewrite_weights(src, str(tmp_path / "a"), lambda w: w.update({extra: w["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{extra}' names expert 4, but the config has num_experts=4 \(experts 0\.\.3\)"):
        make_runner(beyond)
    on_dense = "model.layers.1.mlp.experts.0.gate_proj.weight"
    dense = _rewrite_weights(src, str(tmp_path / "b"), lambda w: w.update({on_dense: w["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{on_dense}' has no place in Qwen3MoeForCausalLM"):
        make_runner(dense)
    wrong = copy_model_with(src, str(tmp_path / "c"), lambda d: d.update(moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight' does not fit"):
        make_runner(wrong)


def test_a_zero_width_shared_expert_loads_as_transformers_builds_it(tiny_model_factory: Callable[..., str]) -> None:
    """Qwen2-MoE always has a shared expert and its gate; at shared_expert_intermediate_size 0 the
    checkpoint holds [0, H] / [H, 0] tensors and a [1, H] gate, and the shared term is 0."""
    import transformers as tf

    path = tiny_model_factory("qwen2_moe", shared_expert_intermediate_size=0)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    prompt = [5, 9, 200, 31, 7, 77, 12]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    driver = BatchDriver(make_runner(path))
    got = driver.extend([driver.new_req()], [prompt]).next_token_logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_moe_config_without_intermediate_size_takes_the_class_default(tmp_path: Any) -> None:
    """A MoE layer reads the experts' widths: config.json may leave the dense width out (transformers
    then never reads it); the config class's default stands in. A dense model must state it."""
    import transformers as tf

    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "num_local_experts": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, hf = ModelConfig.from_pretrained(str(tmp_path)), tf.AutoConfig.from_pretrained(str(tmp_path))
    assert ours.moe is not None and ours.moe.intermediate_size == ours.intermediate_size == hf.intermediate_size == 14336
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json has no intermediate_size"):
        ModelConfig.from_pretrained(str(tmp_path))
