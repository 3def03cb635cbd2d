# SPDX-License-Identifier: MIT
"""
bench/side_by_side.py -- the benchmark harness: run decoding methods side by side on a prompt set and
report SpecBench-style numbers. Every speed claim of the methods' own (RESULTS.md) comes from it.

    python bench/side_by_side.py --methods vanilla,hf-greedy,hf-pld --max-new-tokens 128 --out bench/results/run.jsonl

How the measurement is made fair (the same rules as SpecBench, Xia et al. 2024):
  * one model, loaded once, shared by all methods;
  * methods are INTERLEAVED per prompt (prompt 1: A B C, prompt 2: A B C, ...), so slow drifts of the
    machine (thermal, other processes) hit every method alike;
  * one untimed warm-up run of every method before timing;
  * every run starts from scratch (stateful drafters get a fresh state per prompt);
  * speedup = the method's mean of per-prompt tokens/s over hf-greedy's mean of per-prompt tokens/s (a ratio
    of means, not a mean of per-prompt ratios): SpecBench's definition, as RESULTS.md states it; the tables also give total tokens over total time, which weighs slow prompts more;
  * the prompt set is split in two fixed halves (`prompts.split_of`): defaults are tuned on one, reported on
    the other;
  * mean accepted tokens = new tokens / target forwards, bonus token included; target forwards are counted
    by a forward hook on the target model, so HF's own methods are counted the same way as ours;
  * our methods also report their acceptance rate (accepted / drafted tokens) and the share of the time spent
    drafting; the header names the device, the torch and transformers versions, the dtype and the decoding mode;
  * "identical" = the token ids equal hf-greedy's on that prompt (the lossless check); with --temperature > 0,
    those of the plain sampler (vanilla) with the same seed, and hf-sample is the speed baseline;

The prompt file uses SpecBench's question.jsonl format: {"question_id", "category", "turns"}; the first turn
is the prompt. prompts/prompts.jsonl is the project's own set (see prompts/make_prompts.py).

Methods: vanilla, hf-greedy, hf-pld (transformers' prompt lookup decoding), and the PROJECT_METHODS below
(each method file's variants, plus hf-assisted). A method may fix fields of its config for a tuning sweep:
`--methods cacheback@ll=1@tdl=32,ngram@draft_count=6 --split tune`.

    python bench/side_by_side.py --fafo-steps 1024,2048,4096,7168 --out bench/results/fafo-steps.jsonl

times one FAFO step and one Lookahead step instead, on each attention back-end (dense mask, split SDPA,
FlexAttention compacted blocks; FAFO §4.4), after each context length. The long-context prompt set
(`--prompts prompts/long_prompts.jsonl`, categories 1k/2k/4k/7k) measures the same at the level of tokens/s.

`--repeats N` runs the whole interleaved pass N times and reports mean ± std between passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import sys
import time
from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

if __name__ == "__main__":  # run as a script: the repository's root on the path (python -m bench.side_by_side)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import prompts  # noqa: E402
import verify  # noqa: E402
from tools.methods import METHODS  # noqa: E402

# name -> (the method, as tools/methods.py names it, and fields of its config to fix). Modules are imported
# only when asked for. Each method file has the same interface: <X>Config.for_device(device),
# prepare(model, tok, cfg, name) -> (cfg, extra), generate(model, ids, n, eos, cfg, **extra).
PROJECT_METHODS = {
    **{name: (name, {}) for name in METHODS},  # every method of tools/methods.py under its own name
    "ngram-nogate": ("ngram", {"cost": "free"}),  # the chapter exactly: every draft verified
    # the paper's Table 1 (on CPU the default is already "no frozen"; on CUDA "dual")
    "cacheback-dual": ("cacheback", {"frozen": "stdlib"}),
    "cacheback-dual-selfchat": ("cacheback", {"frozen": "selfchat"}),
    "cacheback-nofrozen": ("cacheback", {"frozen": "none"}),
    "cacheback-onlyfrozen": ("cacheback", {"frozen": "stdlib", "dynamic_table": False}),
    "cacheback-onlyfrozen-selfchat": ("cacheback", {"frozen": "selfchat", "dynamic_table": False}),
    "card-lockstep": ("card", {"mode": "lockstep"}),
    # Table 2's ablation needs a cache with branches: K = 4, k = 2, with and without correction
    "card-k4": ("card", {"mode": "lockstep", "K": 4, "k": 2}),
    "card-nocorrect": ("card", {"mode": "lockstep", "K": 4, "k": 2, "correct": False}),
    "fafo-quest": ("fafo", {"compress": "quest"}),
    "fafo-snapkv": ("fafo", {"compress": "snapkv"}),  # SnapKV's prompt selection + the recent positions
    "fafo-promptpool": ("fafo", {"prompt_pool": True}),  # the pool seeded with the prompt's k-grams
    # Lookahead Decoding (Fu et al. 2024) in the same file: full-KV guesses, the pool keyed by the last token.
    # "lookahead" runs at FAFO's n, k, m (equal settings); "lookahead-own" at its code's recommendation for a
    # 7B model (LEVEL N = 5, WINDOW_SIZE W = 7, GUESS_SET_SIZE G = 7: n = W streams, k = N - 1, m = G), with
    # its pool seeded from the prompt in "-promptpool"; "lookahead-mtbench" at its MT-Bench script's 5/15/15.
    "lookahead": ("fafo", {"compress": "none", "lookback": 1, "pool_refresh": "insert"}),
    "lookahead-own": ("fafo", {"compress": "none", "lookback": 1, "n_guess": 7, "k": 4, "m": 7, "pool_cap": 7,
                               "pool_refresh": "insert"}),
    "lookahead-own-promptpool": ("fafo", {"compress": "none", "lookback": 1, "n_guess": 7, "k": 4, "m": 7,
                                          "pool_cap": 7, "pool_refresh": "insert", "prompt_pool": True}),
    "lookahead-mtbench": ("fafo", {"compress": "none", "lookback": 1, "n_guess": 15, "k": 4, "m": 15,
                                   "pool_cap": 15, "pool_refresh": "insert"}),
    "fafo-fullkv": ("fafo", {"compress": "none"}),  # FAFO minus C: full-KV guesses, FAFO's lookback keys
}
# transformers' assisted generation with CARD's draft model: the classic draft-then-verify baseline
HF_METHODS = ["vanilla", "hf-greedy", "hf-sample", "hf-pld", "hf-assisted"]


def parse_method(spec: str) -> tuple[str, dict]:
    """'cacheback@ll=1@tdl=32' -> ('cacheback', {'ll': 1, 'tdl': 32}): a method with some of its config
    fields fixed, for tuning sweeps. Values are read as int, then float, else kept as text."""
    name, *pairs = spec.split("@")
    fixed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise verify.UserError(f"--methods {spec}: expected name@key=value@...")
        for cast in (int, float, str):
            try:
                fixed[key.replace("-", "_")] = cast(value)
                break
            except ValueError:
                continue
    return name, fixed


def _import(module_name: str, method: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        raise verify.UserError(f"--methods {method}: {module_name}.py is not in this checkout yet") from None


class FirstToken:
    """Notes when the first new token appears (time to first token: the prefill, mostly). Our methods call it
    as their on_emit hook; HF's generate calls it as a streamer, whose first put() is the prompt and whose
    second is the first new token. Long prompts need it: there the prefill can be most of the wall time, and
    the decoding rate after it is what a speculative method changes."""

    def __init__(self):
        self.t: float | None = None
        self.puts = 0

    def __call__(self, *args) -> None:
        if self.t is None:
            self.t = time.perf_counter()

    def put(self, value) -> None:  # the transformers streamer protocol
        self.puts += 1
        if self.puts == 2:
            self()

    def end(self) -> None:
        pass


@torch.no_grad()
def hf_sample(model, prompt_ids, max_new_tokens: int, eos_ids, sampling: verify.Sampling, **gen_kwargs) -> list[int]:
    """transformers' own sampler with the same temperature / top-k / top-p: the speed baseline of sampled runs
    (its random stream is not our keyed noise, so identity is checked against vanilla's plain sampler)."""
    from transformers import GenerationConfig

    eos = list(eos_ids)
    config = GenerationConfig(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=eos[0])
    torch.manual_seed(sampling.seed)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **gen_kwargs)
    return out[0, ids.shape[1] :].tolist()


