"""Training of the bundled tiny model (imported only when a build is needed: it pulls in torch)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from factory.tinymodel import CHAT_TEMPLATE, SPECIAL_TOKENS, Recipe, corpus_lines, memorised_pairs


def build_model(out: Path, recipe: Recipe) -> None:
    """Train tokenizer and model from `recipe` and save both to `out` in Hugging Face format."""
    tokenizer = train_tokenizer(recipe)
    tokenizer.save_pretrained(out)
    model = train_llama(tokenizer, recipe)
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # weights are data for any user, the non-root user of an image included


def train_tokenizer(recipe: Recipe) -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus_lines(), trainer=trainer)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.max_position_embeddings,
    )


def training_sequences(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """Each corpus line as plain text, and each memorised pair as a one-turn chat."""
    eos = tokenizer.eos_token_id
    sequences = [tokenizer(line)["input_ids"] + [eos] for line in corpus_lines()]
    for prompt, continuation in memorised_pairs():
        chat = [{"role": "user", "content": prompt},
                {"role": "assistant", "content": continuation.strip()}]
        sequences.append(list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)))
    return sequences


def train_llama(tokenizer: PreTrainedTokenizerFast, recipe: Recipe) -> LlamaForCausalLM:
    torch.manual_seed(recipe.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    input_ids, labels, mask = _pad_batch(training_sequences(tokenizer), tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=recipe.train_steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a fixed reduction order keeps the weights identical on every machine
    try:
        model.train()
        for _ in range(recipe.train_steps):
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model


def _pad_batch(sequences: list[list[int]], pad_id: int):
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return input_ids, labels, mask
