# SPDX-License-Identifier: MIT
"""Two or more bench/side_by_side.py row files side by side: per method, whether every prompt's output was identical
to HF greedy's in every file (each file's rows compare with the hf-greedy run beside them; greedy HF is
deterministic, so identical there means identical to each other), and each file's speedup over hf-greedy
(SpecBench's, as bench/side_by_side.py's tables: the mean of per-prompt tokens/s over hf-greedy's mean of per-prompt
tokens/s in that file, a ratio of means) and mean accepted length. Used to show that a change kept identity and speed (RESULTS.md).

    python tools/compare_runs.py before=bench/a.jsonl after=bench/b.jsonl
"""

import argparse
import json
import sys


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="NAME=ROWS.jsonl", help="a label and a bench/side_by_side.py --out file")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            print(f"error: {spec}: expected NAME=ROWS.jsonl", file=sys.stderr)
            return 2
        runs[name] = load(path)
    names = list(runs)
    methods = [m for m in dict.fromkeys(r["method"] for r in runs[names[0]])]
    header = "| method | identical to HF greedy, every prompt and file | " + " | ".join(
        f"{n}: speedup | {n}: mean accepted" for n in names) + " |"
    print(header)
    print("|---" * (2 + 2 * len(names)) + "|")
    for m in methods:
        same = all(r["identical"] for n in names for r in runs[n] if r["method"] == m)
        cells = []
        for n in names:
            rows = [r for r in runs[n] if r["method"] == m]
            baseline = [r["tokens_per_s"] for r in runs[n] if r["method"] == "hf-greedy"]
            speedup = mean([r["tokens_per_s"] for r in rows]) / mean(baseline)
            accepted = mean([r["mean_accepted"] for r in rows])
            cells.append(f"{speedup:.2f}x | {accepted:.2f}")
        print(f"| {m} | {'yes' if same else 'NO'} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
