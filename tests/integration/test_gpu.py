"""The same engine on CUDA: runs where a GPU is present, skipped with the reason elsewhere."""

import asyncio

import pytest
import torch

from factory.tinymodel import memorised_pairs
from service.engine.base import GenerationRequest, SamplingParams
from service.engine.torch_engine import TorchEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda is not available)")]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
async def test_engine_on_cuda_recalls_memorised_lines_in_a_batch(tiny_model_dir, precision):
    engine = TorchEngine(tiny_model_dir, device="cuda", precision=precision, max_num_seqs=16)
    await engine.start()
    try:
        assert engine.runner.keys.is_cuda

        async def complete(prompt: str) -> str:
            ids = engine.tokenizer(prompt)["input_ids"]
            text = ""
            async for deltas in engine.generate(GenerationRequest(prompt, ids, SamplingParams(temperature=0, max_tokens=40))):
                text += "".join(d.text for d in deltas)
            return text

        pairs = memorised_pairs()[:16]
        outputs = await asyncio.gather(*(complete(p) for p, _ in pairs))
        correct = sum(out == expected for out, (_, expected) in zip(outputs, pairs))
        assert correct >= (16 if precision == "fp32" else 14), outputs
    finally:
        await engine.shutdown()


async def _greedy_tokens(engine: TorchEngine, prompts: list[str], max_tokens: int = 24) -> list[list[int]]:
    async def one(prompt: str) -> list[int]:
        ids = engine.tokenizer(prompt)["input_ids"]
        tokens: list[int] = []
        async for deltas in engine.generate(GenerationRequest(prompt, ids, SamplingParams(temperature=0, max_tokens=max_tokens))):
            tokens += [t for d in deltas for t in d.token_ids]
        return tokens

    await engine.start()
    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await engine.shutdown()


async def test_cuda_greedy_tokens_equal_the_cpus(tiny_model_dir):
    """fp32 on CUDA and on CPU, in one batch of prompts the model has and has not memorised."""
    prompts = [p for p, _ in memorised_pairs()[:8]] + ["The weather today", "Once upon a time", "1, 2, 3,", "Q:"]
    on_cpu = await _greedy_tokens(TorchEngine(tiny_model_dir, device="cpu", precision="fp32", max_num_seqs=16), prompts)
    on_cuda = await _greedy_tokens(TorchEngine(tiny_model_dir, device="cuda", precision="fp32", max_num_seqs=16), prompts)
    assert on_cuda == on_cpu


