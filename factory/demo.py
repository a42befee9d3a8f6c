"""`inferkiln demo`: the main job on the embedded default model.

Today it serves the bundled tiny model with the runtime and checks it with the official OpenAI
client; the factory stages (image build, chart, harness, publish) join it as they land.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from factory.tinymodel import ensure_tiny_model, memorised_pairs


def run_demo(*, port: int, once: bool, echo: Callable[[str], None]) -> int:
    from openai import OpenAI

    from service.launcher import ServerProcess

    echo("1/3 making the tiny model (cached after the first run)...")
    model_dir = ensure_tiny_model()
    log_path = Path(tempfile.mkdtemp(prefix="inferkiln-demo-")) / "service.log"
    echo(f"2/3 starting the runtime on port {port} (log: {log_path})...")
    with ServerProcess(["--model", str(model_dir)], port=port, log_path=log_path) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        prompt, expected = memorised_pairs()[0]
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=32)
        answer = reply.choices[0].message.content
        echo(f"3/3 chat check: {prompt!r} -> {answer!r} ({'ok' if answer == expected.strip() else 'MISMATCH'})")
        echo("try it:")
        echo(f"  curl -s {server.url}/v1/chat/completions -H 'Content-Type: application/json' "
             f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{prompt}\"}}], "
             "\"temperature\": 0}'")
        if answer != expected.strip():
            return 1
        if not once:
            echo("serving until Ctrl-C...")
            try:
                server.proc.wait()
            except KeyboardInterrupt:
                pass
    return 0
