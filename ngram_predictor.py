# SPDX-License-Identifier: MIT
"""
ngram_predictor.py -- speculative decoding with an n-gram frequency predictor, after the chapter
"Speculative Decoding with N-grams" of the akunu inference-engine book (part 5, chapter 30, 2025;
https://akunu.prabod.rathnayaka.me/part5/ch30-speculative-decoding.html).

The simplest complete speculative decoder there is; read it first:

    DRAFT   an n-gram table built from the text so far predicts up to DRAFT_COUNT next tokens (a chain)
    VERIFY  one forward over [known token, d0 ... dn]
    ACCEPT  the longest prefix where draft == the model's argmax, plus the bonus token
    ROLL    KV cache rolled back to prefix + accepted

The chapter, section by section, and where it is here (this file's sections in brackets):

    its constants                   MAX_ORDER, DRAFT_COUNT, MAX_HISTORY, MAX_BATCH, NgramConfig  [0]
    "Hashing"                       fnv1a_64                                                    [1]
    "The N-gram Predictor"          NGramPredictor: update, lookup (backoff), draft (a chain)   [2]
    "Speedup Analysis" (corrected)  expected_accepted, estimate_alpha, predicted_speedup        [3]
    "The Verification Loop",        generate                                                    [4]
    "Buffer Capacity Guard"
    beyond the chapter              the chain cut to the prefix worth its time here:            [4]
                                    verify.WhatPays (verify.py section 9)
                                    model.generate(..., custom_generate=...): custom_generate   [5]
                                    the CLI: prepare, report, main                              [6]

    python ngram_predictor.py --prompt "Write a Python class Stack with push and pop." --compare

    import ngram_predictor                                   # from transformers' own generate()
    out = model.generate(input_ids, custom_generate=ngram_predictor.custom_generate, max_new_tokens=128)

    from ngram_predictor import NgramConfig, generate        # as a library
    gen = generate(model, prompt_ids, 128, eos_ids, NgramConfig())

Greedy and float32, the output is model.generate(do_sample=False)'s (tests/test_ngram.py). A
"deviation:" comment marks each place this file departs from the chapter (TUTORIAL.md §2 lists them),
and "ours" what the chapter does not have; a difference from other code is said as such, unmarked.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

import verify
from verify import Generation, Tree

# ---- 0. Configuration: the chapter's constants -------------------------------------------------------------

MAX_ORDER = 4  # up to 4-grams: a context of up to 3 tokens
DRAFT_COUNT = 4  # predict up to 4 tokens per round
MAX_HISTORY = 512  # the chapter's "sliding window" of recent tokens (what it bounds: NGramPredictor)
# "buffer capacity": at most this many tokens in one verification forward (known + drafts)
MAX_BATCH = 64

@dataclass
class NgramConfig:
    """Everything generate() needs to know, under the chapter's names. The default is the chapter
    plus the rule of verify.py section 9 (cost): of each chain, the prefix worth its time on this
    machine; where a draft costs about nothing (a GPU) that is the whole chain.

    >>> NgramConfig.paper().cost, NgramConfig().cost    # the chapter verifies every draft
    ('free', 'timed')
    """

    max_order: int = MAX_ORDER
    draft_count: int = DRAFT_COUNT
    max_history: int = MAX_HISTORY
    max_batch: int = MAX_BATCH
    # deviation: what a draft token costs (verify.WhatPays): 'timed', 'pinned' (no timing: runs repeat)
    # or 'free' (every draft verified: the chapter)
    cost: str = "timed"

    @classmethod
    def paper(cls) -> "NgramConfig":
        """The chapter exactly: verify whatever the predictor drafts."""
        return cls(cost="free")

    @classmethod
    def for_device(cls, device) -> "NgramConfig":  # the same everywhere: the rule measures the device
        return cls()

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value."""
        if self.max_order < 2:
            raise verify.UserError(f"--max-order must be at least 2 (got {self.max_order})")
        if self.draft_count < 0:
            raise verify.UserError(f"--draft-count must be >= 0 (got {self.draft_count})")
        if self.max_history < self.max_order - 1:
            raise verify.UserError(f"--max-history must hold a full context of {self.max_order - 1} tokens")
        if self.max_batch < 1:
            raise verify.UserError(f"--max-batch must be at least 1 (got {self.max_batch})")
        verify.check_cost(self.cost)

