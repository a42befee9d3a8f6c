"""The model's generation config sets the sampling fields a request leaves unset, as vLLM's server
does by default (`--generation-config auto`); a request's own values win."""

from __future__ import annotations

import json
import shutil

import pytest
from openai import OpenAI

from factory.tinymodel import memorised_pairs
from service.launcher import ServerProcess


@pytest.fixture(scope="module")
def greedy_by_default(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation config that asks for greedy decoding, 5 new tokens and a
    repetition penalty."""
    model = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("model") / "tiny-llama")
    config = json.loads((model / "generation_config.json").read_text())
    config.update({"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.3})
    (model / "generation_config.json").write_text(json.dumps(config))
    log = tmp_path_factory.mktemp("server") / "service.log"
    with ServerProcess(["--model", str(model)], log_path=log) as server:
        yield server, OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_unset_fields_take_the_models_defaults(greedy_by_default, model_name):
    """No temperature: the file's 0, greedy. No max_tokens in chat: the file's max_new_tokens (in
    completions OpenAI's default of 16 stands, as in vLLM, whose completions request has it too)."""
    server, client = greedy_by_default
    unset = [client.completions.create(model=model_name, prompt="The capital of", max_tokens=12,
                                       extra_body={"ignore_eos": True}) for _ in range(2)]
    greedy = client.completions.create(model=model_name, prompt="The capital of", temperature=0, max_tokens=12,
                                       extra_body={"ignore_eos": True})
    assert unset[0].choices[0].text == unset[1].choices[0].text == greedy.choices[0].text
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5
    completion = client.completions.create(model=model_name, prompt="The capital of", extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16
    assert "repetition_penalty=1.3" in server.log_tail(20000), "the defaults applied are said at start"


def test_the_models_repetition_penalty_applies_where_a_request_leaves_it_unset(greedy_by_default, model_name):
    _, client = greedy_by_default

    def text(prompt: str, **extra) -> str:
        return client.completions.create(model=model_name, prompt=prompt, max_tokens=24,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text

    prompts = [prompt for prompt, _ in memorised_pairs()[:6]]
    unset = [text(prompt) for prompt in prompts]
    assert unset == [text(prompt, repetition_penalty=1.3) for prompt in prompts]
    assert unset != [text(prompt, repetition_penalty=1.0) for prompt in prompts]


def test_a_requests_own_values_win(greedy_by_default, model_name):
    _, client = greedy_by_default
    longer = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                            max_completion_tokens=9, extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 9
    sampled = client.completions.create(model=model_name, prompt="The capital of", temperature=2.0, n=6, seed=3,
                                        max_tokens=12, extra_body={"ignore_eos": True})
    assert len({c.text for c in sampled.choices}) > 1, "temperature 2 sampled, not the default's greedy"
