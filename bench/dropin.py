# SPDX-License-Identifier: MIT
"""What a user of the drop-in waits for, side by side with plain `model.generate` (RESULTS.md, "The drop-in's
first call, later calls and a new process"):

    python bench/dropin.py --out bench/results/dropin      # about 5 minutes on a 2-core CPU

1. Later calls. In one process, per prompt: plain greedy `model.generate`, then three
   `model.generate(custom_generate=METHOD.custom_generate)` calls with no options, then plain greedy again.
   The first call sets the method up (CARD: builds its int8 draft and starts its draft process); the
   second and third show what every later call costs. Each is given as its wall time over the mean of
   the two greedy runs on the same prompt.
2. A new process. Fresh Python processes, alternating: one times plain greedy's first call, the other one
   method's first call, each to its first streamed token (the streamer's first put after the prompt) and
   to its end. The measured costs on disk (verify.costs_path()) are made first by a warm-up process, as a
   user's earlier run would have made them; the processes then show what a second process pays.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import prompts  # noqa: E402
from tools.methods import METHODS  # noqa: E402

# one fresh process: load, then one timed call; prints {"first_token_s": ..., "wall_s": ..., "tokens": [...]}
ONE_CALL = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
from transformers.generation.streamers import BaseStreamer
import verify

class FirstToken(BaseStreamer):
    def __init__(self):
        self.puts, self.at = 0, None
    def put(self, value):
        self.puts += 1
        if self.puts == 2 and self.at is None:  # the first put is the prompt
            self.at = time.perf_counter()
    def end(self):
        pass

if __name__ == "__main__":
    model, tok = verify.load_model()
    ids = torch.tensor([verify.encode_prompt(tok, {prompt!r})])
    method = {method!r}
    options = dict(do_sample=False) if method == "greedy" else {{}}
    if method != "greedy":
        options["custom_generate"] = __import__(method).custom_generate
    streamer = FirstToken()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens={n}, streamer=streamer, **options)
    wall = time.perf_counter() - start
    print(json.dumps({{"first_token_s": streamer.at - start, "wall_s": wall,
                      "tokens": out[0, ids.shape[1]:].tolist()}}))
"""


def one_process(method: str, prompt: str, n: int) -> dict:
    code = ONE_CALL.format(root=ROOT, prompt=prompt, method=method, n=n)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"error: the {method} process failed: {run.stderr.strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def later_calls(modules: list[str], prompts: list[str], n: int) -> list[dict]:
    """Part 1, in this process."""
    import importlib

    import torch

    import verify

    model, tok = verify.load_model()
    rows = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for prompt in prompts:
            ids = torch.tensor([verify.encode_prompt(tok, prompt)])
            greedy = []
            calls = []

            def timed(**options):
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=n, **options)
                return time.perf_counter() - start, out

            seconds, want = timed(do_sample=False)
            greedy.append(seconds)
            for _ in range(3):
                seconds, out = timed(custom_generate=module.custom_generate)
                calls.append(seconds)
                assert torch.equal(out, want), f"{module_name}: not identical to greedy"
            greedy.append(timed(do_sample=False)[0])
            base = statistics.mean(greedy)
            rows.append({"part": "later calls", "method": module_name, "prompt": prompt, "greedy_s": base,
                         "calls_s": calls, "over_greedy": [c / base for c in calls]})
            print(f"{module_name:16} greedy {base:5.2f} s | calls " + " ".join(f"{c:5.2f} s ({base / c:.2f}x)"
                                                                               for c in calls), flush=True)
    return rows


def new_processes(modules: list[str], prompt: str, n: int, repeats: int) -> list[dict]:
    """Part 2: a warm-up process per method, then `repeats` alternating pairs."""
    rows = []
    for module_name in modules:
        one_process(module_name, prompt, 8)  # a user's earlier run: the measured costs exist on disk
    for repeat in range(repeats):
        for method in ["greedy", *modules]:
            r = one_process(method, prompt, n)
            rows.append({"part": "new process", "method": method, "repeat": repeat, **r})
            print(f"{method:16} first token {r['first_token_s']:5.2f} s | whole call {r['wall_s']:5.2f} s",
                  flush=True)
    want = next(r["tokens"] for r in rows if r["method"] == "greedy")
    for r in rows:
        assert r["tokens"] == want, f"{r['method']}: not identical to greedy"
    return rows


def table(rows: list[dict]) -> str:
    lines = ["Later calls in one process (speed over plain greedy's on the same prompt, greedy's time over the "
             "call's, mean over prompts):", "",
             "| method | first call | second call | third call |", "| --- | --- | --- | --- |"]
    for method in dict.fromkeys(r["method"] for r in rows if r["part"] == "later calls"):
        mine = [r for r in rows if r["part"] == "later calls" and r["method"] == method]
        speeds = [[r["greedy_s"] / seconds for seconds in r["calls_s"]] for r in mine]
        cells = [f"{statistics.mean(col):.2f}x" for col in zip(*speeds)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "A new process's first call (median over the repeats; the measured costs already on disk):", "",
              "| method | first streamed token | speed over greedy's | whole call | speed over greedy's |",
              "| --- | --- | --- | --- | --- |"]
    fresh = [r for r in rows if r["part"] == "new process"]
    medians = {}
    for method in dict.fromkeys(r["method"] for r in fresh):
        mine = [r for r in fresh if r["method"] == method]
        medians[method] = (statistics.median(r["first_token_s"] for r in mine),
                           statistics.median(r["wall_s"] for r in mine))
    first, whole = medians["greedy"]
    for method, (f, w) in medians.items():
        lines.append(f"| {method} | {f:.2f} s | {first / f:.2f}x | {w:.2f} s | {whole / w:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=3, help="reporting-half prompts for part 1")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per method for part 2")
    parser.add_argument("--out", help="write OUT.jsonl (rows) and OUT.md (tables)")
    args = parser.parse_args(argv)
    names = args.methods.split(",")
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        print(f"error: --methods: unknown {', '.join(unknown)} (known: {', '.join(METHODS)})", file=sys.stderr)
        return 2
    modules = [METHODS[m].module for m in names]
    texts = [q["prompt"] for q in prompts.load_prompts(prompts.SHORT, None, "report")][: args.prompts]
    rows = later_calls(modules, texts, args.max_new_tokens)
    rows += new_processes(modules, texts[0], args.max_new_tokens, args.repeats)
    text = table(rows)
    print("\n" + text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(f"`python bench/dropin.py {' '.join(argv or sys.argv[1:])}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
