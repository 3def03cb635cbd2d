# SPDX-License-Identifier: MIT
"""vLLM with and without speculative decoding, side by side: no speculation, vLLM's own training-free drafters
(ngram: prompt lookup; suffix: SuffixDecoding, through arctic-inference) and ours (serve/vllm_proposers.py), gated
(the default: serve/gate.py) and ungated, all at the same k, on the reporting half of the shipped prompts, float32
on the CPU; and no-drafts (a custom_class proposer whose every chain is empty: what vLLM's speculative path costs
by itself, the floor under any outside proposer; not in the default list). Batch 1 sends the prompts one at a
time; a batch B > 1 submits all of them at once to an engine with max_num_seqs = B (continuous batching: at most
B running; the reporting half has 14 prompts, so batch 16 runs 14 at first).

    make serve-venv                                        # once (arctic-inference for suffix included)
    LD_PRELOAD=$PWD/.venv-serve/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 \\
        .venv-serve/bin/python bench/serve_bench.py --out bench/results/serve-gate

How the comparison is kept fair on a noisy machine (here a run's speed moved by a third from one ten minutes to
the next): each drafter runs beside its own engine without speculation, both alive side by side (an idle engine
costs memory, not time), each first warmed up on a batch of the other half's prompts (whole answers), with no
prefix caching (every run prefills its prompts, as a server does for prompts it sees once). At batch 1 every
prompt runs on both in turn, as bench/side_by_side.py interleaves methods per prompt; at a batch B > 1 the
whole batch runs without speculation, with the drafter, and without speculation again (a steady drift cancels;
no speculation's tokens/s is over all its runs; --rounds R alternates them R times, A B A B ... A), --reps
times, each repetition in fresh engines (suffix keeps every response and would draft the next repetition's
from the last; for the same reason each of its later rounds runs in a fresh engine). Each ratio is over the
no speculation of its own pair and repetition. --together puts every drafter in one group with one engine
without speculation (A B C ... A, the drafters' order rotated each round), so that each ratio is over the same
runs of no speculation; --against NAME sets each drafter beside NAME (e.g. vllm-suffix) instead of no
speculation.

Reported per configuration and batch: tokens/s (total new tokens over total wall time) and its ratio over no
speculation (the speedup at batch sizes above 1; the median of the repetitions, each beside it); at batch 1 also
SpecBench's speedup (the mean of per-prompt tokens/s over no speculation's mean: a ratio of means); vLLM's own
counters (drafts, draft tokens, accepted tokens; mean acceptance length = 1 + accepted / drafts); and whether
every output is no speculation's, token for token. Eager mode (enforce_eager) by default: a compiled engine
(--compile) takes about two minutes more to start (serve/README.md). --one-process runs each
engine inside this process (vLLM's uni executor) instead of vLLM's default engine-core process and worker
process: on two cores the default's worker computes on one core while its engine-core process spins on the
other, and no speculation ran 1.55x as fast in one process at batch 16, side by side (RESULTS.md, "Serving
under load in one process").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import prompts  # noqa: E402
import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
# each drafter runs side by side with no speculation. subtle: engines in one process share vLLM's metrics
# registry, and each new engine's counters replace the earlier ones', so only the engine made last can be
# counted: the drafter of a pair (after no speculation); in larger groups (--together) or beside another drafter
# (--against) none is
DRAFTERS = ("no-drafts", "vllm-ngram", "vllm-suffix", "ngram", "ngram-ungated", "cacheback", "cacheback-ungated",
            "cacheback-paper", "cacheback-paper-ungated")
# drafters that remember earlier requests' answers (suffix: arctic-inference's global tree caches every finished
# response): run again, the same batch would be drafted from its own answers, so each round gets a fresh engine
REMEMBERS_ANSWERS = ("vllm-suffix",)


class NoDrafts:
    """A custom_class proposer that drafts nothing: what vLLM's speculative path costs by itself, the floor
    under any outside proposer. subtle: with a speculative_config, vLLM 0.32's model runner builds the
    speculative metadata and runs its rejection sampler every step, empty chains or not (gpu_model_runner.py,
    _prepare_inputs: use_spec_decode = self.speculative_config is not None)."""

    def __init__(self, vllm_config):
        pass

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


def configurations(k: int) -> dict[str, dict]:
    """name -> the engine keywords that select its drafter."""
    return {
        "none": {},
        "no-drafts": {"speculative_config": {"method": "custom_class", "model": "bench.serve_bench.NoDrafts",
                                             "num_speculative_tokens": k}},
        "vllm-ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": k}},
        "vllm-suffix": {"speculative_config": {"method": "suffix", "num_speculative_tokens": k}},
        "ngram": proposers.engine_args("ngram", k),
        "ngram-ungated": proposers.engine_args("ngram", k, gate="off"),
        "cacheback": proposers.engine_args("cacheback", k),
        "cacheback-ungated": proposers.engine_args("cacheback", k, gate="off"),
        "cacheback-paper": proposers.engine_args("cacheback", k, preset="paper"),
        "cacheback-paper-ungated": proposers.engine_args("cacheback", k, preset="paper", gate="off"),
    }


def counters(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters: the last engine made in this process (see DRAFTERS)."""
    totals = dict.fromkeys(COUNTERS, 0)
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            totals[m.name] += int(m.value)
    return totals


