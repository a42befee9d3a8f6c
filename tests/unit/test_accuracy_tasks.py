"""The accuracy settings: lm-eval tasks in specs and on the command line, how a score is picked
from lm-eval's results, and the bundled task's data (the tiny model's lines, kept in step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.cli import task_option
from factory.errors import InputError
from factory.spec import AccuracyTask
from factory.spec import Tests as SpecTests
from factory.tinymodel import memorised_pairs
from factory.verify.harness import HarnessConfig
from factory.verify.lm_eval_tasks import BUNDLED_TASKS, pick_score

GSM8K = {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.1,
         "exact_match,flexible-extract": 0.75, "exact_match_stderr,flexible-extract": 0.1}


@pytest.mark.parametrize("metric,expected", [
    (None, ("exact_match,strict-match", 0.5)),
    ("exact_match", ("exact_match,strict-match", 0.5)),
    ("exact_match,flexible-extract", ("exact_match,flexible-extract", 0.75)),
    ("acc", None),
])
def test_the_score_is_the_named_metric_or_the_first(metric, expected):
    assert pick_score(GSM8K, metric) == expected


def test_task_option_parses_name_min_and_limit():
    assert task_option("gsm8k:0.75:250") == AccuracyTask(name="gsm8k", min=0.75, limit=250)
    assert task_option("inferkiln_tiny_lines:0.9") == AccuracyTask(name="inferkiln_tiny_lines", min=0.9)
    for bad in ("gsm8k", "gsm8k:high", "gsm8k:1.5", "gsm8k:0.5:0"):
        with pytest.raises(InputError, match="NAME:MIN"):
            task_option(bad)


def test_a_specs_include_path_is_relative_to_the_spec(tmp_path):
    tests = SpecTests.model_validate({"accuracy": {"tasks": [{"name": "mine", "min": 0.5}], "include_path": "tasks",
                                               "endpoint": "chat"}})
    config = HarnessConfig.from_tests(tests, base=tmp_path)
    assert (config.task_paths, config.endpoint, config.tasks[0].name) == ([tmp_path / "tasks"], "chat", "mine")
    assert HarnessConfig.from_tests(SpecTests()).tasks == []  # `test --url` without --task: skipped, with a reason


def test_the_bundled_task_holds_the_tiny_models_lines():
    rows = [json.loads(line) for line in (BUNDLED_TASKS / "inferkiln_tiny_lines.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["completion"]) for r in rows] == memorised_pairs()
    assert "task: inferkiln_tiny_lines" in Path(BUNDLED_TASKS / "inferkiln_tiny_lines.yaml").read_text()
