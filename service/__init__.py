"""The inferkiln runtime: an OpenAI-compatible, NIM-style inference microservice."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("inferkiln")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
