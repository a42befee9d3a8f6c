"""The torch engine's compiled decode step (`compile_decode`) with the real tiny model: inductor's
C++ kernels compiled here, the same greedy tokens as the TorchScript graph."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
import yaml
from openai import OpenAI

from service.engine.torch_engine import TorchEngine
from service.launcher import ServerProcess
from service.manifest import default_manifest
from service.profiles import cpu_computes
from tests.integration.test_batching import collect, varied_requests

pytestmark = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                                reason="no C++ compiler on PATH: inductor compiles its CPU kernels at run time")


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """A plain engine and a compiling one, on one event loop for the module (compiling takes a while)."""
    loop = asyncio.new_event_loop()
    plain = TorchEngine(tiny_model_dir, max_num_seqs=8)
    compiled = TorchEngine(tiny_model_dir, max_num_seqs=8, compile_decode=True)
    loop.run_until_complete(plain.start())
    loop.run_until_complete(compiled.start())
    yield loop, plain, compiled
    loop.run_until_complete(plain.shutdown())
    loop.run_until_complete(compiled.shutdown())
    loop.close()


def test_one_sequence_decodes_compiled_with_the_same_greedy_tokens(engines):
    loop, plain, compiled = engines
    step = compiled.runner.compiled
    assert step.ready and all(w.untyped_storage().nbytes() == 0 for w in step.module.weights), "plain copies released"
    reqs = varied_requests(plain, 6)
    expected = [loop.run_until_complete(collect(plain, r)) for r in reqs]
    before = step.steps
    assert [loop.run_until_complete(collect(compiled, r)) for r in reqs] == expected
    assert step.steps - before >= sum(len(tokens[0]) for tokens in expected) - 2 * len(reqs)


def test_batches_run_on_the_graph_and_agree(engines):
    loop, plain, compiled = engines
    reqs = varied_requests(plain, 8)
    async def together(engine):
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    assert loop.run_until_complete(together(compiled)) == loop.run_until_complete(together(plain))


def test_a_step_that_would_compile_again_raises_and_the_graph_takes_over(engines, monkeypatch):
    loop, plain, compiled = engines
    step = compiled.runner.compiled
    runner = compiled.runner
    with torch.inference_mode(), pytest.raises(RuntimeError, match="recompile"):  # int32 tables: new guards
        with torch.compiler.set_stance("fail_on_recompile"):
            step.step(torch.tensor([1]), torch.tensor([20]), torch.tensor([[0, 0]], dtype=torch.int32),
                      torch.arange(21), runner.keys, runner.values)
    # A fault the engine cannot be made to reach with real requests: the compiled step raising.
    monkeypatch.setattr(step, "step", lambda *args: (_ for _ in ()).throw(RuntimeError("would recompile")))
    reqs = varied_requests(plain, 3)
    expected = [loop.run_until_complete(collect(plain, r)) for r in reqs]
    assert [loop.run_until_complete(collect(compiled, r)) for r in reqs] == expected
    assert not step.ready
    step.ready = True  # the module's engine is shared: back as it was


@pytest.mark.skipif(not cpu_computes("bf16"),
                    reason="this CPU does not compute bf16 natively (AVX512-BF16 or AMX)")
def test_bf16_decodes_compiled_with_the_graphs_greedy_tokens(tiny_model_dir):
    """bf16 weights and KV cache: inductor's kernels and oneDNN's round differently, yet on the
    memorised lines the greedy tokens agree."""
    async def tokens(compile_decode: bool) -> tuple[list[dict], int]:
        engine = TorchEngine(tiny_model_dir, precision="bf16", max_num_seqs=8, compile_decode=compile_decode)
        await engine.start()
        try:
            out = [await collect(engine, r) for r in varied_requests(engine, 6)]
            return out, engine.runner.compiled.steps if compile_decode else 0
        finally:
            await engine.shutdown()

    expected, _ = asyncio.run(tokens(False))
    compiled, steps = asyncio.run(tokens(True))
    assert compiled == expected
    assert steps >= sum(len(t[0]) for t in expected) - 2 * len(expected)


def test_the_profile_turns_it_on(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # importing inductor here set /tmp's
    manifest = default_manifest(tiny_model_dir)
    manifest.profiles[0].engine_args["compile_decode"] = True
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest.model_dump(mode="json")))
    cache = tmp_path / "cache"
    args = ["--model", str(tiny_model_dir), "--manifest", str(path), "--cache-path", str(cache)]
    with ServerProcess(args, log_path=tmp_path / "log", timeout=600) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
    log = (tmp_path / "log").read_text()
    assert "compiled decode step ready" in log
    assert any((cache / "torchinductor").iterdir()), "inductor's cache kept with the weights"
