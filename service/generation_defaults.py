"""The model's own sampling defaults: what its generation_config.json sets, applied to the sampling
parameters a request leaves unset, as vLLM's OpenAI server does in its default configuration
(`--generation-config auto`). A Llama 3 Instruct model's file asks for temperature 0.6 and top-p
0.9, and the same request should sample alike whichever engine the profile chose.

vLLM reads the values that differ from transformers' defaults (`GenerationConfig.to_diff_dict`) of
repetition_penalty, presence_penalty, frequency_penalty, temperature, top_k, top_p, min_p and
max_new_tokens (its max_tokens); so does this."""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)


def whole(value: float) -> bool:
    """An integral value (JSON as Python writes it may carry NaN and Infinity, which int() refuses)."""
    return math.isfinite(value) and value == int(value)


# generation_config.json's name -> the request field it is the default of, and the values that field takes
APPLIED = {"temperature": ("temperature", lambda v: 0 <= v <= 2), "top_p": ("top_p", lambda v: 0 < v <= 1),
           "top_k": ("top_k", whole), "min_p": ("min_p", lambda v: 0 <= v <= 1),
           "presence_penalty": ("presence_penalty", lambda v: -2 <= v <= 2),
           "frequency_penalty": ("frequency_penalty", lambda v: -2 <= v <= 2),
           "repetition_penalty": ("repetition_penalty", lambda v: 0 < v < math.inf),
           "max_new_tokens": ("max_tokens", lambda v: whole(v) and v >= 1)}


def sampling_defaults(model_dir: Path) -> dict[str, float | int]:
    """The request fields' defaults the model sets (field name -> value); {} without a generation config."""
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except OSError:  # no generation_config.json
        return {}
    except ValueError as error:  # one transformers refuses (max_new_tokens 0): none of it is applied
        log.warning("the model's generation config is not valid (%s); its sampling defaults are not applied", error)
        return {}
    defaults = {}
    for key, (field, valid) in APPLIED.items():
        value = diff.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not valid(value):
            log.warning("the model's generation config sets %s=%r, not a value a request may give; not applied",
                        key, value)
            continue
        defaults[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    if defaults:
        log.info("sampling defaults from the model's generation config, for requests that leave them unset: %s",
                 ", ".join(f"{key}={value}" for key, value in defaults.items()))
    return defaults
