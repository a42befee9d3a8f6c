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
