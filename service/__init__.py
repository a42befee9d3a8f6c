"""The inferkiln runtime: an OpenAI-compatible, NIM-style inference microservice."""

# The one place the release version is written: pyproject.toml reads it, and images carry the
# `service` package itself (not an installed distribution), so metadata look-ups would miss it.
__version__ = "0.1.0"