async def test_cuda_attention_builds_no_cudnn_graph_per_shape(tiny_model_dir):
    """A bf16 prefill and decode step on CUDA run flash or memory-efficient attention, never cuDNN's,
    which builds a graph for every new key length (service.engine.llama_runner.CUDA_ATTENTION)."""
    engine = TorchEngine(tiny_model_dir, device="cuda", precision="bf16", max_num_seqs=4)
    await engine.start()
    try:
        ids = engine.tokenizer("Once upon a time")["input_ids"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine.runner.forward([(ids, [1], 0), (ids[:3], [2], 0)])  # prompts
            engine.runner.forward([(ids[-1:], [1], len(ids) - 1), (ids[-1:], [2], 3)])  # a decode step
        ran = {event.key for event in profile.key_averages() if "attention" in event.key}
    finally:
        await engine.shutdown()
    assert "aten::_scaled_dot_product_cudnn_attention" not in ran, ran
    assert ran & {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention"}, ran


def test_the_runtime_picks_the_gpu_profile_of_a_plain_model_directory(tiny_model_dir, tmp_path):
    """A directory with no manifest on a GPU node: NVML finds the GPU, the default manifest's torch
    profile for any GPU wins over its CPU one, and the server streams the model's lines from CUDA."""
    import httpx
    from openai import OpenAI

    from service.launcher import ServerProcess
    from service.manifest import default_manifest

    gpu_profile = next(p for p in default_manifest(tiny_model_dir).profiles if p.tags.gpu != "cpu")
    with ServerProcess(["--model", str(tiny_model_dir)], log_path=tmp_path / "serve.log", timeout=300) as server:
        assert httpx.get(f"{server.url}/v1/metadata").json()["selectedModelProfileId"] == gpu_profile.id
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        pairs = memorised_pairs()[:4]
        outputs = []
        for prompt, _ in pairs:
            stream = client.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=48,
                                               temperature=0, stream=True)
            outputs.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
        correct = sum(out.strip() == expected.strip() for out, (_, expected) in zip(outputs, pairs))
        assert correct >= 3, (outputs, server.log_tail())


def _vllm_cuda_reason() -> str | None:
    from service.profiles import vllm_build

    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (torch.cuda is not available)"
    if vllm_build() != "cuda":
        return "needs vLLM's CUDA build (pip install --require-hashes -r dockerfiles/locks/cuda.txt)"
    return None


@pytest.mark.skipif(_vllm_cuda_reason() is not None, reason=str(_vllm_cuda_reason()))
def test_the_runtime_serves_a_vllm_cuda_profile(tiny_model_dir, tmp_path):
    """The `cuda` flavor's path: a vllm profile for any GPU, vLLM supervised by the runtime."""
    import yaml
    from openai import OpenAI

    from service.launcher import ServerProcess

    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({
        "schema_version": "1", "model": {"name": "tiny-llama", "source": f"local://{tiny_model_dir}"},
        "profiles": [{"tags": {"engine": "vllm", "precision": "fp32", "tp": 1, "gpu": "any"},
                      "engine_args": {"enforce_eager": True, "gpu_memory_utilization": 0.3}}]}))
    with ServerProcess([], env={"NIM_MANIFEST_PATH": str(manifest)}, timeout=900) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        prompt, expected = memorised_pairs()[0]
        reply = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=48, temperature=0)
        assert reply.choices[0].text.strip() == expected.strip()


async def test_cuda_lora_batch_greedy_tokens_equal_the_cpus(tiny_model_dir, tmp_path):
    """Two adapters and the base model in one batch, fp32 on CUDA and on CPU: the same tokens."""
    from factory.tinymodel.adapter import random_adapter
    from service.adapters import ModelShape, read_adapter
    from service.engine.lora import LoraLimits

    shape = ModelShape.of_model(tiny_model_dir)
    adapters = [None] + [read_adapter(random_adapter(tiny_model_dir, tmp_path / f"a{i}", 8, targets, seed=i), shape, 8)
                         for i, targets in enumerate((["q_proj", "o_proj"], ["gate_proj", "down_proj", "v_proj"]))]
    prompts = [p for p, _ in memorised_pairs()[:6]]

    async def tokens(device: str) -> list[list[int]]:
        engine = TorchEngine(tiny_model_dir, device=device, precision="fp32", max_num_seqs=16,
                             lora=LoraLimits(max_loras=2, max_cpu_loras=2, max_rank=8))
        await engine.start()

        async def one(i: int, prompt: str) -> list[int]:
            ids = engine.tokenizer(prompt)["input_ids"]
            request = GenerationRequest(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=16), adapters[i % 3])
            return [t async for deltas in engine.generate(request) for d in deltas for t in d.token_ids]

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await engine.shutdown()

    assert await tokens("cuda") == await tokens("cpu")


async def test_cuda_speculation_keeps_the_greedy_tokens(tiny_model_dir):
    """N-gram drafts verified on CUDA: the tokens decoding one a step gives, with drafts kept."""
    from service.engine.ngram import NgramConfig

    prompts = [(p + c + " ") * 3 + p for p, c in memorised_pairs()[:6]] + [p for p, _ in memorised_pairs()[6:10]]
    speculation = NgramConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    plain = TorchEngine(tiny_model_dir, device="cuda", precision="fp32", max_num_seqs=16)
    speculating = TorchEngine(tiny_model_dir, device="cuda", precision="fp32", max_num_seqs=16, speculation=speculation)
    assert await _greedy_tokens(speculating, prompts, 40) == await _greedy_tokens(plain, prompts, 40)
    assert speculating.spec_counts.accepted_tokens > 0
