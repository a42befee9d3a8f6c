"""The OpenAI API through the official client, against the real server and the real tiny model."""

from __future__ import annotations

import pytest

from factory.tinymodel import memorised_pairs

PAIRS = memorised_pairs()


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].max_model_len == 512
    assert models[0].owned_by == "system"


@pytest.mark.parametrize("prompt,expected", PAIRS[:4])
def test_completion_greedy_recalls_memorised_line(client, model_name, prompt, expected):
    reply = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "stop"


def test_chat_greedy_recalls_memorised_line(client, model_name):
    prompt, expected = PAIRS[5]
    reply = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=40)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.strip()


def test_usage_counts_are_exact_tokens(client, model_name, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt, expected = PAIRS[1]
    reply = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0)
    prompt_ids = tokenizer(prompt)["input_ids"]
    # the continuation's tokens plus the end-of-sequence token that stopped it
    completion_ids = tokenizer(prompt + expected)["input_ids"][len(prompt_ids):]
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(completion_ids) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_max_tokens_gives_length_and_exact_count(client, model_name):
    reply = client.completions.create(model=model_name, prompt=PAIRS[2][0], max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_streaming_completion_text_equals_non_streaming(client, model_name):
    prompt = PAIRS[3][0]
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_streaming_chat_has_role_content_and_usage(client, model_name):
    prompt, expected = PAIRS[6]
    chunks = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=40,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.strip()
    assert chunks[-1].usage.completion_tokens > 0
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_without_include_usage_sends_no_usage(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt="Trains run", max_tokens=5, stream=True))
    assert all(c.usage is None for c in chunks)


