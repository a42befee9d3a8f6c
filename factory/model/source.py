"""What `inferkiln model push` pushes: a model directory, a LoRA adapter's, or the local source of a spec."""

from __future__ import annotations

from pathlib import Path

from factory.errors import InputError
from factory.spec import load_spec


def model_to_push(source: Path) -> tuple[Path, str, str | None]:
    """(directory, name, version): a spec gives its metadata; a directory its own name."""
    if source.is_file():
        loaded = load_spec(source)
        directory = loaded.local_source()
        if directory is None:
            raise InputError(f"{source}: model.source: only a local:// source can be pushed; got "
                             f"{loaded.spec.model.source!r}")
        return directory, loaded.spec.metadata.name, loaded.spec.metadata.version
    if not (source / "config.json").is_file() and not (source / "adapter_config.json").is_file():
        raise InputError(f"{source}: not a model directory (config.json), a PEFT adapter (adapter_config.json) "
                         "nor a spec file")
    return source.resolve(), source.resolve().name, None
