import math

import pytest
import torch

from service.engine import sampling
from service.engine.base import SamplingError, SamplingParams
from service.engine.sampling import (banned_ids, bias_tensors, draw, make_generator, probabilities, process_logits,
                                     sample_token, token_logprob)
from service.metrics import token_buckets


def needs_the_native_draw() -> None:
    if not sampling.native_draw(torch.device("cpu")):
        pytest.skip("the kernel library does not run on this CPU (x86 with AVX2 and FMA) or did not load")


@pytest.fixture(params=["native", "aten"])
def draws(request, monkeypatch):
    """sample_token's temperature-only draw both ways: one call to cpu_sampling.cpp where it runs
    here, and the aten ops that run elsewhere (a GPU, a CPU without AVX2)."""
    if request.param == "aten":
        monkeypatch.setattr(sampling, "native_draw", lambda device: False)
    else:
        needs_the_native_draw()
    return request.param


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert sample_token(logits, SamplingParams(temperature=0), make_generator(SamplingParams(), 0, logits.device)) == 1


def test_penalties_follow_openai_definitions():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    out = process_logits(torch.zeros(4), params, [2, 2, 3])
    assert out.tolist() == [0.0, 0.0, -2.5, -1.5]


def test_min_tokens_holds_back_the_stop_ids_until_reached():
    logits, stops, params = torch.tensor([5.0, 1.0, 4.0]), torch.tensor([0, 2]), SamplingParams(min_tokens=2)
    held = process_logits(logits, params, [1], stop_ids=stops)
    assert held.tolist() == [-math.inf, 1.0, -math.inf] and logits.tolist() == [5.0, 1.0, 4.0]
    assert process_logits(logits, params, [1, 1], stop_ids=stops) is logits  # reached: nothing to change
    assert params.adjusts_logits, "a greedy request with min_tokens takes no argmax shortcut"


def test_allowed_token_ids_leave_only_those_before_the_bias():
    logits = torch.tensor([5.0, 1.0, 4.0, 2.0])
    out = process_logits(logits, SamplingParams(allowed_token_ids=(1, 3), logit_bias=((0, 1.0), (3, 1.0))), [],
                         allowed=torch.tensor([1, 3]))
    assert out.tolist() == [-math.inf, 1.0, -math.inf, 3.0] and logits.tolist() == [5.0, 1.0, 4.0, 2.0]


def test_bad_words_bar_a_words_last_token_after_the_rest_of_it():
    """vLLM's bad words: a one-token word always, a longer one where the output ends with its start."""
    words = ((3,), (1, 2), (0, 1, 2))
    assert banned_ids(words, []) == [3]
    assert banned_ids(words, [5, 1]) == [3, 2]
    assert banned_ids(words, [0, 1]) == [3, 2, 2]
    out = process_logits(torch.tensor([5.0, 1.0, 4.0, 2.0]), SamplingParams(bad_words=words), [7, 1])
    assert out.tolist() == [5.0, 1.0, -math.inf, -math.inf] and SamplingParams(bad_words=words).adjusts_logits


def test_a_greedy_row_with_every_token_excluded_is_refused_as_a_sampled_one_is():
    """No token left (bad words, allowed ids and min_tokens together): the request's 400, not token 0."""
    row = torch.full((4,), -math.inf)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        with pytest.raises(SamplingError):
            sample_token(row, params, torch.Generator().manual_seed(0))


def test_repetition_penalty_follows_vllms_definition():
    """Each token of the prompt or the output (a repeat counts once) divided by the penalty where its
    logit is positive, multiplied where not, before the frequency and presence penalties."""
    logits = torch.tensor([2.0, -2.0, 2.0, -1.0, 3.0, 0.0])
    out = process_logits(logits, SamplingParams(repetition_penalty=2.0), [1, 1, 5], torch.tensor([0, 1]))
    assert out.tolist() == [1.0, -4.0, 2.0, -1.0, 3.0, 0.0]
    both = process_logits(logits, SamplingParams(repetition_penalty=2.0, presence_penalty=0.5), [0], torch.tensor([3]))
    assert both.tolist() == [0.5, -2.0, 2.0, -2.0, 3.0, 0.0]
    assert logits.tolist() == [2.0, -2.0, 2.0, -1.0, 3.0, 0.0], "the row as computed is left as it was"


