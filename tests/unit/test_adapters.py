"""The adapter registry's checks and rescans, and the LoRA pool's slots, on small hand-made adapters."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from service.adapters import MLP_MODULES, AdapterError, AdapterRegistry, ModelShape, read_adapter
from service.engine.kv_blocks import block_keys
from service.engine.lora import LoraLimits, LoraPool

SHAPE = ModelShape.from_config({"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "intermediate_size": 24, "num_hidden_layers": 2})


def write_adapter(path, rank=4, modules=("q_proj", "down_proj"), layers=2, config=None, shape=SHAPE):
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(layers):
        for module in modules:
            features_in, features_out = shape.features[module]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.ones(rank, features_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.ones(features_out, rank)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "bias": "none", **(config or {})}))
    return path


def test_a_good_adapter_is_read_with_its_rank_modules_and_scaling(tmp_path):
    adapter = read_adapter(write_adapter(tmp_path / "a"), SHAPE, 8)
    assert (adapter.name, adapter.rank, adapter.scaling) == ("a", 4, 2.0)
    assert adapter.modules == {"q_proj", "down_proj"}
    weights = adapter.load()
    a, b = weights[(1, "down_proj")]
    assert a.shape == (4, 24) and b.shape == (16, 4) and b[0, 0].item() == 2.0  # scaling folded into B


@pytest.mark.parametrize("make,reason", [
    (lambda p: write_adapter(p, rank=16), "rank 16 is above NIM_MAX_LORA_RANK=8"),
    (lambda p: write_adapter(p, layers=3), "adapts layer 2; the base model has 2"),
    (lambda p: write_adapter(p, shape=ModelShape.from_config({"hidden_size": 32, "num_attention_heads": 4,
                                                               "intermediate_size": 24, "num_hidden_layers": 2})),
     "down_proj lora_B of layer 0 is (32, 4), the base model needs (16, 4) (a different base model"),
    (lambda p: write_adapter(p, config={"use_dora": True}), "DoRA is not supported"),
    (lambda p: write_adapter(p, config={"r": 2}), "or r does not match the weights"),
    (lambda p: (write_adapter(p), (p / "adapter_model.safetensors").unlink()), "no adapter_model.safetensors"),
    (lambda p: (write_adapter(p), (p / "adapter_model.safetensors").write_bytes(b"\x10\x00")),
     "adapter_model.safetensors is corrupt or unreadable"),
    (lambda p: (write_adapter(p), (p / "adapter_config.json").write_text("{")), "adapter_config.json cannot be read"),
    (lambda p: write_adapter(p, config={"peft_type": "IA3"}), "peft_type 'IA3' is not LoRA"),
])
def test_a_bad_adapter_is_refused_with_its_reason(tmp_path, make, reason):
    make(tmp_path / "bad")
    with pytest.raises(AdapterError, match=re.escape(reason)):
        read_adapter(tmp_path / "bad", SHAPE, 8)


def test_an_unreadable_adapter_is_left_out_logged_once_and_the_others_served(tmp_path, caplog):
    """A config that cannot even be stat'ed (a symlink loop: unreadable for root too) is one warning,
    not a failed scan."""
    source = tmp_path / "peft"
    write_adapter(source / "good")
    (source / "looped").mkdir()
    (source / "looped" / "adapter_config.json").symlink_to("adapter_config.json")
    registry = AdapterRegistry(source, SHAPE, 8, "base")
    with caplog.at_level(logging.WARNING):
        registry.scan()
        registry.scan()
    assert registry.names() == ["good"]
    assert caplog.text.count("LoRA adapter looped not served: adapter_config.json cannot be read") == 1


def test_a_module_the_engines_do_not_adapt_is_refused(tmp_path):
    path = write_adapter(tmp_path / "a")
    save_file({"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.ones(4, 16),
               "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.ones(16, 4)},
              path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="targets 'rotary', which the engines do not adapt"):
        read_adapter(path, SHAPE, 8)


def test_rescans_add_change_and_remove_and_log_a_refusal_once(tmp_path, caplog):
    source = tmp_path / "peft"
    write_adapter(source / "one")
    write_adapter(source / "bad", rank=16)
    registry = AdapterRegistry(source, SHAPE, 8, "base")
    with caplog.at_level(logging.WARNING):
        added, removed = registry.scan()
        registry.scan()
    assert [a.name for a in added] == ["one"] and removed == []
    assert registry.names() == ["one"]
    assert caplog.text.count("LoRA adapter bad not served: rank 16") == 1
    first = registry.get("one")
    write_adapter(source / "one", rank=2)  # changed in place: a new version
    write_adapter(source / "base")  # the base model's name is not an adapter's
    added, removed = registry.scan()
    assert [a.rank for a in added] == [2] and removed == [first]
    assert registry.names() == ["one"]
    held = registry.get("one")
    shutil.rmtree(source / "one")
    assert registry.scan() == ([], [held])
    assert registry.names() == []


def test_the_pool_evicts_the_least_recently_used_unheld_adapter_and_never_a_held_one(tmp_path):
    adapters = [read_adapter(write_adapter(tmp_path / f"a{i}"), SHAPE, 8) for i in range(3)]
    pool = LoraPool(SHAPE, LoraLimits(max_loras=2, max_cpu_loras=1, max_rank=8), torch.float32, torch.device("cpu"))
    assert pool.acquire(adapters[0]) == 1 and pool.acquire(adapters[1]) == 2
    assert pool.acquire(adapters[2]) is None  # both slots held
    pool.release(adapters[1])
    pool.release(adapters[0])
    assert pool.acquire(adapters[2]) == 2  # a1 was released first: least recently used
    assert pool.acquire(adapters[0]) == 1  # still loaded
    # slot 1's qkv block (the first 3*8 columns) holds a0's q_proj A (ones, rank 4 of 8); k and v stay zero
    qkv_a = pool.a[0]
    assert qkv_a[:, :4].eq(1).all() and qkv_a[:, 4:24].eq(0).all()
    assert pool.columns[0].tolist() == [1] * 24 + [2] * 24  # each column's slot, for the step's masks


def test_prefix_cache_keys_of_different_adapters_differ():
    tokens = list(range(40))
    assert block_keys(tokens, 16) != block_keys(tokens, 16, root=hash(("a", (1,))))
    assert block_keys(tokens, 16, root=5) == block_keys(tokens, 16, root=5)