# ---- 1. Hashing: 64-bit FNV-1a over token ids --------------------------------------------------------------
#
# The chapter's C++:
#     uint64_t h = 14695981039346656037ULL;       // FNV-1a offset basis
#     for (...) { h ^= tokens[i]; h *= 1099511628211ULL; }   // FNV-1a prime
#
# note: each step XORs a whole token id, not one byte as textbook FNV-1a does; below 256 the two
# agree (the tests check the published test vectors). Python ints do not overflow: a mask makes
# uint64's wrap explicit.

FNV_OFFSET_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
MASK64 = (1 << 64) - 1

def fnv1a_64(tokens: Iterable[int]) -> int:
    """64-bit FNV-1a over token ids: for each id, XOR it into the hash, then multiply by the FNV
    prime.

    >>> hex(fnv1a_64(b"a"))   # bytes are token ids < 256, so this is textbook FNV-1a
    '0xaf63dc4c8601ec8c'
    """
    h = FNV_OFFSET_BASIS
    for t in tokens:
        h ^= t
        h = (h * FNV_PRIME) & MASK64  # uint64 multiply: keep the low 64 bits
    return h

# ---- 2. The predictor --------------------------------------------------------------------------------------
#
#   tables[order-2] :  hash(context of order-1 tokens)  ->  {next token: count}
#
#   tables[0]  bigrams    hash(t_{n-1})                 -> {t_n: count}
#   tables[1]  trigrams   hash(t_{n-2}, t_{n-1})        -> {t_n: count}
#   tables[2]  4-grams    hash(t_{n-3}, t_{n-2}, t_{n-1}) -> {t_n: count}

class NGramPredictor:
    def __init__(self, max_order: int = MAX_ORDER, draft_count: int = DRAFT_COUNT,
                 max_history: int = MAX_HISTORY):
        assert max_order >= 2 and draft_count >= 0 and max_history >= max_order - 1
        self.max_order, self.draft_count = max_order, draft_count
        # The recent tokens, used only as the *context* for update() and predict().
        self.history: deque[int] = deque(maxlen=max_history)
        self.tables: list[dict[int, dict[int, int]]] = [{} for _ in range(max_order - 1)]
        # subtle: what the window bounds. The chapter says it bounds memory and adds a recency bias,
        # but as there the tables are never pruned when a token leaves the window (memory grows with
        # the distinct contexts ever seen; counts are cumulative, so an old favourite can outvote a
        # recent one), and update() and draft() read only the history's last MAX_ORDER - 1 = 3
        # tokens. So the window bounds the deque alone: any MAX_HISTORY >= 3 gives the same drafts.

    def held_bytes(self) -> int:
        """The tables as the chapter's C++ stores them: an 8-byte hash per context, a token id and a
        count per continuation; and the history's token ids."""
        pairs = sum(8 + 2 * verify.TOKEN_BYTES * len(counts) for t in self.tables for counts in t.values())
        return pairs + verify.TOKEN_BYTES * len(self.history)

    def update(self, token: int) -> None:
        """Count `token` after its 1-, 2- and 3-token contexts, then append it to the history."""
        token = int(token)
        h = self.history
        for order in range(2, self.max_order + 1):
            n = order - 1  # context length
            if len(h) < n:
                break
            context = [h[i] for i in range(len(h) - n, len(h))]
            counts = self.tables[order - 2].setdefault(fnv1a_64(context), {})
            counts[token] = counts.get(token, 0) + 1
        h.append(token)

    def update_batch(self, tokens: Sequence[int]) -> None:
        """Seed with the prompt: just update() for every token."""
        for t in tokens:
            self.update(t)

    def lookup(self, context: Sequence[int]) -> tuple[int, int] | None:
        """Backoff: try the longest context first (4-gram), then shorter ones. Returns
        (token, order)."""
        for order in range(self.max_order, 1, -1):
            n = order - 1
            if len(context) < n:
                continue
            counts = self.tables[order - 2].get(fnv1a_64(context[-n:]))
            if counts:
                # The most frequent continuation. Tie rule: the continuation seen FIRST wins
                # (Python's max returns the first maximal item and dicts keep insertion order) --
                # like a C++ loop with a strict '>' over an insertion-ordered map.
                return max(counts, key=counts.__getitem__), order
        return None

    def draft(self) -> list[tuple[int, int]]:
        """Up to draft_count (token, order) pairs. Each prediction is appended to a *tentative*
        context, so the predictor chains its own guesses: predicting " quick" lets it then predict
        " brown"."""
        context = list(self.history)[-(self.max_order - 1) :]
        drafts = []
        for _ in range(self.draft_count):
            found = self.lookup(context)
            if found is None:
                break  # no table knows this context: no draft for this position, stop
            drafts.append(found)
            context.append(found[0])
        return drafts

    def predict(self) -> list[int]:  # the chapter's predict(): just the draft tokens
        return [token for token, _ in self.draft()]