def make_runner(spec: str, model, tok, args, sampled: bool = False):
    """Returns run(prompt_ids, max_new_tokens, eos_ids, sampling, first) -> (token ids, Generation or None);
    `first` is a FirstToken."""
    name, overrides = parse_method(spec)
    if name == "vanilla":  # greedy, or the plain sampler: the tokens every sampled method must match
        return lambda ids, n, eos, s, first: _gen(verify.vanilla_generate(model, ids, n, eos, s, on_emit=first))
    if name == "hf-greedy":
        return lambda ids, n, eos, s, first: (verify.hf_generate(model, ids, n, eos, streamer=first), None)
    if name == "hf-sample":  # transformers' own sampler: the speed baseline of sampled runs
        if not sampled:
            raise verify.UserError("--methods hf-sample: needs --temperature > 0")
        return lambda ids, n, eos, s, first: (hf_sample(model, ids, n, eos, s, streamer=first), None)
    if sampled and name in ("hf-pld", "hf-assisted"):
        raise verify.UserError(f"--methods {name}: compared greedy only here (drop it, or use --temperature 0)")
    if name == "hf-pld":
        # transformers' prompt lookup decoding: drafts by matching the last n-gram in the prompt/output.
        return lambda ids, n, eos, s, first: (verify.hf_generate(model, ids, n, eos, streamer=first,
                                                                 prompt_lookup_num_tokens=args.pld_tokens), None)
    if name == "hf-assisted":
        card = _import("card", name)
        # the draft card.py derives from the target: int8 on a CPU (torch's int8 has no GPU kernels), else self
        spec = "int8" if model.device.type == "cpu" else "self"
        draft = card.load_draft(model, tok, card.CardConfig(draft=spec), args.model)

        def run_assisted(ids, n, eos, s, first):
            return verify.hf_generate(model, ids, n, eos, streamer=first, assistant_model=draft), None

        run_assisted.assistant = draft  # held_bytes counts its weights and its cache
        return run_assisted
    if name in PROJECT_METHODS:
        method, fixed = PROJECT_METHODS[name]
        module_name, config_name, _ = METHODS[method]
        module = _import(module_name, name)
        config_class = getattr(module, config_name)
        try:
            cfg = dataclasses.replace(config_class.for_device(model.device), **fixed, **overrides)
        except TypeError as e:  # a field the config does not have
            raise verify.UserError(f"--methods {spec}: {e}") from None
        cfg.check()
        # What needs the model (a draft model, a frozen table, a measured cost): the method's prepare(), the
        # same hook its own CLI uses, run once before timing.
        if module_name == "cacheback" and cfg.frozen in module.FROZEN_CORPORA:  # a set-up step: build once
            import tools.build_frozen

            tools.build_frozen.ensure_table(tok, cfg, model, args.model)
        asked = cfg  # (CARD: before its set-up chooses what is 'best' in it)
        cfg, extra = module.prepare(model, tok, cfg, args.model) if hasattr(module, "prepare") else (cfg, {})

        def run(ids, n, eos, s, first):
            return module.generate(model, ids, n, eos, cfg, sampling=s, on_emit=first, **extra)

        if module_name == "card":  # its cost model's predictions beside each measurement
            draft = extra["draft_model"]  # a model (lockstep) or a card.DraftProcess, whose .model is the draft's
            costs = card_costs(model, draft.model if isinstance(draft, module.DraftProcess) else draft, cfg)
            setup = None
            if cfg.draft in ("int8", "self"):  # what the set-up predicted for the configuration (kept on disk)
                measured = module.measure_for_choice(model, tok, asked, args.model)
                setup = module.choose(cfg, *measured, can_split=cfg.mode == "parallel")[0]
            return lambda *a: _gen(card_predict(module, run(*a), costs, cfg, setup))
        return lambda *a: _gen(run(*a))
    raise verify.UserError(f"--methods: unknown method {name!r} (known: {', '.join(HF_METHODS + list(PROJECT_METHODS))})")


