"""The model's own sampling defaults: what its generation_config.json sets, applied to the sampling
parameters a request leaves unset, as vLLM's OpenAI server does in its default configuration
(`--generation-config auto`). A Llama 3 Instruct model's file asks for temperature 0.6 and top-p
0.9, and the same request should sample alike whichever engine the profile chose.

vLLM reads the values that differ from transformers' defaults (`GenerationConfig.to_diff_dict`) of
repetition_penalty, presence_penalty, frequency_penalty, temperature, top_k, top_p, min_p and
max_new_tokens (its max_tokens). The torch engine has no repetition penalty and no min-p: where the
file sets them they are said at start-up, and not applied."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# generation_config.json's name -> the request field it is the default of, and the values that field takes
APPLIED = {"temperature": ("temperature", lambda v: v >= 0), "top_p": ("top_p", lambda v: 0 < v <= 1),
           "top_k": ("top_k", lambda v: v == int(v)), "presence_penalty": ("presence_penalty", lambda v: -2 <= v <= 2),
           "frequency_penalty": ("frequency_penalty", lambda v: -2 <= v <= 2),
           "max_new_tokens": ("max_tokens", lambda v: v == int(v) and v >= 1)}
NOT_APPLIED = ("repetition_penalty", "min_p")  # vLLM applies them; the torch engine cannot


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
    ignored = {key: diff[key] for key in NOT_APPLIED if diff.get(key) is not None}
    if ignored:
        log.warning("the model's generation config sets %s, which the torch engine does not apply (vLLM would)",
                    ", ".join(f"{key}={value}" for key, value in ignored.items()))
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