def test_an_extreme_repetition_penalty_saturates_and_still_samples(draws):
    """A penalty a request may send (any positive float) divides a positive logit past float32's
    range: it saturates there, so a draw still has a distribution (the penalised likeliest, as the
    penalty's limit gives), and a token a grammar forbade stays at -inf."""
    logits = torch.tensor([2.0, 1.0, float("-inf"), -3.0])
    gen = make_generator(SamplingParams(seed=0), 0, logits.device)
    tiny = SamplingParams(repetition_penalty=1e-300)
    out = process_logits(logits, tiny, [], torch.tensor([0, 1, 2, 3]))
    assert out.isfinite().tolist() == [True, True, False, True]
    assert {sample_token(out, tiny, gen) for _ in range(50)} <= {0, 1}
    huge = SamplingParams(repetition_penalty=1e300)
    out = process_logits(logits, huge, [], torch.tensor([0, 1, 2, 3]))
    assert out.isfinite().tolist() == [True, True, False, True] and sample_token(out, huge, gen) in (0, 1, 3)


def test_min_p_drops_the_tokens_below_its_share_of_the_likeliest(draws):
    """After the temperature, as in vLLM: at T=1 a min_p of 0.3 keeps 0.5 and 0.2 (0.4 of the
    likeliest) and drops 0.1 (0.2 of it); at T=2 the distribution flattens and keeps 0.1 too; 1
    keeps the likeliest alone."""
    logits = torch.log(torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1]))
    gen = make_generator(SamplingParams(seed=0), 0, logits.device)
    for params, kept in ((SamplingParams(min_p=0.3), {1, 2}), (SamplingParams(min_p=0.3, temperature=2.0), {0, 1, 2, 3, 4}),
                         (SamplingParams(min_p=1.0), {1}), (SamplingParams(min_p=0.3, top_k=1), {1})):
        assert {sample_token(logits, params, gen) for _ in range(300)} == kept, params
    probs, _ = probabilities(logits, SamplingParams(min_p=0.3))
    assert torch.allclose(probs, torch.tensor([0.0, 5 / 7, 2 / 7, 0.0, 0.0]))


def test_logit_bias_applies():
    out = process_logits(torch.zeros(3), SamplingParams(logit_bias=((1, -100.0),)), [])
    assert out.tolist() == [0.0, -100.0, 0.0]
    twice = process_logits(torch.zeros(3), SamplingParams(logit_bias=((2, 1.5), (2, 1.0))), [])  # "2" and "02"
    assert twice.tolist() == [0.0, 0.0, 2.5]


def test_a_requests_logit_bias_is_made_once_and_applied_as_made():
    """The engine keeps each request's bias as tensors (bias_tensors) and passes them at every step."""
    params = SamplingParams(logit_bias=((2, 3.0), (0, -1.0)))
    ids, values = bias_tensors(params)
    assert ids.tolist() == [2, 0] and values.tolist() == [3.0, -1.0] and ids.dtype == torch.long
    made = (torch.tensor([1]), torch.tensor([7.0]))
    assert process_logits(torch.zeros(3), params, [], bias=made).tolist() == [0.0, 7.0, 0.0]
    assert bias_tensors(SamplingParams()) is None


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for params, allowed in ((SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.7), {0, 1}),
                            (SamplingParams(top_p=0.5), {0})):
        gen = make_generator(SamplingParams(seed=0), 0, logits.device)
        assert {sample_token(logits, params, gen) for _ in range(300)} == allowed


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_keeps_the_nucleus_a_sort_of_the_whole_vocabulary_gives(top_p):
    """Looked for among the likeliest few first, the nucleus is the one the whole vocabulary's sort
    gives: within the first look (peaked logits) and well beyond it (flat ones)."""
    torch.manual_seed(0)
    for logits in (torch.randn(3000) * 4, torch.randn(3000) * 0.2):
        params = SamplingParams(top_p=top_p, temperature=0.7)
        probs, ids = probabilities(logits, params)
        kept = set(ids[probs > 0].tolist())
        ranked, order = torch.sort(torch.softmax(logits / 0.7, -1), descending=True)
        before = torch.cumsum(ranked, 0) - ranked
        expected = set(order[before < top_p].tolist()) | {int(order[0])}
        assert kept == expected
        assert torch.allclose(probs.sum(), ranked[before < top_p].sum())


