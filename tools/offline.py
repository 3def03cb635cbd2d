# SPDX-License-Identifier: MIT
"""Drafting quality without a model: replay a drafter over a known greedy text, in seconds.

Under greedy decoding the emitted text is the model's greedy text whatever the drafter, so a drafter can be
run offline over a stream (prompt ids, the model's greedy output ids), with no model at all. At each step it
proposes its chain or tree from its state; the accepted length is the longest root path whose tokens are the
stream's next tokens, the bonus token is the one after it; then the drafter learns the emitted tokens, as its
generate() makes it learn them. Mean accepted tokens (MAT: new tokens over target forwards, the prefill
counted, as bench/side_by_side.py counts), draft tokens per step and acceptance by position come out as an online run
gives them: tests/test_offline.py checks the n-gram predictor and Cacheback against generate() step by step,
and prompt lookup's target forwards against transformers' own run (after an EOS see `replay`).

    python tools/offline.py                                    # every drafter, budgets 4, 16, 64, tuning streams
    python tools/offline.py --streams selfchat --budgets 4,16,96 --drafters cacheback-paper,ngram --json
    python tools/offline.py --text notes.txt                   # a reader's own text (tokenized, NOT greedy)

The drafters, under their files' names, at a budget B of draft tokens per forward:
    ngram            ngram_predictor.NGramPredictor (the chapter: DRAFT_COUNT = B; its cost gate is off)
    cacheback-cpu    cacheback.grow_tree at the CPU geometry (LL 2, FL 3, CRT B/4), TDL = B + 1, no frozen table
    cacheback-paper  the paper's (LL 1, FL 3, CRT B/6, the selfchat frozen table), TDL = B + 1
    prompt-lookup    transformers' prompt lookup decoding, from its documented rule: the last n tokens
                     (n = max_matching_ngram_size = 2, then 1) looked up at their earliest earlier occurrence,
                     the up to prompt_lookup_num_tokens = B tokens after it drafted, cut before an EOS
The cost gate and the pruning are off: they read a device's costs, which offline has none of.

Streams (cached under the default model's folder, made once: about 3 minutes on a 2-core CPU):
    tune, report   HF greedy output of the shipped prompts' tuning (odd ids) and reporting (even ids) halves
    selfchat       the default model's own greedy answers to corpus/instructions.jsonl (batched greedy,
                   re-tokenized from their text: the model's text, not always token for token its greedy ids)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import cacheback  # noqa: E402
import ngram_predictor  # noqa: E402
import prompts  # noqa: E402
import verify  # noqa: E402
from verify import Tree  # noqa: E402

POSITIONS = 8  # acceptance reported at draft positions 1..8
BUDGETS = (4, 16, 64)


# ---- the replay loop: one drafter over one stream -------------------------------------------------------------

@dataclass
class Replay:
    """What one drafter did over one or more streams: per step the draft size and the accepted length."""

    tokens: int = 0  # emitted tokens
    forwards: int = 0  # target forwards: the prefill and one per step
    drafted: list = field(default_factory=list)  # per step: draft tokens (tree size - 1)
    accepted: list = field(default_factory=list)  # per step: accepted draft tokens (bonus not counted)
    reached: list = field(default_factory=lambda: [0] * POSITIONS)  # steps whose draft reaches depth k
    hit: list = field(default_factory=lambda: [0] * POSITIONS)  # steps that accepted k or more
    per_stream: list = field(default_factory=list)  # each stream's own MAT

    def add(self, other: "Replay") -> None:
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.hit = [a + b for a, b in zip(self.hit, other.hit)]
        self.per_stream += other.per_stream

    def row(self) -> dict:
        steps = max(len(self.drafted), 1)
        streams = max(len(self.per_stream), 1)
        return {"mat": self.tokens / max(self.forwards, 1), "mat_mean": sum(self.per_stream) / streams,
                "draft_per_step": sum(self.drafted) / steps,
                "acceptance": [h / r if r else None for h, r in zip(self.hit, self.reached)],
                "steps": len(self.drafted), "tokens": self.tokens}


def walk(tree: Tree, stream: Sequence[int], at: int) -> list[int]:
    """The accepted path's node indices below the root: verify.accepted_path's walk, with the stream's tokens
    from index `at` (the token after the root) as the model's choices (none past the stream's end)."""
    depths = tree.depths

    def choose(node: int) -> int:  # the model's token after `node`: the stream's, at that depth
        position = at + depths[node]
        return stream[position] if position < len(stream) else -1  # -1: no child carries it

    path, _ = verify.accepted_path(tree, None, choose)
    return path[1:]


def replay(prompt: Sequence[int], output: Sequence[int], start: Callable, propose: Callable,
           learn: Callable, max_new_tokens: int | None = None) -> Replay:
    """Run one drafter over one stream, as its generate() runs: start(prompt, first token) makes its state;
    then per step propose(state, room) -> the draft Tree below the pending token (room: the most tokens a
    step may still emit, max_new_tokens (default: the stream's length) less those emitted, as generate()
    cuts its draft), and learn(state, new tokens) after the step. subtle: a stream that ends at an EOS
    ends the same step online, so the forwards (and MAT) agree; but the model's tokens after an EOS are not
    in the stream, so drafted tokens past it count as rejected here and may count as accepted online."""
    r = Replay(tokens=len(output), forwards=1)
    state = start(list(prompt), output[0])
    limit = len(output) if max_new_tokens is None else max_new_tokens
    done = 1  # emitted so far: the prefill's token
    while done < len(output):
        tree = propose(state, limit - done)
        path = walk(tree, output, done)
        depth = max(tree.depths)
        for k in range(min(depth, POSITIONS)):
            r.reached[k] += 1
            r.hit[k] += len(path) > k
        r.drafted.append(len(tree) - 1)
        r.accepted.append(len(path))
        new = list(output[done : done + len(path) + 1])  # the accepted tokens and the bonus
        done += len(new)
        r.forwards += 1
        learn(state, new)
    r.per_stream.append(r.tokens / r.forwards)  # this stream's own MAT
    return r


# ---- the drafters: each file's own drafting code, driven as its generate() drives it ---------------------

def ngram_drafter(budget: int):
    """ngram_predictor.generate()'s drafting: the predictor seeded with the prompt, a chain of up to
    DRAFT_COUNT = budget tokens (the buffer guard and the room cut as there), every emitted token learned."""
    # the chapter's buffer guard stays: MAX_BATCH = 64 tokens a forward, so B = 64 drafts 63 at most
    cfg = ngram_predictor.NgramConfig(draft_count=budget, cost="free")

    def start(prompt, first):
        predictor = ngram_predictor.NGramPredictor(cfg.max_order, cfg.draft_count, cfg.max_history)
        predictor.update_batch(prompt)
        predictor.update(first)
        return {"predictor": predictor, "pending": first}

    def propose(state, room):
        drafted = state["predictor"].draft()[: cfg.max_batch - 1][: room - 1]
        return Tree.chain(state["pending"], [token for token, _ in drafted])

    def learn(state, new):
        state["predictor"].update_batch(new)
        state["pending"] = new[-1]

    return start, propose, learn


def cacheback_drafter(budget: int, cfg: cacheback.CachebackConfig, frozen: cacheback.CacheTable | None):
    """cacheback.generate()'s drafting: a fresh dynamic table from the prompt, grow_tree below the pending
    token under TDL = budget + 1, the room cut, the new windows after each step."""
    cfg = dataclasses.replace(cfg, tdl=budget + 1, crt=min(cfg.crt, budget - 1), cost="free")

    def start(prompt, first):
        dynamic = cacheback.CacheTable(cfg.ll, cfg.fl, cfg.lc, cfg.fc)
        text = prompt + [first]
        if cfg.dynamic_table:
            cacheback.update_table(dynamic, text, 0)
        return {"dynamic": dynamic, "text": text}

    def propose(state, room):
        text = state["text"]
        tree = cacheback.grow_tree(text[-1], text, state["dynamic"], frozen, cfg.tdl, cfg.crt, cfg.frozen_order,
                                   cut=cfg.follower_fit == "cut")
        if max(tree.depths) >= room:
            depths = tree.depths
            tree = tree.subtree(lambda i: depths[i] < room)
        return tree

    def learn(state, new):
        first_new = len(state["text"])
        state["text"] += new
        if cfg.dynamic_table:
            cacheback.update_table(state["dynamic"], state["text"], first_new)

    return start, propose, learn


def prompt_lookup_drafter(budget: int, max_matching_ngram_size: int = 2, eos_ids: Sequence[int] = ()):
    """transformers' prompt lookup, from its documented rule (not its class): for n = max_matching_ngram_size
    down to 1, the earliest earlier occurrence of the text's last n tokens with tokens after it; draft up to
    `budget` (prompt_lookup_num_tokens) of those, cut before an EOS (a draft that is only an EOS: none)."""
    eos = set(eos_ids)

    def start(prompt, first):
        return {"text": prompt + [first]}

    def propose(state, room):
        text = state["text"]
        draft = []
        for n in range(min(max_matching_ngram_size, len(text) - 1), 0, -1):
            tail = text[-n:]
            for i in range(len(text) - n):  # earliest first; the tail itself has nothing after it
                if text[i : i + n] == tail:
                    draft = text[i + n : i + n + budget]
                    break
            if draft:
                break
        cut = next((j for j, t in enumerate(draft) if t in eos), len(draft))
        return Tree.chain(text[-1], draft[:cut][: room - 1])

    def learn(state, new):
        state["text"] += new

    return start, propose, learn


# Cacheback's presets, as its file defines them (the budget then sets TDL, and CRT in proportion)
CACHEBACK_PRESETS = {f"cacheback-{name}": getattr(cacheback.CachebackConfig, name)() for name in cacheback.PRESETS}


def make_drafter(name: str, budget: int, frozen_table=None, eos_ids=(), max_matching_ngram_size: int = 2,
                 chain: int | None = None, **fields):
    """(start, propose, learn) of the drafter `name` at budget B; `fields` fix Cacheback's config (ll, fl,
    frozen_order, dynamic_table, ...). chain = k: each tree's first branch, at most k tokens, as the vLLM
    proposer drafts it (cacheback.first_branch); an n-gram chain is cut to k."""
    if name == "ngram":
        drafter = ngram_drafter(budget)
    elif name == "prompt-lookup":
        drafter = prompt_lookup_drafter(budget, max_matching_ngram_size, eos_ids)
    elif name in CACHEBACK_PRESETS:
        base = CACHEBACK_PRESETS[name]
        # CRT scales with the budget: the presets reserve a quarter (CPU: 4 of 16) and a sixth (16 of 96)
        crt = max(1, budget * base.crt // (base.tdl - 1))
        cfg = dataclasses.replace(base, crt=crt, **fields)
        frozen = frozen_table if cfg.frozen != "none" else None
        drafter = cacheback_drafter(budget, cfg, frozen)
    else:
        raise ValueError(f"unknown drafter {name!r}")
    if chain is None:
        return drafter
    start, propose_tree, learn = drafter

    def propose(state, room):
        tree = propose_tree(state, room)
        return Tree.chain(tree.tokens[0], cacheback.first_branch(tree)[:chain])

    return start, propose, learn


DRAFTERS = ("ngram", *CACHEBACK_PRESETS, "prompt-lookup")


def replay_all(streams: list[dict], name: str, budget: int, max_new_tokens: int | None = None,
               **kwargs) -> Replay:
    total = Replay()
    for s in streams:
        total.add(replay(s["prompt"], s["output"], *make_drafter(name, budget, **kwargs),
                         max_new_tokens=max_new_tokens))
    return total


# ---- streams ------------------------------------------------------------------------------------------------

def stream_path(name: str, n: int) -> str:
    return os.path.join(os.path.dirname(verify.converted_dir()), f"streams-{name}-{n}.jsonl")


def make_streams(name: str, n: int = 128) -> list[dict]:
    """The stream set `name`, made once and cached: {"id", "prompt", "output", "greedy"} per stream."""
    path = stream_path(name, n)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    from tqdm import tqdm

    model, tok = verify.load_model(device="cpu")
    eos = verify.eos_ids_of(model, tok)
    rows = []
    if name == "selfchat":
        from tools import build_frozen

        for r in build_frozen.selfchat_answers(model, tok, verify.DEFAULT_MODEL, progress=False):
            answer = tok(r["answer"], add_special_tokens=False).input_ids + eos[:1]
            rows.append({"id": r["id"], "prompt": verify.encode_prompt(tok, r["instruction"]),
                         "output": answer[:n], "greedy": False})
    else:
        questions = prompts.load_prompts(prompts.SHORT, None, name)
        for q in tqdm(questions, desc=f"streams: HF greedy, {name} half", unit="prompt", file=sys.stderr):
            ids = verify.encode_prompt(tok, q["prompt"])
            rows.append({"id": q["question_id"], "prompt": ids, "output": verify.hf_generate(model, ids, n, eos),
                         "greedy": True})
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def text_stream(path: str) -> list[dict]:
    """A reader's own text file, tokenized: its first line the prompt, the rest the output (not greedy)."""
    tok = verify.load_model(device="cpu")[1]
    with open(path, encoding="utf-8") as f:
        first, _, rest = f.read().partition("\n")
    return [{"id": 0, "prompt": tok(first).input_ids, "output": tok(rest, add_special_tokens=False).input_ids,
             "greedy": False}]


