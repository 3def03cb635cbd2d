# SPDX-License-Identifier: MIT
"""vLLM with and without speculative decoding, side by side: no speculation, vLLM's own training-free drafters
(ngram: prompt lookup; suffix: SuffixDecoding, through arctic-inference) and ours (serve/vllm_proposers.py), all
at the same k, on the reporting half of the shipped prompts, float32 on the CPU. One vLLM engine per configuration,
one after another in this process; each is timed at batch 1 (the prompts one at a time) and at batch 8 (all of
them submitted at once, at most 8 running: continuous batching).

    make serve-venv                                        # once (arctic-inference for suffix included)
    LD_PRELOAD=$PWD/.venv-serve/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 \\
        .venv-serve/bin/python bench/serve_bench.py --out bench/results/serve

Reported per configuration and batch: tokens/s as total new tokens over total wall time; at batch 1 also
SpecBench's speedup (the mean of per-prompt tokens/s over the mean of no speculation's: a ratio of means); vLLM's
own counters (drafts, draft tokens, accepted tokens; mean acceptance length = 1 + accepted / drafts); and whether
every output is no speculation's, token for token. Eager mode (enforce_eager) by default: a compiled engine
(--compile) takes about two minutes more to start; here it decoded 11-14% faster at batch 1, with the same
ratios over no speculation within 0.03 (RESULTS.md, "Serving with vLLM").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402
import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


def configurations(k: int) -> dict[str, dict]:
    """name -> the engine keywords that select its drafter."""
    return {
        "none": {},
        "vllm-ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": k}},
        "vllm-suffix": {"speculative_config": {"method": "suffix", "num_speculative_tokens": k}},
        "ngram": proposers.engine_args("ngram", k),
        "cacheback": proposers.engine_args("cacheback", k),
        "cacheback-paper": proposers.engine_args("cacheback", k, preset="paper"),
    }


def counters(llm) -> dict[str, int]:
    return {m.name: int(m.value) for m in llm.get_metrics() if m.name in COUNTERS}


def timed(llm, vllm, prompts: list[list[int]], max_tokens: int, batch: int):
    """Greedy outputs, per-prompt seconds (batch 1) or the batch's seconds, and the counters' growth."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = counters(llm)
    outputs = []
    seconds = []
    if batch == 1:
        for p in prompts:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            outputs.append(list(out[0].outputs[0].token_ids))
    else:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        outputs = [list(o.outputs[0].token_ids) for o in out]
    after = counters(llm)
    grown = {name.split("num_")[-1]: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
    return outputs, seconds, grown


def run(name: str, engine_args: dict, prompts, warm_up: list[int], args, vllm) -> list[dict]:
    """One fresh engine per batch size: a drafter that learns across requests (suffix's global tree, our
    table = 'server') must not have seen the outputs in the other batch's run."""
    rows = []
    for batch in args.batches:
        t0 = time.perf_counter()
        llm = vllm.LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=8, seed=0,
                       enforce_eager=not args.compile, disable_log_stats=False, **engine_args)
        load_s = time.perf_counter() - t0
        timed(llm, vllm, [warm_up], 16, 1)  # a prompt outside the set
        outputs, seconds, grown = timed(llm, vllm, prompts, args.max_new_tokens, batch)
        del llm
        gc.collect()
        tokens = [len(o) for o in outputs]
        row = {"config": name, "batch": batch, "k": args.k, "load_s": round(load_s, 1),
               "tokens": sum(tokens), "seconds": round(sum(seconds), 3),
               "tokens_per_s": sum(tokens) / sum(seconds), **grown, "outputs": outputs}
        if batch == 1:
            row["per_prompt_tokens_per_s"] = [n / s for n, s in zip(tokens, seconds)]
        rows.append(row)
        print(f"{name:16s} batch {batch}: {row['tokens_per_s']:6.1f} tokens/s, drafts {grown['drafts']}, "
              f"accepted {grown['accepted_tokens']} of {grown['draft_tokens']}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["batch"]: r for r in rows if r["config"] == "none"}
    head = ("| drafter | batch | tokens/s | over none (total) | over none (SpecBench) | drafts | draft tokens | "
            "accepted | mean acceptance length | identical |")
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        b = base[r["batch"]]
        specbench = "-"
        if r["batch"] == 1:
            mean = sum(r["per_prompt_tokens_per_s"]) / len(r["per_prompt_tokens_per_s"])
            base_mean = sum(b["per_prompt_tokens_per_s"]) / len(b["per_prompt_tokens_per_s"])
            specbench = f"{mean / base_mean:.2f}x"
        mal = f"{1 + r['accepted_tokens'] / r['drafts']:.2f}" if r["drafts"] else "-"
        same = sum(o == p for o, p in zip(r["outputs"], b["outputs"]))
        lines.append(f"| {r['config']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x | {specbench} | {r['drafts']} | "
                     f"{r['draft_tokens']} | {r['accepted_tokens']} | {mal} | {same}/{len(r['outputs'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=verify.converted_dir(), help="the served model (default: the default model)")
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens for every drafter (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--split", default="report", choices=["tune", "report", "all"],
                   help="which half of bench/prompts.jsonl (default: report)")
    p.add_argument("--configs", default=",".join(configurations(4)), help="comma list (default: all)")
    p.add_argument("--batches", default="1,8", help="batch sizes, each in a fresh engine (default: 1,8)")
    p.add_argument("--compile", action="store_true", help="vLLM's compiled mode instead of eager")
    p.add_argument("--out", help="write OUT.jsonl (one row per configuration and batch) and OUT.md")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    known = configurations(args.k)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in known]
    if unknown or names[0] != "none":
        print(f"error: --configs must start with none and name only {', '.join(known)}", file=sys.stderr)
        return 2
    import vllm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    questions = bench.load_prompts(os.path.join(ROOT, "bench", "prompts.jsonl"), None, args.split)
    prompts = [verify.encode_prompt(tok, q["prompt"]) for q in questions]
    warm_up = verify.encode_prompt(tok, "Say hello.")
    os.environ.update(proposers.serve_environment())
    rows = []
    for name in names:
        rows += run(name, known[name], prompts, warm_up, args, vllm)
    text = (f"vLLM {vllm.__version__}, float32, {'compiled' if args.compile else 'eager'}, k = {args.k}, "
            f"{len(prompts)} prompts ({args.split} half), {args.max_new_tokens} new tokens at most, "
            f"{verify.cpu_name()}\n\n" + table(rows))
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
