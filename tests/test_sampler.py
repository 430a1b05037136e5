"""Sampler, SamplingBatchInfo and penalties on hand-made logits (sglang-facts.md §11)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pytest
import torch

from minisgl.layers.sampler import Sampler, SampleOutput, gumbel_noise
from minisgl.sampling.sampling_batch_info import SamplingBatchInfo
from minisgl.sampling.sampling_params import SamplingParams, check_type

V = 8
EOS = 7


@dataclass
class FakeReq:
    """The Req fields SamplingBatchInfo reads."""

    sampling_params: SamplingParams
    origin_input_ids: List[int] = field(default_factory=lambda: [1, 2, 3])
    output_ids: List[int] = field(default_factory=list)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None


def req(output_ids: Optional[List[int]] = None, **params: Any) -> FakeReq:
    sp = SamplingParams(**params)
    sp.normalize()
    sp.verify(V)
    return FakeReq(sp, output_ids=list(output_ids or []))


def sample(logits: torch.Tensor, reqs: List[FakeReq]) -> SampleOutput:
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu", {EOS})
    logits = logits.clone()
    info.apply_logits_bias(logits)
    return Sampler()(logits, info)


def kept_tokens(logits: torch.Tensor, n: int = 400, **params: Any) -> set:
    """Tokens a request can draw: sample many times (unseeded, global RNG) and collect them."""
    out = sample(logits.expand(n, -1), [req(**params) for _ in range(n)])
    return set(out.next_token_ids.tolist())


PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()[None, :]  # [1, V], softmax(LOGITS) == PROBS


def test_greedy_is_argmax_and_temperature_zero_is_greedy() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [req(temperature=0.0) for _ in range(5)])
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.next_token_logprobs is None


def test_top_k_1_equals_greedy_in_a_sampled_batch() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    reqs = [req(top_k=1, temperature=1.5) if i % 2 == 0 else req(temperature=1.0) for i in range(6)]
    for _ in range(20):
        out = sample(logits, reqs)
        assert out.next_token_ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_top_k_keeps_the_k_most_likely() -> None:
    assert kept_tokens(LOGITS, top_k=3) == {0, 1, 2}


def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    # cumulative: 0.40, 0.65, 0.80, 0.90 -> with top_p 0.7, token 2 crosses 0.7 and stays
    assert kept_tokens(LOGITS, top_p=0.7) == {0, 1, 2}
    assert kept_tokens(LOGITS, top_p=0.35) == {0}  # the first token alone crosses 0.35


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # p_max 0.40 * 0.3 = 0.12: tokens with p >= 0.12 survive
    assert kept_tokens(LOGITS, min_p=0.3) == {0, 1, 2}


def test_filters_compose_in_sglang_order() -> None:
    # top-k 4 then top-p 0.5: {0, 1}; min-p 0.7 (0.28) then leaves {0}
    assert kept_tokens(LOGITS, top_k=4, top_p=0.5) == {0, 1}
    assert kept_tokens(LOGITS, top_k=4, top_p=0.5, min_p=0.7) == {0}


def test_unfiltered_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    n = 4000
    out = sample(LOGITS.expand(n, -1), [req() for _ in range(n)])
    freq = torch.bincount(out.next_token_ids, minlength=V).float() / n
    assert torch.allclose(freq, PROBS, atol=0.03)


def test_temperature_sharpens_and_flattens() -> None:
    torch.manual_seed(0)
    n = 3000
    cold = sample(LOGITS.expand(n, -1), [req(temperature=0.25) for _ in range(n)]).next_token_ids
    hot = sample(LOGITS.expand(n, -1), [req(temperature=4.0) for _ in range(n)]).next_token_ids
    assert (cold == 0).float().mean() > 0.85
    assert (hot == 0).float().mean() < 0.3


def test_seeded_requests_are_reproducible_and_batch_independent() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2)).expand(16, -1)
    seeded = [req(seed=1234) for _ in range(16)]
    for r, n_out in zip(seeded, range(16)):
        r.output_ids = list(range(n_out))  # 16 different positions
    first = sample(logits, seeded).next_token_ids
    torch.manual_seed(99)  # the global RNG must not matter
    again = sample(logits, seeded).next_token_ids
    assert first.tolist() == again.tolist()
    # the same request alone, or surrounded by unseeded requests, draws the same token
    mixed = [req(), seeded[5], req(temperature=2.0)]
    assert sample(logits[:3], mixed).next_token_ids[1] == first[5]
    # a different seed gives a different sequence of draws
    other = [req(seed=4321, output_ids=list(range(n))) for n in range(16)]
    assert sample(logits, other).next_token_ids.tolist() != first.tolist()
    assert len(set(first.tolist())) > 1  # positions change the noise too


def test_seeds_of_any_size_sample_like_their_low_32_bits() -> None:
    """OpenAI's seed has no range (and n > 1 adds j to it): a huge seed must not fail the batch."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3)).expand(16, -1)
    small = sample(logits, [req(seed=5, output_ids=list(range(n))) for n in range(16)]).next_token_ids
    for seed in (2**64 + 5, 2**63 + 2**32 * 7 + 5, -(2**70) + 5):
        huge = [req(seed=seed, output_ids=list(range(n))) for n in range(16)]
        assert sample(logits, huge).next_token_ids.tolist() == small.tolist()