def timed(llm, vllm, encoded: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, dict]:
    """Greedy outputs of the prompts submitted together, the seconds they took, the counters' growth."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = counters(llm)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in encoded], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = counters(llm)
    grown = {name.split("num_")[-1]: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
    return [list(o.outputs[0].token_ids) for o in out], seconds, grown


def run_group(group: list[str], known: dict, batch: int, rep: int, encoded, warm_up, args, vllm) -> list[dict]:
    """The group's engines side by side, each warmed up on `batch` prompts outside the set (warm_up) submitted
    together; batch 1: each prompt on each engine in turn; else the whole batch on the baseline, the drafter (or
    each drafter of the group), the baseline. One row per configuration."""

    def started(name: str):
        # subtle: no prefix caching: the baseline's second run of the same prompts would skip their prefills
        # (here 16.1 s against 17.8 s for the first, at batch 8)
        llm = vllm.LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=batch, seed=0,
                       enforce_eager=not args.compile, disable_log_stats=False, enable_prefix_caching=False,
                       distributed_executor_backend="uni" if args.one_process else None, **known[name])
        # the batch's shapes and lengths, on prompts outside the set. subtle: whole answers, not a few tokens:
        # after a 16-token warm-up the baseline's second run was faster than its first in 13 of 20 groups at
        # batch 16 (by 0.3 s of 15), and the drafter, which runs once, only ever had a first run
        timed(llm, vllm, warm_up[:batch], args.max_new_tokens)
        return llm

    engines = {name: started(name) for name in group}
    rows = {name: {"config": name, "batch": batch, "rep": rep, "group": group[1], "base": group[0], "k": args.k,
                   "outputs": [], "seconds": [], "tokens_timed": 0, "same_again": True,
                   # vLLM's counters are read right for the engine made last only (DRAFTERS); no speculation has none
                   "counted": name == "none" or (name == group[-1] and len(group) == 2 and not args.against),
                   **{c.split("num_")[-1]: 0 for c in COUNTERS}} for name in group}
    work = [[p] for p in encoded] if batch == 1 else [encoded]
    for i, part in enumerate(work):
        if batch == 1:
            order = group[i % len(group):] + group[: i % len(group)]  # each engine first in turn
        else:
            # subtle: the machine's speed drifts by a third over minutes (RESULTS.md), and a whole batch takes
            # 15-30 s: the baseline runs before and after the drafter, so that a steady drift
            # cancels; --rounds R alternates them R times (A B A B ... A): one run at batch 16
            # moves by up to 14% either way
            # with several drafters (--together) their order rotates from round to round, so that none always
            # runs first after the baseline (nor right after suffix's fresh engine starts)
            order = [group[0]]
            drafters = group[1:]
            for r in range(args.rounds):
                turn = r % len(drafters)
                order += [*drafters[turn:], *drafters[:turn], group[0]]
        ran = set()
        for name in order:
            if name in ran and name in REMEMBERS_ANSWERS:  # its tree holds this batch's answers: a fresh engine
                del engines[name]
                gc.collect()  # the old engine shut down before the new one starts
                engines[name] = started(name)  # subtle: made last, its counters are the ones read (DRAFTERS)
            outputs, seconds, grown = timed(engines[name], vllm, part, args.max_new_tokens)
            if name in ran:  # the baseline's second run: timed, its outputs checked against its first
                rows[name]["same_again"] &= outputs == rows[name]["outputs"][-len(outputs):]
            else:
                rows[name]["outputs"] += outputs
            ran.add(name)
            rows[name]["seconds"].append(seconds)
            rows[name]["tokens_timed"] += sum(len(o) for o in outputs)
            for counter, value in grown.items():
                rows[name][counter] += value
    for name in group:
        row = rows[name]
        tokens = [len(o) for o in row["outputs"]]
        row["tokens"] = sum(tokens)
        row["tokens_per_s"] = row["tokens_timed"] / sum(row["seconds"])
        if batch == 1:
            row["per_prompt_tokens_per_s"] = [n / s for n, s in zip(tokens, row["seconds"])]
        print(f"rep {rep} {name:24s} batch {batch:2d}: {row['tokens_per_s']:6.1f} tokens/s, drafts {row['drafts']}, "
              f"accepted {row['accepted_tokens']} of {row['draft_tokens']}"
              + ("" if row["same_again"] else " (its two runs' outputs differ)"), file=sys.stderr, flush=True)
    engines.clear()
    gc.collect()
    return list(rows.values())


def specbench(row: dict, base: dict) -> float:
    """SpecBench's speedup: the mean of per-prompt tokens/s over the baseline's (a ratio of means)."""
    mean = sum(row["per_prompt_tokens_per_s"]) / len(row["per_prompt_tokens_per_s"])
    return mean / (sum(base["per_prompt_tokens_per_s"]) / len(base["per_prompt_tokens_per_s"]))


def round_ratios(row: dict, base: dict) -> list[float]:
    """With --rounds R at a batch above 1 (A B A B ... A): each of the drafter's runs over the mean of the two
    baseline runs either side of it (the same batch each time, so a ratio of seconds is one of speeds)."""
    return [(base["seconds"][i] + base["seconds"][i + 1]) / 2 / seconds for i, seconds in enumerate(row["seconds"])]


def summary(rows: list[dict]) -> list[dict]:
    """Per configuration and batch, over the repetitions: the median tokens/s, the median of the ratios over
    the no speculation of the same group and repetition (total tokens over total time; SpecBench's at batch 1
    too), each ratio, vLLM's counters (summed) and how many outputs are no speculation's in every run. No
    speculation itself: its runs of every group."""
    base = {(r["batch"], r["group"], r["rep"]): r for r in rows if r["config"] == r.get("base", "none")}
    order = []
    for r in rows:
        if (r["batch"], r["config"]) not in order:
            order.append((r["batch"], r["config"]))
    out = []
    for batch, config in sorted(order, key=lambda key: (key[0], order.index(key))):
        runs = [r for r in rows if r["config"] == config and r["batch"] == batch]
        ratios = [r["tokens_per_s"] / base[batch, r["group"], r["rep"]]["tokens_per_s"] for r in runs]
        entry = {"config": config, "batch": batch, "runs": len(runs),
                 "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                 "over_none": statistics.median(ratios), "ratios": ratios,
                 **{c: sum(r[c] for r in runs) for c in ("drafts", "draft_tokens", "accepted_tokens")},
                 "counted": all(r.get("counted", True) for r in runs),
                 "identical": min(sum(o == p for o, p in zip(r["outputs"], base[batch, r["group"], r["rep"]]["outputs"]))
                                  for r in runs), "prompts": len(runs[0]["outputs"])}
        if batch == 1:
            entry["specbench"] = statistics.median(specbench(r, base[1, r["group"], r["rep"]]) for r in runs)
        elif config != runs[0].get("base", "none") and len(runs[0]["seconds"]) > 1:
            # --rounds: each round's ratio too
            entry["rounds"] = [round_ratios(r, base[batch, r["group"], r["rep"]]) for r in runs]
        out.append(entry)
    return out


def table(rows: list[dict]) -> str:
    bases = {r.get("base", "none") for r in rows}
    over = f"over {bases.pop()}" if len(bases) == 1 else "over ungated"
    head = (f"| drafter | batch | tokens/s | {over} (total) | each run | {over} (SpecBench) | drafts | "
            "draft tokens | accepted | mean acceptance length | identical |")
    lines = [head, "|" + " --- |" * 11]
    for e in summary(rows):
        mal = f"{1 + e['accepted_tokens'] / e['drafts']:.2f}" if e["drafts"] else "-"
        counts = f"{e['drafts']} | {e['draft_tokens']} | {e['accepted_tokens']} | {mal}" if e["counted"] else "- | - | - | -"
        sb = f"{e['specbench']:.2f}x" if "specbench" in e else "-"
        each = " ".join(f"{x:.2f}" for x in e["ratios"])
        if "rounds" in e:  # each repetition's rounds, in parentheses
            each += " (rounds: " + "; ".join(" ".join(f"{x:.2f}" for x in rounds) for rounds in e["rounds"]) + ")"
        lines.append(f"| {e['config']} | {e['batch']} | {e['tokens_per_s']:.1f} | {e['over_none']:.2f}x | {each} | "
                     f"{sb} | {counts} | "
                     f"{e['identical']}/{e['prompts']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=verify.converted_dir(), help="the served model (default: the default model)")
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens for every drafter (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--split", default="report", choices=["tune", "report", "all"],
                   help="which half of prompts/prompts.jsonl (default: report)")
    p.add_argument("--configs", help="comma list; each runs in its group beside no speculation (default: all but "
                                     "no-drafts; with --one-process, all but no-drafts and vllm-ngram)")
    p.add_argument("--batches", default="1,4,8,16", help="batch sizes (max_num_seqs) (default: 1,4,8,16)")
    p.add_argument("--reps", type=int, default=2, help="repetitions at batch sizes above 1, each in fresh engines "
                   "(default: 2; batch 1 interleaves per prompt, once)")
    p.add_argument("--rounds", type=int, default=1,
                   help="at batch sizes above 1, how many times the drafter runs between runs of the "
                        "baseline in each repetition (A B A; 2: A B A B A; default: 1; vllm-suffix runs each "
                        "round in a fresh engine: it remembers answers)")
    beside = p.add_mutually_exclusive_group()  # what each drafter is set beside: no speculation by default
    beside.add_argument("--against-ungated", action="store_true", help="each of ours gated beside itself ungated, "
                   "instead of beside no speculation (the ratios are then gated over ungated)")
    beside.add_argument("--against", metavar="NAME", help="each configuration beside NAME (e.g. vllm-suffix) instead "
                   "of beside no speculation: the ratios are then over NAME; vLLM's counters are not shown, since "
                   "NAME's fresh engines (suffix's, each round) would take over the registry they are read from")
    beside.add_argument("--together", action="store_true", help="at each batch size every configuration in one group "
                   "with no speculation (two drafters: A B C A C B A ..., their order rotated each round): each drafter's ratio "
                   "over the same baseline runs; "
                   "vLLM's counters are not shown (one registry, and suffix's fresh engines take it over)")
    p.add_argument("--compile", action="store_true", help="vLLM's compiled mode instead of eager")
    p.add_argument("--one-process", action="store_true",
                   help="each engine inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor) "
                        "instead of vLLM's default engine-core and worker processes")
    p.add_argument("--out", help="write OUT.jsonl (a row per configuration, batch, group and repetition) and OUT.md")
    p.add_argument("--table", metavar="JSONL",
                   help="print the table of a run's OUT.jsonl and stop (in .venv: no vLLM needed)")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print(table([json.loads(line) for line in f]))
        return 0
    args.batches = [int(b) for b in args.batches.split(",")]
    known = configurations(args.k)
    # subtle: vllm-ngram loads numba, and in a process that has loaded it vLLM 0.32.0 cannot start another
    # engine (its CPU kernel registration scans every module and fails on llvmlite's library object)
    left_out = ("no-drafts", "vllm-ngram") if args.one_process else ("no-drafts",)
    names = set(args.configs.split(",")) if args.configs else set(known) - set(left_out)
    if args.one_process and "vllm-ngram" in names:
        print("error: --configs: vllm-ngram cannot run with --one-process (vLLM starts no further engine in a "
              "process that has loaded numba)", file=sys.stderr)
        return 2
    unknown = sorted(names - set(known))
    if unknown:
        print(f"error: --configs: unknown {', '.join(unknown)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    if args.against_ungated:  # each of ours gated against itself ungated: what the gate costs or brings
        groups = [[name + "-ungated", name] for name in DRAFTERS if name in names and name + "-ungated" in known]
    elif args.together:  # one group: the drafters side by side, between the same runs of no speculation
        groups = [["none", *(name for name in DRAFTERS if name in names)]]
    elif args.against:  # each against another drafter, directly: the two alternate, as a drafter and none do
        if args.against not in known:
            print(f"error: --against: unknown {args.against} (known: {', '.join(known)})", file=sys.stderr)
            return 2
        groups = [[args.against, name] for name in DRAFTERS if name in names and name != args.against]
    else:
        groups = [["none", name] for name in DRAFTERS if name in names]
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if args.one_process:  # read by vLLM when an engine starts: set before any does
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    questions = prompts.load_prompts(prompts.SHORT, None, args.split)
    encoded = [verify.encode_prompt(tok, q["prompt"]) for q in questions]
    other = {"report": "tune", "tune": "report"}.get(args.split)  # the warm-up's prompts: the other half's
    warm_up = [verify.encode_prompt(tok, q["prompt"]) for q in prompts.load_prompts(prompts.SHORT, None, other)] \
        if other else [verify.encode_prompt(tok, "Say hello.")] * max(args.batches)
    os.environ.update(proposers.serve_environment())
    rows = []
    for batch in args.batches:
        for rep in range(1 if batch == 1 else args.reps):
            for group in groups:
                rows += run_group(group, known, batch, rep, encoded, warm_up, args, vllm)
                if args.out:  # as it goes: a long run's rows survive an interruption
                    with open(args.out + ".jsonl", "w", encoding="utf-8") as f:
                        f.writelines(json.dumps(r) + "\n" for r in rows)
    rounds = f" of {args.rounds} rounds (A B A ... A)" if args.rounds > 1 else ""
    processes = "one process" if args.one_process else "engine-core and worker processes"
    text = (f"vLLM {vllm.__version__} (vllm-cpu), float32, {'compiled' if args.compile else 'eager'}, {processes}, "
            f"k = {args.k}, "
            f"{len(encoded)} prompts ({args.split} half), {args.max_new_tokens} new tokens at most, batch 1 "
            f"interleaved per prompt, larger batches {args.reps} repetitions (medians){rounds}, {verify.cpu_name()}\n\n"
            + table(rows))
    print(text)
    if args.out:
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
