"""The README's main-job command, as a user runs it (with --once so it returns)."""

from typer.testing import CliRunner

from factory.cli import app
from service.launcher import free_port


def test_demo_serves_the_tiny_model_and_prints_a_curl_line(tiny_model_dir):
    result = CliRunner().invoke(app, ["demo", "--once", "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    assert "chat check:" in result.output and "(ok)" in result.output
    assert "curl -s http://127.0.0.1:" in result.output and '"model": "tiny-llama"' in result.output


def test_tiny_model_command_prints_the_directory_last(tiny_model_dir):
    result = CliRunner().invoke(app, ["tiny-model"])
    assert result.exit_code == 0
    assert result.output.strip().splitlines()[-1] == str(tiny_model_dir)