def test_seeded_generators_repeat_and_choices_differ(draws):
    logits = torch.zeros(1000)
    params = SamplingParams(seed=42)

    def draws(index):
        gen = make_generator(params, index, logits.device)
        return [sample_token(logits, params, gen) for _ in range(10)]

    assert draws(0) == draws(0) and draws(0) != draws(1)


def test_sampling_matches_the_distribution(draws):
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


def test_extreme_parameters_sample_or_refuse_never_crash(draws):
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


def test_logit_bias_masking_every_token_still_samples(draws):
    params = SamplingParams(logit_bias=tuple((i, -100.0) for i in range(4)))
    gen = make_generator(SamplingParams(seed=0), 0, torch.device("cpu"))
    logits = process_logits(torch.tensor([1.0, 5.0, 2.0, 0.0]), params, [])
    assert sample_token(logits, SamplingParams(temperature=0.01), gen) == 1


def test_a_distribution_with_no_finite_mass_is_the_requests_error(draws):
    gen = make_generator(SamplingParams(seed=0), 0, torch.device("cpu"))
    for logits in (torch.full((4,), float("-inf")), torch.tensor([float("nan")] * 4),
                   torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.0, float("inf")])):
        with pytest.raises(SamplingError):
            sample_token(logits, SamplingParams(), gen)
    state = gen.get_state()
    with pytest.raises(SamplingError):
        sample_token(torch.full((4,), float("-inf")), SamplingParams(), gen)
    assert torch.equal(gen.get_state(), state)  # refused before drawing: the choice's next draws are as they were


def test_a_draw_is_the_inverse_cdf_at_one_uniform_and_never_a_token_without_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        u = float(torch.rand((), generator=torch.Generator().set_state(gen.get_state()), dtype=torch.float64))
        assert draw(probs, gen) == (1 if u < 0.25 else 3)


def test_penalty_free_logits_are_not_copied():
    logits = torch.zeros(4)
    assert process_logits(logits, SamplingParams(presence_penalty=1.0), []) is logits
    assert process_logits(logits, SamplingParams(), [1, 2]) is logits
    assert process_logits(logits, SamplingParams(frequency_penalty=1.0), [1]) is not logits
    assert process_logits(logits, SamplingParams(repetition_penalty=1.2), [], torch.tensor([3])) is not logits
    assert process_logits(logits, SamplingParams(repetition_penalty=1.2), []) is logits


@pytest.mark.parametrize("vocab", [1, 7, 63, 64, 65, 640, 32005])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.8, 1e-4, 50.0])
def test_the_native_draw_is_the_inverse_cdf_at_the_generators_uniform(vocab, temperature):
    """cpu_sampling.cpp's token is the aten ops' for the same uniform of the same generator, and the
    generator moves on by that one draw: a seed's tokens are the same on either path."""
    needs_the_native_draw()
    params = SamplingParams(temperature=temperature)
    for scale in (0.1, 3.0, 20.0):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
        probs, _ = probabilities(logits, params)
        native, aten = torch.Generator().manual_seed(vocab), torch.Generator().manual_seed(vocab)
        for _ in range(40):
            assert torch.ops.inferkiln.sample_row(logits, temperature, native) == draw(probs, aten)
            assert torch.equal(native.get_state(), aten.get_state())


def test_the_native_draw_never_picks_a_token_without_mass():
    needs_the_native_draw()
    logits = torch.full((1000,), float("-inf"))
    logits[[3, 500, 999]] = torch.tensor([0.0, 1.0, -2.0])
    logits[[10, 700]] = -200.0  # e^-200 is below float's least normal: no mass either
    gen = torch.Generator().manual_seed(0)
    assert {torch.ops.inferkiln.sample_row(logits, 1.0, gen) for _ in range(3000)} == {3, 500, 999}
