import hashlib
import json

import pytest

from factory.tinymodel import (MARKER, Recipe, cached_model_dir, corpus_lines, ensure_tiny_model, entry_lock,
                               memorised_pairs, recipe_digest)
from factory.tinymodel import train
from tests.concurrency import after_the_first


def test_pairs_split_every_line():
    pairs = memorised_pairs()
    assert len(pairs) == len(corpus_lines()) >= 50
    assert all(prompt + rest == line for (prompt, rest), line in zip(pairs, corpus_lines()))
    assert len({p for p, _ in pairs}) == len(pairs), "prompts are unambiguous"


def test_recipe_digest_changes_with_the_recipe():
    assert recipe_digest(Recipe()) != recipe_digest(Recipe(seed=1))


def test_training_is_deterministic_and_cached(tmp_path, monkeypatch):
    quick = Recipe(train_steps=3, hidden_size=32, intermediate_size=64, num_layers=1)
    monkeypatch.setenv("INFERKILN_CACHE", str(tmp_path / "cache-a"))

    def weights_digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    first = ensure_tiny_model(tmp_path / "a", quick)
    monkeypatch.setenv("INFERKILN_CACHE", str(tmp_path / "cache-b"))  # a second, independent training
    second = ensure_tiny_model(tmp_path / "b", quick)
    assert weights_digest(first) == weights_digest(second)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    marker = json.loads((first / MARKER).read_text())
    assert marker["digest"] == recipe_digest(quick)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "a", quick) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime, "a cached model is not rebuilt"


def test_a_second_caller_waits_for_the_training_under_way_and_takes_its_model(tmp_path, monkeypatch):
    """The demo and the test suite on one fresh machine want the same tiny model: the second waits on
    its cache entry's lock and trains nothing (here a training would fail), then copies the first's."""
    monkeypatch.setenv("INFERKILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(train, "build_model", lambda *_: pytest.fail("trained a second time"))
    digest = recipe_digest(Recipe())
    cached = cached_model_dir(digest)

    def first():
        cached.mkdir(parents=True)
        (cached / "config.json").write_text("{}")
        (cached / MARKER).write_text(json.dumps({"digest": digest}))

    out = after_the_first(entry_lock(cached), lambda: ensure_tiny_model(tmp_path / "out"), first)
    assert out == tmp_path / "out" and (out / "config.json").read_text() == "{}"


def test_saved_in_hugging_face_format(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_model_dir / name).is_file(), name
    assert AutoConfig.from_pretrained(tiny_model_dir).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<s><|user|>hi</s><|assistant|>"
