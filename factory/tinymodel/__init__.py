"""The bundled tiny model: a few-layer Llama that memorises the lines of `corpus.txt`.

No model hub is reachable where inferkiln is built and tested, so the project makes its own model:
a byte-level BPE tokenizer trained with `tokenizers` and a small `LlamaForCausalLM` trained for a
few seconds on the shipped corpus, both deterministic from a seed and saved in standard Hugging Face
format. Greedy decoding completes every memorised line, which gives the accuracy tests a known
answer. Builds are cached by a digest of the recipe, the corpus and this builder's version.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from factory.locking import exclusive, replacing_dir
from factory.paths import cache_dir

BUILDER_VERSION = "1"
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
MARKER = "inferkiln-tiny-model.json"
MODEL_NAME = "tiny-llama"  # the directory name, hence the served model name without a manifest

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# Plain turns as `<|role|>content</s>`; calls and their results in the Hermes format
# (service/api/tool_calls.py), which the model never saw in training: constrained decoding writes it.
# Tools are listed as `name(parameter, ...)` only: their full schemas would not fit the 512-token
# context in this small vocabulary, and the grammar holds them anyway.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|><tools>{% for tool in tools %}{% set function = tool['function'] %}"
    "{{ ' ' if not loop.first }}{{ function['name'] }}("
    "{{ ((function['parameters'] or {})['properties'] or {}) | join(', ') }}){% endfor %}</tools>{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|user|><tool_response>\n{{ message['content'] }}\n</tool_response>{{ eos_token }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "<|assistant|>{{ message['content'] or '' }}{% for call in message['tool_calls'] %}"
    "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>{% endfor %}{{ eos_token }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights; its digest names the cache entry."""

    seed: int = 1234
    vocab_size: int = 640
    hidden_size: int = 128  # head_dim 32: vLLM's CPU attention has no kernel for 24
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    train_steps: int = 300
    learning_rate: float = 4e-3


def corpus_lines() -> list[str]:
    return [line.strip() for line in CORPUS_PATH.read_text().splitlines() if line.strip()]


def memorised_pairs() -> list[tuple[str, str]]:
    """(prompt, continuation) for every corpus line: the first half of its words, then the rest.

    The continuation starts with its separating space, so `prompt + continuation` is the line.
    """
    pairs = []
    for line in corpus_lines():
        words = line.split(" ")
        cut = max(2, len(words) // 2)
        pairs.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    return pairs


def recipe_digest(recipe: Recipe = Recipe()) -> str:
    payload = json.dumps(
        {"recipe": asdict(recipe), "corpus": CORPUS_PATH.read_text(), "builder": BUILDER_VERSION,
         "template": CHAT_TEMPLATE},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def ensure_tiny_model(out: Path | None = None, recipe: Recipe = Recipe()) -> Path:
    """Return a directory holding the tiny model, training it only when no valid copy exists.

    The model is built once into the cache; `out` gets a copy of the cached build.
    """
    digest = recipe_digest(recipe)
    cached = cached_model_dir(digest)
    with exclusive(entry_lock(cached)):  # a second caller waits, then finds it built
        if not _is_complete(cached, digest):
            _build_into(cached, recipe, digest)
    if out is None:
        return cached
    out = Path(out)
    if not _is_complete(out, digest):
        with replacing_dir(out, ".tiny-model-") as staging:
            shutil.copytree(cached, staging, dirs_exist_ok=True)
    return out


def cached_model_dir(digest: str) -> Path:
    return cache_dir() / "models" / digest[:16] / MODEL_NAME


def entry_lock(cached: Path) -> Path:
    """The lock of a cache entry (a model's, an adapter's): beside its digest's folder."""
    return cached.parent.with_name(cached.parent.name + ".lock")


def _build_into(target: Path, recipe: Recipe, digest: str) -> None:
    from factory.tinymodel.train import build_model

    with replacing_dir(target, ".tiny-model-") as staging:
        build_model(staging, recipe)
        (staging / MARKER).write_text(json.dumps({"digest": digest, "recipe": asdict(recipe)}))


def _is_complete(path: Path, digest: str, marker_name: str = MARKER) -> bool:
    marker = path / marker_name
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("digest") == digest
    except ValueError:
        return False
