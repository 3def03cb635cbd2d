# SPDX-License-Identifier: MIT
"""What one vLLM engine step costs against its rows and the draft tokens in it: the numbers behind the batch
gate's rule (TUTORIAL.md §7.5). A proposer that sends every row a chain of a set length (d copies of its last
token: rejected, but verified all the same), the length stepping through 0..4 every few steps, times the gap
between its calls at batch 1 and batch 8 (ignore_eos, 200 tokens a request, the tuning half's prompts).

    LD_PRELOAD=$PWD/.venv-serve/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 \\
        .venv-serve/bin/python bench/serve_steps.py --out bench/results/serve-steps

Reported: the median step, per (rows, draft tokens in the forward), over plain decode steps only (every row
sampled and was in the step before). --one-process: vLLM inside this process (on two cores the set-up whose
model computes on both).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import prompts  # noqa: E402
import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402

STEPS_FILE = "SPECDEC_SERVE_STEPS"  # where FixedChains appends its timings (the environment names it)


class FixedChains(proposers.NgramProposer):
    """Sends each row d copies of its last token, d = (call // 7) % 5, and records the time since its last
    call, the rows and the draft tokens of the forward that time covered."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.calls_made = 0
        self.last = None  # (time, rows, draft tokens) of the last call
        self.out = open(os.environ[STEPS_FILE], "a", encoding="utf-8")

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        now = time.perf_counter()
        decode = all(sampled_token_ids)
        if self.last is not None and decode and self.last[1] == len(sampled_token_ids):
            self.out.write(json.dumps({"seconds": now - self.last[0], "rows": self.last[1],
                                       "drafts": self.last[2]}) + "\n")
        self.calls_made += 1
        d = (self.calls_made // 7) % 5
        chains = [[int(token_ids_cpu[row][int(num_tokens_no_spec[row]) - 1])] * d if sampled else []
                  for row, sampled in enumerate(sampled_token_ids)]
        self.last = (time.perf_counter(), len(sampled_token_ids) if decode else None, sum(map(len, chains)))
        self.out.flush()
        return chains


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=verify.converted_dir())
    p.add_argument("--batches", default="1,8")
    p.add_argument("--out", help="write OUT.jsonl (the steps) and OUT.md")
    p.add_argument("--one-process", action="store_true",
                   help="vLLM inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor): on two "
                        "cores the set-up whose model computes on both (serve_bench.py --one-process)")
    args = p.parse_args(argv)
    if args.one_process:  # read by vLLM when an engine starts: set before any does
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    encoded = [verify.encode_prompt(tok, q["prompt"]) for q in prompts.load_prompts(prompts.SHORT, None, "tune")]
    os.environ.update(proposers.serve_environment())
    steps_path = tempfile.mktemp(suffix=".jsonl")
    os.environ[STEPS_FILE] = steps_path
    spec = proposers.engine_args("ngram", 4)
    spec["speculative_config"]["model"] = "bench.serve_steps.FixedChains"
    executor = "uni" if args.one_process else None  # None: vLLM's default (a worker process)
    for batch in [int(b) for b in args.batches.split(",")]:
        llm = vllm.LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=batch, seed=0,
                       enforce_eager=True, distributed_executor_backend=executor, **spec)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in encoded[: max(batch, 3)]], params, use_tqdm=False)
        del llm
        gc.collect()  # subtle: in one process, the engine must be gone before the next one starts
    with open(steps_path, encoding="utf-8") as f:
        steps = [json.loads(line) for line in f]
    by = {}
    for s in steps:
        by.setdefault((s["rows"], s["drafts"]), []).append(s["seconds"])
    lines = ["| rows | draft tokens in the forward | steps | median step (ms) |", "| --- | --- | --- | --- |"]
    for (rows, drafts), seconds in sorted(by.items()):
        if len(seconds) >= 5:
            lines.append(f"| {rows} | {drafts} | {len(seconds)} | {1000 * statistics.median(seconds):.1f} |")
    processes = "one process" if args.one_process else "engine-core and worker processes"
    head = f"vLLM {vllm.__version__} (vllm-cpu), float32, eager, {processes}, {verify.cpu_name()}"
    text = head + "\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(s) + "\n" for s in steps)
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