def test_seeded_sampling_follows_the_distribution() -> None:
    n = 3000
    reqs = [req(seed=s) for s in range(n)]
    out = sample(LOGITS.expand(n, -1), reqs).next_token_ids
    freq = torch.bincount(out, minlength=V).float() / n
    assert torch.allclose(freq, PROBS, atol=0.03)
    u = gumbel_noise(torch.tensor([7]), torch.tensor([3]), 100000)
    assert abs(float(u.mean()) - 0.5772) < 0.02  # Gumbel(0, 1) mean: Euler's constant


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, V)
    r = req(output_ids=[3, 3, 5], frequency_penalty=0.5, presence_penalty=0.25)
    r.origin_input_ids = [1, 1, 1]  # the prompt is never penalised
    info = SamplingBatchInfo.from_reqs([r], V, "cpu", {EOS})
    info.apply_logits_bias(logits)
    expected = torch.zeros(V)
    expected[3] = -(0.5 * 2 + 0.25)
    expected[5] = -(0.5 * 1 + 0.25)
    assert torch.allclose(logits[0], expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0, 0, 0, 0]])
    info = SamplingBatchInfo.from_reqs([req(output_ids=[0, 1], repetition_penalty=2.0)], V, "cpu", {EOS})
    info.apply_logits_bias(logits)
    assert logits[0, :4].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_min_new_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, V)
    logits[:, EOS] = 10.0
    logits[:, 4] = 9.0
    reqs = [req(output_ids=[1], min_new_tokens=3, stop_token_ids=[4]), req(output_ids=[1, 2, 3], min_new_tokens=3)]
    out = sample(logits, reqs).next_token_ids.tolist()
    assert out[0] not in (EOS, 4)
    assert out[1] == EOS  # min_new_tokens reached: EOS is allowed again
    ignore = req(output_ids=[], min_new_tokens=3, ignore_eos=True)  # EOS does not stop it: nothing to block
    assert sample(logits[:1], [ignore]).next_token_ids.tolist() == [EOS]


def test_logit_bias_is_added_after_penalties_and_steers_each_row_alone() -> None:
    """SGLang's order: penalties, then logit_bias added; a row without one is untouched."""
    logits = torch.zeros(3, V)
    reqs = [
        req(output_ids=[3], frequency_penalty=1.0, logit_bias={"3": 0.5, "6": -2}),
        req(),
        req(logit_bias={"1": 100}),
    ]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu", {EOS})
    assert info.needs_logits_bias
    info.apply_logits_bias(logits)
    assert logits[0].tolist() == [0, 0, 0, -0.5, 0, 0, -2.0, 0]  # -1 from the penalty, +0.5 from the bias
    assert logits[1].tolist() == [0.0] * V
    assert logits[2].tolist() == [0, 100, 0, 0, 0, 0, 0, 0]