def _gen(gen):
    return gen.tokens, gen


def held_bytes(run, gen, model, length: int) -> int | None:
    """What a run held beyond the target's weights, in bytes: our methods count it themselves
    (gen.extra["held_bytes"], verify.tensor_bytes); for HF's, its KV cache of `length` positions from
    the config, plus hf-assisted's assistant (its weights and its cache)."""
    if gen is not None:
        return gen.extra.get("held_bytes")
    held = verify.kv_cache_bytes(model.config, length, model.dtype)
    assistant = getattr(run, "assistant", None)
    if assistant is not None:
        held += verify.tensor_bytes(assistant) + verify.kv_cache_bytes(assistant.config, length, assistant.dtype)
    return held


def memory_table(rows, methods) -> str:
    """The memory each method held beyond the target's weights: the mean and the largest over its rows
    (MB); on CUDA also torch's peak allocation during the run, beyond what was allocated before it."""
    cuda = any("peak_cuda_bytes" in r for r in rows)
    lines = ["", "Memory held beyond the target's weights (MB; held_bytes: counted from the run's tensors, "
             "tables as token ids" + ("; peak CUDA: torch.cuda.max_memory_allocated over the run" if cuda else "")
             + "):", "", "| method | mean | largest |" + (" peak CUDA, mean |" if cuda else ""),
             "|---|---|---|" + ("---|" if cuda else "")]
    for m in methods:
        held = [r["held_bytes"] for r in rows if r["method"] == m and r.get("held_bytes") is not None]
        if not held:
            continue
        line = f"| {m} | {sum(held) / len(held) / 1e6:.1f} | {max(held) / 1e6:.1f} |"
        if cuda:
            peaks = [r["peak_cuda_bytes"] for r in rows if r["method"] == m and "peak_cuda_bytes" in r]
            line += f" {sum(peaks) / max(len(peaks), 1) / 1e6:.1f} |"
        lines.append(line)
    return "\n".join(lines)


# ---- CARD's cost model (card.py, section 5b) beside each run: the speedup that the step times measured here,
# with the run's own acceptance and hit rate, predict (card.choose predicts it before the run, from the draft's
# agreement). Each side is timed alone with its threads: the model errs on the fast side.

