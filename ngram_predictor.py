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
    beyond the chapter              CostGate: skip drafts not worth their measured cost here    [5]
                                    model.generate(..., custom_generate=...): custom_generate   [6]
                                    the CLI: prepare, report, main                              [7]

    python ngram_predictor.py --prompt "Write a Python class Stack with push and pop." --compare

    import ngram_predictor                                   # from transformers' own generate()
    out = model.generate(input_ids, custom_generate=ngram_predictor.custom_generate, max_new_tokens=128)

    from ngram_predictor import NgramConfig, generate        # as a library
    gen = generate(model, prompt_ids, 128, eos_ids, NgramConfig())

Greedy and float32, the output is model.generate(do_sample=False)'s (tests/test_ngram.py). Where
this file deviates from the chapter it says so in a "deviation:" comment (and in TUTORIAL.md §2).
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
    plus our cost gate (section 5), on costs measured once per device (kept on disk): where a draft
    costs about nothing (a GPU) the gate lets every draft through; where it costs more (a CPU) it
    withholds the drafts that would cost more than they bring.

    >>> NgramConfig.paper().draft_cost, NgramConfig().draft_cost    # the chapter always verifies
    (1.0, None)
    """

    max_order: int = MAX_ORDER
    draft_count: int = DRAFT_COUNT
    max_history: int = MAX_HISTORY
    max_batch: int = MAX_BATCH
    # t(1+D)/t(1) for the gate; None = measured; 1.0 = no gate (the chapter)
    draft_cost: float | None = None

    @classmethod
    def paper(cls) -> "NgramConfig":
        """The chapter exactly: verify whatever the predictor drafts."""
        return cls(draft_cost=1.0)

    @classmethod
    def for_device(cls, device) -> "NgramConfig":  # the same everywhere: the gate measures the device
        return cls()

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value. draft_cost may come as the
        command line's text ('auto' or a number): it is read into None or a float here."""
        if self.max_order < 2:
            raise verify.UserError(f"--max-order must be at least 2 (got {self.max_order})")
        if self.draft_count < 0:
            raise verify.UserError(f"--draft-count must be >= 0 (got {self.draft_count})")
        if self.max_history < self.max_order - 1:
            raise verify.UserError(f"--max-history must hold a full context of {self.max_order - 1} tokens")
        if self.max_batch < 1:
            raise verify.UserError(f"--max-batch must be at least 1 (got {self.max_batch})")
        self.draft_cost = self.read_draft_cost(self.draft_cost)

    @staticmethod
    def read_draft_cost(cost) -> float | None:
        """None for 'auto' (measured), else a number >= 1 (the command line gives text)."""
        if cost in (None, "auto"):
            return None
        refusal = verify.UserError(f"--draft-cost must be 'auto' or a number >= 1 (got {cost!r})")
        try:
            value = float(cost)
        except ValueError:
            raise refusal from None
        if not value >= 1.0:  # (nan too)
            raise refusal
        return value

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
# (the second form: sum_{k=1}^{D} P(accepted >= k).) The chapter sums the first term up to k = D,
# counting the all-accepted case twice: its printed 2.05 and 3.28 for alpha = 0.7 and 0.9 are too
# high, the correct values 1.77 and 3.10 (its 0.94 for alpha = 0.5 is right). See TUTORIAL.md §2.
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
             cfg: NgramConfig, *, draft_costs: dict[int, float] | None = None,
             sampling: verify.Sampling = verify.GREEDY, on_emit=None, on_step=None,
             stop=None) -> Generation:
    """Speculative decoding with n-gram drafts. draft_costs = {n: t(1+n)/t(1)}, the cost gate's
    curve (measured once per machine by `prepare`, else now); cfg.draft_cost replaces it (1.0 = the
    chapter: always verify). `sampling`: greedy by default; sampled, exactly the plain sampler's
    tokens (verify.Sampling)."""
    cfg.check()
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step, stop=stop)
    predictor = NGramPredictor(cfg.max_order, cfg.draft_count, cfg.max_history)
    predictor.update_batch(prompt_ids)  # seed the tables with the prompt (chat template included)
    gate = CostGate.for_run(model, cfg, draft_costs)  # section 5; draft_cost = 1 lets all drafts by
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
        orders = [order for _, order in drafted]
        refused = []  # deviation (section 5): a draft not worth its cost on this hardware
        if drafted and not gate.allows(orders):
            refused = drafted
            drafted = []
            orders = []
        drafts = [token for token, _ in drafted]
        draft_s = time.perf_counter() - t0

        # -- VERIFY (no draft: the chapter's "no-draft fallback", a plain one-token forward)
        tree = Tree.chain(known, drafts)  # [known, d0, ..., dn] at positions pos, pos+1, ...
        pos = verify.cache_len(cache)
        logits = verify.tree_forward(model, cache, tree)  # [1 + n_draft, V]
        # -- ACCEPT: longest prefix where draft == the model's token (argmax, or the keyed sample),
        # plus the bonus token at the first mismatch.
        path, bonus = verify.accept(tree, logits, pos, sampling)
        # the known token + accepted drafts (= accepted + 1 in the chapter's words)
        keep = len(path)
        gate.update(orders, keep - 1)
        # -- ROLL BACK: the KV of rejected drafts was computed from a wrong context; forget it.
        verify.rollback(cache, pos + keep)
        n_before = len(gen.tokens)
        done = gen.finish_step(tree, path, bonus, draft_s, kv_before=pos + len(tree), kv_after=pos + keep,
                               orders=orders, refused=refused)  # what an on_step hook is shown
        predictor.update_batch(gen.tokens[n_before:])  # the predictor learns every emitted token
        if done:
            gen.extra["draft_cost"] = gate.cost_of(cfg.draft_count)  # t(1+D)/t(1): a full draft
            gen.extra["gated_drafts"] = gate.skipped
            gen.extra["held_bytes"] = verify.tensor_bytes(cache) + predictor.held_bytes()
            return gen
        known = bonus