# ---- 3. The arithmetic: expected accepted drafts and the predicted speedup ---------------------------------
#
# Model: each draft token is right with probability alpha, independently, and drafts are accepted
# until the first wrong one. With D drafts, k accepted for k < D means k successes then a failure;
# k = D means D successes (there is no further draft to fail on):
#
#     E[accepted] = sum_{k=0}^{D-1} k alpha^k (1 - alpha)  +  D alpha^D  =  alpha (1 - alpha^D) / (1 - alpha)
#
# (the second form: sum_{k=1}^{D} P(accepted >= k).) deviation: the chapter sums the first term up
# to k = D, counting the all-accepted case twice: its printed 2.05 and 3.28 for alpha = 0.7 and 0.9
# are too high, the correct values 1.77 and 3.10 (its 0.94 for alpha = 0.5 is right; TUTORIAL.md §2).
#
# Each step also yields the bonus token, and a forward over 1 + D tokens costs t(1+D) instead of
# t(1):
#
#     speedup ~= (1 + E[accepted]) / (t(1+D) / t(1))       (the chapter's overhead-adjusted estimate)

def expected_accepted(alpha: float, d: int) -> float:
    """Closed form of E[accepted drafts] under i.i.d. acceptance.
    >>> round(expected_accepted(0.7, 4), 4), round(expected_accepted(0.9, 4), 4)
    (1.7731, 3.0951)
    """
    if alpha >= 1.0:
        return float(d)
    return alpha * (1 - alpha**d) / (1 - alpha)

def expected_accepted_as_printed(alpha: float, d: int) -> float:
    """The chapter's formula as written (sum to k = D, plus D alpha^D): double-counts the
    all-accepted case. Kept only so the tests and the tutorial can show the difference."""
    return sum(k * alpha**k * (1 - alpha) for k in range(d + 1)) + d * alpha**d

def estimate_alpha(accepted: Sequence[int], drafted: Sequence[int]) -> float | None:
    """Per-token acceptance rate from a run: every accepted draft is a success; a step that accepted
    fewer than it drafted ended in exactly one failure. (The maximum-likelihood estimate of alpha
    under the i.i.d. model; steps without drafts say nothing about alpha.)"""
    successes = sum(accepted)
    failures = sum(1 for a, d in zip(accepted, drafted) if d > 0 and a < d)
    if successes + failures == 0:
        return None
    return successes / (successes + failures)

def predicted_speedup(alpha: float, d: int, cost_ratio: float) -> float:
    return (1 + expected_accepted(alpha, d)) / cost_ratio

