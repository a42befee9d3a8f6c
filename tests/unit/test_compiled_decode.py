"""The compiled decode step's torch code, run eagerly (compiling it is tests/integration's), and where
`compile_decode` cannot run."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service import profiles
from service.engine import compiled_decode
from service.engine.compiled_decode import CompileUnavailable, DecodeStep, check_can_compile
from service.engine.llama_runner import LlamaRunner


def test_the_step_computes_what_transformers_computes_over_paged_blocks(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = tokenizer("The capital of France is Paris, a city on the river Seine.")["input_ids"]
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0].float()
        runner = LlamaRunner(model, num_blocks=64, block_size=4, max_len=512)
        step = DecodeStep(runner, [LlamaRunner._linears(layer, False) for layer in runner.layers])
        tables = [[9, 2, 30, 7, 11, 5, 40, 41], [3, 12, 50, 51, 52, 53, 54, 55]]  # blocks in any order
        last = len(ids) - 1
        for table, start in zip(tables, (last, 6)):
            runner.forward([(ids[:start], table, 0)])
        logits, keys, values = step(torch.tensor([ids[last], ids[6]]), torch.tensor([last, 6]), torch.tensor(tables),
                                    torch.arange(last + 1), runner.keys, runner.values)
        assert torch.allclose(logits[0], expected[last], atol=1e-4)
        assert torch.allclose(logits[1], expected[6], atol=1e-4)
        runner.forward([([ids[last]], tables[0], last)])  # the graph writes what the step returned
        row = tables[0][last // 4] * 4 + last % 4
        assert torch.allclose(runner.keys[:, row], keys[:, 0], atol=1e-5)
        assert torch.allclose(runner.values[:, row], values[:, 0], atol=1e-5)


@pytest.mark.parametrize("device,dtype,dynamic,words", [
    ("cuda", torch.float32, False, "fp32 on CPU"),
    ("cpu", torch.float16, False, "fp32 on CPU"),
    ("cpu", torch.float32, True, "fixed rotary tables"),
])
def test_where_it_cannot_run_it_says_why(device, dtype, dynamic, words):
    with pytest.raises(CompileUnavailable, match=words):
        check_can_compile(torch.device(device), dtype, dynamic)


@pytest.mark.parametrize("flags,allowed", [({"avx2", "avx512f"}, False), ({"avx512f", "avx512_bf16"}, True),
                                           ({"amx_tile", "amx_bf16"}, True)])
def test_bf16_only_where_the_cpu_computes_it(monkeypatch, flags, allowed):
    monkeypatch.setattr(profiles, "cpu_flags", lambda: frozenset(flags))
    if allowed:
        check_can_compile(torch.device("cpu"), torch.bfloat16, False)
    else:
        with pytest.raises(CompileUnavailable, match="bf16 on CPUs that compute it natively"):
            check_can_compile(torch.device("cpu"), torch.bfloat16, False)


def test_without_a_compiler_it_says_so(monkeypatch):
    monkeypatch.setattr(compiled_decode.shutil, "which", lambda name: None)
    with pytest.raises(CompileUnavailable, match="C\\+\\+ compiler"):
        check_can_compile(torch.device("cpu"), torch.float32, False)