def card_costs(model, draft, cfg) -> dict:
    """The cost model's step times after 256 cached tokens: t_verify and t_draft each on the threads its side
    gets in cfg.mode, t_target (plain decoding's) on all of them."""
    main_threads = torch.get_num_threads()
    split = cfg.mode == "parallel" and draft.device.type == "cpu"
    half = max(1, main_threads // 2)  # the draft process's share (card.DraftProcess), the target the rest
    draft_threads, target_threads = (half, max(1, main_threads - half)) if split else (main_threads, main_threads)
    t_target = verify.measure_step_times(model, [1], repeats=3)[1]
    t_verify = verify.measure_step_times(model, [cfg.ratio + 1], repeats=3, threads=target_threads)[cfg.ratio + 1]
    t_draft = verify.measure_step_times(draft, [cfg.K], repeats=3, threads=draft_threads)[cfg.K]
    return {"t_target": t_target, "t_verify": t_verify, "t_draft": t_draft}


def card_predict(card, gen, costs: dict, cfg, setup: float | None = None):
    """gen.extra["predicted_speedup"]: the cost model (of the card module) with this run's acceptance and hit
    rate; gen.extra["predicted_at_setup"]: what card.choose predicted before any run (setup)."""
    gen.extra["predicted_at_setup"] = setup
    if gen.steps:
        hits = gen.extra["hits"]
        max_lead = 2 * cfg.ratio if cfg.max_lead is None else cfg.max_lead
        wait = min(cfg.ratio if cfg.wait is None else cfg.wait, max_lead)  # as card.choose and the process
        gen.extra["predicted_speedup"] = card.predicted_speedup(
            costs, cfg.mode, cfg.ratio, wait, len(gen.tokens) / gen.target_forwards, gen.extra["hit_rate"],
            hit_len=gen.extra["hit_tokens"] / hits if hits else 0.0, max_lead=max_lead)
    return gen


@torch.no_grad()
def fafo_step_times(fafo, model, context: int, backends: Sequence[str] = ("dense", "split", "flex-compiled"), repeats: int = 10,
               block_size: int = 128, **params) -> dict:
    """§4.4's claim, measured: one FAFO step after `context` cached tokens on each back-end (same rows, same
    StreamingLLM selection), and Lookahead's step (C = none: the guess rows see the whole cache) on the dense
    and split back-ends. Returns ms per step (median of `repeats`, after two warm-up calls) as
    `<backend>_ms` and `lookahead_<backend>_ms`. `--fafo-steps` prints them (RESULTS.md)."""
    d = dataclasses.replace(fafo.FafoConfig.for_device(model.device), **params)
    lay = fafo.StepLayout(d.n_guess, d.k, d.m)
    comp = fafo.StreamingLLM(d.sink, d.recent)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    ids = [rng.randrange(vocab) for _ in range(context)]
    cache = verify.new_cache(model, context + lay.rows)
    verify.prefill(model, cache, ids)
    windows = [[rng.randrange(vocab) for _ in range(lay.k)] for _ in range(lay.n)]
    cands = [tuple(rng.randrange(vocab) for _ in range(lay.k)) for _ in range(lay.m)]
    tokens, positions = lay.inputs(ids[-1], context, windows, cands)
    read = lay.read_rows()  # the head runs on these rows only, as in generate()

    def timed(step) -> float:
        ts = []
        for i in range(repeats + 2):
            verify.sync(model)
            t0 = time.perf_counter()
            step()
            verify.sync(model)
            ts.append(time.perf_counter() - t0)
        return 1000 * float(np.median(ts[2:]))  # the first two calls are warm-up (and compilation)

    def on_dynamic_cache(kv):  # dense and split append to the cache: roll it back after each step
        def step():
            kv.forward(tokens, positions, rows=read)
            verify.rollback(cache, context)
        return step

    out = {"context": context, "rows": lay.rows, "guess_rows": lay.n * lay.k, "selected": len(comp.select(context))}
    for backend in backends:
        if backend.startswith("flex"):
            flex = fafo.FlexKV(model, cache, lay, comp.budget, context + 1, block_size, compiled=backend == "flex-compiled")
            flex.select(comp.select(context))
            flex_ms = timed(lambda: flex.forward(tokens, positions, rows=read))
            out.update(flex_backend=backend, block=block_size, flex_ms=flex_ms)
            continue
        kv = {"dense": fafo.DenseKV, "split": fafo.SplitKV}[backend](model, cache, lay)
        kv.select(comp.select(context))
        out[f"{backend}_ms"] = timed(on_dynamic_cache(kv))
        kv.select(range(context))  # Lookahead: the guess rows see every cached position
        out[f"lookahead_{backend}_ms"] = timed(on_dynamic_cache(kv))
    return out


# ----------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------


POSITIONS = 8  # per-position acceptance is reported for draft positions 1..8


def per_position(accepted, depths) -> list[list[int]]:
    """[[steps whose draft reached position j, steps that accepted position j] for j = 1..POSITIONS]: a step
    accepts position j when at least j of its draft tokens were accepted (vLLM's per-position acceptance).

    >>> per_position([2, 0, 1], [3, 1, 1])[:3]
    [[3, 2], [1, 1], [1, 0]]
    """
    return [[sum(d >= j for d in depths), sum(a >= j for a in accepted)] for j in range(1, POSITIONS + 1)]


def position_rates(rows) -> list[float | None]:
    """Per-position acceptance over rows: accepted / reached at positions 1..POSITIONS (None: never reached)."""
    out = []
    for j in range(POSITIONS):
        reached = sum(r["per_position"][j][0] for r in rows)
        out.append(sum(r["per_position"][j][1] for r in rows) / reached if reached else None)
    return out


def summarize(rows, methods, baseline: str = "hf-greedy"):
    """{category or 'overall': {method: {tokens_per_s, speedup, speedup_total, ..., identical}}}.

    Rows from several passes (--repeats; each row's "repeat") are summarized pass by pass; the three timed
    figures are then the mean over the passes, with their standard deviation between passes in
    tokens_per_s_std, speedup_std and speedup_total_std (0 for a single pass). The counted figures (mean
    accepted, acceptance, identical) are over all rows.

    >>> rows = [dict(method=m, category="c", question_id=1, repeat=r, tokens_per_s=t, new_tokens=10,
    ...              wall_s=10 / t, target_forwards=5, identical=True)
    ...         for r, (b, t) in enumerate([(10, 12), (10, 14)]) for m, t in (("hf-greedy", b), ("x", t))]
    >>> s = summarize(rows, ["hf-greedy", "x"])["overall"]["x"]
    >>> round(s["speedup"], 2), round(s["speedup_std"], 2), s["mean_accepted"]
    (1.3, 0.14, 2.0)
    """
    passes = sorted({r.get("repeat", 0) for r in rows})
    # each pass is summarized on its own (a speedup is a ratio within one pass: both sides ran interleaved)
    per = [_summarize_pass([r for r in rows if r.get("repeat", 0) == p], methods, baseline) for p in passes]
    out = _summarize_pass(rows, methods, baseline)  # the counted figures, over all rows
    for g, by_method in out.items():
        for m, s in by_method.items():
            for key in ("tokens_per_s", "speedup", "speedup_total", "decode_speedup", "speedup_vanilla",
                        "decode_speedup_vanilla"):
                vals = [x[g][m][key] for x in per if m in x.get(g, {})]
                if None in vals:  # not measured (rows without a first-token time)
                    s[key], s[key + "_std"] = None, None
                    continue
                s[key] = sum(vals) / len(vals)
                # sample standard deviation between passes; 0 for a single pass
                s[key + "_std"] = (sum((v - s[key]) ** 2 for v in vals) / max(1, len(vals) - 1)) ** 0.5
            s["passes"] = len(per)
    return out


def _summarize_pass(rows, methods, baseline: str):
    # every row counts twice: in its category and in "overall"
    groups = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for g in (r["category"], "overall"):
            groups[g][r["method"]].append(r)
    def mean(rs, key):  # None where a row lacks the figure (no first-token time) or there are no rows
        vals = [r.get(key) for r in rs]
        return sum(vals) / len(vals) if vals and None not in vals else None

    out = {}
    for g, by_method in groups.items():
        base = by_method.get(baseline, [])
        base_tps = sum(r["tokens_per_s"] for r in base) / len(base) if base else float("nan")
        # our own plain decoding on the same KV cache: what speculation gains apart from what the cache gains
        van = by_method.get("vanilla", [])
        van_tps, van_dec = mean(van, "tokens_per_s"), mean(van, "decode_tokens_per_s")
        out[g] = {}
        for m in methods:
            rs = by_method.get(m, [])
            if not rs:
                continue
            tps = sum(r["tokens_per_s"] for r in rs) / len(rs)
            total_tps = sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
            base_total = sum(r["new_tokens"] for r in base) / sum(r["wall_s"] for r in base) if base else float("nan")
            # the decoding rate after the first token (prefill left out), SpecBench's ratio of means again
            dec, base_dec = mean(rs, "decode_tokens_per_s"), mean(base, "decode_tokens_per_s")
            decode_speedup = dec / base_dec if dec and base_dec else None
            ttft = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
            out[g][m] = {
                "tokens_per_s": tps,
                "decode_speedup": decode_speedup,
                "ttft_s": sum(ttft) / len(ttft) if ttft else None,
                "speedup": tps / base_tps,  # SpecBench's: mean of per-prompt tokens/s, over the baseline's
                "speedup_total": total_tps / base_total,  # total tokens over total time, over the baseline's
                # the same two ratios over our vanilla (same cache), when the run has it
                "speedup_vanilla": tps / van_tps if van_tps else None,
                "decode_speedup_vanilla": dec / van_dec if dec and van_dec else None,
                "mean_accepted": sum(r["new_tokens"] for r in rs) / max(1, sum(r["target_forwards"] for r in rs)),
                # our methods only: accepted / drafted tokens, and the share of the wall time spent drafting
                "acceptance": (sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))
                               if all("drafted" in r for r in rs) else None),
                "draft_share": (sum(r["draft_s"] for r in rs) / sum(r["wall_s"] for r in rs)
                                if all("draft_s" in r for r in rs) else None),
                "per_position": position_rates(rs) if all("per_position" in r for r in rs) else None,
                "identical": sum(bool(r["identical"]) for r in rs) / len(rs),
                # CARD only: its cost model's prediction (card.predicted_speedup) and its cache hit rate, per-prompt means
                "predicted": mean(rs, "predicted_speedup"),
                "predicted_at_setup": mean(rs, "predicted_at_setup"),
                "hit_rate": mean(rs, "hit_rate"),
                "n": len({r["question_id"] for r in rs}),  # prompts (a prompt run in several passes counts once)
            }
    return out