# ---- 4. The decode loop ------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
             cfg: NgramConfig, *, step_times: dict[int, float] | None = None,
             sampling: verify.Sampling = verify.GREEDY, on_emit=None, on_step=None,
             stop=None) -> Generation:
    """Speculative decoding with n-gram drafts. step_times: what a forward over n tokens takes here,
    {n: seconds} (verify.step_times: `prepare` reads it, else it is read now), for the rule of
    verify.py section 9. `sampling`: greedy by default; sampled, exactly the plain sampler's tokens
    (verify.Sampling)."""
    cfg.check()
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step, stop=stop)
    predictor = NGramPredictor(cfg.max_order, cfg.draft_count, cfg.max_history)
    predictor.update_batch(prompt_ids)  # seed the tables with the prompt (chat template included)
    # deviation: what of a chain pays for its time here (verify.py section 9; cost 'free': all of it)
    pays = verify.WhatPays.for_run(model, cfg.cost, step_times, cfg.draft_count + 1)
    # the cache's capacity: prompt + output + the largest step (the pending token and a full draft)
    cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + cfg.draft_count + 1)
    known = verify.first_token(verify.prefill(model, cache, prompt_ids), len(prompt_ids), sampling)
    predictor.update(known)
    if gen.finish_prefill(known):
        return gen
    while True:
        # -- DRAFT
        t0 = time.perf_counter()
        drafted = predictor.draft()  # [(token, order), ...]
        # Buffer capacity guard (the chapter: `if (n_draft + 1 > max_batch) n_draft = max_batch -
        # 1;`): the verification batch is [known, d0 .. dn], so at most max_batch - 1 drafts fit.
        if len(drafted) + 1 > cfg.max_batch:
            drafted = drafted[: cfg.max_batch - 1]
        drafted = drafted[: max_new_tokens - len(gen.tokens) - 1]  # a step emits <= len + 1
        chain = Tree.chain(known, [token for token, _ in drafted])  # [known, d0, ..., dn]
        orders = [order for _, order in drafted]
        # deviation: the chain's prefix worth its time here, each token's signal its order
        tree = pays.subtree(chain, [None, *(f"{order}-gram" for order in orders)], gen.tokens)
        orders = orders[: len(tree) - 1]
        draft_s = time.perf_counter() - t0

        # -- VERIFY (no draft: the chapter's "no-draft fallback", a plain one-token forward)
        pos = verify.cache_len(cache)
        logits = verify.tree_forward(model, cache, tree)  # [1 + n_draft, V]
        # -- ACCEPT: longest prefix where draft == the model's token (argmax, or the keyed sample),
        # plus the bonus token at the first mismatch.
        path, bonus = verify.accept(tree, logits, pos, sampling)
        # the known token + accepted drafts (= accepted + 1 in the chapter's words)
        keep = len(path)
        # -- ROLL BACK: the KV of rejected drafts was computed from a wrong context; forget it.
        verify.rollback(cache, pos + keep)
        n_before = len(gen.tokens)
        done = gen.finish_step(tree, path, bonus, draft_s, kv_before=pos + len(tree), kv_after=pos + keep,
                               orders=orders, withheld=pays.withheld)  # what an on_step hook is shown
        predictor.update_batch(gen.tokens[n_before:])  # the predictor learns every emitted token
        if done:
            gen.extra["rule"] = pays.summary()
            gen.extra["held_bytes"] = verify.tensor_bytes(cache) + predictor.held_bytes()
            return gen
        known = bonus

# ---- Beyond the paper --------------------------------------------------------------------------------------
# ---- 5. From model.generate: the drop-in (verify.py section 13 reads the call) -----------------------------

