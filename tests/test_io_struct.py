"""io_struct codec: every registered message type survives encode -> decode unchanged.

A sample per registered type lives in SAMPLES; a type registered without a sample
fails `test_every_registered_type_has_a_sample`, so no message crosses a process
boundary untested (STYLE.md habit 4).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict

import numpy as np
import pytest

from minisgl.managers import io_struct
from minisgl.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    ClearDecodeStatusReq,
    FlushCacheReqInput,
    FreezeGCReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetLoadReqInput,
    GetLoadReqOutput,
    HiddenStateRows,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAUpdateOutput,
    ProfileReq,
    ProfileReqOutput,
    ProfileReqType,
    SchedulerSnapshotOut,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TpBroadcastInput,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    decode,
    encode,
)
from minisgl.sampling.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _sampling_params() -> SamplingParams:
    p = SamplingParams.from_dict(
        {"temperature": 0.0, "max_new_tokens": 7, "stop": ["\n\n", "终"], "stop_token_ids": [5, 2], "seed": 3,
         "custom_params": {"token_ids": [1, 2], "name": "é"}}
    )
    p.normalize()
    return p


SAMPLES: Dict[str, Any] = {
    "TokenizedGenerateReqInput": TokenizedGenerateReqInput(
        rid="r1", input_text="héllo 👩‍👩‍👧‍👦", input_ids=[1, 2, 3], sampling_params=_sampling_params(),
        return_logprob=True, logprob_start_len=0, top_logprobs_num=2, stream=True, priority=-1, created_time=1.5,
        custom_logit_processor='{"callable": "80"}', return_hidden_states=True, lora_id="adapter-a", extra_key="tenant\0 é",
    ),  # fmt: skip
    "TokenizedEmbeddingReqInput": TokenizedEmbeddingReqInput(
        rid="e1", input_text="héllo", input_ids=[4, 5], sampling_params=SamplingParams.from_dict({"max_new_tokens": 0}),
        dimensions=8, created_time=2.5,
    ),  # fmt: skip
    "BatchEmbeddingOutput": BatchEmbeddingOutput(
        rids=["e1", "e2"],
        finished_reasons=[{"type": "length", "length": 0}, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}],
        embeddings=[[0.1, -0.25, 1e-30], None],  # None: aborted before its prompt was computed
        prompt_tokens=[2, 7],
        cached_tokens=[1, 0],
        time_stats=[{"ttft_ms": 3.0}, {"queue_ms": 0.5}],
    ),
    "SamplingParams": _sampling_params(),
    "AbortReq": AbortReq(rid="r1", abort_all=False),
    "FlushCacheReqInput": FlushCacheReqInput(),
    "FreezeGCReq": FreezeGCReq(),
    "FlushCacheReqOutput": FlushCacheReqOutput(success=False, message="requests are running"),
    "GetLoadReqInput": GetLoadReqInput(),
    "GetLoadReqOutput": GetLoadReqOutput(
        num_running_reqs=2, num_waiting_reqs=1, num_used_tokens=30, available_tokens=90, evictable_tokens=4,
        protected_tokens=6, max_total_num_tokens=130, token_usage=0.23, cache_hit_rate=0.5, new_token_ratio=0.7,
        num_retracted_reqs_total=1,
    ),  # fmt: skip
    "ProfileReq": ProfileReq(
        ProfileReqType.START_PROFILE, output_dir="/tmp/prof é", num_steps=3, activities=["CPU", "GPU"], with_stack=False,
        record_shapes=None, profile_prefix="run1",
    ),  # fmt: skip
    "ProfileReqOutput": ProfileReqOutput(success=True, message="Stop profiling.", paths=["/tmp/1.5-TP-0.trace.json.gz"]),
    "LoadLoRAAdapterReqInput": LoadLoRAAdapterReqInput(lora_name="tenant é", lora_path="/adapters/é a", pinned=True, lora_id="tenant é#2"),
    "UnloadLoRAAdapterReqInput": UnloadLoRAAdapterReqInput(lora_name="a", lora_id="a#3"),
    "LoRAUpdateOutput": LoRAUpdateOutput(success=False, error_message="rank 8 > 4", loaded_adapters={"a": "/x/a", "é": "/x/é"}),
    "UpdateWeightFromDiskReqInput": UpdateWeightFromDiskReqInput(model_path="/ckpt/é step 3", load_format="auto",
                                                                 abort_all_requests=True, weight_version="step-3"),
    "UpdateWeightFromDiskReqOutput": UpdateWeightFromDiskReqOutput(success=False, message="shape mismatch", num_paused_requests=0),
    "UpdateWeightsFromTensorReqInput": UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b"\x00\n{", b"", b"ABC"], flush_cache=False,
                                                                       weight_version="v2"),
    "UpdateWeightsFromTensorReqOutput": UpdateWeightsFromTensorReqOutput(success=True, message="Succeeded to update model weights."),
    "GetWeightsByNameReqInput": GetWeightsByNameReqInput(name="model.norm.weight", truncate_size=3),
    "GetWeightsByNameReqOutput": GetWeightsByNameReqOutput(parameter=[[0.5, -1.25], [3.0, 1e-7]], message=""),
    "ClearDecodeStatusReq": ClearDecodeStatusReq(rids=["a", "b"]),
    "SchedulerSnapshotOut": SchedulerSnapshotOut(step=12, snapshot_json=json.dumps({"step": 12, "waiting": ["a"]})),
    # rank 0's inputs of one iteration, to the other tensor-parallel ranks: the messages inside come back typed
    "TpBroadcastInput": TpBroadcastInput(
        recv_reqs=[
            TokenizedGenerateReqInput(rid="r2", input_text=None, input_ids=[7, 8], sampling_params=_sampling_params()),
            AbortReq(rid="r1"), FlushCacheReqInput(), FreezeGCReq(),
        ],
        run_step=False, shutdown=True, lockstep_state=[3, 1, 0, 2, 0, 90, 4, 250],
    ),  # fmt: skip
    "BatchTokenIDOutput": BatchTokenIDOutput(
        rids=["a", "b"],
        finished_reasons=[None, {"type": "stop", "matched": 2}],
        decode_ids=[[10, 11, 12], [13]],
        read_offsets=[2, 0],
        output_ids=[[12], [13]],
        skip_special_tokens=[True, False],
        spaces_between_special_tokens=[True, True],
        no_stop_trim=[False, True],
        stop_strs=[["\n"], []],
        stop_regexes=[[], [r"\d{3}"]],
        prompt_tokens=[5, 6],
        completion_tokens=[1, 4],
        cached_tokens=[0, 3],
        output_token_logprobs_val=[[NEG_INF], [-0.25]],
        output_token_logprobs_idx=[[12], [13]],
        output_top_logprobs_val=[[[-0.1, NEG_INF]], [[-0.25, -3.0]]],
        output_top_logprobs_idx=[[[12, 7]], [[13, 9]]],
        input_token_logprobs_val=[[None, -1.5], []],  # the prompt's first token has no logprob
        input_token_logprobs_idx=[[3, 4], []],
        input_top_logprobs_val=[[None, [-0.5]], []],
        input_top_logprobs_idx=[[None, [8]], []],
        output_token_ids_logprobs_val=[[[-1.0, NEG_INF]], []],
        output_token_ids_logprobs_idx=[[[3, 4]], []],
        input_token_ids_logprobs_val=[[None, [-2.0, -3.0]], []],
        input_token_ids_logprobs_idx=[[None, [3, 4]], []],
        time_stats=[{"queue": 0.01}, {"queue": 0.02, "e2e": 0.5}],
        # request a's first output: its prompt's rows [2, H] and one decode row [H]; b did not ask
        output_hidden_states=[HiddenStateRows(np.array([[0.5, -1e-30], [3.25, 0.0], [1.5, -2.0]], dtype=np.float32), 2), None],
    ),
    "BatchStrOutput": BatchStrOutput(
        rids=["a", "b"],
        finished_reasons=[{"type": "length", "length": 4}, {"type": "stop", "matched": "终"}],
        output_strs=["你好", "👍🏽 "],
        output_ids=[[12], [13]],
        prompt_tokens=[5, 6],
        completion_tokens=[4, 4],
        cached_tokens=[0, 3],
        output_token_logprobs_val=[[NEG_INF], [-0.25]],
        output_token_logprobs_idx=[[12], [13]],
        output_top_logprobs_val=[[[NEG_INF, NEG_INF]], [[-0.25, -3.0]]],
        output_top_logprobs_idx=[[[12, 7]], [[13, 9]]],
        input_token_logprobs_val=[[], [None, NEG_INF]],
        input_token_logprobs_idx=[[], [3, 4]],
        input_top_logprobs_val=[[], [None, [NEG_INF]]],
        input_top_logprobs_idx=[[], [None, [8]]],
        time_stats=[{"ttft": 0.1}, {}],
        output_hidden_states=[HiddenStateRows.empty(), None],  # (a asked: nothing new in this message)
    ),
}


def test_every_registered_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(io_struct._MESSAGE_TYPES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name: str) -> None:
    msg = SAMPLES[name]
    assert type(msg).__name__ == name
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    # Every field travels explicitly (a receiver never silently falls back to a default); the JSON
    # ends at the first newline (hidden states' raw rows follow it)
    assert set(json.loads(data.split(b"\n")[0])) == {"__type__"} | {f.name for f in dataclasses.fields(msg)}


def test_lora_update_replies_keep_sglang_s_names() -> None:
    """SGLang names a load's and an unload's reply LoadLoRAAdapterReqOutput / UnloadLoRAAdapterReqOutput,
    both its LoRAUpdateOutput: code written against those names imports and reads the same fields."""
    assert LoadLoRAAdapterReqOutput is UnloadLoRAAdapterReqOutput is LoRAUpdateOutput
    assert [f.name for f in dataclasses.fields(LoRAUpdateOutput)] == ["success", "error_message", "loaded_adapters"]


def test_neg_inf_logprobs_survive() -> None:
    back = decode(encode(SAMPLES["BatchTokenIDOutput"]))
    assert back.output_token_logprobs_val[0][0] == NEG_INF
    assert math.isinf(back.output_top_logprobs_val[0][0][1])


def test_nested_sampling_params_is_rebuilt_as_a_dataclass() -> None:
    back = decode(encode(SAMPLES["TokenizedGenerateReqInput"]))
    assert isinstance(back.sampling_params, SamplingParams)
    assert back.sampling_params.top_k == 1 and back.sampling_params.stop_strs == ["\n\n", "终"]
    assert back.sampling_params.stop_token_ids == [2, 5]


def test_matched_stop_keeps_int_vs_str() -> None:
    back = decode(encode(SAMPLES["BatchTokenIDOutput"]))
    assert back.finished_reasons[1]["matched"] == 2 and isinstance(back.finished_reasons[1]["matched"], int)
    back = decode(encode(SAMPLES["BatchStrOutput"]))
    assert back.finished_reasons[1]["matched"] == "终"


def test_unregistered_types_are_refused() -> None:
    # GenerateReqInput never leaves the HTTP process: it is not registered.
    with pytest.raises(TypeError, match="not a registered"):
        encode(GenerateReqInput(text="hi"))

    @dataclasses.dataclass
    class Smuggled:
        cmd: str = "rm -rf /"

    with pytest.raises(TypeError):
        encode(Smuggled())
    with pytest.raises(TypeError):
        encode(ClearDecodeStatusReq(rids={"a"}))  # a set is not a message field type
    with pytest.raises((TypeError, KeyError)):
        decode(json.dumps({"__type__": "Smuggled", "cmd": "x"}).encode())
    with pytest.raises((TypeError, KeyError)):
        decode(json.dumps({"__type__": "GenerateReqInput", "text": "hi"}).encode())
    with pytest.raises(TypeError):
        decode(json.dumps({"rids": ["a"]}).encode())  # a plain dict is not a message
    with pytest.raises(TypeError):
        decode(b"[1, 2]")


def test_float32_embeddings_survive_exactly() -> None:
    """An embedding crosses two process boundaries as JSON numbers: each float32 value (made a
    Python float by tolist) comes back bit for bit, so base64 of the float32 bytes on the far
    side is the model's own (float32 -> double is exact; JSON writes the double's shortest repr)."""
    import torch

    values = torch.randn(257, generator=torch.Generator().manual_seed(0)).tolist()
    msg = BatchEmbeddingOutput(rids=["e"], finished_reasons=[None], embeddings=[values], prompt_tokens=[1], cached_tokens=[0])
    back = decode(encode(msg))
    assert torch.equal(torch.tensor(back.embeddings[0], dtype=torch.float32), torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_states_survive_exactly(dtype: str) -> None:
    """Hidden states cross two process boundaries (scheduler -> detokenizer -> HTTP process) as
    float32 rows: every value of the model's dtype comes back bit for bit (bfloat16 -> float32 is
    exact), the prompt's [n, H] entry and the [H] decode entries alike."""
    import torch

    gen = torch.Generator().manual_seed(1)
    rows = (torch.randn(7, 96, generator=gen) * torch.logspace(-20, 20, 96)).to(getattr(torch, dtype))  # [7, H]
    sent = HiddenStateRows(rows.to(torch.float32).numpy(), prompt_rows=5)
    msg = dataclasses.replace(SAMPLES["BatchTokenIDOutput"], output_hidden_states=[sent, None])
    back = decode(encode(decode(encode(msg))))  # (two hops: the detokenizer re-encodes what it got)
    assert back.output_hidden_states[1] is None
    entries = back.output_hidden_states[0].entries()
    assert [e.shape for e in entries] == [(5, 96), (96,), (96,)]
    got = torch.from_numpy(np.concatenate([entries[0], np.stack(entries[1:])])).to(getattr(torch, dtype))
    bits = torch.int16 if dtype == "bfloat16" else torch.int32  # (compared as bits: -0.0 and NaNs too)
    assert torch.equal(got.view(bits), rows.view(bits))


