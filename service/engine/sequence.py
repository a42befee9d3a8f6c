"""Per-sequence output handling shared by engines: incremental detokenization and stop conditions."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable

from service.engine.base import ChoiceDelta, SamplingParams, TokenLogprob

# Prompt tokens kept as context when decoding the first output tokens, so tokenizers that drop a
# leading space at the start of a text (SentencePiece) still produce it mid-sentence.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text deltas whose concatenation equals decoding all output tokens at once.

    Decodes a small window of tokens and emits only the new suffix, holding back text that ends in
    an incomplete UTF-8 sequence (U+FFFD) until the next token completes it.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special: bool = True) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.size = len(tokenizer)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < self.size:  # a padded row of the model's vocabulary: no text, as in vLLM
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is held back, emitted at the end of the sequence."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class ByteLevelDetokenizer:
    """The same text as `IncrementalDetokenizer` for byte-level BPE vocabularies, at O(1) a token.

    Each token stands for fixed bytes, so a table from id to bytes and an incremental UTF-8 decoder
    replace two `decode()` calls per token.
    """

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        try:
            piece = self.table[token_id]
        except IndexError:  # a padded row of the model's vocabulary, past the tokenizer's: no text, as in vLLM
            piece = b""
        return self.decoder.decode(piece)

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_table(tokenizer, skip_special: bool = True) -> list[bytes] | None:
    """Id -> bytes for tokenizers whose decode() is plain byte-level; None where it is not. Special
    tokens are b"" where `skip_special`, as decode(skip_special_tokens=True) drops them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if (json.loads(backend.to_str()).get("decoder") or {}).get("type") != "ByteLevel":
        return None
    to_byte = {char: byte for byte, char in _bytes_to_unicode().items()}
    added = tokenizer.added_tokens_decoder
    table = []
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in added:  # added tokens hold plain text
            table.append(added[token_id].content.encode())
        elif piece is None or any(char not in to_byte for char in piece):
            return None
        else:
            table.append(bytes(to_byte[char] for char in piece))
    return _special_blanked(table, tokenizer) if skip_special else table


def _special_blanked(table: list[bytes], tokenizer) -> list[bytes]:
    """A copy of `table` (the same bytes objects) whose special tokens write nothing."""
    blanked = list(table)
    for token_id, token in tokenizer.added_tokens_decoder.items():
        if token.special and token_id < len(blanked):
            blanked[token_id] = b""
    return blanked


Detokenizer = IncrementalDetokenizer | ByteLevelDetokenizer


def detokenizer_factory(tokenizer) -> Callable[[list[int], bool], Detokenizer]:
    """Pick the fastest exact detokenizer for this tokenizer once; call the result per sequence with
    its prompt and whether special tokens are skipped (vLLM's skip_special_tokens)."""
    written = byte_level_table(tokenizer, skip_special=False)
    if written is None:
        return lambda prompt_ids, skip_special=True: IncrementalDetokenizer(tokenizer, prompt_ids, skip_special)
    skipped = _special_blanked(written, tokenizer)
    return lambda prompt_ids, skip_special=True: ByteLevelDetokenizer(skipped if skip_special else written)


class SequenceOutput:
    """One choice of a request: its tokens, text, and when it stops (stop strings held back)."""

    def __init__(self, index: int, detokenizer: Detokenizer,
                 params: SamplingParams, eos_ids: frozenset[int], max_new_tokens: int) -> None:
        self.index = index
        self.params = params
        self.detok = detokenizer
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` already emitted
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, logprob: TokenLogprob | None) -> ChoiceDelta:
        """Add a sampled token and return what the client may see now."""
        self.token_ids.append(token_id)
        delta = ChoiceDelta(self.index, token_ids=[token_id], logprobs=[logprob] if logprob else [])
        if token_id in self.stop_ids:
            # The stop token is counted in usage; its text is shown only where asked for, as in vLLM.
            self.finish_reason, delta.stop_reason = "stop", (token_id if token_id in self.params.stop_token_ids else None)
            if self.params.include_stop_str_in_output:
                self.text += self.detok.add(token_id)
            self.text += self.detok.flush()
        else:
            before = len(self.text)
            self.text += self.detok.add(token_id)
            if self._match_stop_string(delta, before):
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                before = len(self.text)
                self.text += self.detok.flush()
                self._match_stop_string(delta, before)
        delta.text = self._take_text()
        delta.finish_reason = self.finish_reason
        return delta

    def finish(self, reason: str) -> ChoiceDelta:
        """End the sequence from outside (abort, error) and flush its text."""
        self.finish_reason = reason
        return ChoiceDelta(self.index, text=self._take_text(), finish_reason=reason)

    def _match_stop_string(self, delta: ChoiceDelta, before: int) -> bool:
        """Whether a stop string ends in the text added after `before` characters (as vLLM looks,
        only once the choice has more than min_tokens tokens); the text is cut at it."""
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return False
        hits = [(pos, s) for s in self.params.stop if (pos := self.text.find(s, max(0, before - len(s) + 1))) != -1]
        if not hits:
            return False
        pos, stop = min(hits)
        self.text = self.text[:pos + len(stop) if self.params.include_stop_str_in_output else pos]
        delta.stop_reason = stop
        return True

    def _take_text(self) -> str:
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - max(self.hold - 1, 0))
        chunk, self.sent = self.text[self.sent:end], end
        return chunk
