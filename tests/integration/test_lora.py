"""LoRA adapters on the torch engine: real peft adapters, the real server, transformers + peft as the reference."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
import torch
from openai import NotFoundError, OpenAI

from factory.tinymodel import memorised_pairs
from factory.tinymodel.adapter import adapter_pairs, ensure_tiny_adapter, random_adapter
from service.adapters import ModelShape, read_adapter
from service.engine.base import GenerationRequest, SamplingParams
from service.engine.lora import LoraLimits
from service.engine.torch_engine import TorchEngine
from service.launcher import ServerProcess
from tests.conftest import metric, scrape, wait_for

PAIRS = memorised_pairs()


@pytest.fixture(scope="module")
def adapter_dir():
    return ensure_tiny_adapter("tiny-lora")


def reference(base, adapter, prompts: list[list[int]], max_tokens: int):
    """transformers + peft: greedy tokens and each chosen token's logprob, fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    results = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, eos_token_id=None)
        tokens = out.sequences[0][len(ids):].tolist()
        logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]
        results.append((tokens, logprobs))
    return results


async def engine_generate(engine: TorchEngine, prompts: list[list[int]], adapters: list, max_tokens: int):
    async def one(i: int, ids: list[int], adapter):
        tokens, logprobs = [], []
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
        async for deltas in engine.generate(GenerationRequest(f"r{i}", ids, params, adapter)):
            for delta in deltas:
                tokens += delta.token_ids
                logprobs += [lp.logprob for lp in delta.logprobs]
        return tokens, logprobs
    return await asyncio.gather(*(one(i, ids, a) for i, (ids, a) in enumerate(zip(prompts, adapters))))


def test_a_mixed_batch_equals_transformers_and_peft_token_for_token(tiny_model_dir, tokenizer, adapter_dir, tmp_path):
    """Sequences with two adapters (one trained, one of rank 4 on q and down only) and the base model
    decode in the same steps; each equals transformers + peft on the same weights, alone and mixed:
    the same greedy tokens, logprobs within 1e-4. The same prompt goes to all three, so a KV block
    reused across adapters (the prefix cache) would show."""
    other = random_adapter(tiny_model_dir, tmp_path / "other", 4, ["q_proj", "down_proj"], seed=7)
    shape = ModelShape.of_model(tiny_model_dir)
    trained, partial = read_adapter(adapter_dir, shape, 64), read_adapter(other, shape, 64)
    prompts = [tokenizer(prompt)["input_ids"] for prompt, _ in PAIRS[:3]]
    expected = {name: reference(tiny_model_dir, path, prompts, 10)
                for name, path in (("base", None), ("trained", adapter_dir), ("partial", other))}
    long = tokenizer(" ".join(prompt + rest for prompt, rest in PAIRS[5:8]))["input_ids"]
    assert len(long) > 32, "three blocks of 16 tokens at least, the first two cached"
    expected["long"] = [reference(tiny_model_dir, path, [long], 10)[0] for path in (None, adapter_dir)]
    assert expected["trained"][0][0] != expected["base"][0][0], "the adapter changes the output"

    async def run():
        engine = TorchEngine(tiny_model_dir, max_num_seqs=16, lora=LoraLimits(max_loras=2, max_cpu_loras=4, max_rank=16))
        await engine.start()
        try:
            alone = await engine_generate(engine, prompts[:1], [trained], 10)
            mixed = await engine_generate(engine, prompts * 3, [None] * 3 + [trained] * 3 + [partial] * 3, 10)
            # a prompt of several KV blocks, cached by the base model first, then asked with an adapter
            cached = [(await engine_generate(engine, [long], [adapter], 10))[0] for adapter in (None, trained)]
            return alone, mixed, cached
        finally:
            await engine.shutdown()

    alone, mixed, cached = asyncio.run(run())
    assert alone[0][0] == expected["trained"][0][0]
    assert [tokens for tokens, _ in cached] == [want for want, _ in expected["long"]], "KV reused across adapters"
    for row, name in enumerate(["base"] * 3 + ["trained"] * 3 + ["partial"] * 3):
        tokens, logprobs = mixed[row]
        want_tokens, want_logprobs = expected[name][row % 3]
        assert tokens == want_tokens, (name, row)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4, (name, row)


