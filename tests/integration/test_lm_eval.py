"""lm-eval tasks scored by lm-eval itself against the real service: the bundled task, a spec's own
task directory, and the one-line failures (unknown task, data that is not available offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from factory.spec import AccuracyTask
from factory.tinymodel import memorised_pairs
from factory.verify.lm_eval_tasks import run_tasks


def test_the_bundled_task_scores_the_tiny_model(server):
    [row] = run_tasks(server.url, "tiny-llama", [AccuracyTask(name="inferkiln_tiny_lines", min=0.9)],
                      include_paths=[], endpoint="completions", tokenizer=None)
    assert (row["metric"], row["score"], row["samples"], row["passed"]) == ("exact_match,none", 1.0, 64, True)


def test_a_specs_own_task_gates_on_its_minimum(server, tmp_path):
    """A task directory like a spec's include_path: the right answers pass, wrong ones score 0 and fail."""
    pairs = memorised_pairs()[:6]
    for name, rows in (("right_lines", pairs), ("wrong_lines", [(p, " something else.") for p, _ in pairs])):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in rows))
        (tmp_path / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
            "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
            "doc_to_target: '{{completion}}'\ngeneration_kwargs: {until: ['\\n'], max_gen_toks: 48, do_sample: false}\n"
            "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true, "
            "regexes_to_ignore: ['^\\s+', '\\s+$']}]\n")
    tasks = [AccuracyTask(name="right_lines", min=0.8, limit=4), AccuracyTask(name="wrong_lines", min=0.1)]
    right, wrong = run_tasks(server.url, "tiny-llama", tasks, include_paths=[tmp_path], endpoint="completions",
                             tokenizer=None)
    assert (right["score"], right["samples"], right["passed"]) == (1.0, 4, True)
    assert (wrong["score"], wrong["samples"], wrong["passed"]) == (0.0, 6, False)


def test_unknown_tasks_and_unavailable_data_fail_in_one_line(tmp_path):
    """Run as its own process with the Hub off, as where it cannot be reached (the client's settings
    are read at import); no server is needed: the data is loaded before any request."""
    script = ("import json; from factory.spec import AccuracyTask; from factory.verify.lm_eval_tasks import run_tasks; "
              "print(json.dumps(run_tasks('http://127.0.0.1:9', 'm', [AccuracyTask(name='gsm8k', min=0.5, limit=2), "
              "AccuracyTask(name='no_such_task', min=0.5)], include_paths=[], endpoint='completions', tokenizer=None)))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    gsm8k, unknown = json.loads(out.stdout.splitlines()[-1])
    assert gsm8k["error"].startswith("lm-eval task gsm8k: dataset openai/gsm8k (main) is not available offline")
    assert "\n" not in gsm8k["error"] and "score" not in gsm8k
    assert unknown["error"].startswith("lm-eval has no task 'no_such_task'")