def test_logit_bias_forces_and_bans_tokens_and_the_logprobs_see_it() -> None:
    forced = req(temperature=1.0, logit_bias={"5": 100})
    banned = req(temperature=0, logit_bias={"0": -100})
    banned.return_logprob = True
    out = sample(torch.cat([LOGITS, LOGITS]), [forced, banned])
    assert out.next_token_ids.tolist() == [5, 1]  # 0 is the argmax without the ban
    biased = torch.log_softmax(LOGITS[0] + torch.tensor([-100.0] + [0.0] * (V - 1)), -1)
    assert out.next_token_logprobs is not None
    assert math.isclose(float(out.next_token_logprobs[1]), float(biased[1]), rel_tol=1e-5)
    assert kept_tokens(LOGITS, logit_bias={str(t): -100 for t in range(V - 1)}) == {V - 1}


def test_a_requests_logit_bias_is_parsed_once_not_at_every_step() -> None:
    """A batch's bias rows are rebuilt every step; parsing 1,024 ids per request there slowed
    every other client's steps by a third."""
    r = req(logit_bias={str(t): 1.0 for t in range(V)})
    first = SamplingBatchInfo.from_reqs([r], V, "cpu", {EOS}).logit_bias
    ids, values = r.sampling_params.logit_bias_tensors("cpu")
    assert r.sampling_params.logit_bias_tensors("cpu")[0] is ids  # built once, then reused
    assert r.sampling_params.logit_bias_tensors("cpu:0")[0] is not ids  # (another device: built for it)
    again = SamplingBatchInfo.from_reqs([req(), r], V, "cpu", {EOS}).logit_bias
    assert first is not None and again is not None and torch.equal(again[1], first[0]) and again[0].abs().sum() == 0
    assert "_logit_bias_tensors" not in [f.name for f in dataclasses.fields(SamplingParams)]  # never sent between processes


def test_no_penalties_means_no_orchestrator() -> None:
    info = SamplingBatchInfo.from_reqs([req(), req(temperature=0)], V, "cpu", {EOS})
    assert info.penalizer_orchestrator is None


def test_logprobs_of_sampled_token_and_top_logprobs() -> None:
    r1 = req(temperature=0)
    r1.return_logprob, r1.top_logprobs_num = True, 3
    r2 = req(temperature=2.0, top_k=2)
    r2.return_logprob, r2.top_logprobs_num = True, 1
    logits = torch.cat([LOGITS, LOGITS])
    out = sample(logits, [r1, r2])
    assert out.next_token_logprobs is not None and out.top_logprobs_val is not None and out.top_logprobs_idx is not None
    assert out.top_logprobs_idx[0] == [0, 1, 2] and len(out.top_logprobs_val[1]) == 1
    assert math.isclose(out.top_logprobs_val[0][0], math.log(0.40), rel_tol=1e-5)
    # logprobs come after temperature: row 2 is the distribution of logits / 2
    tempered = torch.log_softmax(LOGITS[0] / 2.0, -1)
    assert math.isclose(float(out.next_token_logprobs[1]), float(tempered[out.next_token_ids[1]]), rel_tol=1e-5)
    assert math.isclose(float(out.next_token_logprobs[0]), math.log(0.40), rel_tol=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": -2}, {"min_p": 1.5},
        {"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0.0},
        {"min_new_tokens": 5, "max_new_tokens": 2},
        {"logit_bias": {"1": 100.5}}, {"logit_bias": {"1": -101}}, {"logit_bias": {"1": math.nan}},
        {"logit_bias": {str(V): 1.0}}, {"logit_bias": {"-1": 1.0}},
    ],
)  # fmt: skip
def test_bad_values_are_rejected(params: Dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**params).verify(V)