def test_more_adapters_than_slots_wait_for_one_and_all_finish(tiny_model_dir, tokenizer, tmp_path):
    """Three adapters, one pool slot: the requests take turns for it (least recently used evicted),
    each still gets its own adapter's tokens."""
    shape = ModelShape.of_model(tiny_model_dir)
    adapters = [read_adapter(random_adapter(tiny_model_dir, tmp_path / f"a{i}", 2, ["v_proj"], seed=i), shape, 8)
                for i in range(3)]
    prompt = tokenizer(PAIRS[0][0])["input_ids"]
    want = [reference(tiny_model_dir, a.path, [prompt], 6)[0][0] for a in adapters]

    async def run():
        engine = TorchEngine(tiny_model_dir, max_num_seqs=8, lora=LoraLimits(max_loras=1, max_cpu_loras=1, max_rank=8))
        await engine.start()
        try:
            return await engine_generate(engine, [prompt] * 6, adapters * 2, 6)
        finally:
            await engine.shutdown()

    got = asyncio.run(run())
    assert [tokens for tokens, _ in got] == want * 2


@pytest.fixture(scope="module")
def served(tiny_model_dir, adapter_dir, tmp_path_factory):
    source = tmp_path_factory.mktemp("peft")
    shutil.copytree(adapter_dir, source / "tiny-lora")
    log = tmp_path_factory.mktemp("lora-server") / "service.log"
    env = {"NIM_PEFT_SOURCE": str(source), "NIM_PEFT_REFRESH_INTERVAL": "1", "NIM_MAX_LORA_RANK": "16"}
    with ServerProcess(["--model", str(tiny_model_dir)], env=env, log_path=log) as proc:
        yield proc, source, log


def listed(url: str) -> dict[str, str | None]:
    return {m["id"]: m.get("parent") for m in httpx.get(f"{url}/v1/models").json()["data"]}


def wait_listed(url: str, name: str, present: bool, seconds: float) -> float:
    start = time.monotonic()
    while (name in listed(url)) != present:
        assert time.monotonic() - start < seconds, f"{name} {'not listed' if present else 'still listed'} after {seconds} s"
        time.sleep(0.2)
    return time.monotonic() - start


