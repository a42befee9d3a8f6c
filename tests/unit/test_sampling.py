import math

import torch

from service.engine.base import SamplingParams
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
