"""checkov's Kubernetes checks on every value set a chart renders; each failure fails the chart
unless it is an accepted exception below, which says why it is accepted.

One checkov run covers the whole value matrix (one file per value set), since its start-up is most
of its time.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from factory.chart.helm import ChartError
from factory.stack import checkov_binary

# check id -> why the chart does otherwise (checkov 3.3.30's ids; see factory.stack.CHECKOV_SPEC).
ACCEPTED = {
    "CKV_K8S_15": "imagePullPolicy IfNotPresent, as NVIDIA's nim-llm chart: the tag is a digest of the image's inputs "
                  "(immutable by construction) or image.digest pins it, so Always would only re-pull a multi-GB "
                  "image at every pod start and keep pods from starting while the registry is down",
    "CKV_K8S_43": "the chart is validated and packaged before its image is pushed, so no registry digest exists "
                  "yet; its tag is a digest of the image's inputs, and image.digest pins the pushed image where "
                  "ops know it",
}


def checkov_failures(value_sets: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    """Failed checks not in ACCEPTED, per value set, one line each."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, objects in value_sets.items():
            (Path(tmp) / f"{name}.yaml").write_text(yaml.safe_dump_all(objects))
        done = subprocess.run([checkov_binary(), "--directory", tmp, "--framework", "kubernetes", "--output", "json",
                               "--quiet", "--compact", "--skip-check", ",".join(ACCEPTED)],
                              capture_output=True, text=True, timeout=600)
    if done.returncode not in (0, 1) or not done.stdout.strip():  # 1: some check failed
        raise ChartError(f"checkov did not run ({done.returncode}): {done.stderr.strip()[-2000:]}")
    reports = json.loads(done.stdout)
    failures: dict[str, list[str]] = {name: [] for name in value_sets}
    for report in reports if isinstance(reports, list) else [reports]:
        for failed in (report.get("results") or {}).get("failed_checks", []):
            name = Path(failed["file_path"]).stem
            failures.setdefault(name, []).append(
                f"checkov {failed['check_id']} ({failed['check_name']}): {failed['resource']}")
    return failures
