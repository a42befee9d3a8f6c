"""The batched runner computes what transformers computes, chunk by chunk, over paged blocks."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from service import profiles
from service.engine import cpu_gemm, llama_graph, llama_runner
from service.engine.llama_graph import ONEDNN, PANELS, PANELS_BF16, PLAIN
from service.engine.llama_runner import Linear, LlamaRunner, UnsupportedModel, can_pack, packed_layout

ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return tokenizer, model, LlamaRunner(model, num_blocks=64, block_size=4, max_len=512)


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_chunked_prefill_then_decode_matches_transformers(setup):
    tokenizer, model, runner = setup
    ids = tokenizer("The capital of France is Paris, a city on the river Seine.")["input_ids"]
    expected = reference(model, ids)
    with torch.inference_mode():
        table = [9, 2, 30, 7, 11, 5, 40, 41]  # blocks in any order
        first = runner.forward([(ids[:4], table, 0)])[0]
        second = runner.forward([(ids[4:9], table, 4)])[0]
        steps = [runner.forward([([ids[p]], table, p)])[0] for p in range(9, len(ids))]
    assert torch.allclose(first, expected[3], atol=ATOL)
    assert torch.allclose(second, expected[8], atol=ATOL)
    for offset, logits in enumerate(steps):
        assert torch.allclose(logits, expected[9 + offset], atol=ATOL)


def test_mixed_batch_of_chunks_and_positions(setup):
    tokenizer, model, runner = setup
    a = tokenizer("Owls hunt mice in the dark with silent wings.")["input_ids"]
    b = tokenizer("Tea")["input_ids"]
    with torch.inference_mode():
        runner.forward([(a[:6], [0, 1], 0)])
        logits = runner.forward([(a[6:], [0, 1, 3, 4, 6, 8], 6), (b, [20], 0)])  # a continues while b starts
    assert torch.allclose(logits[0], reference(model, a)[-1], atol=ATOL)
    assert torch.allclose(logits[1], reference(model, b)[-1], atol=ATOL)


def test_every_position_of_a_mixed_batch(setup):
    """Speculation's verify step: one token for one sequence, several for another, a logit row per token."""
    tokenizer, model, runner = setup
    a = tokenizer("Rivers run down to the sea")["input_ids"]
    b = tokenizer("Snow falls on the quiet hills tonight")["input_ids"]
    with torch.inference_mode():
        runner.forward([(a[:-1], [60, 61, 62, 63], 0), (b[:4], [50, 51, 52, 53, 54], 0)])
        logits = runner.forward([([a[-1]], [60, 61, 62, 63], len(a) - 1), (b[4:], [50, 51, 52, 53, 54], 4)],
                                every_position=True)
    assert logits.shape[0] == 1 + len(b) - 4
    assert torch.allclose(logits[0], reference(model, a)[-1], atol=ATOL)
    assert torch.allclose(logits[1:], reference(model, b)[4:], atol=ATOL)


def test_prompts_decodes_and_verified_drafts_share_one_pass(setup):
    """One pass of a step: a decode, a prompt from its start (its last row) and a draft being
    verified (a row per token), each flagged alone."""
    tokenizer, model, runner = setup
    a = tokenizer("Rivers run down to the sea")["input_ids"]
    b = tokenizer("Snow falls on the quiet hills tonight")["input_ids"]
    c = tokenizer("Bread is baked from flour and water")["input_ids"]
    with torch.inference_mode():
        runner.forward([(a[:-1], [40, 41, 42, 43], 0), (b[:4], [44, 45, 46, 47, 48], 0)])
        logits = runner.forward([([a[-1]], [40, 41, 42, 43], len(a) - 1), (c, [49, 30, 31], 0),
                                 (b[4:], [44, 45, 46, 47, 48], 4)],
                                every_position=[False, False, True])
    assert logits.shape[0] == 2 + len(b) - 4
    assert torch.allclose(logits[0], reference(model, a)[-1], atol=ATOL)
    assert torch.allclose(logits[1], reference(model, c)[-1], atol=ATOL)
    assert torch.allclose(logits[2:], reference(model, b)[4:], atol=ATOL)


def test_shared_and_copied_blocks_continue_like_the_original(setup):
    """A fork: the second sequence holds the first's full block and a copy of its partial one."""
    tokenizer, model, runner = setup
    ids = tokenizer("Seven days make one week")["input_ids"][:7]
    with torch.inference_mode():
        runner.forward([(ids[:-1], [50, 51], 0)])
        runner.copy_blocks([(51, 52)])
        logits = runner.forward([([ids[-1]], [50, 51], len(ids) - 1), ([ids[-1]], [50, 52], len(ids) - 1)])
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    assert torch.allclose(logits[0], reference(model, ids)[-1], atol=ATOL)


