# SPDX-License-Identifier: MIT
"""The shipped prompt sets, and which half of them each prompt is in.

    prompts/prompts.jsonl        our own 28 prompts, 7 categories x 4 (make_prompts.py writes it)
    prompts/long_prompts.jsonl   long-context prompts of about 1k, 2k, 4k and 7k tokens
                                 (make_long_prompts.py)

Both are in SpecBench's question.jsonl format: {"question_id", "category", "turns"}, the first turn
the prompt. The split in two halves is a fact about the prompts, so it lives here: every default was
chosen on the tuning half and every table reports the other (RESULTS.md, "Conventions"). bench/,
tools/ and the tests read this package; it imports nothing of the project's but verify (its
one-line error).

    >>> [split_of(i) for i in (1, 2, 3, 4)]
    ['tune', 'report', 'tune', 'report']
    >>> len(load_prompts(SHORT, None, "report"))
    14
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Sequence

import verify

HERE = os.path.dirname(os.path.abspath(__file__))
SHORT = os.path.join(HERE, "prompts.jsonl")
LONG = os.path.join(HERE, "long_prompts.jsonl")


def split_of(question_id: int) -> str:
    """The fixed split of the shipped prompt set: odd question ids are the TUNING half (every default
    was chosen on them), even ids the REPORTING half (every table in README and TUTORIAL is measured
    on them). prompts.jsonl holds four consecutive ids per category, so each category is in both."""
    return "tune" if int(question_id) % 2 else "report"


def load_prompts(path: str, limit: int | None, split: str = "all",
                 categories: Sequence[str] | None = None) -> list[dict]:
    """SpecBench question.jsonl rows -> [{question_id, category, prompt}], the first turn as the
    prompt, only those of `split` (tune / report / all) and of `categories` (None: all), at most
    `limit` per category (in file order). A malformed line is a one-line error, not a traceback."""
    if not os.path.isfile(path):
        raise verify.UserError(f"--prompts {path}: no such file")
    rows = []
    per_cat = defaultdict(int)
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q = {"question_id": row["question_id"], "category": row["category"],
                     "prompt": row["turns"][0]}
            except (ValueError, KeyError, IndexError, TypeError):
                raise verify.UserError(f"{path}:{line_no}: not a SpecBench question (question_id, "
                                       "category, turns)") from None
            if split != "all" and split_of(q["question_id"]) != split:
                continue
            if categories is not None and q["category"] not in categories:
                continue
            if limit is None or per_cat[q["category"]] < limit:
                per_cat[q["category"]] += 1
                rows.append(q)
    if not rows:
        of = f" of category {', '.join(categories)}" if categories else ""
        raise verify.UserError(f"{path}: no prompts{of}")
    return rows