def test_inverse_cdf_draw_follows_the_distribution_and_skips_zeros() -> None:
    """The global-RNG draw (one uniform + binary search per row) keeps multinomial's law."""
    from minisgl.layers.sampler import multinomial_inverse_cdf

    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0]) * 7  # unnormalised, zeros at both ends
    ids = multinomial_inverse_cdf(probs.expand(20000, -1).contiguous())
    freq = torch.bincount(ids, minlength=6).float() / 20000
    assert freq[[0, 2, 5]].sum() == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs / probs.sum(), atol=0.015)
    one_hot = torch.zeros(3, 5)
    one_hot[:, 4] = 1.0  # all mass on the last token: u rounding up must not run past the end
    assert multinomial_inverse_cdf(one_hot).tolist() == [4, 4, 4]


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
        ({"seed": "x"}, "seed"), ({"seed": 1.0}, "seed"), ({"temperature": "0.5"}, "temperature"),
        ({"top_p": None}, "top_p"), ({"top_k": 2.5}, "top_k"), ({"n": "2"}, "n"),
        ({"ignore_eos": "no"}, "ignore_eos"), ({"no_stop_trim": 1}, "no_stop_trim"),
        ({"stop": 5}, "stop"), ({"stop": ["a", 5]}, "stop"), ({"stop": ""}, "stop"), ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"), ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stream_interval": 0.5}, "stream_interval"),
        ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"1.0": 1}}, "logit_bias"), ({"logit_bias": {"1": "1"}}, "logit_bias"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
    ],
)  # fmt: skip
def test_from_dict_refuses_wrong_types_naming_the_field(params: Dict[str, Any], needle: str) -> None:
    """The user-input gate (the native /generate body, Engine.generate): a wrong type never reaches the scheduler."""
    with pytest.raises(ValueError, match=needle):
        SamplingParams.from_dict(params)


def test_sglangs_keys_are_accepted_as_null_and_sampling_seed_names_the_seed() -> None:
    p = SamplingParams.from_dict({"regex": None, "json_schema": None, "ebnf": None, "stop_regex": None, "sampling_seed": 5})
    assert p.seed == 5  # SGLang's native name for it
    with pytest.raises(ValueError, match="sampling_seed .* and seed .* name the same seed"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})
    assert SamplingParams.from_dict({"seed": 3, "sampling_seed": 3}).seed == 3


def test_min_p_one_keeps_exactly_the_most_likely_tokens() -> None:
    # min_p is valid up to 1.0: the threshold is then p_max itself and only the best tokens
    # (here two tied ones) survive, never an empty row that would draw an arbitrary token
    logits = torch.tensor([[3.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert kept_tokens(logits, min_p=1.0) == {0, 1}
    assert kept_tokens(LOGITS, min_p=1.0) == {0}


def test_unseeded_requests_batched_with_a_seeded_one_still_sample_at_random() -> None:
    # One request with a seed must not make its unseeded neighbours deterministic: they
    # draw from the global RNG, so 400 of them at the same position spread over the vocabulary.
    torch.manual_seed(0)
    n = 400
    reqs = [req(seed=7)] + [req() for _ in range(n)]
    out = sample(LOGITS.expand(n + 1, -1), reqs).next_token_ids
    unseeded = out[1:]
    assert len(set(unseeded.tolist())) >= 4
    freq = torch.bincount(unseeded, minlength=V).float() / n
    assert abs(float(freq[0]) - 0.40) < 0.08


@pytest.mark.parametrize("key", SamplingParams.KEYS)
def test_every_sampling_key_refuses_a_value_of_the_wrong_type(key: str) -> None:
    """check_type lets any value through for a key it has no rule for: a new key in
    SamplingParams.KEYS must get one, or a wrong type reaches the scheduler."""
    with pytest.raises(ValueError, match=key):
        check_type(key, object())