def test_fused_projections_leave_the_model_intact(setup):
    tokenizer, model, runner = setup
    attention = model.model.layers[0].self_attn
    qkv = runner.linears[0]["qkv"].weight
    assert attention.q_proj.weight.data_ptr() == qkv.data_ptr(), "views, not copies"
    ids = tokenizer("Bread is baked")["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, len(ids):]) == " from flour, water"


@pytest.mark.parametrize("field, value", [("model_type", "gpt2"), ("hidden_act", "quick_gelu")])
def test_what_the_runner_cannot_compute_is_refused(setup, field, value):
    _, model, _ = setup
    original = getattr(model.config, field)
    setattr(model.config, field, value)
    try:
        with pytest.raises(UnsupportedModel, match=value):
            LlamaRunner(model, 1, 16, 16)
    finally:
        setattr(model.config, field, original)


def panels_run_here() -> bool:
    """Whether this CPU can run the library (x86 with AVX2 and FMA), whether or not the engine
    chooses it here (cpu_gemm.suits): its arithmetic is checked wherever it can run."""
    return cpu_gemm.runs_here() and cpu_gemm.load()


@pytest.fixture
def panels_chosen(monkeypatch):
    """The engine lays fp32 weights out in panels here, as on the CPUs the kernel suits."""
    if not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    monkeypatch.setattr(cpu_gemm, "suits", lambda device, dtype: device.type == "cpu" and dtype == torch.float32)


@pytest.mark.parametrize("layout", [ONEDNN, PANELS], ids=["onednn", "avx2-panels"])
def test_packed_weights_compute_the_same_logits(tiny_model_dir, setup, monkeypatch, layout):
    tokenizer, _, runner = setup
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("torch has no oneDNN here")
    if layout == PANELS and not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    monkeypatch.setattr(llama_runner, "PACK_MIN_ELEMENTS", 0)  # the tiny model's weights are below it
    monkeypatch.setattr(cpu_gemm, "suits", lambda device, dtype: layout == PANELS)
    packed = LlamaRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), 64, 4, 512, pack_weights=True)
    assert {linear.layout for layer in packed.linears for linear in layer.values()} == {layout}
    assert ("oneDNN" if layout == ONEDNN else "panels") in packed.matmul_kernels()  # the start-up log's line
    a = tokenizer("Owls hunt mice in the dark with silent wings.")["input_ids"]
    b = tokenizer("Tea")["input_ids"]
    with torch.inference_mode():
        chunks = [(a, [0, 1, 2, 3, 4, 5], 0), (b, [20], 0)]
        assert torch.allclose(packed.forward(chunks), runner.forward(chunks), atol=ATOL)
        decode = [([5], [0, 1, 2, 3, 4, 5], len(a)), ([6], [20], len(b))]
        assert torch.allclose(packed.forward(decode), runner.forward(decode), atol=ATOL)


def test_a_step_of_decodes_alone_runs_its_layers_in_one_call_with_the_same_logits(tiny_model_dir, setup, monkeypatch,
                                                                                  panels_chosen):
    tokenizer, _, _ = setup
    monkeypatch.setattr(llama_runner, "PACK_MIN_ELEMENTS", 0)
    packed = LlamaRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), 64, 4, 512, pack_weights=True)
    a = tokenizer("Owls hunt mice in the dark with silent wings.")["input_ids"]

    def ran(chunks) -> tuple[torch.Tensor, set[str]]:
        with torch.inference_mode(), torch.profiler.profile() as profile:
            logits = packed.forward(chunks)
        return logits, {event.name for event in profile.events()}

    with torch.inference_mode():
        packed.forward([(a, [0, 1, 2, 3, 4, 5], 0)])
    decode = ([5], [0, 1, 2, 3, 4, 5], len(a))
    alone, alone_ops = ran([decode])
    packed.rezero()  # the mixed step writes the decode's key and value again
    with torch.inference_mode():
        packed.forward([(a, [0, 1, 2, 3, 4, 5], 0)])
    monkeypatch.setattr(llama_runner, "SPLIT_WIDTH", 0)  # the prompt chunk beside it stays a chunk: the per-op graph
    mixed, mixed_ops = ran([decode, (a[:3], [10], 0)])
    assert {"inferkiln::decode_inputs", "inferkiln::decode_layers"} <= alone_ops
    assert "inferkiln::decode_layers" not in mixed_ops
    assert torch.allclose(alone[0], mixed[0], atol=1e-5, rtol=0)


