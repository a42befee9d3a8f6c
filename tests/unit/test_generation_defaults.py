import json
import logging

from service.generation_defaults import sampling_defaults


def write(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_no_generation_config_sets_nothing(tmp_path):
    assert sampling_defaults(tmp_path) == {}


def test_the_values_vllm_reads_become_the_request_fields_defaults(tmp_path):
    """Llama 3 Instruct's file, plus the other keys vLLM reads (max_new_tokens is max_tokens)."""
    model = write(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6,
                             "top_p": 0.9, "top_k": 20, "presence_penalty": 0.5, "max_new_tokens": 256,
                             "repetition_penalty": 1.05, "min_p": 0.1})
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "presence_penalty": 0.5,
                                        "max_tokens": 256, "repetition_penalty": 1.05, "min_p": 0.1}


def test_what_the_file_sets_is_applied_and_nothing_else(tmp_path):
    """With transformers 5 (vLLM's environment and ours) a value the file sets counts even where it
    was transformers' old default (top_k 50), and a file of token ids alone sets nothing."""
    assert sampling_defaults(write(tmp_path, {"temperature": 1.0, "top_k": 50})) == {"temperature": 1.0, "top_k": 50}
    assert sampling_defaults(write(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})) == {}


def test_a_value_no_request_could_send_is_said_and_left_out(tmp_path, caplog):
    model = write(tmp_path, {"temperature": 0.7, "repetition_penalty": 0, "min_p": 1.5, "top_p": 0.0,
                             "top_k": 2.5, "presence_penalty": 5, "frequency_penalty": "much"})
    with caplog.at_level(logging.WARNING, logger="service.generation_defaults"):
        assert sampling_defaults(model) == {"temperature": 0.7}
    said = caplog.text
    assert all(part in said for part in ("top_p=0.0", "top_k=2.5", "presence_penalty=5", "frequency_penalty='much'",
                                         "repetition_penalty=0", "min_p=1.5"))


def test_a_generation_config_transformers_refuses_sets_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="service.generation_defaults"):
        assert sampling_defaults(write(tmp_path, {"temperature": 0.7, "max_new_tokens": 0})) == {}
    assert "max_new_tokens" in caplog.text


def test_a_count_that_is_not_finite_is_left_out_not_a_failed_start(tmp_path, caplog):
    """JSON as Python writes it may carry NaN and Infinity, and transformers reads them."""
    (tmp_path / "generation_config.json").write_text('{"top_k": NaN, "max_new_tokens": Infinity, "temperature": '
                                                      'Infinity, "top_p": 0.5}')
    with caplog.at_level(logging.WARNING, logger="service.generation_defaults"):
        assert sampling_defaults(tmp_path) == {"top_p": 0.5}
    assert all(part in caplog.text for part in ("top_k=nan", "max_new_tokens=inf", "temperature=inf"))