def test_n_choices_are_independent_and_counted(client, model_name):
    reply = client.completions.create(model=model_name, prompt="The", max_tokens=12, n=4, temperature=1.5, seed=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert len({c.text for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == sum(
        client.completions.create(model=model_name, prompt="The", max_tokens=12, n=1, temperature=1.5, seed=3 + i)
        .usage.completion_tokens for i in range(4))


def test_seed_reproduces_sampled_output(client, model_name):
    def sample(seed: int) -> str:
        return client.completions.create(model=model_name, prompt="A", max_tokens=20, temperature=1.3, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_stop_string_cuts_output_and_is_reported(client, model_name):
    prompt, expected = PAIRS[0]  # " is Paris, a city on the river Seine."
    reply = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0, stop=[" on"])
    assert reply.choices[0].text == expected.split(" on")[0]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["stop_reason"] == " on"


def test_stop_string_in_stream_is_never_sent(client, model_name):
    prompt, expected = PAIRS[0]
    chunks = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0,
                                       stop=["river"], stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected.split("river")[0]


def test_chat_logprobs_with_top_alternatives(client, model_name):
    reply = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": PAIRS[4][0]}],
                                           temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy picks the likeliest token, which heads the alternatives
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_completion_logprobs_legacy_format(client, model_name):
    reply = client.completions.create(model=model_name, prompt=PAIRS[7][0], max_tokens=4, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens).startswith(reply.choices[0].text[:3])


def test_token_prompt_and_batch_prompts(client, model_name, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (p0, e0), (p1, e1) = PAIRS[8], PAIRS[9]
    reply = client.completions.create(model=model_name, prompt=[tokenizer(p0)["input_ids"], tokenizer(p1)["input_ids"]],
                                      max_tokens=40, temperature=0)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [e0, e1]
    batch = client.completions.create(model=model_name, prompt=[p0, p1], max_tokens=40, temperature=0, n=2)
    texts = {c.index: c.text for c in batch.choices}
    assert texts == {0: e0, 1: e0, 2: e1, 3: e1}


def test_echo_prepends_prompt(client, model_name):
    prompt, expected = PAIRS[10]
    reply = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0, echo=True)
    assert reply.choices[0].text == prompt + expected


def test_logit_bias_steers_greedy_choice(client, model_name, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = dict(model=model_name, prompt="Bread", max_tokens=3, temperature=0, logprobs=0)
    first = client.completions.create(**base).choices[0].logprobs.tokens[0]
    banned = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(first))[0]
    steered = client.completions.create(**base, logit_bias={str(banned): -100}).choices[0].logprobs.tokens[0]
    assert steered != first


def test_sampling_parameters_are_accepted(client, model_name):
    base = dict(model=model_name, prompt="Bread", max_tokens=8, extra_body={"ignore_eos": True, "top_k": 5})
    greedy = client.completions.create(**{**base, "temperature": 0}).choices[0].text
    # top_p this small keeps only the likeliest token: sampling becomes greedy
    narrow = client.completions.create(**base, temperature=1.0, top_p=0.01, seed=1,
                                       frequency_penalty=0.5, presence_penalty=0.5).choices[0].text
    assert narrow == greedy


def test_vllms_repetition_penalty_and_min_p(client, model_name):
    """vLLM's extensions: a repetition penalty changes greedy choices (the memorised lines repeat
    words), and a min_p of 1 keeps only the likeliest token, so sampling at temperature 1 is greedy."""
    def text(prompt: str, temperature: float = 0, seed: int | None = None, **extra) -> str:
        return client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=temperature,
                                         seed=seed, extra_body={"ignore_eos": True, **extra}).choices[0].text

    prompts = [prompt for prompt, _ in PAIRS[:6]]
    assert any(text(p, repetition_penalty=1.3) != text(p) for p in prompts)
    assert all(text(p, repetition_penalty=1.0) == text(p) for p in prompts[:2])
    assert all(text(p, min_p=1.0, temperature=1.0, seed=s) == text(p) for s, p in enumerate(prompts))


def test_user_field_is_accepted(client, model_name):
    reply = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, user="someone")
    assert reply.usage.completion_tokens <= 2


def test_vllms_truncate_prompt_tokens_and_an_output_bounded_by_the_context(client, model_name, tiny_model_dir):
    """A prompt cut to its last tokens (BOS kept, as vLLM's tokenizer cuts), or its first; -1 fits a
    prompt far past the context; a max_tokens past what the context leaves stops there, as in vLLM
    0.32 (it was a 400)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt, _ = PAIRS[2]
    ids = tokenizer(prompt)["input_ids"]

    def served(text: str, max_tokens: int = 2, **extra):
        extra["return_token_ids"] = True
        return client.completions.create(model=model_name, prompt=text, max_tokens=max_tokens, temperature=0,
                                         extra_body=extra)

    assert served(prompt, truncate_prompt_tokens=5).choices[0].prompt_token_ids == ids[:1] + ids[-4:]
    assert served(prompt, truncate_prompt_tokens=5, truncation_side="left").choices[0].prompt_token_ids == ids[-5:]
    assert served(prompt, truncate_prompt_tokens=5, truncation_side="right").choices[0].prompt_token_ids == ids[:5]
    fitted = served("word " * 600, truncate_prompt_tokens=-1)
    assert fitted.usage.prompt_tokens == 511 and fitted.usage.completion_tokens == 1
    bounded = served("word " * 160, max_tokens=500)
    assert bounded.usage.total_tokens == 512 and bounded.choices[0].finish_reason == "length"


def test_vllms_return_token_ids_give_the_prompts_and_the_choices_ids(client, model_name, tiny_model_dir):
    """vLLM's return_token_ids: the prompt's ids as encoded, each choice's ids (its text decoded from
    them), the same streamed as whole, and nothing of them unless asked."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt, _ = PAIRS[2]
    asked = {"model": model_name, "max_tokens": 12, "temperature": 0, "extra_body": {"return_token_ids": True}}
    reply = client.completions.create(prompt=[prompt, "Hi"], **asked)
    for choice, text in zip(reply.choices, [prompt, "Hi"]):
        assert choice.prompt_token_ids == tokenizer(text)["input_ids"]
        assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    assert sum(len(c.token_ids) for c in reply.choices) == reply.usage.completion_tokens
    streamed: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    for chunk in client.completions.create(prompt=[prompt, "Hi"], stream=True, **asked):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)
            if (ids := getattr(c, "prompt_token_ids", None)) is not None:  # absent after a choice's first chunk
                assert c.index not in prompts, "a choice's prompt ids come once, in its first chunk"
                prompts[c.index] = ids
    assert streamed == {c.index: c.token_ids for c in reply.choices}
    assert prompts == {c.index: c.prompt_token_ids for c in reply.choices}

    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(messages=messages, **asked)
    assert tokenizer.decode(chat.choices[0].token_ids, skip_special_tokens=True) == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **asked))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids and len(chat.prompt_token_ids) == chat.usage.prompt_tokens
    assert [t for chunk in chunks for c in chunk.choices for t in getattr(c, "token_ids", None) or []] == \
        chat.choices[0].token_ids
    plain = client.completions.with_raw_response.create(model=model_name, prompt="Hi", max_tokens=2).http_response.json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_vllms_return_tokens_as_token_ids_name_the_logprobs_tokens(client, model_name):
    """vLLM's return_tokens_as_token_ids: "token_id:N" for each token and alternative, the offsets
    counting those names; a chat token's bytes stay its text's (vLLM 0.32's)."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    reply = client.completions.create(model=model_name, prompt="The capital", max_tokens=4, temperature=0,
                                      logprobs=2, extra_body=extra)
    choice = reply.choices[0]
    names = [f"token_id:{t}" for t in choice.token_ids]
    assert choice.logprobs.tokens == names
    assert choice.logprobs.text_offset == [sum(map(len, names[:i])) for i in range(len(names))]
    assert all(top and all(k.startswith("token_id:") for k in top) for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert b"".join(bytes(e.bytes) for e in entries).decode() == chat.choices[0].message.content
    assert all(bytes(t.bytes).decode() == t.token and t.token.startswith("token_id:")
               for e in entries for t in e.top_logprobs)


def test_vllms_cache_salt_keeps_prefix_caches_apart(client, model_name, server):
    """vLLM's cache_salt: a prompt's cached KV serves later requests of the same salt only (the
    unsalted share theirs), so one tenant cannot learn from timing what another asked."""
    from tests.conftest import metric, scrape

    prompt = " ".join(f"salted probe {i}" for i in range(24))  # several 16-token blocks, asked nowhere else

    def hits_of(salt: str | None) -> float:
        before = metric(scrape(server.url), "prefix_cache_hits_total", model_name=model_name)
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"cache_salt": salt} if salt else {})
        return metric(scrape(server.url), "prefix_cache_hits_total", model_name=model_name) - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-a") > 0
    assert hits_of("tenant-b") == 0 and hits_of(None) == 0
    assert hits_of(None) > 0 and hits_of("tenant-b") > 0