def test_an_untied_lm_head_goes_into_panels_and_a_tied_one_stays_the_embedding(tiny_model_dir, panels_chosen):
    """The head computes the same logits in panels, its original released; the tiny model's head is
    its embedding table, which panels would copy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    plain = LlamaRunner(LlamaForCausalLM(config).eval(), 16, 4, 64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    packed = LlamaRunner(model, 16, 4, 64, pack_weights=True)
    assert packed.head.layout == PANELS and plain.head.layout == PLAIN
    assert model.lm_head.weight.numel() == 0, "the panels are the only copy"
    with torch.inference_mode():
        prompt, decode = [([5, 9, 200, 17, 3], [0, 1], 0)], [([299], [0, 1], 5)]
        assert torch.allclose(packed.forward(prompt), plain.forward(prompt), atol=ATOL)
        assert torch.allclose(packed.forward(decode), plain.forward(decode), atol=ATOL)
    tied = LlamaRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), 16, 4, 64, pack_weights=True)
    assert tied.head.layout == PLAIN


def test_weights_are_laid_out_for_the_kernel_that_gains_from_it():
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("torch has no oneDNN here")
    small, large = torch.randn(384, 128), torch.randn(1536, 512)
    here = packed_layout(torch.device("cpu"), torch.float32)
    chosen = cpu_gemm.suits(torch.device("cpu"), torch.float32) and cpu_gemm.load()
    assert Linear(small, None, here).layout == (PANELS if chosen else PLAIN)
    assert Linear(large, None, here).layout == (PANELS if chosen else ONEDNN)
    assert Linear(large, None, PLAIN).layout == PLAIN
    x, packed = torch.randn(1, 3, 512), Linear(large.clone(), None, here)
    assert torch.allclose(llama_graph.linear(x, packed.weight, None, packed.layout, 1536), x @ large.T, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 8, 17, 70])
@pytest.mark.parametrize("columns, inner", [(1, 7), (23, 64), (24, 64), (25, 33), (70, 16), (100, 768), (200, 40)])
def test_avx2_panels_compute_what_torch_does_for_any_shape(rows, columns, inner):
    if not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    torch.manual_seed(rows * 1000 + columns)
    weight, bias, x = torch.randn(columns, inner), torch.randn(columns), torch.randn(2, rows, inner)
    packed = cpu_gemm.pack(weight)
    assert packed.shape == (-(-columns // cpu_gemm.PANEL), inner, cpu_gemm.PANEL)
    expected = x @ weight.T
    assert torch.allclose(torch.ops.inferkiln.linear_fp32(x, packed, columns, None), expected, atol=1e-4)
    assert torch.allclose(torch.ops.inferkiln.linear_fp32(x.transpose(0, 1), packed, columns, bias),
                          (expected + bias).transpose(0, 1), atol=1e-4), "non-contiguous input, bias"
    one = x[:1, :1]  # one row: its own path, a panel at a time, 4 at once off AMD's AVX-512 CPUs (1-9 panels here)
    alone = torch.ops.inferkiln.linear_fp32(one, packed, columns, bias)
    assert torch.allclose(alone, one @ weight.T + bias, atol=1e-4)
    # the one-row path (AVX-512 where the CPU has it) sums each column's k in the tiles' order: the same floats
    beside = torch.cat([one, torch.randn(1, 1, inner)], dim=1)
    assert torch.equal(alone, torch.ops.inferkiln.linear_fp32(beside, packed, columns, bias)[:, :one.shape[1]])


def test_the_avx512_and_avx2_paths_compute_the_same_floats(tmp_path):
    """On an AVX-512 CPU the kernel takes its AVX-512 paths; INFERKILN_GEMM_AVX2=1 keeps the AVX2 ones,
    which a CPU without AVX-512 takes: every row count's regime (one row; one group; groups in blocks
    of k, up to 16 rows with AVX2 and 32 with AVX-512; more) gives the same floats in both."""
    if not panels_run_here() or cpu_gemm.fp32_isa() != "AVX-512":
        pytest.skip("the AVX-512 paths run only on x86 CPUs with AVX-512F and VL")
    torch.manual_seed(5)
    rows = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70)
    weight, bias, x = torch.randn(100, 200), torch.randn(100), torch.randn(70, 200)
    torch.save({"x": x, "packed": cpu_gemm.pack(weight), "bias": bias}, tmp_path / "in.pt")
    script = ("import sys, torch\nfrom service.engine import cpu_gemm\nassert cpu_gemm.load()\n"
              "d = torch.load(sys.argv[1])\n"
              f"torch.save([torch.ops.inferkiln.linear_fp32(d['x'][:m], d['packed'], 100, d['bias']) for m in {rows}], "
              "sys.argv[2])")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "avx2.pt")], check=True,
                   env={**os.environ, "INFERKILN_GEMM_AVX2": "1"}, timeout=300)
    packed = cpu_gemm.pack(weight)
    for m, avx2 in zip(rows, torch.load(tmp_path / "avx2.pt")):
        assert torch.equal(torch.ops.inferkiln.linear_fp32(x[:m], packed, 100, bias), avx2), f"{m} rows"


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_every_panel_is_computed_once_whatever_the_threads(threads):
    """Each thread takes its contiguous share of the panels and then the others' from their backs
    (cpu_shares.h): with more threads than cores, a share's owner is preempted and its panels taken
    by others. Every thread count gives the floats one thread gives, for one row and several, fp32
    and bf16, with fewer panels than threads too."""
    if not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    torch.manual_seed(threads)
    before = torch.get_num_threads()
    x = torch.randn(40, 96)
    cases = [(w, m) for w in [torch.randn(columns, 96) for columns in (24, 70, 1000)] for m in (1, 8, 40)]
    kernels = [(torch.ops.inferkiln.linear_fp32, cpu_gemm.pack, torch.float32)]
    if bf16_panels_run_here():
        kernels.append((torch.ops.inferkiln.linear_bf16, cpu_gemm.pack_bf16, torch.bfloat16))
    try:
        for op, pack, dtype in kernels:
            inputs = [(x[:m].to(dtype), pack(w.to(dtype)), w.shape[0]) for w, m in cases]
            torch.set_num_threads(1)
            alone = [op(rows, packed, n, None) for rows, packed, n in inputs]
            torch.set_num_threads(threads)
            for _ in range(20):
                assert all(torch.equal(op(rows, packed, n, None), one)
                           for (rows, packed, n), one in zip(inputs, alone)), dtype
    finally:
        torch.set_num_threads(before)


ALIGNMENT_CHECK = """
import sys, torch
from service import profiles
from service.engine import cpu_gemm
assert cpu_gemm.load()
torch.manual_seed(9)
kernels = [(torch.ops.inferkiln.linear_fp32, cpu_gemm.pack, torch.float32)]
if "avx512_bf16" in profiles.cpu_flags():
    kernels.append((torch.ops.inferkiln.linear_bf16, cpu_gemm.pack_bf16, torch.bfloat16))
for op, pack, dtype in kernels:
    for columns, inner in ((70, 96), (100, 33), (24, 768)):
        weight, x = torch.randn(columns, inner).to(dtype), torch.randn(8, inner).to(dtype)
        packed = pack(weight)
        assert packed.data_ptr() % 64 == 0
        shifted = torch.empty(packed.numel() + 1, dtype=dtype)[1:].view(packed.shape).copy_(packed)
        for rows in (1, 3, 4, 5, 8):
            assert torch.equal(op(x[:rows], packed, columns, None), op(x[:rows], shifted, columns, None)), (dtype, rows)
