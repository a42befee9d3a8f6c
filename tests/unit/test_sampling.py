import math

import pytest
import torch

from service.engine.base import SamplingError, SamplingParams
from service.engine.sampling import make_generator, process_logits, sample_token, token_logprob
from service.metrics import token_buckets


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert sample_token(logits, SamplingParams(temperature=0), make_generator(SamplingParams(), 0, logits.device)) == 1


def test_penalties_follow_openai_definitions():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    out = process_logits(torch.zeros(4), params, [2, 2, 3])
    assert out.tolist() == [0.0, 0.0, -2.5, -1.5]


def test_logit_bias_applies():
    out = process_logits(torch.zeros(3), SamplingParams(logit_bias=((1, -100.0),)), [])
    assert out.tolist() == [0.0, -100.0, 0.0]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for params, allowed in ((SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.7), {0, 1}),
                            (SamplingParams(top_p=0.5), {0})):
        gen = make_generator(SamplingParams(seed=0), 0, logits.device)
        assert {sample_token(logits, params, gen) for _ in range(300)} == allowed


def test_seeded_generators_repeat_and_choices_differ():
    logits = torch.zeros(1000)
    params = SamplingParams(seed=42)

    def draws(index):
        gen = make_generator(params, index, logits.device)
        return [sample_token(logits, params, gen) for _ in range(10)]

    assert draws(0) == draws(0) and draws(0) != draws(1)


def test_sampling_matches_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    gen = make_generator(SamplingParams(seed=1), 0, probs.device)
    counts = torch.bincount(torch.tensor([sample_token(torch.log(probs), SamplingParams(), gen)
                                          for _ in range(4000)]), minlength=3)
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_token_logprob_is_log_softmax_with_sorted_top():
    logits = torch.tensor([2.0, 1.0, 0.0])
    lp = token_logprob(logits, 1, 2, str)
    expected = torch.log_softmax(logits, -1)
    assert math.isclose(lp.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t.token_id for t in lp.top] == [0, 1]


def test_token_buckets_are_vllm_1_2_5_series():
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_extreme_parameters_sample_or_refuse_never_crash():
    """Any value a request can send samples a token from the kept support, or raises SamplingError."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = make_generator(SamplingParams(seed=0), 0, logits.device)
    for params in (SamplingParams(top_p=5e-324), SamplingParams(top_p=1e-45), SamplingParams(temperature=1e-300),
                   SamplingParams(temperature=2e-5), SamplingParams(temperature=1e-300, top_p=5e-324),
                   SamplingParams(temperature=1e-4, top_k=3)):
        assert {sample_token(logits, params, gen) for _ in range(50)} == {0}, params
    assert {sample_token(logits, SamplingParams(temperature=2.0), gen) for _ in range(400)} == {0, 1, 2, 3}


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_logit_bias_masking_every_token_still_samples():
    params = SamplingParams(logit_bias=tuple((i, -100.0) for i in range(4)))
    gen = make_generator(SamplingParams(seed=0), 0, torch.device("cpu"))
    logits = process_logits(torch.tensor([1.0, 5.0, 2.0, 0.0]), params, [])
    assert sample_token(logits, SamplingParams(temperature=0.01), gen) == 1


def test_a_distribution_with_no_finite_mass_is_the_requests_error():
    gen = make_generator(SamplingParams(seed=0), 0, torch.device("cpu"))
    for logits in (torch.full((4,), float("-inf")), torch.tensor([float("nan")] * 4)):
        with pytest.raises(SamplingError):
            sample_token(logits, SamplingParams(), gen)