# ---- Beyond the paper --------------------------------------------------------------------------------------
# ---- 5. The cost gate (our deviation from the chapter) -----------------------------------------------------
#
# The chapter claims speculation "never hurts": with no draft the step is a plain one-token forward.
# That holds only if a *rejected* draft is free, i.e. t(1+D) ~ t(1). On a GPU it nearly is; on a
# small CPU a forward over 5 tokens costs well over a one-token one, so a rejected draft slows its
# step down, and without a gate prompts with few repeats decode slower than plain decoding
# (RESULTS.md, "The n-gram predictor").
#
# So we apply the chapter's own estimate *per step*, before verifying:
#     verify the draft only if   1 + E[accepted]  >  t(1+n) / t(1)   ("draft_cost" of its length n <= D)
# i.e. only if the expected tokens per forward beat the plain step's 1 token per 1 unit of cost.
# E[accepted] = sum_k prod_{j<=k} alpha(order_j), alpha measured online per order (4-gram, trigram,
# bigram). subtle: the prior must be optimistic. A withheld draft teaches the gate nothing, so with
# alpha = 1/2 (1 + E = 1.94 for four drafts) a full draft costing 1.95 would never be tried. With
# alpha = 3/4 until measured, every order is tried early and only orders that proved poor are withheld.
# With draft_cost = 1 the condition always holds and the decoder is exactly the chapter's.

class CostGate:
    def __init__(self, draft_cost: dict[int, float] | float, max_order: int = MAX_ORDER,
                 draft_count: int = DRAFT_COUNT):
        """draft_cost: {n: t(1+n)/t(1)} for drafts of n = 1..D tokens (`measure_draft_costs`), or
        one number c = t(1+D)/t(1) for a full draft, taken as linear in n below it (c = 1: the gate
        is off). note: a draft of n < D tokens is charged ITS cost, t(1+n)/t(1), not that of a full
        D-token draft."""
        if isinstance(draft_cost, dict):
            self.cost = {int(n): float(c) for n, c in draft_cost.items()}
        else:
            d = max(draft_count, 1)
            self.cost = {n: 1 + (float(draft_cost) - 1) * n / d for n in range(1, d + 1)}
        # Optimistic prior: alpha = 3/4 for every order until measured (3 pseudo-hits in 4
        # pseudo-trials).
        self.hits = {order: 3 for order in range(2, max_order + 1)}
        self.trials = {order: 4 for order in range(2, max_order + 1)}
        self.skipped = 0  # drafts withheld because they were not worth their cost

    @classmethod
    def for_run(cls, model, cfg: NgramConfig, draft_costs: dict[int, float] | None) -> "CostGate":
        """cfg.draft_cost if set, else the curve `prepare` measured, else one measured now."""
        if cfg.draft_cost is not None:
            draft_costs = cfg.draft_cost
        elif draft_costs is None:
            draft_costs = measure_draft_costs(model, cfg.draft_count)
        return cls(draft_costs, cfg.max_order, cfg.draft_count)

    def cost_of(self, n: int) -> float:
        """t(1+n)/t(1) for a draft of n tokens (the largest measured length if n is beyond it)."""
        if n <= 0 or not self.cost:
            return 1.0
        # normally n itself; a bigger forward never costs less
        longer = [k for k in self.cost if k >= n]
        return self.cost[min(longer)] if longer else self.cost[max(self.cost)]

    def alpha(self, order: int) -> float:
        return self.hits[order] / self.trials[order]

    def expected_accepted_of(self, orders: Sequence[int]) -> float:
        """E[accepted] of one draft whose tokens came from these orders, each with its measured
        alpha (section 3's expected_accepted assumes one alpha for all)."""
        e, p = 0.0, 1.0
        for order in orders:
            p *= self.alpha(order)  # P(the first k drafts are all accepted)
            e += p
        return e

    def allows(self, orders: Sequence[int]) -> bool:
        ok = 1 + self.expected_accepted_of(orders) > self.cost_of(len(orders))
        self.skipped += not ok
        return ok

    def update(self, orders: Sequence[int], accepted: int) -> None:
        """Drafts before the first rejection were accepted; the first rejected one failed; the ones
        after it were never really tested (their context was wrong), so they are not counted."""
        for j, order in enumerate(orders[: accepted + 1]):
            self.trials[order] += 1
            self.hits[order] += j < accepted

