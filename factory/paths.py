"""Where the factory keeps caches (rebuildable) and state (the catalog, the local registry's data)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("INFERKILN_CACHE") or Path.home() / ".cache" / "inferkiln")


def state_dir() -> Path:
    return Path(os.environ.get("INFERKILN_HOME") or Path.home() / ".local" / "share" / "inferkiln")


def repo_root() -> Path:
    """The source tree (templates, chart, service code) the factory renders from."""
    return Path(__file__).resolve().parent.parent
