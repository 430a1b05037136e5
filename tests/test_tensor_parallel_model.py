"""Tensor parallelism, the model side: two ranks, each holding half of every split weight, give
the tokens and logprobs of one rank holding all of them.

Two spawned processes (ranks 0 and 1) each build ServerArgs(tp_size=2), a ModelRunner on their
GroupCoordinator and a Scheduler, and are fed the same tokenized requests (the process side,
rank 0 broadcasting them, is not what is tested here). Each scenario's outputs are compared
with a --tp-size 1 Scheduler on the same model, run in this process meanwhile: the same
tokens, logprobs within 1e-4, and the two ranks' outputs identical to the bit (they sample
from the same all_gathered logits, which is what keeps their schedulers in step).
The layers' weight slicing is also checked in-process, without collectives: rank 0's and
rank 1's layers, their partial results put together by hand, equal the whole layer.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from forward_helpers import copy_model_with
from minisgl.distributed import GroupCoordinator

pytestmark = pytest.mark.usefixtures("one_thread")

TP = 2
LOGPROB_TOL = 1e-4


@dataclasses.dataclass
class Scenario:
    """One model and server setup, and the requests it serves in waves (a wave starts when the
    one before it finished, so its prompts can hit the radix cache)."""

    name: str
    model_path: str
    server_args: Dict[str, Any]
    waves: List[List[Dict[str, Any]]]  # each request: input_ids, and for generation max_new_tokens, top_logprobs_num, ...


# ---------------------------------------------------------------------- one rank (or the tp=1 reference)


def run_scenario(sc: Scenario, tp_size: int, group: Optional[GroupCoordinator]) -> Dict[str, Any]:
    """Serve the scenario's requests on a Scheduler of this rank; per rid its outputs, and the
    runner's per-rank shapes."""
    from minisgl.managers.io_struct import BatchEmbeddingOutput, BatchTokenIDOutput, EmbeddingReqInput, GenerateReqInput
    from minisgl.managers.scheduler import Scheduler
    from minisgl.managers.tokenization import tokenize_one_request
    from minisgl.model_executor.model_runner import ModelRunner
    from minisgl.server_args import ServerArgs, resolve_server_args
    from minisgl.utils import get_tokenizer

    args = resolve_server_args(ServerArgs(model_path=sc.model_path, tp_size=tp_size, context_length=512, **sc.server_args))
    runner = ModelRunner(args, show_progress=False, tp_group=group)
    tokenizer = get_tokenizer(args.tokenizer_path, args.trust_remote_code)
    scheduler = Scheduler(args, runner, tokenizer)
    vocab = runner.model_config.vocab_size
    outs: Dict[str, Dict[str, Any]] = {}
    for w, wave in enumerate(sc.waves):
        for i, req in enumerate(wave):
            rid = f"w{w}-{i}"
            obj: Any
            if args.is_embedding:
                obj = EmbeddingReqInput(input_ids=req["input_ids"], rid=rid)
            else:
                obj = GenerateReqInput(
                    input_ids=req["input_ids"], rid=rid, return_logprob=True,
                    sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": req["max_new_tokens"]},
                    top_logprobs_num=req.get("top_logprobs_num", 0), logprob_start_len=req.get("logprob_start_len", -1),
                )  # fmt: skip
            obj.normalize_batch_and_arguments()
            scheduler.process_input_requests([tokenize_one_request(tokenizer, obj, vocab)])
            outs[rid] = {"output_ids": [], "logprobs": [], "top_ids": [], "top_vals": [], "finished": False}
        while not all(o["finished"] for o in outs.values()):
            scheduler.run_step()
            for msg in scheduler.pop_outputs():
                if isinstance(msg, BatchEmbeddingOutput):
                    for j, rid in enumerate(msg.rids):
                        outs[rid].update(embedding=msg.embeddings[j], finished=True)
                elif isinstance(msg, BatchTokenIDOutput):
                    for j, rid in enumerate(msg.rids):
                        o = outs[rid]
                        o["output_ids"] += msg.output_ids[j]
                        o["logprobs"] += msg.output_token_logprobs_val[j]
                        o["top_ids"] += msg.output_top_logprobs_idx[j] if msg.output_top_logprobs_idx else []
                        o["top_vals"] += msg.output_top_logprobs_val[j] if msg.output_top_logprobs_val else []
                        if msg.input_token_logprobs_val and msg.input_token_logprobs_val[j]:
                            o["input_logprobs"] = msg.input_token_logprobs_val[j]
                        o["cached_tokens"] = msg.cached_tokens[j]
                        if msg.spec_verify_ct:
                            o["spec_verify_ct"] = msg.spec_verify_ct[j]
                        o["finished"] = msg.finished_reasons[j] is not None
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    return {
        "outs": outs,
        "kv_heads": runner.token_to_kv_pool.k_buffer[0].shape[1],
        "q_heads": qkv.num_heads,
        "max_total_num_tokens": runner.max_total_num_tokens,
    }


