"""benchmarks.decode_matmuls' own parts: the step's fused weights, and when inductor is skipped."""

from benchmarks.common import LLAMA_76M
from benchmarks.decode_matmuls import fused_weights, skipped


def test_the_fused_weights_are_the_engines_four_matmuls_a_layer():
    shapes = [tuple(w.shape) for w in fused_weights(LLAMA_76M)]
    assert len(shapes) == 40 and shapes[:4] == [(2304, 768), (768, 768), (4608, 768), (768, 2304)]
    assert sum(out * inp for out, inp in shapes) == 76_677_120  # 307 MB of fp32 weights


def test_grouped_query_attention_narrows_the_qkv_projection():
    config = {**LLAMA_76M, "num_hidden_layers": 1, "num_key_value_heads": 4}
    assert tuple(fused_weights(config)[0].shape) == ((12 + 2 * 4) * 64, 768)


def test_inductor_is_skipped_with_its_reason_where_no_compiler_is_found(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "no C++ compiler" in skipped("inductor_cpp_gemm")
    assert skipped("onednn_packed") is None