"""


@pytest.mark.parametrize("avx2", ["0", "1"])
def test_weights_out_of_alignment_compute_the_same_floats(avx2):
    """Where each line of W is read once, W's aligned lines are read in pairs of k where a k is not
    whole lines (with non-temporal loads, but off AMD's CPUs on the AVX-512 one-row path), the rest
    one k at a time: the same floats either way, on the AVX-512 paths and on the AVX2 ones
    (INFERKILN_GEMM_AVX2=1), fp32 and bf16."""
    if not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    subprocess.run([sys.executable, "-c", ALIGNMENT_CHECK], check=True, timeout=300,
                   env={**os.environ, "INFERKILN_GEMM_AVX2": avx2})


def bf16_panels_run_here() -> bool:
    return "avx512_bf16" in profiles.cpu_flags() and cpu_gemm.load()


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 8, 16, 17, 40])
@pytest.mark.parametrize("columns, inner", [(1, 1), (15, 64), (16, 64), (17, 7), (70, 33), (100, 768)])
def test_bf16_panels_compute_what_torch_does_for_any_shape(rows, columns, inner):
    """Summed in fp32 and rounded once: within half a bf16 step of the fp32 product (2^-9 relative,
    more where terms cancel: atol). With K in whole AMX tiles (64, 768) on AMX's tiles where the CPU
    has them, in blocks of 32 rows."""
    if not bf16_panels_run_here():
        pytest.skip("the bf16 panels are for x86 CPUs with AVX512-BF16")
    torch.manual_seed(rows * 1000 + columns)
    weight, bias = torch.randn(columns, inner).bfloat16(), torch.randn(columns).bfloat16()
    x = torch.randn(2, rows, inner).bfloat16()
    packed = cpu_gemm.pack_bf16(weight)
    assert packed.shape == (-(-columns // 16), -(-inner // 2), 16, 2)
    expected = x.float() @ weight.float().T
    out = torch.ops.inferkiln.linear_bf16(x, packed, columns, None)
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, columns)
    assert torch.allclose(out.float(), expected, rtol=2**-8, atol=1e-2)
    biased = torch.ops.inferkiln.linear_bf16(x.transpose(0, 1), packed, columns, bias)
    assert torch.allclose(biased.float(), (expected + bias.float()).transpose(0, 1), rtol=2**-8, atol=1e-2)


AMX_CHECK = """
import sys, torch
from service.engine import cpu_gemm
assert cpu_gemm.load()
torch.manual_seed(5)
outs = []
for columns, inner in ((70, 96), (2304, 768), (768, 2304)):
    weight, bias = torch.randn(columns, inner).bfloat16(), torch.randn(columns).bfloat16()
    packed = cpu_gemm.pack_bf16(weight)
    outs += [torch.ops.inferkiln.linear_bf16(torch.randn(rows, inner).bfloat16(), packed, columns, bias)
             for rows in (1, 4, 16, 33, 100)]
torch.save((torch.ops.inferkiln.bf16_amx(), outs), sys.argv[1])
"""


def test_amx_tiles_compute_what_the_avx512_panels_do(tmp_path):
    """Where the CPU has AMX the bf16 panels run on its tiles (bf16_amx says so, and
    INFERKILN_GEMM_AMX=0 keeps AVX-512): the two round an output differently at most rarely, by
    about a bf16 step (in one of about 10^4 here: tdpbf16ps does not round a pair's products as
    vdpbf16ps does)."""
    if not {"avx512_bf16", "amx_tile", "amx_bf16"} <= profiles.cpu_flags() or not bf16_panels_run_here():
        pytest.skip("AMX's tiles are for x86 CPUs with AMX-BF16")
    runs = {}
    for amx in ("1", "0"):
        subprocess.run([sys.executable, "-c", AMX_CHECK, str(tmp_path / amx)], check=True, timeout=300,
                       env={**os.environ, "INFERKILN_GEMM_AMX": amx})
        runs[amx] = torch.load(tmp_path / amx)
    assert runs["1"][0] is True and runs["0"][0] is False
    for tiles, avx512 in zip(runs["1"][1], runs["0"][1]):
        # a bf16 step (8 bits of precision), more where terms cancel (sums here of size 30-50)
        assert torch.allclose(tiles.float(), avx512.float(), rtol=2**-7, atol=1e-2)
        assert (tiles != avx512).float().mean() < 1e-3


def test_bf16_panels_refuse_what_they_cannot_compute():
    if not bf16_panels_run_here():
        pytest.skip("the bf16 panels are for x86 CPUs with AVX512-BF16")
    packed = cpu_gemm.pack_bf16(torch.randn(30, 16).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.inferkiln.linear_bf16(torch.randn(2, 16), packed, 30, None)
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.inferkiln.linear_bf16(torch.randn(2, 14).bfloat16(), packed, 30, None)
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.inferkiln.linear_bf16(torch.randn(2, 16).bfloat16(), packed, 60, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.inferkiln.linear_bf16(torch.randn(2, 16).bfloat16(), packed, 30, torch.randn(30))


def two_sequences(tokenizer) -> tuple[list, list]:
    """Two prompts as one step's chunks, then a decode step of both."""
    a = tokenizer("Owls hunt mice in the dark with silent wings.")["input_ids"]
    b = tokenizer("Tea")["input_ids"]
    return [(a, [0, 1, 2, 3, 4, 5], 0), (b, [20], 0)], [([5], [0, 1, 2, 3, 4, 5], len(a)), ([6], [20], len(b))]


def test_bf16_weights_in_panels_decode_as_near_fp32_as_onednns(tiny_model_dir, setup, monkeypatch):
    """The tiny model in bf16 with every weight in bf16 panels, its head too (untied here), against
    the fp32 runner: the bound the bf16 runner on oneDNN is held to."""
    tokenizer, _, fp32 = setup
    if not bf16_panels_run_here():
        pytest.skip("the bf16 panels are for x86 CPUs with AVX512-BF16")
    monkeypatch.setattr(cpu_gemm, "suits_bf16", lambda device, dtype: dtype == torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone(), requires_grad=False)  # untied
    runner = LlamaRunner(model, 64, 4, 512, pack_weights=True)
    assert {linear.layout for layer in runner.linears for linear in layer.values()} == {PANELS_BF16}
    assert runner.head.layout == PANELS_BF16 and "bf16 panels (" in runner.matmul_kernels()
    prompts, decodes = two_sequences(tokenizer)
    # a prompt of 40 tokens as well: more than one block of AMX's tiles where the CPU has them
    long = (tokenizer("Owls hunt mice in the dark with silent wings. " * 4)["input_ids"] * 2)[:40]
    with torch.inference_mode():
        fp32.forward(prompts)
        expected = fp32.forward(decodes)
        expected_long = fp32.forward([(long, list(range(30, 40)), 0)])
        runner.forward(prompts)
        logits = runner.forward(decodes)
        logits_long = runner.forward([(long, list(range(30, 40)), 0)])
    assert torch.allclose(logits, expected, atol=0.2), (logits - expected).abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert torch.allclose(logits_long, expected_long, atol=0.2), (logits_long - expected_long).abs().max()
    assert torch.equal(logits_long.argmax(-1), expected_long.argmax(-1))


def test_avx2_panels_refuse_what_they_cannot_compute():
    if not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    packed = cpu_gemm.pack(torch.randn(30, 16))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.inferkiln.linear_fp32(torch.randn(2, 16, dtype=torch.bfloat16), packed, 30, None)
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.inferkiln.linear_fp32(torch.randn(2, 15), packed, 30, None)
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.inferkiln.linear_fp32(torch.randn(2, 16), packed, 60, None)


def test_fused_norms_compute_what_torch_does():
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(1)
    for rows, width in [(1, 768), (3, 7), (70, 64), (0, 16)]:
        x, y, weight = torch.randn(rows, width), torch.randn(rows, width), torch.randn(width)
        assert torch.allclose(torch.ops.inferkiln.rms_norm(x, weight, 1e-6), F.rms_norm(x, [width], weight, 1e-6),
                              atol=1e-5)
        hidden = x.clone()
        normed = torch.ops.inferkiln.add_rms_norm(hidden, y, weight, 1e-5)
        assert torch.allclose(hidden, x + y), "the residual is added in place"
        assert torch.allclose(normed, F.rms_norm(x + y, [width], weight, 1e-5), atol=1e-5)


def test_fused_rotary_and_paged_decode_attention_compute_what_the_aten_ops_do():
    """Rotary positions and the cache writes against llama_graph.rotate and index_copy_; one query a
    sequence over rows scattered through the cache (GQA: 2 query heads a key head) against SDPA over
    the gathered rows, each sequence at its own length."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(2)
    heads, kv_heads, dim, tokens, cache_rows = 4, 2, 16, 3, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(tokens, 1, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = torch.randn(cache_rows, kv_heads, dim), torch.randn(cache_rows, kv_heads, dim)
    written = torch.tensor([5, 17, 30])
    expected_qk = llama_graph.rotate(qkv[:, :(heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.index_copy_(0, written, expected_qk[:, heads:])
    expected_values.index_copy_(0, written, qkv[:, (heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim))
    torch.ops.inferkiln.rope_store(qkv, cos, sin, heads, kv_heads, keys, values, written)
    assert torch.allclose(qkv[:, :(heads + kv_heads) * dim].view(tokens, -1, dim), expected_qk, atol=1e-6)
    assert torch.allclose(keys, expected_keys, atol=1e-6) and torch.equal(values, expected_values)

    rows = torch.tensor([[8, 9, 10, 11, 0, 1, 2, 5], [20, 21, 22, 23, 24, 25, 26, 17], [30, 31, 0, 0, 0, 0, 0, 0]])
    positions = torch.tensor([7, 7, 0])  # the last sequence sees its first row alone
    out = torch.ops.inferkiln.decode_attention(qkv, 0, heads, keys, values, rows, positions, 0.25)
    for s in range(tokens):
        seen = rows[s, :positions[s] + 1]
        q = qkv[s, :heads * dim].view(1, heads, 1, dim)
        k, v = (cache.index_select(0, seen).transpose(0, 1).unsqueeze(0) for cache in (keys, values))
        expected = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
        assert torch.allclose(out[s], expected.flatten(), atol=1e-5), s
    offset = torch.ops.inferkiln.decode_attention(qkv, 1, heads, keys, values, rows[1:], positions[1:], 0.25)
    assert torch.allclose(offset, out[1:]), "`first` picks the group's rows of qkv"
    threads = torch.get_num_threads()
    try:  # a sequence alone is split over the threads by its KV heads: the same floats however split
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            alone = torch.ops.inferkiln.decode_attention(qkv, 1, heads, keys, values, rows[1:2], positions[1:2], 0.25)
            assert torch.equal(alone[0], out[1]), count
    finally:
        torch.set_num_threads(threads)


def test_fused_decode_attention_splits_a_sequence_by_uneven_runs_of_kv_heads():
    """3 KV heads over 2 threads: runs of 2 and 1 (GQA, 2 query heads each), against SDPA."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(3)
    heads, kv_heads, dim = 6, 3, 16
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim)
    keys, values = torch.randn(50, kv_heads, dim), torch.randn(50, kv_heads, dim)
    rows = torch.tensor([[40, 3, 17, 8, 22]])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = torch.ops.inferkiln.decode_attention(qkv, 0, heads, keys, values, rows, torch.tensor([4]), 0.3)
    finally:
        torch.set_num_threads(threads)
    k, v = (cache.index_select(0, rows[0]).transpose(0, 1).unsqueeze(0) for cache in (keys, values))
    expected = F.scaled_dot_product_attention(qkv[:, :heads * dim].view(1, heads, 1, dim), k, v, scale=0.3, enable_gqa=True)
    assert torch.allclose(out[0], expected.flatten(), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64, 80])