def _pm(s: dict, key: str, unit: str, digits: int = 2) -> str:
    """'1.23x' for one pass, '1.23x ± 0.04' (std between passes) for several; '-' when not measured."""
    if s.get(key) is None:
        return "-"
    text = f"{s[key]:.{digits}f}{unit}"
    return text + f" ± {s[key + '_std']:.{digits}f}" if s.get("passes", 1) > 1 else text


def _over_vanilla(s: dict) -> str:
    """'1.10x; 1.25x': SpecBench's speedup and the decode speedup over our vanilla, '-' without a vanilla run."""
    if s.get("speedup_vanilla") is None:
        return "-"
    return f"{_pm(s, 'speedup_vanilla', 'x')}; {_pm(s, 'decode_speedup_vanilla', 'x')}"


def markdown(summary, methods, baseline: str = "hf-greedy") -> str:
    """A compact speedup table (methods x categories), then one detailed table per category."""
    cats = [c for c in summary if c != "overall"] + ["overall"]  # "overall" last, as SpecBench's tables
    passes = next(iter(summary["overall"].values())).get("passes", 1)  # > 1: every timed cell gets "± std"
    lines = [f"Speedup vs {baseline}, SpecBench's definition (mean of per-prompt tokens/s, over {baseline}'s), "
             "per category" + (f"; mean ± std over {passes} passes:" if passes > 1 else ":"), ""]
    lines.append("| method | " + " | ".join(cats) + " |")
    lines.append("|---" * (len(cats) + 1) + "|")
    for m in methods:
        cells = [_pm(summary[c][m], "speedup", "x") if m in summary[c] else "-" for c in cats]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    # per-position acceptance exists only for our own methods (HF's report no drafts)
    shown = [m for m in methods if summary["overall"].get(m, {}).get("per_position")]
    if shown:
        lines += ["", "Per-position acceptance, all prompts: of the steps whose draft reached position j, the share "
                  "that accepted it:", "", "| method | " + " | ".join(f"j = {j}" for j in range(1, POSITIONS + 1)) + " |",
                  "|---" * (POSITIONS + 1) + "|"]
        for m in shown:
            rates = summary["overall"][m]["per_position"]
            lines.append(f"| {m} | " + " | ".join("-" if x is None else f"{100 * x:.0f}%" for x in rates) + " |")
    # CARD's cost model beside the measurement: a large gap means a cost the model leaves out (or noise)
    predicted = [m for m in methods if summary["overall"].get(m, {}).get("predicted") is not None]
    if predicted:
        lines += ["", "CARD's cost model (card.predicted_speedup): the speedup predicted from the measured step times, mean "
                  "accepted length and hit rate (over a plain one-token target step), beside the measured one "
                  "(SpecBench's, over " + baseline + "), all prompts:", "",
                  "(predicted at set-up: card.choose's, from the draft's agreement instead, before any run)", "",
                  "| method | predicted at set-up | predicted | measured | mean accepted | hit rate |", "|---" * 6 + "|"]
        for m in predicted:
            s = summary["overall"][m]
            setup = "-" if s["predicted_at_setup"] is None else f"{s['predicted_at_setup']:.2f}x"
            lines.append(f"| {m} | {setup} | {s['predicted']:.2f}x | {_pm(s, 'speedup', 'x')} | "
                         f"{s['mean_accepted']:.2f} | {s['hit_rate']:.2f} |")
    # the detailed tables: both speedup definitions side by side (they disagree when prompts differ in length:
    # total tokens over total time weighs the slow prompts more), then the decode rate after the first token
    # (on long prompts the prefill is most of the wall time and is the same for every method)
    for c in cats:
        n = next(iter(summary[c].values()))["n"]
        lines += ["", f"**{c}** ({n} prompts)", "",
                  "| method | tokens/s | speedup (SpecBench) | speedup (total tokens / total time) | decode speedup "
                  "(after the first token) | over vanilla, same cache (SpecBench; decode) | time to first token | "
                  "mean accepted | acceptance rate | drafting time | identical |", "|---" * 11 + "|"]

        def pct(x):
            return "-" if x is None else f"{100 * x:.1f}%"

        for m in methods:
            if m in summary[c]:
                s = summary[c][m]
                ttft = "-" if s.get("ttft_s") is None else f"{s['ttft_s']:.2f} s"
                lines.append(f"| {m} | {_pm(s, 'tokens_per_s', '', 1)} | {_pm(s, 'speedup', 'x')} | {_pm(s, 'speedup_total', 'x')} | "
                             f"{_pm(s, 'decode_speedup', 'x')} | {_over_vanilla(s)} | {ttft} | "
                             f"{s['mean_accepted']:.2f} | {pct(s['acceptance'])} | {pct(s['draft_share'])} | "
                             f"{100 * s['identical']:.0f}% |")
    return "\n".join(lines)