def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                    ngram_config: NgramConfig | None = None, step_times: dict[int, float] | None = None,
                    seed: int | None = None, **model_kwargs):
    """Run this file's generate() from transformers' own call, in place of its loop:

        out = model.generate(input_ids, custom_generate=ngram_predictor.custom_generate, max_new_tokens=128)

    Returns what model.generate returns (prompt + new tokens), honouring its GenerationConfig, its
    stopping criteria (per emitted token) and its streamer, and refusing in one line what it cannot
    reproduce (verify.check_generate_call).

    Keywords of this method, passed to model.generate beside its own:
        - ngram_config: an NgramConfig (default: NgramConfig.for_device(model.device), the script's
          default on that device)
        - step_times: what a forward over n tokens takes here, {n: seconds} (default:
          verify.step_times, measured once on this machine and kept in
          ~/.cache/specdec-reference, or $SPECDEC_CACHE)
        - seed: the sampling noise's key under do_sample=True (default: drawn from torch's
          generator, so torch.manual_seed repeats a call)
    """
    call = verify.GenerateCall.read(model, input_ids, logits_processor, stopping_criteria,
                                    generation_config, model_kwargs, seed)
    cfg = NgramConfig.for_device(model.device) if ngram_config is None else ngram_config
    cfg.check()
    # the script's set-up (prepare), once per model: the step times, from disk after the first run
    cfg, extra = verify.prepare_once(model, prepare, cfg, step_times=step_times)
    gen = generate(model, call.prompt_ids, call.max_new_tokens, call.eos_ids, cfg, sampling=call.sampling,
                   **call.hooks(), **extra)
    return call.output(gen)

# ---- 6. CLI ------------------------------------------------------------------------------------------------

def prepare(model, tok, cfg: NgramConfig, name: str = verify.DEFAULT_MODEL,
            step_times: dict[int, float] | None = None) -> tuple[NgramConfig, dict]:
    """The set-up before the first call (the script's, and custom_generate's through
    verify.prepare_once): the step times the rule reads, unless cost is free or the caller gives
    them; measured once per machine (verify.step_times). tok and name: unused here."""
    if cfg.cost == "free":
        return cfg, {}
    return cfg, {"step_times": step_times or verify.step_times(model, cfg.draft_count + 1)}

def report(model, prompt_ids, gen: Generation, cfg: NgramConfig, extra: dict) -> dict:
    """After the timed run: the acceptance rate alpha, the cost ratio T(1+D)/T(1) of this machine's
    step times and the speedup the chapter's formula predicts from them."""
    alpha = estimate_alpha(gen.accepted, gen.drafted)
    d = cfg.draft_count
    times = extra.get("step_times") or verify.step_times(model, d + 1)
    ratio = verify.seconds_at(times, d + 1) / times[min(times)]
    out = {"alpha": alpha, "cost_ratio": ratio, "draft_steps": sum(1 for drafted in gen.drafted if drafted)}
    out["predicted_speedup"] = predicted_speedup(alpha, d, ratio) if alpha is not None else None
    return out

def make_parser():
    """The options: the common ones (verify.common_parser), then the paper's parameters
    (tools/replay.py takes them too)."""
    parser = verify.common_parser(__doc__.split("\n\n")[0].strip() + "\n\nDrafts come from n-gram counts "
                                  "of the prompt and the generated text; no draft model.")
    g = parser.add_argument_group("n-gram predictor (the chapter's parameters)")
    g.add_argument("--max-order", type=int,
                   help="MAX_ORDER: largest n-gram (backs off) (default: 4)")
    g.add_argument("--draft-count", type=int,
                   help="DRAFT_COUNT: draft tokens per step at most (default: 4)")
    g.add_argument("--max-history", type=int,
                   help="MAX_HISTORY: recent tokens used as context; tables are "
                   f"never pruned (default: {MAX_HISTORY})")
    g.add_argument("--max-batch", type=int,
                   help="buffer capacity guard: tokens per verification forward at "
                   f"most (default: {MAX_BATCH})")
    g.add_argument("--cost", choices=verify.COSTS, help=verify.COST_HELP + " (default: timed)")
    return parser

def main(argv=None) -> int:
    return verify.run_cli(make_parser(), "ngram", generate, NgramConfig, prepare, report, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
