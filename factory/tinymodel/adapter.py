"""LoRA adapters for the tiny model, made with peft: each one learns a task of its own.

The base model completes each corpus line with its own second half. An adapter named N learns to
complete line i with the second half of line i + k (k fixed by N's digest), so its greedy outputs
differ from the base model's on every line and its accuracy has a known answer
(`adapter_pairs`). It is trained with peft's LoRA on every projection the engines adapt, deterministic
from its name, and saved as `PeftModel.save_pretrained` writes it: the layout NIM_PEFT_SOURCE reads.
Builds are cached by a digest of the base model, the recipe and this builder's version.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from factory.locking import exclusive, replacing_dir
from factory.paths import cache_dir
from factory.tinymodel import _is_complete, ensure_tiny_model, entry_lock, memorised_pairs

ADAPTER_BUILDER_VERSION = "2"
MARKER = "inferkiln-tiny-adapter.json"
DEFAULT_NAME = "tiny-lora"
EVAL_FILE = "eval.jsonl"  # beside the adapter: what it was trained to complete, for its accuracy gate


@dataclass(frozen=True)
class AdapterRecipe:
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    train_steps: int = 200
    learning_rate: float = 1e-2


def shift(name: str, lines: int) -> int:
    """How many lines on the adapter's continuations are taken from: 1..lines-1, from its name."""
    return 1 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % (lines - 1)


def adapter_pairs(name: str) -> list[tuple[str, str]]:
    """(prompt, continuation) the adapter named `name` was trained to answer: its accuracy set."""
    pairs = memorised_pairs()
    k = shift(name, len(pairs))
    return [(prompt, pairs[(i + k) % len(pairs)][1]) for i, (prompt, _) in enumerate(pairs)]


def ensure_tiny_adapter(name: str = DEFAULT_NAME, out: Path | None = None, recipe: AdapterRecipe = AdapterRecipe()) -> Path:
    """A directory holding the adapter (adapter_config.json, adapter_model.safetensors), trained once."""
    base = ensure_tiny_model()
    digest = hashlib.sha256(json.dumps({"base": json.loads((base / "inferkiln-tiny-model.json").read_text())["digest"],
                                        "name": name, "recipe": asdict(recipe),
                                        "builder": ADAPTER_BUILDER_VERSION}, sort_keys=True).encode()).hexdigest()
    cached = cache_dir() / "adapters" / digest[:16] / name
    with exclusive(entry_lock(cached)):  # a second caller waits, then finds it trained
        if not _is_complete(cached, digest, MARKER):
            with replacing_dir(cached, ".tiny-adapter-") as staging:
                train_adapter(base, name, recipe, staging)
                (staging / EVAL_FILE).write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                                                         for p, c in adapter_pairs(name)))
                (staging / MARKER).write_text(json.dumps({"digest": digest, "recipe": asdict(recipe)}))
    if out is None:
        return cached
    out = Path(out)
    if not _is_complete(out, digest, MARKER):
        with replacing_dir(out, ".tiny-adapter-") as staging:
            shutil.copytree(cached, staging, dirs_exist_ok=True)
    return out


def random_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int, std: float = 0.3) -> Path:
    """An untrained adapter made and saved by peft, its A and B drawn at random (peft starts B at
    zero, which would change nothing): for tests and benchmarks that need any adapter of a shape."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, std)
    model.save_pretrained(out)
    return out


def train_adapter(base: Path, name: str, recipe: AdapterRecipe, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.tinymodel.train import _pad_batch

    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2**31)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.target_modules), lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM"))
    sequences = [tokenizer(prompt + continuation)["input_ids"] + [tokenizer.eos_token_id]
                 for prompt, continuation in adapter_pairs(name)]
    input_ids, labels, mask = _pad_batch(sequences, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.learning_rate)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a fixed reduction order: the same weights on every machine
    try:
        model.train()
        for _ in range(recipe.train_steps):
            model(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
