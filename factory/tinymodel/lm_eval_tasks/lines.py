"""The tasks' data: the JSONL beside this file, which lm-eval cannot locate from a relative path."""

from pathlib import Path

import datasets

DISTRACTOR_OFFSETS = (1, 7, 13)  # other lines' rests, the same for every run


def _records() -> list[dict]:
    return datasets.Dataset.from_json(str(Path(__file__).with_name("inferkiln_tiny_lines.jsonl"))).to_list()


def load(**_metadata) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_records())})


def load_choices(**_metadata) -> datasets.DatasetDict:
    """Each line's first half with four rests: its own, at position i % 4, and three others."""
    records, rows = _records(), []
    for i, record in enumerate(records):
        others = [records[(i + offset) % len(records)]["completion"] for offset in DISTRACTOR_OFFSETS]
        answer = i % 4
        rows.append({"prompt": record["prompt"], "choices": others[:answer] + [record["completion"]] + others[answer:],
                     "answer": answer})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