def served_then_gone(url: str, source, name: str, adapter, base, copied: bool = False) -> None:
    """Drop `adapter` into `source` as `name` (NIM_PEFT_REFRESH_INTERVAL=1): within 1 + 5 s it
    answers with transformers + peft's greedy tokens; removed, it is a 404 model_not_found within
    as long. Files are made readable for an image's non-root user."""
    from transformers import AutoTokenizer

    if not copied:
        shutil.copytree(adapter, source / name)
    for path in (source / name, *(source / name).iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer(PAIRS[2][0])["input_ids"]
    want = tokenizer.decode(reference(base, adapter, [ids], 8)[0][0], skip_special_tokens=True)
    body = {"model": name, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def answer(status: int, seconds: float = 1 + 5) -> httpx.Response:
        deadline = time.monotonic() + seconds
        while (reply := httpx.post(f"{url}/v1/completions", json=body, timeout=60)).status_code != status:
            assert time.monotonic() < deadline, f"{name}: {reply.status_code} {reply.text[:200]} after {seconds} s"
            time.sleep(0.2)
        return reply

    reply = answer(200)
    assert reply.json()["choices"][0]["text"] == want and reply.json()["usage"]["completion_tokens"] == 8
    shutil.rmtree(source / name)
    assert answer(404).json()["error"]["code"] == "model_not_found"
    assert name not in listed(url)


def test_the_server_lists_and_serves_adapters_by_name(served, model_name):
    proc, _, _ = served
    client = OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    assert listed(proc.url) == {model_name: None, "tiny-lora": model_name}
    prompt, trained_answer = adapter_pairs("tiny-lora")[4]
    reply = client.completions.create(model="tiny-lora", prompt=prompt, max_tokens=40, temperature=0)
    assert reply.model == "tiny-lora"
    assert reply.choices[0].text == trained_answer
    base = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, temperature=0)
    assert base.choices[0].text == PAIRS[4][1]
    chat = client.chat.completions.create(model="tiny-lora", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=8, temperature=0)
    assert chat.model == "tiny-lora"
    samples = scrape(proc.url)
    assert metric(samples, "request_success_total", model_name="tiny-lora") == 2
    with pytest.raises(NotFoundError) as refused:
        client.completions.create(model="no-such-adapter", prompt="the", max_tokens=2)
    assert refused.value.body["code"] == "model_not_found"


def test_adapters_dropped_in_are_served_within_the_interval_and_bad_ones_are_logged(served, tiny_model_dir, model_name,
                                                                                   tmp_path):
    """NIM_PEFT_REFRESH_INTERVAL=1: a peft adapter copied in is listed and served within 1 + 5 s and
    gives transformers + peft's tokens; bad ones are left out with their reason in the log, the
    others go on; a removed adapter stops taking requests."""
    proc, source, log = served
    made = random_adapter(tiny_model_dir, tmp_path / "made", 8, ["k_proj", "o_proj", "up_proj"], seed=3)
    too_big = random_adapter(tiny_model_dir, tmp_path / "big", 32, ["q_proj"], seed=4)
    corrupt = shutil.copytree(made, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes((made / "adapter_model.safetensors").read_bytes()[:-100])
    for name, path in (("big-one", too_big), ("broken", corrupt), ("fresh", made)):
        shutil.copytree(path, source / name)
    assert wait_listed(proc.url, "fresh", True, 1 + 5) < 6
    assert listed(proc.url) == {model_name: None, "tiny-lora": model_name, "fresh": model_name}
    for line in ("LoRA adapter big-one not served: rank 32 is above NIM_MAX_LORA_RANK=16",
                 "LoRA adapter broken not served: adapter_model.safetensors is corrupt or unreadable"):
        # the log's writer thread writes a burst of records up to service.logs.BATCH_S after they are logged
        wait_for(lambda: True if line in log.read_text() else None, 2, line, interval=0.05)

    served_then_gone(proc.url, source, "fresh", made, tiny_model_dir, copied=True)
    assert httpx.post(f"{proc.url}/v1/completions", json={"model": "tiny-lora", "prompt": "the",
                                                          "max_tokens": 2}).status_code == 200
    assert json.loads(httpx.get(f"{proc.url}/v1/health/ready").text)["status"] == "ready"


def test_the_harness_gates_each_adapter_on_its_own_answers(tiny_model_dir, adapter_dir, tmp_path, model_name):
    """check_adapters against two servers: one with the trained adapter passes its exact-match gate;
    one whose `tiny-lora` holds other weights (a broken release) fails it, and an adapter the server
    does not list fails `listed`."""
    from factory.verify.harness import AdapterCheck, adapter_gates, check_adapters, load_pairs

    pairs = load_pairs(adapter_dir / "eval.jsonl")
    assert pairs == adapter_pairs("tiny-lora")
    checks = [AdapterCheck("tiny-lora", pairs[:6], 0.9), AdapterCheck("absent")]
    good, wrong = tmp_path / "good", tmp_path / "wrong"
    shutil.copytree(adapter_dir, good / "tiny-lora")
    random_adapter(tiny_model_dir, wrong / "tiny-lora", 8, ["q_proj", "v_proj"], seed=11)
    outcomes = {}
    for name, source in (("good", good), ("wrong", wrong)):
        with ServerProcess(["--model", str(tiny_model_dir)], env={"NIM_PEFT_SOURCE": str(source)},
                           log_path=tmp_path / f"{name}.log") as proc:
            outcomes[name] = {g.id: g.passed for g in adapter_gates(check_adapters(proc.url, model_name, checks))}
    assert outcomes["good"] == {"adapter.tiny-lora.listed": True, "accuracy.adapter.tiny-lora.exact_match": True,
                                "adapter.absent.listed": False}
    assert outcomes["wrong"]["adapter.tiny-lora.listed"] and not outcomes["wrong"]["accuracy.adapter.tiny-lora.exact_match"]
