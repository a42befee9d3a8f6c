"""N-gram speculation in the torch engine with the real tiny model: the same greedy outputs, fewer steps."""

from __future__ import annotations

import asyncio

import pytest
import yaml
from openai import OpenAI

from factory.tinymodel import memorised_pairs
from service.engine.ngram import NgramConfig
from service.engine.torch_engine import TorchEngine
from service.launcher import ServerProcess
from service.manifest import default_manifest
from tests.conftest import metric, scrape
from tests.integration.test_batching import collect, request, varied_requests

SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture
async def engines(tiny_model_dir):
    plain = TorchEngine(tiny_model_dir, max_num_seqs=32)
    speculating = TorchEngine(tiny_model_dir, max_num_seqs=32, speculation=NgramConfig(**SPECULATION))
    await plain.start()
    await speculating.start()
    yield plain, speculating
    await plain.shutdown()
    await speculating.shutdown()


def repetitive(engine: TorchEngine, count: int):
    """Prompts that quote themselves, as an edit of a text does, decoded greedily at length."""
    return [request(engine, (prompt + completion + " ") * 3 + prompt, temperature=0, max_tokens=48, ignore_eos=True)
            for prompt, completion in memorised_pairs()[:count]]


async def test_greedy_outputs_are_the_same_and_drafts_are_kept(engines):
    plain, speculating = engines
    reqs = repetitive(plain, 6) + varied_requests(plain, 10)
    expected = [await collect(plain, r) for r in reqs]
    assert [await collect(speculating, r) for r in reqs] == expected
    assert await asyncio.gather(*(collect(speculating, r) for r in reqs)) == expected  # drafts in a batch
    counts = speculating.stats().spec_decode
    assert counts.drafts > 0 and 0 < counts.accepted_tokens <= counts.draft_tokens
    assert plain.stats().spec_decode is None


async def test_requests_that_cannot_speculate_decode_as_before(engines):
    plain, speculating = engines
    prompt = memorised_pairs()[0][0] * 3
    for params, speculates in ((dict(temperature=1.0, seed=7), False), (dict(temperature=0, logprobs=2), False),
                               (dict(temperature=0, presence_penalty=1.0), False), (dict(temperature=0, n=2), True)):
        drafts = speculating.stats().spec_decode.drafts
        req = request(plain, prompt, max_tokens=24, ignore_eos=True, **params)
        assert await collect(speculating, req) == await collect(plain, req), params
        assert (speculating.stats().spec_decode.drafts > drafts) == speculates, params


async def test_a_stop_inside_the_kept_tokens_ends_the_choice_there(engines):
    plain, speculating = engines
    for base in repetitive(plain, 3):
        req = request(plain, plain.tokenizer.decode(base.prompt_token_ids), temperature=0, max_tokens=30)
        expected = await collect(plain, req)
        assert await collect(speculating, req) == expected


def test_the_profile_turns_it_on_and_the_metrics_count_it(tiny_model_dir, tmp_path):
    manifest = default_manifest(tiny_model_dir)
    manifest.profiles[0].engine_args["speculative_config"] = SPECULATION
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest.model_dump(mode="json")))
    prompt, completion = memorised_pairs()[0]
    with ServerProcess(["--model", str(tiny_model_dir), "--manifest", str(path)], log_path=tmp_path / "log") as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        text = (prompt + completion + " ") * 3 + prompt
        params = dict(model="tiny-llama", prompt=text, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**params)
        streamed = client.completions.create(**params, stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 40
        samples = scrape(server.url)
    drafts, proposed, accepted = (metric(samples, f"spec_decode_num_{name}_total", model_name="tiny-llama")
                                  for name in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and 0 < accepted <= proposed
