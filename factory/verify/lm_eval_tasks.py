"""Accuracy on lm-evaluation-harness tasks, scored by lm-eval itself against the server's URL
(its `local-completions` or `local-chat-completions` model), each gated on a minimum score.

Standard tasks (gsm8k, mmlu, ...) fetch their data from the Hugging Face Hub; where it is neither
cached nor reachable, the task fails with one line naming the dataset. The bundled tiny model's
lines ship as a local task (factory/tinymodel/lm_eval_tasks), always on the include path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from factory.spec import AccuracyTask

BUNDLED_TASKS = Path(__file__).parent.parent / "tinymodel" / "lm_eval_tasks"
ENDPOINTS = {"completions": ("local-completions", "/v1/completions"),
             "chat": ("local-chat-completions", "/v1/chat/completions")}


def task_manager(names: list[str], include_paths: list[Path]):
    """lm-eval's task index; its built-in tasks (a 10 s scan) only when a name is not found locally."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=False)
    if all(name in local.all_tasks for name in names):
        return local
    return TaskManager(include_path=[str(p) for p in include_paths])


def model_args(url: str, model: str, endpoint: str, tokenizer: Path | None, concurrency: int) -> dict:
    """Prompts go as text, so the server tokenizes them as for any client (BOS included). A local
    tokenizer, when there is one, lets lm-eval count context lengths (loglikelihood tasks need it)."""
    args = {"model": model, "base_url": url + ENDPOINTS[endpoint][1], "tokenized_requests": False,
            "num_concurrent": concurrency, "max_retries": 1, "timeout": 300}
    if tokenizer is not None:
        return args | {"tokenizer_backend": "huggingface", "tokenizer": str(tokenizer)}
    return args | {"tokenizer_backend": "none"}


def unavailable(manager, name: str, exc: Exception) -> str:
    """One line: which dataset the task could not load, and why."""
    cfg = manager.task_index[name].cfg or {}
    dataset = cfg.get("dataset_path") or "its data"
    dataset += f" ({cfg['dataset_name']})" if cfg.get("dataset_name") else ""
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    return (f"lm-eval task {name}: dataset {dataset} is not available offline ({reason}); "
            "put it in the Hugging Face cache (HF_HOME) or run where the Hub is reachable")


def pick_score(scores: dict, metric: str | None) -> tuple[str, float] | None:
    """`metric` as lm-eval reports it ("exact_match,strict-match") or by its name alone; by default the
    task's first metric."""
    keys = [k for k in scores if "," in k and "_stderr," not in k and isinstance(scores[k], int | float)]
    if metric is not None:
        keys = [k for k in keys if k == metric or k.split(",")[0] == metric]
    return (keys[0], float(scores[keys[0]])) if keys else None


def run_task(manager, task: AccuracyTask, args: dict, endpoint: str) -> dict:
    import lm_eval

    row: dict = {"task": task.name, "min": task.min, "limit": task.limit}
    if task.name not in manager.all_tasks:
        return row | {"error": f"lm-eval has no task {task.name!r} (see `lm-eval ls tasks`, or add its YAML "
                               "under tests.accuracy.include_path)"}
    try:
        manager.load([task.name])
    except Exception as exc:  # datasets and the Hub raise many kinds; each means the data is not there
        return row | {"error": unavailable(manager, task.name, exc)}
    results = lm_eval.simple_evaluate(
        model=ENDPOINTS[endpoint][0], model_args=args, tasks=[task.name], task_manager=manager, limit=task.limit,
        num_fewshot=task.num_fewshot, apply_chat_template=endpoint == "chat", log_samples=False)
    picked = pick_score(results["results"].get(task.name, {}), task.metric)
    if picked is None:
        return row | {"error": f"lm-eval task {task.name} reported no metric {task.metric or ''}".rstrip()}
    metric, score = picked
    samples = sum(n["effective"] for n in results.get("n-samples", {}).values())
    return row | {"metric": metric, "score": score, "samples": samples, "passed": score >= task.min}


def run_tasks(url: str, model: str, tasks: list[AccuracyTask], *, include_paths: list[Path], endpoint: str,
              tokenizer: Path | None, concurrency: int = 8) -> list[dict]:
    """One row per task: its score against its minimum, or the one-line reason it could not run."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = task_manager([t.name for t in tasks], [BUNDLED_TASKS, *include_paths])
    args = model_args(url, model, endpoint, tokenizer, concurrency)
    return [run_task(manager, task, args, endpoint) for task in tasks]