def test_hidden_states_travel_as_raw_float32_bytes_not_json_numbers() -> None:
    """A 300 x 256 prompt entry crosses a hop as 4 bytes a number after a short JSON head (as JSON
    numbers it was ~20 bytes each, and ~0.8 us each to write and to read), and comes back bit for bit:
    NaN (its payload too), inf and -0.0 included. In the answer, NaN and inf are null (JSON has neither)."""
    rows = np.random.default_rng(0).standard_normal((300, 256)).astype(np.float32)
    rows[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    rows.view(np.uint32)[1, 0] = 0x7FC00123  # a NaN with a payload
    msg = dataclasses.replace(SAMPLES["BatchTokenIDOutput"], output_hidden_states=[HiddenStateRows(rows, 299), None])
    data = encode(msg)
    head, raw = data.split(b"\n", 1)
    assert len(head) < 2_000 and len(raw) == rows.nbytes  # (the rows' bytes, none of them as text)
    assert raw == rows.tobytes()
    back = decode(data).output_hidden_states[0]
    assert back == HiddenStateRows(rows, 299) and back.rows.view(np.uint32)[1, 0] == 0x7FC00123
    entries = back.as_lists()  # (what the Engine returns, and the JSON answer writes)
    assert len(entries) == 2 and len(entries[0]) == 299 and len(entries[1]) == 256
    assert entries[0][0][:4] == [None, None, None, -0.0] and math.copysign(1.0, entries[0][0][3]) == -1.0
    assert entries[0][1][0] is None and entries[0][2] == rows[2].tolist()


def test_a_weight_update_carries_its_safetensors_files_as_raw_bytes() -> None:
    """The HTTP process -> the scheduler, and rank 0 -> the other ranks: the files' bytes follow the
    JSON as they are (base64 is the HTTP body's only), beside hidden-state rows in the same frame."""
    files = [bytes(range(256)) * 40, b"", b"\n\n"]  # (newlines: the JSON head's end mark, inside the raw part)
    msg = TpBroadcastInput(recv_reqs=[UpdateWeightsFromTensorReqInput(files, weight_version="v3")], run_step=False,
                           shutdown=False, lockstep_state=[0] * 8)  # fmt: skip
    data = encode(msg)
    head = data.split(b"\n", 1)[0]
    assert len(head) < 1_000 and len(data) < sum(map(len, files)) + 1_100  # (not as base64 or JSON numbers)
    back = decode(data).recv_reqs[0]
    assert back.serialized_named_tensors == files and back.weight_version == "v3"
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    both = dataclasses.replace(SAMPLES["BatchTokenIDOutput"], output_hidden_states=[HiddenStateRows(rows, 1), None])
    assert decode(encode(TpBroadcastInput(recv_reqs=[both, UpdateWeightsFromTensorReqInput(files)], run_step=True, shutdown=False,
                                          lockstep_state=[0] * 8))).recv_reqs == [both, UpdateWeightsFromTensorReqInput(files)]  # fmt: skip
    with pytest.raises(TypeError, match="Tensor"):  # (the Engine's in-process tensors never cross a process boundary)
        import torch

        encode(UpdateWeightsFromTensorReqInput([], named_tensors=[("model.norm.weight", torch.ones(2))]))
