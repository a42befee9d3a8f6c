"""benchmarks.decode_matmuls' pure parts: the step's fused shapes, and when inductor is skipped."""

from benchmarks.common import LLAMA_76M
from benchmarks.decode_matmuls import fused_shapes, skipped


def test_the_fused_shapes_are_the_engines_four_matmuls_a_layer():
    shapes = fused_shapes(LLAMA_76M)
    assert len(shapes) == 40 and shapes[:4] == [(2304, 768), (768, 768), (4608, 768), (768, 2304)]
    assert sum(out * inp for out, inp in shapes) == 76_677_120  # 307 MB of fp32 weights


def test_grouped_query_attention_narrows_the_qkv_projection():
    config = {**LLAMA_76M, "num_key_value_heads": 4}
    assert fused_shapes(config)[0] == ((12 + 2 * 4) * 64, 768)


def test_inductor_is_skipped_with_its_reason_where_no_compiler_is_found(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "no C++ compiler" in skipped("inductor_cpp_gemm")
    assert skipped("onednn_packed") is None