def bar_chart(summary, methods, path: str, title: str, baseline: str = "hf-greedy") -> None:
    """Grouped bars: speedup over the baseline per category (and overall), one bar per method; the dashed
    line at 1.0 is the baseline itself. Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cats = [c for c in summary if c != "overall"] + ["overall"]
    shown = [m for m in methods if m != baseline]  # the baseline is the dashed line at 1.0, not a bar
    x = np.arange(len(cats))
    width = 0.8 / max(1, len(shown))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cats)), 4))
    for i, m in enumerate(shown):
        vals = [summary[c].get(m, {}).get("speedup", 0) for c in cats]
        ax.bar(x + (i - (len(shown) - 1) / 2) * width, vals, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x, cats, rotation=20)
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="vanilla,hf-greedy,hf-pld", help="comma list (hf-greedy is always run: it is the reference)")
    p.add_argument("--prompts", default=prompts.SHORT,
                   help="SpecBench question.jsonl-style file (default: prompts/prompts.jsonl)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default: 128)")
    p.add_argument("--model", default=verify.DEFAULT_MODEL, help="as in every method script")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on every device (TF32 off): the dtype whose outputs are token-identical to "
                        "HF greedy; bfloat16/float16 round a many-row forward differently, so 'identical' drops")
    p.add_argument("--no-chat", action="store_true", help="feed the raw prompt, no chat template")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    p.add_argument("--categories", default=None,
                   help="comma list: only the prompts of these categories (e.g. 4k in prompts/long_prompts.jsonl)")
    p.add_argument("--split", default="report", choices=["report", "tune", "all"],
                   help="which half of the prompt set: report (even question ids: what README and TUTORIAL report), "
                        "tune (odd ids: what the defaults were chosen on) or all (default: report)")
    p.add_argument("--out", default="bench/results/latest.jsonl", help="one JSON row per (method, prompt); a .png chart and .md table go beside it")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="T > 0: every method samples (seed = the question id), the speed baseline is hf-sample and "
                        "'identical' means equal to the plain sampler (vanilla) with the same seed (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: top-k (default: 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: top-p (default: 1 = off)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole interleaved pass N times; tables give mean ± std over the passes (default: 1)")
    p.add_argument("--pld-tokens", type=int, default=10, help="hf-pld: prompt_lookup_num_tokens (default: 10)")
    p.add_argument("--fafo-steps", metavar="CONTEXTS",
                   help="instead of the prompt set: time one FAFO step and one Lookahead step on each attention "
                        "back-end after each of these cached-context lengths, e.g. 1024,4096,7168 (fafo_step_times)")
    p.add_argument("--cost-curve", metavar="SIZES",
                   help="instead of a benchmark: time one verification forward over each of these numbers of new "
                        "tokens after 300 cached ones (TUTORIAL.md §1.1), e.g. 1,2,4,8,16,32,64,96")
    p.add_argument("--fafo-backends", default="dense,split,flex-compiled",
                   help="--fafo-steps: the attention back-ends to time, a comma list of dense, split, flex, "
                        "flex-compiled (default: dense,split,flex-compiled)")
    args = p.parse_args(argv)
    try:
        if args.fafo_steps:
            return run_fafo_steps(args)
        if args.cost_curve:
            return run_cost_curve(args)
        return run(args)
    except verify.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run_cost_curve(args) -> int:
    """TUTORIAL.md §1.1's table: what one verification forward over n new tokens costs on this device."""
    try:
        sizes = sorted({int(x) for x in args.cost_curve.split(",")})
        assert sizes and sizes[0] >= 1
    except (ValueError, AssertionError):
        raise verify.UserError(f"--cost-curve: a comma list of positive integers (got {args.cost_curve!r})") from None
    model, _ = verify.load_model(args.model, args.device, args.dtype)
    times = verify.measure_step_times(model, [1, *sizes], context=300, repeats=5)
    print(f"{model.device}, {model.dtype}, one forward after 300 cached tokens (fastest of 5)\n")
    print("| new tokens in one forward | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    print("| time (ms) | " + " | ".join(f"{1000 * times[n]:.0f}" for n in sizes) + " |")
    print("| × one token | " + " | ".join(f"{times[n] / times[1]:.2f}" for n in sizes) + " |")
    return 0


def run_fafo_steps(args) -> int:
    """FAFO §4.4 and TUTORIAL §5.7: one step's time on each attention back-end, FAFO (StreamingLLM guesses)
    against Lookahead (full-KV guesses), after each context length."""
    try:
        contexts = [int(x) for x in args.fafo_steps.split(",")]
        assert contexts and min(contexts) >= 16
    except (ValueError, AssertionError):
        raise verify.UserError(f"--fafo-steps: a comma list of context lengths >= 16 (got {args.fafo_steps!r})") from None
    backends = [b for b in args.fafo_backends.split(",") if b]
    if not backends or any(b not in ("dense", "split", "flex", "flex-compiled") for b in backends):
        raise verify.UserError(f"--fafo-backends: a comma list of dense, split, flex, flex-compiled (got {args.fafo_backends!r})")
    import fafo
    from tqdm import tqdm

    model, _ = verify.load_model(args.model, args.device, args.dtype)
    if max(contexts) + 64 > verify.context_length(model):
        raise verify.UserError(f"--fafo-steps: {max(contexts)} exceeds the model's context of {verify.context_length(model)}")
    # One column per back-end for FAFO; Lookahead (C = none) has no fixed budget, so no flex column. The last
    # column compares each method on its fastest back-end: the honest "FAFO over Lookahead" for this device.
    cols = [b for b in ("dense", "split", "flex") if any(x.startswith(b) for x in backends)]
    look_cols = [b for b in cols if b != "flex"]
    head = "| context | rows | " + "".join(f"FAFO {b} ms | " for b in cols) + "".join(
        f"Lookahead {b} ms | " for b in look_cols) + ("Lookahead / FAFO (best of each) |" if look_cols else "")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    rows = []
    for c in tqdm(contexts, desc="fafo steps", unit="context", file=sys.stderr):
        r = fafo_step_times(fafo, model, c, backends=backends)
        r.update(device=device_name(model), dtype=str(model.dtype))  # every row says what it was measured on
        rows.append(r)
        line = f"| {c} | {r['rows']} | " + "".join(f"{r[b + '_ms']:.1f} | " for b in cols)
        if look_cols:
            line += "".join(f"{r['lookahead_' + b + '_ms']:.1f} | " for b in look_cols)
            line += f"{min(r['lookahead_' + b + '_ms'] for b in look_cols) / min(r[b + '_ms'] for b in cols):.2f} |"
        lines.append(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # bench/results/ is not in git
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    text = f"{device_name(model)}, {model.dtype}, median of 10 steps\n\n" + "\n".join(lines)
    print(text)
    with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(f"`python bench/side_by_side.py {' '.join(sys.argv[1:])}`\n\n{text}\n")
    return 0


def device_name(model) -> str:
    """'cuda: NVIDIA H100 ...' or 'cpu: AMD EPYC ... (2 threads, AVX2)': what the numbers were measured on."""
    import torch

    if model.device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(model.device)}"
    name, isa = "cpu", ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1] for line in lines if line.startswith("flags")).split())
        # the instruction set picks torch's int8 kernels, so CARD's int8 draft differs between CPUs
        isa = ", AVX-512" if "avx512f" in flags else ", AVX2" if "avx2" in flags else ""
    except (OSError, StopIteration):
        pass
    return f"cpu: {name} ({torch.get_num_threads()} threads{isa})"


