import argparse

import pytest

from service.settings import Settings, SettingsError, add_settings_arguments, load_settings


def test_defaults_match_the_contract():
    settings = load_settings({}, {})
    assert settings.server_port == 8000
    assert settings.manifest_path == "/opt/nim/etc/default/model_manifest.yaml"
    assert settings.cache_path == "/opt/nim/.cache"
    assert settings.log_level == "INFO" and settings.jsonl_logging is False
    assert settings.max_num_seqs is None  # filled from the profile later


def test_cli_beats_environment_beats_default():
    env = {"NIM_SERVER_PORT": "9000", "NIM_LOG_LEVEL": "debug", "NIM_JSONL_LOGGING": "1"}
    assert load_settings({}, env).server_port == 9000
    assert load_settings({"server_port": "9100"}, env).server_port == 9100
    assert load_settings({}, env).log_level == "DEBUG"
    assert load_settings({}, env).jsonl_logging is True


def test_empty_environment_values_count_as_unset():
    assert load_settings({}, {"NIM_SERVER_PORT": ""}).server_port == 8000


@pytest.mark.parametrize("cli,env,fragment", [
    ({}, {"NIM_LOG_LEVEL": "LOUD"}, "NIM_LOG_LEVEL='LOUD'"),
    ({"server_port": "x"}, {}, "--port='x'"),
    ({}, {"NIM_MAX_MODEL_LEN": "-5"}, "NIM_MAX_MODEL_LEN='-5'"),
    ({}, {"NIM_DISABLE_MODEL_DOWNLOAD": "perhaps"}, "NIM_DISABLE_MODEL_DOWNLOAD"),
])
def test_bad_values_name_their_source(cli, env, fragment):
    with pytest.raises(SettingsError) as err:
        load_settings(cli, env)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_log_level_error_lists_allowed_values():
    with pytest.raises(SettingsError) as err:
        load_settings({}, {"NIM_LOG_LEVEL": "LOUD"})
    for level in ("DEBUG", "INFO", "WARNING", "ERROR"):
        assert level in str(err.value)


def test_every_field_has_a_flag_an_env_and_a_description():
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    assert vars(parser.parse_args([])) == {}  # unset flags never mask the environment
    for name, field in Settings.model_fields.items():
        assert field.description and field.json_schema_extra["env"].startswith("NIM_"), name


def test_secrets_are_masked():
    settings = load_settings({}, {"NIM_API_KEY": "s3cret"})
    assert settings.api_key == "s3cret"
    assert "s3cret" not in repr(settings.public_dict())
