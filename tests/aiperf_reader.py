"""Reads report run directories with NVIDIA AIPerf's own code; runs in .venv-aiperf (scripts/setup.sh).

    .venv-aiperf/bin/python tests/aiperf_reader.py RUN_DIR [RUN_DIR ...]

Validates profile_export_aiperf.json as AIPerf's JsonExportData (and its input_config as a
BenchmarkConfig), every profile_export.jsonl line as a MetricRecordInfo, then loads the directory
as `aiperf plot` does. Prints, per directory, what AIPerf read, as JSON; exits non-zero on any failure.
"""

import json
import sys
from pathlib import Path

from aiperf.common.models.export_models import JsonExportData
from aiperf.common.models.record_models import MetricRecordInfo
from aiperf.config.config import BenchmarkConfig
from aiperf.plot.core.data_loader import DataLoader


def read(run_dir: Path) -> dict:
    export = JsonExportData.model_validate_json((run_dir / "profile_export_aiperf.json").read_text())
    BenchmarkConfig.model_validate(export.input_config.model_dump(exclude_unset=True))
    records = [MetricRecordInfo.model_validate_json(line)
               for line in (run_dir / "profile_export.jsonl").read_text().splitlines()]
    run = DataLoader().load_run(run_dir)
    metrics = {name: getattr(export, name).model_dump(exclude_none=True)
               for name in JsonExportData.model_fields if hasattr(getattr(export, name), "unit")}
    return {"schema_version": export.schema_version, "model": run.metadata.model,
            "concurrency": run.metadata.concurrency, "request_count": run.metadata.request_count,
            "was_cancelled": export.was_cancelled, "errors": [e.count for e in export.error_summary or []],
            "records": len(records), "loaded_rows": len(run.requests),
            "record_metrics": sorted({name for r in records for name in r.metrics}), "metrics": metrics}


if __name__ == "__main__":
    print(json.dumps({arg: read(Path(arg)) for arg in sys.argv[1:]}, indent=2, default=str))