@torch.no_grad()
def measure_draft_costs(model, d: int) -> dict[int, float]:
    """{n: t(1+n)/t(1)} for n = 1..D drafts: what the cost gate charges a draft of each length."""
    if d <= 0:
        return {}
    curve = verify.measure_cost_curve(model, list(range(2, d + 2)))
    return {n: curve[1 + n] for n in range(1, d + 1)}

# ---- 6. From model.generate: the drop-in (verify.py section 13 reads the call) -----------------------------

def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                    ngram_config: NgramConfig | None = None, draft_costs: dict[int, float] | None = None,
                    seed: int | None = None, **model_kwargs):
    """Run this file's generate() from transformers' own call, in place of its loop:

        out = model.generate(input_ids, custom_generate=ngram_predictor.custom_generate, max_new_tokens=128)

    Returns what model.generate returns (prompt + new tokens), honouring its GenerationConfig, its
    stopping criteria (per emitted token) and its streamer, and refusing in one line what it cannot
    reproduce (verify.check_generate_call).

    Keywords of this method, passed to model.generate beside its own:
        - ngram_config: an NgramConfig (default: NgramConfig.for_device(model.device), the script's
          default on that device)
        - draft_costs: the cost gate's curve {n: t(1+n)/t(1)} (default: measured once on this
          machine and kept in ~/.cache/specdec-reference, or $SPECDEC_CACHE)
        - seed: the sampling noise's key under do_sample=True (default: drawn from torch's
          generator, so torch.manual_seed repeats a call)
    """
    call = verify.GenerateCall.read(model, input_ids, logits_processor, stopping_criteria,
                                    generation_config, model_kwargs, seed)
    cfg = NgramConfig.for_device(model.device) if ngram_config is None else ngram_config
    cfg.check()
    # the script's set-up (prepare), once per model: the gate's curve, from disk after the first run
    cfg, extra = verify.prepare_once(model, prepare, cfg, draft_costs=draft_costs)
    gen = generate(model, call.prompt_ids, call.max_new_tokens, call.eos_ids, cfg, sampling=call.sampling,
                   **call.hooks(), **extra)
    return call.output(gen)

# ---- 7. CLI ------------------------------------------------------------------------------------------------

def prepare(model, tok, cfg: NgramConfig, name: str = verify.DEFAULT_MODEL,
            draft_costs: dict[int, float] | None = None) -> tuple[NgramConfig, dict]:
    """The set-up before the first call (the script's, and custom_generate's through
    verify.prepare_once): the cost gate's curve, unless cfg.draft_cost fixes it or the caller gives
    draft_costs; measured once per machine (verify.measured_costs). tok and name: unused here."""
    if cfg.draft_cost is not None:
        return cfg, {}
    if draft_costs is None:
        draft_costs = measure_draft_costs(model, cfg.draft_count)
    return cfg, {"draft_costs": draft_costs}

def report(model, prompt_ids, gen: Generation, cfg: NgramConfig, extra: dict) -> dict:
    """After the timed run: the acceptance rate alpha, the cost ratio t(1+D)/t(1) (the gate's, or
    measured now when --draft-cost fixed it) and the speedup the chapter's formula predicts from
    them."""
    alpha = estimate_alpha(gen.accepted, gen.drafted)
    d = cfg.draft_count
    ratio = gen.extra["draft_cost"] if cfg.draft_cost is None else measure_draft_costs(model,
                                                                                       d).get(d, 1.0)
    out = {"alpha": alpha, "cost_ratio": ratio, "draft_steps": sum(1 for d in gen.drafted if d)}
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
    g.add_argument("--draft-cost",
                   help="cost gate (our deviation, section 5): auto = measure t(1+n)/t(1); a "
                   "number c = t(1+D)/t(1); 1 = the chapter, always verify (default: auto)")
    return parser

def main(argv=None) -> int:
    return verify.run_cli(make_parser(), "ngram", generate, NgramConfig, prepare, report, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