def run_header(args, model, n_prompts: int, sampling) -> str:
    """One line naming everything a reader needs to compare two runs."""
    import torch
    import transformers

    mode = ("greedy" if sampling.greedy else
            f"sampled (T {sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}, seed = question id)")
    return (f"model {args.model} | {device_name(model)} | dtype {str(model.dtype).removeprefix('torch.')} | "
            f"torch {torch.__version__} | transformers {transformers.__version__} | {mode}, batch 1 | "
            f"max new tokens {args.max_new_tokens} | {n_prompts} prompts ({args.split} split)"
            + (f" | {args.repeats} passes" if getattr(args, "repeats", 1) > 1 else ""))


def run(args) -> int:
    from tqdm import tqdm

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    sampling = verify.Sampling(args.temperature, args.top_k, args.top_p)
    sampling.check()
    # greedy: hf-greedy is the speed baseline and the tokens to match; sampled: hf-sample is the speed
    # baseline and the plain sampler (vanilla, same seed) gives the tokens to match
    baseline, reference_method = ("hf-greedy", "hf-greedy") if sampling.greedy else ("hf-sample", "vanilla")
    for m in (reference_method, baseline):  # always run, whatever --methods says
        if m not in methods:
            methods.insert(0, m)
    if args.max_new_tokens <= 0:
        raise verify.UserError("--max-new-tokens must be positive")
    if args.repeats < 1:
        raise verify.UserError("--repeats must be at least 1")
    if args.limit is not None and args.limit <= 0:
        raise verify.UserError("--limit must be positive")
    questions = prompts.load_prompts(args.prompts, args.limit, args.split,
                                     args.categories.split(",") if args.categories else None)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model, tok = verify.load_model(args.model, args.device, args.dtype)
    eos = verify.eos_ids_of(model, tok)
    runners = {m: make_runner(m, model, tok, args, sampled=not sampling.greedy) for m in methods}

    # Count target forwards with a hook rather than trusting each method's own counter: HF's methods
    # (hf-greedy, hf-pld) have none, and a hook counts every method the same way. It is on the TARGET model
    # only, so a draft model's forwards (hf-assisted, card) are not counted.
    forwards = [0]
    model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))

    encoded = [verify.encode_prompt(tok, q["prompt"], chat=not args.no_chat) for q in questions]
    # One untimed warm-up per method: the first call of anything pays for allocations, lazy imports and
    # kernel selection, which must not be charged to whichever method happens to run first.
    for m in methods:
        runners[m](encoded[0], min(16, args.max_new_tokens), eos, sampling, FirstToken())

    rows = []
    # one bar for the whole run, redrawn in place (at most a few times a second): never a line per prompt
    bar = tqdm(total=args.repeats * len(questions) * len(methods), desc="bench", unit="run", file=sys.stderr,
               mininterval=0.5, dynamic_ncols=True)
    # --repeats N: the whole interleaved pass N times (SpecBench's leaderboard averages 3 runs); the tables
    # give the mean over passes and the standard deviation between them
    for rep, (q, ids) in ((r, x) for r in range(args.repeats) for x in zip(questions, encoded)):
        reference = None
        s = dataclasses.replace(sampling, seed=int(q["question_id"]))  # one seed per prompt
        # the reference runs first on every prompt: the tokens "identical" compares with
        for m in [reference_method] + [x for x in methods if x != reference_method]:
            bar.set_postfix_str(f"{q['category']}#{q['question_id']} {m}" + (f" pass {rep + 1}" if args.repeats > 1 else ""))
            forwards[0] = 0
            verify.sync(model)
            on_cuda = model.device.type == "cuda"
            if on_cuda:  # the peak over this run alone, beyond what was allocated before it
                torch.cuda.reset_peak_memory_stats(model.device)
                allocated_before = torch.cuda.memory_allocated(model.device)
            first = FirstToken()
            t0 = time.perf_counter()
            tokens, gen = runners[m](ids, args.max_new_tokens, eos, s, first)
            verify.sync(model)
            wall = time.perf_counter() - t0
            ttft = (first.t or t0 + wall) - t0
            if m == reference_method:
                reference = tokens
            row = {
                "method": m, "question_id": q["question_id"], "category": q["category"], "repeat": rep,
                "prompt_tokens": len(ids), "new_tokens": len(tokens), "target_forwards": forwards[0],
                "mean_accepted": len(tokens) / max(1, forwards[0]), "tokens_per_s": len(tokens) / wall,
                "wall_s": wall, "identical": tokens == reference, "ttft_s": ttft,
                # tokens after the first over the time after it: the decoding rate, prefill left out
                "decode_tokens_per_s": (len(tokens) - 1) / (wall - ttft) if len(tokens) > 1 and wall > ttft else None,
                "held_bytes": held_bytes(runners[m], gen, model, len(ids) + len(tokens)),
            }
            if on_cuda:
                row["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(model.device) - allocated_before
            if gen is not None:  # our own methods also report their drafting time and their own stats
                row["draft_ms_per_step"] = 1000 * gen.draft_s / max(gen.steps, 1)
                row.update(accepted=sum(gen.accepted), drafted=sum(gen.drafted), draft_s=gen.draft_s,
                           per_position=per_position(gen.accepted, gen.depths))
                row.update({k: v for k, v in gen.extra.items() if isinstance(v, (int, float, str, list, dict))})
            rows.append(row)
            bar.update(1)
    bar.close()

    # speedup per row: tokens/s over the baseline's on the same prompt
    base = {(r["repeat"], r["question_id"]): r["tokens_per_s"] for r in rows if r["method"] == baseline}
    for r in rows:  # per prompt and pass; the tables average tokens/s first (SpecBench), see summarize
        r["speedup"] = r["tokens_per_s"] / base[r["repeat"], r["question_id"]]

    summary = summarize(rows, methods, baseline)
    table = markdown(summary, methods, baseline) + "\n" + memory_table(rows, methods)
    header = run_header(args, model, len(questions), sampling)
    print(header + "\n\n" + table)

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        stem = os.path.splitext(args.out)[0]
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(f"`python bench/side_by_side.py {' '.join(sys.argv[1:])}`\n\n{header}\n\n{table}\n")
        bar_chart(summary, methods, stem + ".png", f"{args.model} on {model.device}", baseline)
        print(f"\nrows: {args.out}  table: {stem}.md  chart: {stem}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
