# SPDX-License-Identifier: MIT
"""Writes prompts/long_prompts.jsonl: long-context prompts (about 1k, 2k, 4k and 7k tokens of the default model's
tokenizer) in SpecBench's question.jsonl format, for FAFO at long context (TUTORIAL.md §5.7).

Each prompt is documentation followed by a question about it (summarization / retrieval over a long passage).
The passages are the plain-text help pages (`pydoc`) of Python standard-library modules, rendered by Python
3.11: text from CPython, distributed under the Python Software Foundation License Version 2, which allows
copying and redistribution with the licence notice kept (https://docs.python.org/3/license.html). The file
paths pydoc prints are removed. No module is used twice, so the prompts share no passage, and none of this
text is in prompts/prompts.jsonl (the set every other default was tuned on).

Categories are the context lengths ("1k" ... "7k"), four prompts each, and eight more at 4k (ids 17-24, added
later without changing ids 1-16): the 4k length is where FAFO's target against Lookahead is judged, and two
prompts per half were too few to judge it (TUTORIAL.md §5.7). bench/side_by_side.py's fixed split applies as for the main
set (odd question ids: the tuning half, even ids: the reporting half).

    python prompts/make_long_prompts.py          # needs the default model's tokenizer (make install)
"""

import importlib
import json
import os
import pydoc
import re
import sys

if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import verify  # noqa: E402

LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096, "7k": 7168}  # prompt tokens, chat template included (about)
ROUNDS = [("1k", 4), ("2k", 4), ("4k", 4), ("7k", 4), ("4k", 8)]  # (length, prompts), in question-id order
MODULES = [  # consumed in order, each module at most once
    "textwrap", "heapq", "bisect", "string", "sched", "fractions", "functools", "dataclasses",
    "secrets", "csv", "gzip", "datetime", "itertools", "queue", "shutil", "json", "statistics", "random",
    "zipfile", "argparse", "contextlib", "calendar", "tarfile", "difflib", "sqlite3", "pathlib", "collections",
    "logging", "decimal", "enum", "pprint", "shlex", "fnmatch", "glob", "tempfile", "copy", "weakref",
    "configparser", "ipaddress", "uuid", "base64", "hashlib", "struct", "array", "operator", "mimetypes",
    "getopt", "optparse", "html.parser", "gettext", "locale", "codecs", "zlib", "bz2", "lzma", "selectors",
]
QUESTIONS = [
    "Summarize the documentation above in five bullet points, one per important function or class.",
    "Using only the documentation above, explain to a beginner which function they should call first and why.",
    "List the classes documented above and give a one-sentence description of each.",
    "Write a short tutorial paragraph, with one code example, for the first module documented above.",
]


def page(name: str) -> str:
    text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
    lines, skip = [], False
    for line in text.splitlines():
        if line in ("FILE", "MODULE REFERENCE"):  # machine-specific paths and URLs
            skip = True
            continue
        if skip and line.startswith("    "):
            continue
        skip = False
        lines.append(line.rstrip())
    # note: pydoc prints default values like <object object at 0x7f21...>, an address that changes every run;
    # a fixed one keeps the prompts reproducible (ids 1-16 were written before this and are kept as written)
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x0>", "\n".join(lines))


def main() -> None:
    _, tok = verify.load_model()  # only the tokenizer is used
    modules = iter(MODULES)
    out, qid = [], 1
    for category, count in ROUNDS:
        target = LENGTHS[category]
        for i in range(count):
            question = QUESTIONS[i % len(QUESTIONS)]
            text, used = "", []
            while True:
                head = len(verify.encode_prompt(tok, f"{text}\n\n{question}"))
                if head >= target - 150:
                    break
                name = next(modules)
                text += ("\n\n" if text else "") + page(name)
                used.append(name)
            # trim to the target at a line boundary
            lines = text.splitlines()
            while len(verify.encode_prompt(tok, "\n".join(lines) + f"\n\n{question}")) > target:
                lines = lines[: max(1, len(lines) - max(1, len(lines) // 50))]
            prompt = "\n".join(lines) + f"\n\n{question}"
            n = len(verify.encode_prompt(tok, prompt))
            out.append({"question_id": qid, "category": category, "turns": [prompt],
                        "source": "pydoc: " + ", ".join(used), "prompt_tokens": n})
            print(f"#{qid} {category}: {n} tokens from {', '.join(used)}")
            qid += 1
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_prompts.jsonl")
    # append-only: a prompt already in the file is kept exactly as it is (results were measured on it)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            kept = {row["question_id"]: row for row in map(json.loads, f)}
        out = [kept.get(row["question_id"], row) for row in out]
    with open(path, "w", encoding="utf-8") as f:
        for row in out:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