def test_fused_decode_attention_reads_a_chunks_rows_together_and_gives_each_what_it_gets_alone(dtype, dim):
    """A chunk split into rows of one token (consecutive positions over one block table) is read as
    groups of rows; each row's output is the one it gets alone, bitwise, and SDPA's with a causal mask.
    Beside it: a decode of another sequence, a chunk of 10 rows (more than a group holds), and a row
    at an earlier position over the same table (not of the group before it)."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(5)
    heads, kv_heads = 6, 3
    keys, values = (torch.randn(300, kv_heads, dim).to(dtype) for _ in range(2))
    chunk_table = torch.randperm(100)[:70]  # scattered cache rows, as blocks lie
    other_table = 100 + torch.randperm(100)[:70]
    rows, positions = [], []
    for position in range(40, 48):  # an 8-token chunk after 40 cached positions
        rows.append(chunk_table), positions.append(position)
    rows.append(other_table), positions.append(65)  # another sequence's decode
    for position in range(50, 60):  # 10 rows of one chunk: two groups
        rows.append(other_table), positions.append(position)
    rows.append(chunk_table), positions.append(3)  # earlier than the chunk's rows
    rows, positions = torch.stack(rows), torch.tensor(positions)
    qkv = torch.randn(len(rows), (heads + 2 * kv_heads) * dim).to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            together = torch.ops.inferkiln.decode_attention(qkv, 0, heads, keys, values, rows, positions, 0.2)
            for s in range(len(rows)):
                alone = torch.ops.inferkiln.decode_attention(qkv, s, heads, keys, values, rows[s:s + 1],
                                                             positions[s:s + 1], 0.2)
                assert torch.equal(together[s], alone[0]), (count, s)
    finally:
        torch.set_num_threads(threads)
    for s in range(len(rows)):
        seen = rows[s, :positions[s] + 1]
        q = qkv[s, :heads * dim].float().view(1, heads, 1, dim)
        k, v = (cache.index_select(0, seen).float().transpose(0, 1).unsqueeze(0) for cache in (keys, values))
        expected = F.scaled_dot_product_attention(q, k, v, scale=0.2, enable_gqa=True).flatten()
        assert torch.allclose(together[s].float(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2), s


BF16_STEP = 2.0 ** -7  # bf16's relative rounding step


def test_fused_norms_in_bf16_round_where_the_graphs_aten_ops_do():
    """In bf16 the norm is computed in fp32, rounded, then times the weight (llama_graph.rms_norm), and
    the residual add is rounded: equal to those ops but where the fp32 sums' order differs (a step)."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(4)
    for rows, width in [(1, 768), (3, 7), (70, 64)]:
        x, y, weight = (torch.randn(*shape).bfloat16() for shape in ((rows, width), (rows, width), (width,)))
        out = torch.ops.inferkiln.rms_norm(x, weight, 1e-6)
        expected = llama_graph.rms_norm(x, weight, 1e-6)
        assert out.dtype == torch.bfloat16 and torch.allclose(out, expected, rtol=BF16_STEP, atol=0)
        assert (out == expected).float().mean() > 0.97, "all but a few elements are the same bf16"
        hidden = x.clone()
        normed = torch.ops.inferkiln.add_rms_norm(hidden, y, weight, 1e-5)
        assert torch.equal(hidden, x + y), "the residual is added in place, rounded as aten rounds"
        assert torch.allclose(normed, llama_graph.rms_norm(x + y, weight, 1e-5), rtol=BF16_STEP, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_computes_what_the_graphs_aten_ops_did(dtype):
    """silu(gate) * up from [gate | up] rows, rounded where aten's silu and mul round in bf16: widths with
    and without a tail past 8, rows of a wider tensor (a stride), large, tiny and non-finite inputs."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(5)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, -100.0, 100.0,
                            float("inf"), float("-inf"), float("nan"), 3.0, -3.0, 0.5])
    for rows, half in [(1, 768), (3, 11), (5, 16), (0, 8)]:
        gate_up = (torch.randn(rows, 2 * half + 6) * 4).to(dtype)[:, :2 * half]  # cast first: the slice's stride stays
        if rows:
            gate_up[0, :min(half, 16)] = special[:min(half, 16)].to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.ops.inferkiln.silu_mul(gate_up)
        expected = F.silu(gate) * up
        assert out.dtype == dtype and out.shape == (rows, half)
        assert torch.equal(out.isnan(), expected.isnan())
        step = BF16_STEP if dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(out.float(), expected.float(), rtol=step, atol=1e-30, equal_nan=True)
        if dtype == torch.bfloat16 and rows * half > 500:  # e^x under float's least normal counts as 0 here
            assert (out == expected).float().mean() > 0.97, "all but a few elements are the same bf16"
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.inferkiln.silu_mul(torch.randn(2, 7))


def test_fused_rotary_and_decode_attention_in_bf16_compute_what_the_graph_did():
    """Rotary positions in bf16 round each product and their sum as the aten ops do (the same
    bits); decode attention reads the bf16 cache and computes in fp32, as the upcast SDPA did, with
    one rounding at the end (within a bf16 step of it)."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(5)
    heads, kv_heads, dim, tokens, cache_rows = 4, 2, 16, 3, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).bfloat16()
    angles = torch.rand(tokens, 1, dim // 2) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    keys, values = (torch.randn(cache_rows, kv_heads, dim).bfloat16() for _ in range(2))
    written = torch.tensor([5, 17, 30])
    expected_qk = llama_graph.rotate(qkv[:, :(heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    expected_keys = keys.clone().index_copy_(0, written, expected_qk[:, heads:])
    torch.ops.inferkiln.rope_store(qkv, cos, sin, heads, kv_heads, keys, values, written)
    assert torch.equal(qkv[:, :(heads + kv_heads) * dim].view(tokens, -1, dim), expected_qk)
    assert torch.equal(keys, expected_keys)
    assert torch.equal(values[written], qkv[:, (heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim))

    rows = torch.tensor([[8, 9, 10, 11, 0, 1, 2, 5], [20, 21, 22, 23, 24, 25, 26, 17], [30, 31, 0, 0, 0, 0, 0, 0]])
    positions = torch.tensor([7, 7, 0])
    out = torch.ops.inferkiln.decode_attention(qkv, 0, heads, keys, values, rows, positions, 0.25)
    assert out.dtype == torch.bfloat16
    for s in range(tokens):
        seen = rows[s, :positions[s] + 1]
        q = qkv[s, :heads * dim].view(1, heads, 1, dim).float()
        k, v = (cache.index_select(0, seen).transpose(0, 1).unsqueeze(0).float() for cache in (keys, values))
        expected = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True).flatten()
        assert torch.allclose(out[s].float(), expected, rtol=BF16_STEP, atol=1e-3), s


def test_a_bf16_step_of_decodes_alone_runs_its_layers_in_one_call_with_the_per_op_logits(tiny_model_dir, setup,
                                                                                         monkeypatch):
    """The tiny model in bf16 panels: a step of decodes alone is one decode_layers call, whose
    logits are the same step's within a mixed step (the per-op graph), and near fp32's."""
    tokenizer, _, fp32 = setup
    if not bf16_panels_run_here():
        pytest.skip("the bf16 panels are for x86 CPUs with AVX512-BF16")
    monkeypatch.setattr(cpu_gemm, "suits_bf16", lambda device, dtype: dtype == torch.bfloat16)
    runner = LlamaRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval(), 64, 4, 512,
                         pack_weights=True)
    a = tokenizer("Owls hunt mice in the dark with silent wings.")["input_ids"]
    decode = ([5], [0, 1, 2, 3, 4, 5], len(a))

    def ran(chunks) -> tuple[torch.Tensor, set[str]]:
        runner.rezero()
        with torch.inference_mode():
            runner.forward([(a, [0, 1, 2, 3, 4, 5], 0)])
            with torch.profiler.profile() as profile:
                logits = runner.forward(chunks)
        return logits, {event.name for event in profile.events()}

    alone, alone_ops = ran([decode])
    monkeypatch.setattr(llama_runner, "SPLIT_WIDTH", 0)  # the prompt chunk beside it stays a chunk: the per-op graph
    mixed, mixed_ops = ran([decode, (a[:3], [10], 0)])
    assert "inferkiln::decode_layers" in alone_ops and "inferkiln::decode_layers" not in mixed_ops
    assert torch.allclose(alone[0], mixed[0], atol=0.05, rtol=0), (alone[0] - mixed[0]).abs().max()
    with torch.inference_mode():
        fp32.forward([(a, [0, 1, 2, 3, 4, 5], 0)])
        expected = fp32.forward([decode])
    assert torch.equal(alone.argmax(-1), expected.argmax(-1))


def test_a_narrow_chunk_runs_as_fused_decode_rows_with_a_decode_steps_floats(monkeypatch, panels_chosen):
    """Where the layer ops are fused, a chunk of a few tokens (an n-gram draft's verify) runs as rows of
    the decode step, in one decode_layers call: each token's logits are, bit for bit, those a decode
    step at its position gives, alone or beside another sequence's decode (the matmuls in panels sum
    each column in the same order at any row count; a head left to F.linear, a tied one, does not),
    and near the SDPA path's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(llama_runner, "PACK_MIN_ELEMENTS", 0)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    runner = LlamaRunner(LlamaForCausalLM(config).eval(), 64, 4, 512, pack_weights=True)
    assert runner.graph.fused and runner.head.layout == PANELS
    prompt, draft = [5, 9, 200, 17, 3, 44, 81, 6, 120, 7], [11, 250, 19, 42]
    first, second = list(range(16)), list(range(16, 32))
    with torch.inference_mode(), torch.profiler.profile() as profile:
        runner.forward([(prompt, first, 0), (prompt, second, 0)])
        verified = runner.forward([(draft, first, len(prompt)), (draft[:1], second, len(prompt))],
                                  every_position=[True, False])
    with torch.inference_mode():
        steps = torch.cat([runner.forward([([token], first, len(prompt) + j)]) for j, token in enumerate(draft)])
        alone = runner.forward([(draft[:1], second, len(prompt))])
        monkeypatch.setattr(llama_runner, "SPLIT_WIDTH", 0)  # the chunk through SDPA
        through_sdpa = runner.forward([(draft, first, len(prompt))], every_position=True)
    assert "inferkiln::decode_layers" in {event.name for event in profile.events()}
    assert torch.equal(verified[:4], steps) and torch.equal(verified[4:], alone)
    assert torch.allclose(through_sdpa, steps, atol=ATOL) and torch.equal(through_sdpa.argmax(-1), steps.argmax(-1))


def test_decode_inputs_are_the_graphs_aten_ops_results():
    """Embeddings, rotary cos/sin, written rows, cache rows and positions of a step's decodes (tables of
    unequal lengths, right-padded; blocks scattered through the cache) against the aten ops the graph
    ran for them: the same integers and the same floats. Positions beyond a table are refused."""
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    torch.manual_seed(3)
    embed, cos_table, sin_table = torch.randn(50, 16), torch.randn(40, 8), torch.randn(40, 8)
    block_size, tables, positions, ids = 4, [[7, 2, 9], [5, 0, 0], [3, 8, 0]], [9, 2, 6], [4, 49, 0]
    flat = [block for table in tables for block in table]
    hidden, cos, sin, written, rows, where = torch.ops.inferkiln.decode_inputs(ids, positions, flat, 3, block_size,
                                                                               embed, cos_table, sin_table)
    span = torch.arange(max(positions) + 1)
    expected_rows = torch.tensor(tables).index_select(1, span // block_size) * block_size + span % block_size
    queries = torch.tensor(positions).view(3, 1)
    assert torch.equal(rows, expected_rows) and torch.equal(where, queries)
    assert torch.equal(written, expected_rows.gather(1, queries).flatten())
    assert torch.equal(hidden, F.embedding(torch.tensor(ids), embed))
    assert torch.equal(cos, cos_table[torch.tensor(positions)].unsqueeze(1))
    assert torch.equal(sin, sin_table[torch.tensor(positions)].unsqueeze(1))
    with pytest.raises(RuntimeError, match="beyond its block table"):
        torch.ops.inferkiln.decode_inputs([1], [12], [7, 2, 9], 3, block_size, embed, cos_table, sin_table)
    with pytest.raises(RuntimeError, match="block table"):
        torch.ops.inferkiln.decode_inputs([1, 2], [1, 2], [7, 2, 9], 3, block_size, embed, cos_table, sin_table)


def test_fused_kernels_refuse_rows_outside_the_cache():
    if not panels_run_here():
        pytest.skip("the fused kernels are built with the AVX2 library")
    qkv, keys, values = torch.randn(1, 4 * 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    cos = sin = torch.ones(1, 8)
    attend = torch.ops.inferkiln.decode_attention
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.inferkiln.rope_store(qkv, cos, sin, 2, 1, keys, values, torch.tensor([10]))
    with pytest.raises(RuntimeError, match="out of range"):
        attend(qkv, 0, 2, keys, values, torch.tensor([[0, -1]]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="beyond its rows"):
        attend(qkv, 0, 2, keys, values, torch.tensor([[0, 1]]), torch.tensor([2]), 1.0)
    nothing = attend(qkv, 0, 2, keys, values, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1.0)
    assert nothing.shape == (0, 16), "no rows: nothing to attend, and no task to split"
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.inferkiln.rms_norm(torch.randn(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="x's dtype"):
        torch.ops.inferkiln.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="qkv's dtype"):
        attend(qkv.bfloat16(), 0, 2, keys, values, torch.tensor([[0, 1]]), torch.tensor([1]), 1.0)


def test_the_kernel_is_built_once_and_whole(tmp_path, monkeypatch):
    if not panels_run_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA")
    monkeypatch.setenv("INFERKILN_KERNEL_DIR", str(tmp_path))
    path = cpu_gemm.build(cpu_gemm.library_path())
    assert path.parent == tmp_path and path.name.startswith("cpu_gemm-") and list(tmp_path.iterdir()) == [path]
    monkeypatch.setattr(cpu_gemm, "SOURCES", (*cpu_gemm.SOURCES, tmp_path / "broken.cpp"))
    (tmp_path / "broken.cpp").write_text("this is not C++")
    with pytest.raises(Exception):
        cpu_gemm.build(tmp_path / "cpu_gemm-broken.so")
    assert sorted(tmp_path.iterdir()) == sorted([path, tmp_path / "broken.cpp"]), "a failed build leaves nothing half-written"


def test_the_forward_pass_takes_every_core_only_for_compute_bound_models_on_small_machines(monkeypatch):
    from service import profiles
    from service.engine import torch_engine

    monkeypatch.setattr(profiles.os, "sched_getaffinity", lambda _: set(range(4)))
    assert torch_engine.default_cpu_threads(400_000) == 3, "the tiny model leaves a core to HTTP"
    assert torch_engine.default_cpu_threads(76_000_000) == 4
    monkeypatch.setattr(profiles.os, "sched_getaffinity", lambda _: set(range(profiles.SPARE_CORE_FROM)))
    assert torch_engine.default_cpu_threads(76_000_000) == profiles.SPARE_CORE_FROM - 1, "many cores: one for HTTP"
    monkeypatch.setattr(profiles.os, "sched_getaffinity", lambda _: {0})
    assert torch_engine.default_cpu_threads(400_000) == 1


def test_rope_that_changes_with_length_is_computed_each_step(tiny_model_dir, setup):
    """Dynamic NTK rope: cos/sin come from the model's rotary module for each step's length."""
    tokenizer, _, _ = setup
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, rope_parameters=rope).eval()
    runner = LlamaRunner(model, num_blocks=64, block_size=4, max_len=512)
    assert runner.rope_table is None
    ids = tokenizer("Rivers run to the sea and the sea is never full.")["input_ids"]
    expected, table = reference(model, ids), [30, 1, 4, 8, 9, 2, 11, 12, 13, 14, 15, 16]
    with torch.inference_mode():
        runner.forward([(ids[:5], table, 0)])
        logits = runner.forward([(ids[5:], table, 5)])[0]
    assert torch.allclose(logits, expected[-1], atol=ATOL)


AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("vendor,flags,suits,suits_bf16", [
    ("AuthenticAMD", {"avx2", "fma"}, True, False),  # Zen 2/3: measured
    ("AuthenticAMD", {"avx2", "fma", "avx512f", "avx512_bf16"}, True, True),  # Zen 4: measured
    ("GenuineIntel", {"avx2", "fma"}, True, False),
    ("GenuineIntel", {"avx2", "fma", "avx512f", "avx512_bf16"}, True, False),  # no AMX: not measured
    ("GenuineIntel", {"avx2", "fma", *AMX}, True, True),  # a Xeon with AMX: measured
    ("AuthenticAMD", {"avx2"}, False, False),
    ("", set(), False, False),  # no /proc/cpuinfo
])
def test_the_panels_are_chosen_on_the_cpus_they_were_measured_faster_on(monkeypatch, vendor, flags, suits, suits_bf16):
    monkeypatch.setattr(profiles, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(profiles, "cpu_vendor", lambda: vendor)
    assert cpu_gemm.suits(torch.device("cpu"), torch.float32) is suits
    assert not cpu_gemm.suits(torch.device("cpu"), torch.bfloat16)
    assert not cpu_gemm.suits(torch.device("cuda"), torch.float32)
    assert cpu_gemm.suits_bf16(torch.device("cpu"), torch.bfloat16) is suits_bf16
    assert not cpu_gemm.suits_bf16(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype,flags,upcast", [
    (torch.bfloat16, {"avx512f", "avx512_bf16"}, True),
    (torch.bfloat16, {"avx512_bf16", "amx_tile", "amx_bf16"}, False),
    (torch.float16, {"amx_tile", "amx_bf16"}, True),
    (torch.float32, {"avx512f"}, False),
])
def test_decode_attention_is_upcast_only_on_cpus_without_amx_for_the_type(monkeypatch, dtype, flags, upcast):
    monkeypatch.setattr(profiles, "cpu_flags", lambda: frozenset(flags))
    assert llama_graph.upcasts_decode_attention(torch.device("cpu"), dtype) is upcast
    assert not llama_graph.upcasts_decode_attention(torch.device("cuda"), dtype)


def test_bf16_decodes_upcast_or_not_stay_near_fp32(tiny_model_dir, setup):
    tokenizer, _, fp32 = setup
    runner = LlamaRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval(), 64, 4, 512)
    prompts, decodes = two_sequences(tokenizer)
    with torch.inference_mode():
        fp32.forward(prompts)
        expected = fp32.forward(decodes)
        runner.forward(prompts)
        for upcast in (True, False):
            runner.graph.upcast_decodes = upcast
            logits = runner.forward(decodes)  # bf16 rounding: within 0.07 of fp32 on 2 cores
            assert torch.allclose(logits, expected, atol=0.2), (upcast, (logits - expected).abs().max())
            assert torch.equal(logits.argmax(-1), expected.argmax(-1))
