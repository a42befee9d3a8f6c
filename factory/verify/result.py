"""The test stage's result: the verdict, every gate, the headline numbers and where the report is.

The full harness output stays in the report directory (summary.json); the stages after `test`
read only this model.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class Gate(BaseModel):
    id: str
    passed: bool
    detail: str


class TestReport(BaseModel):
    __test__ = False  # not a pytest test class

    passed: bool
    summary: str
    gates: list[Gate]
    report_dir: Path
    url: str | None = None
    image: str | None = Field(None, description="the image tested, when the harness started it")
    start_to_ready_s: float | None = None
    skipped: dict[str, str] = Field(default_factory=dict, description="checks not run, and why")
    profile: str | None = Field(None, description="the profile the server selected (/v1/metadata)")
    hardware: str | None = Field(None, description="what the image ran on, when the harness started it")
    exact_match: float | None = None
    accuracy: dict[str, float] = Field(default_factory=dict, description="score per lm-eval task")
    output_tokens_per_s: dict[str, float] = Field(default_factory=dict, description="per concurrency level")

    @classmethod
    def from_gates(cls, gates: list[Gate], report_dir: Path, **fields) -> TestReport:
        failed = [g.id for g in gates if not g.passed]
        summary = (f"{len(gates) - len(failed)}/{len(gates)} gates passed"
                   + (f"; failed: {', '.join(failed[:8])}" if failed else "")
                   + (f"; skipped: {', '.join(fields['skipped'])}" if fields.get("skipped") else ""))
        return cls(passed=bool(gates) and not failed, summary=summary, gates=gates, report_dir=report_dir, **fields)

    def failed_gates(self) -> list[Gate]:
        return [g for g in self.gates if not g.passed]
