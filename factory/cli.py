"""The `inferkiln` command line: thin Typer commands over keyword-only functions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="inferkiln: a factory for OpenAI-compatible LLM inference microservices.",
                  no_args_is_help=True, add_completion=False)


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path | None, typer.Option("--out", help="Directory to write; default: the cache.")] = None,
) -> None:
    """Make (or reuse from its cache) the bundled tiny model; print its directory last."""
    from factory.tinymodel import ensure_tiny_model

    typer.echo("making the tiny model (cached after the first run)...", err=True)
    typer.echo(str(ensure_tiny_model(out)))


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="Port for the demo service.")] = 8000,
    once: Annotated[bool, typer.Option("--once", help="Exit after the check instead of serving on.")] = False,
) -> None:
    """Serve the bundled tiny model, check it with the OpenAI client, print a curl line."""
    from factory.demo import run_demo

    raise typer.Exit(run_demo(port=port, once=once, echo=typer.echo))


def main() -> None:
    app()