def run_or_refusal(sc: Scenario, tp_size: int, group: Optional[GroupCoordinator]) -> Dict[str, Any]:
    try:
        return run_scenario(sc, tp_size, group)
    except ValueError as e:  # a model refused at start: every rank must refuse it (none left waiting)
        return {"refused": str(e)}


def _rank_main(rank: int, store_path: str, scenarios: List[Scenario], results: Any) -> None:
    torch.set_num_threads(1)
    try:
        from minisgl.distributed import init_tensor_parallel_group

        group = init_tensor_parallel_group(rank, TP, store_path, timeout_s=120)
        results.put((rank, {sc.name: run_or_refusal(sc, TP, group) for sc in scenarios}))
    except BaseException:  # (the parent fails with this rank's traceback, not a queue timeout)
        results.put((rank, traceback.format_exc()))


def run_two_ranks(scenarios: List[Scenario], tmp_path: Any, reference: Callable[[], Dict[str, Any]]) -> Any:
    """Both ranks' results, and `reference()` computed in this process while they run."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(str(tmp_path), "tp-store")
    procs = [ctx.Process(target=_rank_main, args=(r, store, scenarios, results), daemon=True) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        ref = reference()
        got: Dict[int, Any] = {}
        deadline = time.monotonic() + 300
        while len(got) < len(procs):
            try:
                rank, out = results.get(timeout=1)
            except queue.Empty:  # a rank that died before reporting (e.g. at import) fails the test now
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < deadline, f"ranks gave no result (exit codes {dead})"
                continue
            assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return ref, got


# ---------------------------------------------------------------------- the scenarios


def _prompt(seed: int, n: int, vocab: int = 500) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def with_random_biases(src: str, dst: str) -> str:
    """A copy of a model whose biases are random: transformers initialises them to zero, and a
    zero bias added twice (once per rank) would look right."""
    from safetensors.torch import load_file, save_file

    copy_model_with(src, dst)
    path = os.path.join(dst, "model.safetensors")
    weights = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(".bias")]:
        weights[name] = torch.randn(weights[name].shape, generator=g) * 0.5
    save_file(weights, path, metadata={"format": "pt"})
    return dst


def with_stored_head(src: str, dst: str, last_row_delta: float = 0.0) -> str:
    """A copy of a tied model whose checkpoint also stores lm_head.weight: the embedding, its last
    row (held by the last rank) moved by `last_row_delta`."""
    from safetensors.torch import load_file, save_file

    copy_model_with(src, dst)
    path = os.path.join(dst, "model.safetensors")
    weights = load_file(path)
    head = weights["model.embed_tokens.weight"].clone()
    head[-1] += last_row_delta
    weights["lm_head.weight"] = head
    save_file(weights, path, metadata={"format": "pt"})
    return dst


def build_scenarios(factory: Callable[..., str], tmp_path: Any) -> List[Scenario]:
    shared = _prompt(0, 24)  # a prefix the second wave finds in the radix tree
    llama = factory("llama", vocab_size=511, num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    # tied, and the checkpoint stores the head too: each rank checks its rows of it
    qwen3 = with_stored_head(factory("qwen3"), os.path.join(str(tmp_path), "qwen3-head"))
    # (Qwen3: tied embeddings, per-head q/k norms, 4 q heads over 2 KV heads: 2 / 1 per rank)
    return [
        Scenario("qwen3: chunked prefill, radix hits, page_size 4, prompt logprobs", qwen3,
                 # (a KV budget that binds: 1 MiB holds 1,024 tokens of 2 KV heads, 2,048 of one rank's 1)
                 dict(page_size=4, chunked_prefill_size=16, attention_backend="cpu", cpu_kv_cache_gb=2**-10),
                 [[dict(input_ids=shared + _prompt(1, 13), max_new_tokens=6, top_logprobs_num=3, logprob_start_len=0),
                   dict(input_ids=_prompt(2, 9), max_new_tokens=8)],
                  [dict(input_ids=shared + _prompt(3, 5), max_new_tokens=6, top_logprobs_num=2),
                   dict(input_ids=shared + _prompt(1, 13), max_new_tokens=4)]]),
        # one KV head for two ranks (replicated), an odd vocabulary (the last rank's padding row),
        # an untied head, biases on q/k/v/o and the MLP (a row-parallel bias is added once)
        Scenario("llama: 1 KV head for 2 ranks, vocab 511, untied head, biases",
                 with_random_biases(llama, os.path.join(str(tmp_path), "llama-biases")),
                 dict(attention_backend="torch"),
                 [[dict(input_ids=_prompt(4, 17, 511), max_new_tokens=8, top_logprobs_num=4, logprob_start_len=3),
                   dict(input_ids=_prompt(5, 6, 511), max_new_tokens=8)]]),
        # experts split by their intermediate columns, a shared expert reduced with them, a dense layer
        Scenario("qwen2_moe: experts, shared expert", factory("qwen2_moe"), dict(attention_backend="cpu"),
                 [[dict(input_ids=_prompt(6, 20), max_new_tokens=6), dict(input_ids=_prompt(7, 7), max_new_tokens=6)]]),
        Scenario("qwen3: NGRAM verify passes", qwen3, dict(speculative_algorithm="NGRAM", attention_backend="cpu"),
                 [[dict(input_ids=_prompt(8, 6) * 4, max_new_tokens=12)]]),
        Scenario("qwen3: embeddings, chunked", qwen3, dict(is_embedding=True, chunked_prefill_size=8),
                 [[dict(input_ids=_prompt(9, 19)), dict(input_ids=_prompt(10, 5))]]),
        # the CUDA path's kernels (attention, RMSNorm, RoPE) on this rank's heads, through the
        # Triton interpreter: one extend and one decode step (each costs seconds here)
        Scenario("qwen3: triton backend", qwen3, dict(attention_backend="triton"),
                 [[dict(input_ids=_prompt(11, 5), max_new_tokens=2)]]),
        # a stored head that differs in a row only rank 1 holds: rank 0 learns it from the min over ranks
        Scenario("qwen3: a tied head that differs", with_stored_head(factory("qwen3"), os.path.join(str(tmp_path), "bad-head"), 1.0),
                 {}, [[dict(input_ids=_prompt(12, 5), max_new_tokens=1)]]),
    ]  # fmt: skip


def assert_same_outputs(name: str, ref: Dict[str, Any], tp: Dict[str, Any]) -> None:
    assert ref.keys() == tp.keys()
    for rid, r in ref.items():
        t = tp[rid]
        where = f"{name} {rid}"
        if "embedding" in r:
            torch.testing.assert_close(torch.tensor(t["embedding"]), torch.tensor(r["embedding"]), atol=1e-5, rtol=0, msg=where)
            continue
        assert r["output_ids"] and t["output_ids"] == r["output_ids"], where
        torch.testing.assert_close(torch.tensor(t["logprobs"]), torch.tensor(r["logprobs"]), atol=LOGPROB_TOL, rtol=0, msg=where)
        assert t["top_ids"] == r["top_ids"], where
        torch.testing.assert_close(torch.tensor(t["top_vals"]), torch.tensor(r["top_vals"]), atol=LOGPROB_TOL, rtol=0, msg=where)
        assert ("input_logprobs" in t) == ("input_logprobs" in r), where
        if "input_logprobs" in r:  # (entry 0 is None: the first prompt token has no logprob)
            assert t["input_logprobs"][0] is None and r["input_logprobs"][0] is None
            torch.testing.assert_close(torch.tensor(t["input_logprobs"][1:]), torch.tensor(r["input_logprobs"][1:]), atol=LOGPROB_TOL, rtol=0, msg=where)
        assert t["cached_tokens"] == r["cached_tokens"], where
        assert t.get("spec_verify_ct") == r.get("spec_verify_ct"), where


def test_two_ranks_serve_what_one_rank_serves(tiny_model_factory: Callable[..., str], tmp_path: Any) -> None:
    scenarios = build_scenarios(tiny_model_factory, tmp_path)
    ref, got = run_two_ranks(scenarios, tmp_path, lambda: {sc.name: run_or_refusal(sc, 1, None) for sc in scenarios})
    *served, refused = scenarios
    for r in (ref, got[0], got[1]):
        assert "lm_head.weight differs from model.embed_tokens.weight" in r[refused.name].get("refused", "")
    for sc in served:
        one, r0, r1 = ref[sc.name], got[0][sc.name], got[1][sc.name]
        assert "refused" not in one and "refused" not in r0, (one.get("refused"), r0.get("refused"))
        assert r0["outs"] == r1["outs"], f"{sc.name}: the ranks' outputs differ (their schedulers would drift apart)"
        assert_same_outputs(sc.name, one["outs"], r0["outs"])
        assert r0["q_heads"] * TP == one["q_heads"]  # each rank attends over its half of the heads
        # its share of the KV heads, or (llama: 1 KV head) the one head both ranks keep
        assert r0["kv_heads"] == max(1, one["kv_heads"] // TP)
    # each rank's pool holds its KV heads only: half the bytes per token, twice the tokens in the same budget
    assert (ref[scenarios[0].name]["max_total_num_tokens"], got[0][scenarios[0].name]["max_total_num_tokens"]) == (1024, 2048)
    chunked = ref[scenarios[0].name]["outs"]
    assert chunked["w1-0"]["cached_tokens"] >= 24 and chunked["w1-1"]["cached_tokens"] >= 36  # the radix hits happened
    assert got[0][scenarios[3].name]["outs"]["w0-0"]["spec_verify_ct"] > 0  # verify passes ran on two ranks


# ---------------------------------------------------------------------- the slicing, in one process


def test_split_layers_put_back_together_equal_the_whole_layer() -> None:
    from minisgl.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from minisgl.layers.vocab_parallel_embedding import VocabParallelEmbedding

    g = torch.Generator().manual_seed(0)
    H, D, I = 16, 4, 12
    x = torch.randn(5, H, generator=g)
    ranks = [GroupCoordinator(r, TP) for r in range(TP)]  # (no process group: nothing here communicates)

    # a plain column-parallel layer: the ranks' outputs side by side are the whole output, bias included
    wc, bc = torch.randn(6, H, generator=g), torch.randn(6, generator=g)
    cols = [ColumnParallelLinear(H, 6, bias=True, tp_group=r) for r in ranks]
    for layer in cols:
        layer.weight_loader(layer.weight, wc)
        layer.weight_loader(layer.bias, bc)
    torch.testing.assert_close(torch.cat([layer(x) for layer in cols], -1), x @ wc.T + bc)

    # q/k/v with 4 q heads and 1 KV head: q split 2 + 2, the KV head on both ranks
    w = {"q": torch.randn(4 * D, H, generator=g), "k": torch.randn(D, H, generator=g), "v": torch.randn(D, H, generator=g)}
    qkv = [QKVParallelLinear(H, D, 4, 1, bias=False, tp_group=r) for r in ranks]
    for layer in qkv:
        for sid, t in w.items():
            layer.weight_loader(layer.weight, t, sid)
    outs = [layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1) for layer in qkv]
    torch.testing.assert_close(torch.cat([q for q, _, _ in outs], -1), x @ w["q"].T)  # rank order = head order
    for _, k, v in outs:
        torch.testing.assert_close(k, x @ w["k"].T)
        torch.testing.assert_close(v, x @ w["v"].T)
    # 2 KV heads over 2 ranks: one each; a fused checkpoint tensor splits the same way
    w2 = torch.randn((4 + 2 + 2) * D, H, generator=g)
    for r, layer in enumerate(QKVParallelLinear(H, D, 4, 2, tp_group=rk) for rk in ranks):
        layer.weight_loader(layer.weight, w2, None)
        q_rows, k_rows = w2[r * 2 * D : (r + 1) * 2 * D], w2[(4 + r) * D : (5 + r) * D]
        v_rows = w2[(6 + r) * D : (7 + r) * D]
        assert torch.equal(layer.weight, torch.cat([q_rows, k_rows, v_rows]))

    # gate/up, then down with a bias: the ranks' partial sums add up to the whole MLP's
    gate, up, down = torch.randn(I, H, generator=g), torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)
    bias = torch.randn(H, generator=g)
    total = torch.zeros(5, H)
    for r in ranks:
        gu = MergedColumnParallelLinear(H, [I, I], tp_group=r)
        gu.weight_loader(gu.weight, gate, 0)
        gu.weight_loader(gu.weight, up, 1)
        row = RowParallelLinear(I, H, bias=False, tp_group=r, reduce_results=False)
        row.weight_loader(row.weight, down)
        g_out, u_out = gu(x).chunk(2, dim=-1)  # [5, I / 2] each: this rank's columns
        total += row(torch.nn.functional.silu(g_out) * u_out)
    whole = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must reduce its results"):
        RowParallelLinear(I, H, bias=True, tp_group=ranks[0], reduce_results=False)
    row_b = RowParallelLinear(I, H, bias=True, tp_group=ranks[1])
    row_b.weight_loader(row_b.bias, bias)  # the bias is whole on every rank (added once, after the sum)
    assert torch.equal(row_b.bias, bias)

    # an odd vocabulary: 7 rows as 4 + 3 and one zero padding row; each id's row on exactly one rank
    table = torch.randn(7, H, generator=g)
    embs = [VocabParallelEmbedding(7, H, tp_group=r) for r in ranks]
    for e in embs:
        e.weight_loader(e.weight, table)
    assert torch.equal(embs[1].weight[3], torch.zeros(H))  # padding
    ids = torch.tensor([0, 3, 4, 6, 2])
    parts = []
    for e in embs:  # the masked lookup, as forward does before its all_reduce
        mine = (ids >= e.vocab_start_index) & (ids < e.vocab_end_index)
        local = torch.nn.functional.embedding(torch.where(mine, ids - e.vocab_start_index, 0), e.weight)
        parts.append(local.masked_fill(~mine[:, None], 0))
    assert torch.equal(parts[0] + parts[1], table[ids])
    with pytest.raises(ValueError, match="shape mismatch"):
        embs[0].weight_loader(embs[0].weight, table[:6])


# ---------------------------------------------------------------------- refusals


def test_a_tied_head_of_the_wrong_shape_is_refused_on_every_rank(tiny_model: str) -> None:
    """A stored lm_head.weight one row short: a rank compares only its rows of the embedding, and
    those (the last rank's, or a single rank's first V - 1) matched it, so the whole shape is
    checked first, with the loader's message, and before any collective (no process group here)."""
    from safetensors.torch import load_file

    from minisgl.models.decoder import DecoderForCausalLM
    from minisgl.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(tiny_model)
    assert mc.tie_word_embeddings
    weights = load_file(os.path.join(tiny_model, "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"][:-1].clone()
    for tp_size in (1, 2):
        for rank in range(tp_size):
            model = DecoderForCausalLM(mc, tp_group=GroupCoordinator(rank, tp_size))
            with pytest.raises(ValueError, match=r"'lm_head.weight' does not fit .*shape mismatch: parameter \(\d+, \d+\) vs checkpoint"):
                model.load_weights(weights.items())



def test_models_the_ranks_cannot_split_are_refused_with_the_fix(tiny_model: str, tiny_model_factory: Callable[..., str]) -> None:
    from minisgl.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(tiny_model)  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by it; use a --tp-size that divides it"):
        mc.check_tensor_parallel(3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\).*one must divide the other"):
        dataclasses.replace(mc, num_heads=6, num_kv_heads=3).check_tensor_parallel(2)
    dataclasses.replace(mc, num_heads=8, num_kv_heads=2).check_tensor_parallel(4)  # 2 KV heads on 4 ranks: replicated
    with pytest.raises(ValueError, match=r"intermediate_size \(130\) is not divisible by it"):
        dataclasses.replace(mc, intermediate_size=130).check_tensor_parallel(4)
    moe = ModelConfig.from_pretrained(tiny_model_factory("qwen2_moe"))  # experts 48 wide, shared expert 96
    moe.check_tensor_parallel(2)
    with pytest.raises(ValueError, match=r"each expert's intermediate size .* \(50\) is not divisible"):
        dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, intermediate_size=50)).check_tensor_parallel(4)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(90\) is not divisible"):
        dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, shared_expert_intermediate_size=90)).check_tensor_parallel(4)


def test_model_runner_refuses_at_start_before_loading(tiny_model: str, tmp_path: Any) -> None:
    from minisgl.model_executor.model_runner import ModelRunner
    from minisgl.server_args import ServerArgs, resolve_server_args

    def runner(tp_size: int, **kw: Any) -> Any:
        args = resolve_server_args(ServerArgs(model_path=tiny_model, tp_size=tp_size, **kw))
        return ModelRunner(args, show_progress=False, tp_group=GroupCoordinator(0, tp_size))

    with pytest.raises(ValueError, match="num_attention_heads"):
        runner(3)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with pytest.raises(ValueError, match=r"LoRA \(--lora-paths, --enable-lora\) needs --tp-size 1"):  # (ServerArgs refuses it)
        runner(2, lora_paths=(f"a={adapter}",))
