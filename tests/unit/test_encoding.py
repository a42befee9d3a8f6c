"""The prompt encoder against transformers' own call, on the real tiny-model tokenizer."""

from service.api.encoding import prompt_encoder

TEXTS = ["", "the", " leading space", "trailing space ", "Hello, world! 123 4567.89", "naïve café — 東京 🙂",
         "tabs\tand\nnew\n\nlines", "<s> looks special </s>", "<unk><s>", "a  b   c    d", "word " * 300]


def test_the_fast_path_gives_transformers_ids(tokenizer):
    encode = prompt_encoder(tokenizer)
    assert encode.__name__ == "fast", "the bundled tokenizer's backend agrees with transformers on the probe"
    for text in TEXTS:
        assert encode(text) == tokenizer(text)["input_ids"], text
        assert encode(text, False) == tokenizer(text, add_special_tokens=False)["input_ids"], text
    assert encode("the", True)[0] == tokenizer.bos_token_id != encode("the", False)[0]


def test_it_leaves_the_tokenizer_as_it_was(tokenizer):
    """The encoder's backend is a copy: transformers' truncation of the original still works."""
    encode = prompt_encoder(tokenizer)
    assert tokenizer("word " * 50, truncation=True, max_length=8)["input_ids"] == tokenizer("word " * 50)["input_ids"][:8]
    assert len(encode("word " * 50)) == len(tokenizer("word " * 50)["input_ids"])


class Wrapped:
    """A test double for a tokenizer whose transformers class adds to what its backend does (an id
    after every prompt here); none of the bundled ones does, so it is made up."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.backend_tokenizer = tokenizer, tokenizer.backend_tokenizer

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.inner(text, add_special_tokens=add_special_tokens)["input_ids"] + [0]}


def test_where_the_backend_disagrees_it_is_transformers(tokenizer):
    encode = prompt_encoder(Wrapped(tokenizer))
    assert encode("the") == tokenizer("the")["input_ids"] + [0]