# ---- the Cacheback paper's Figure 4 and Table 1, as MAT ------------------------------------------------------

def figure4(streams: list[dict], tok, budget: int = 95, limit: int | None = None, lls=(1, 2, 3, 4),
            fls=(1, 2, 3, 4, 5)) -> str:
    """MAT over LL x FL at the paper's other settings (TDL = budget + 1, CRT scaled, LC 2^20, FC 128), the
    selfchat frozen table built for each (LL, FL) from the shipped answers (seconds each)."""
    from tools import build_frozen

    lines = ["| LL \\ FL | " + " | ".join(map(str, fls)) + " |", "|" + " --- |" * (len(fls) + 1)]
    for ll in lls:
        cells = []
        for fl in fls:
            frozen = build_frozen.build_corpus_table(tok, "selfchat", ll, fl, 2**20, 128)[0]
            row = replay_all(streams, "cacheback-paper", budget, limit, frozen_table=frozen, ll=ll, fl=fl).row()
            cells.append(f"{row['mat']:.3f}")
        lines.append(f"| {ll} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table1(streams: list[dict], frozen, budgets: Sequence[int], limit: int | None = None) -> str:
    """MAT of the paper's three table configurations (dual, no frozen, only frozen) at each budget."""
    setups = {"dual": {}, "no frozen": {"frozen": "none"}, "only frozen": {"dynamic_table": False}}
    lines = ["| configuration | " + " | ".join(f"B = {b}" for b in budgets) + " |",
             "|" + " --- |" * (len(budgets) + 1)]
    for name, fields in setups.items():
        cells = []
        for b in budgets:
            row = replay_all(streams, "cacheback-paper", b, limit, frozen_table=frozen, **fields).row()
            cells.append(f"{row['mat']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the command line ---------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    head = ("| drafter | B | MAT (all steps) | MAT (mean over streams) | draft tokens / step | "
            + " | ".join(f"acc@{k}" for k in range(1, POSITIONS + 1)))
    lines = [head + " |", "|" + " --- |" * (5 + POSITIONS)]
    for r in rows:
        acc = " | ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance"])
        lines.append(f"| {r['drafter']} | {r['budget']} | {r['mat']:.3f} | {r['mat_mean']:.3f} | "
                     f"{r['draft_per_step']:.1f} | {acc} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--streams", default="tune", choices=["tune", "report", "selfchat"],
                   help="the stream set (default: tune)")
    p.add_argument("--text", help="replay over this text file instead (first line: the prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="stream length (default: 128)")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma list of {', '.join(DRAFTERS)}")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="draft tokens per forward, B")
    p.add_argument("--json", action="store_true", help="one JSON object per drafter and budget")
    p.add_argument("--max-matching-ngram-size", type=int, default=2,
                   help="prompt lookup: the longest tail looked up (transformers' default: 2)")
    p.add_argument("--follower-fit", choices=["whole", "cut"], default="whole",
                   help="Cacheback: a follower the budget cannot hold whole is skipped (whole, the paper) or cut")
    p.add_argument("--figure4", action="store_true",
                   help="Cacheback's Figure 4 as MAT: LL 1-4 x FL 1-5 at the largest budget given")
    p.add_argument("--table1", action="store_true",
                   help="Cacheback's Table 1 as MAT: dual, no frozen, only frozen, at each budget")
    args = p.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
        if min(budgets) < 1 or args.max_matching_ngram_size < 1:
            raise ValueError
    except ValueError:
        print(f"error: --budgets {args.budgets} and --max-matching-ngram-size: whole numbers >= 1 expected",
              file=sys.stderr)
        return 2
    names = args.drafters.split(",")
    unknown = [n for n in names if n not in DRAFTERS]
    if unknown:
        print(f"error: --drafters: unknown {', '.join(unknown)} (known: {', '.join(DRAFTERS)})", file=sys.stderr)
        return 2
    if args.text and not os.path.isfile(args.text):
        print(f"error: --text {args.text}: no such file", file=sys.stderr)
        return 2
    streams = text_stream(args.text) if args.text else make_streams(args.streams, args.max_new_tokens)
    model, tok = verify.load_model(device="cpu")
    eos = verify.eos_ids_of(model, tok)
    frozen = None
    limit = None if args.text else args.max_new_tokens  # what the streams were made with
    if "cacheback-paper" in names or args.figure4 or args.table1:
        frozen = cacheback.frozen_table_for(tok, CACHEBACK_PRESETS["cacheback-paper"])
    if args.figure4 or args.table1:
        if args.table1:
            print(table1(streams, frozen, budgets, limit))
        if args.figure4:
            print(figure4(streams, tok, max(budgets), limit))
        return 0
    rows = []
    for name in names:
        for b in budgets:
            fields = {"follower_fit": args.follower_fit} if name.startswith("cacheback") else {}
            if name == "prompt-lookup":
                fields = {"max_matching_ngram_size": args.max_matching_ngram_size}
            r = replay_all(streams, name, b, limit, frozen_table=frozen, eos_ids=eos, **fields).row()
            rows.append({"drafter": name, "budget": b, **r})
            if args.json:
                print(json.dumps(rows[-1]))
    if not args.json:
        print(f"{len(streams)} streams ({'--text' if args.text else args.streams}), "
              f"{sum(len(s['output']) for s in streams)} tokens")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
