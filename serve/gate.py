# SPDX-License-Identifier: MIT
"""
serve/gate.py -- the batch gate: how many of its draft tokens each row of a serving engine's batch is
sent, decided every step from the step times measured in the running server and each draft token's
chance of being accepted. It knows nothing of vLLM: serve/vllm_proposers.py feeds it.

A step of the engine is one forward over every running request: one token per row, plus the drafts
sent. On a GPU at small batch that forward is memory-bound, and a draft token costs almost nothing;
on a CPU, or on any device once the batch is large, the forward grows with its tokens, and a rejected
draft token costs nearly what an accepted one brings. Model a step as t(N) = a + b·N over N tokens.
A step with B rows, S expected tokens emitted (B bonus tokens plus the accepted drafts) and time t
gains from one more draft token of acceptance chance P when

    (S + P) / (t + b)  >  S / t        <=>        P  >  b·S / t

so a token is sent only when its expected gain pays for its share of the forward. With no drafts,
S / t = B / (a + b·B): the bar is ρ(B) = b·B / (a + b·B), which rises with the batch. Worked with the
2-core AVX2 CPU's vLLM steps (RESULTS.md, "Serving under load": 67.7 ms at one row, 117.6 ms at
eight, about 5 ms more for each draft token), the bar b·B / t(B) is 0.07 at one row, 0.34 at eight.

The file, section by section:

    step times        StepTimes: t(N) = a + b·N, fitted online to the engine's steps      [1]
    acceptance        Acceptance: P(token accepted | the ones before it were), per signal [2]
                      DraftRecord: a draft scored in hindsight, sent or not
    the rule          BatchGate.choose: the draft tokens worth their forward, batch-wide   [3]
                      AllDrafts: gate = 'off', every draft sent
    a user's cap      schedule_cap: vLLM's num_speculative_tokens_per_batch_size           [4]

What SmartSpec (Liu et al., 2024, arXiv:2406.14066) does for model drafters -- pick k to maximise
goodput from profiled latencies and online acceptance -- done here per draft token, for drafters
without a model, from the method's own signals (the n-gram order and count behind a token, Cacheback's
table and depth), with the step times measured inside the server itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

# ---- 1. Step times -----------------------------------------------------------------------------------------
#
# The engine calls the proposer once per step, synchronously: the time from one point in a call to the
# same point in the next is one engine step (scheduling, the forward, its bookkeeping) plus the
# proposer's own drafting. The proposer knows how many tokens that forward held (each row's token and
# the drafts it was sent) and only hands a step over when it was a plain decode step: a step that
# prefilled a request (a new one, a prefill chunk, a request back from a pause) costs what its prompt
# costs.
#
# Fitted by least squares with exponential forgetting (the context grows, the load changes), so
# recent steps count most. subtle: while the batch size holds and the gate sends nothing, every step
# has the same N and the slope b cannot be seen. A prior gives it until N varies: b = PRIOR_SLOPE·a,
# the 2-core AVX-512 CPU's cost of a row over its fixed cost (no speculation ran 19.2 tokens/s at
# one row and 85.4 at eight: 52 and 94 ms a step, throughput with its prefills, so 6 ms a row over
# 46 ms; RESULTS.md, "Serving with vLLM"). A CPU is where a longer forward costs most, so the prior
# errs toward sending less. It fades with a half-life of PRIOR_HALF_LIFE steps (never below
# PRIOR_FLOOR of its weight), so that the steps' own slope takes over as soon as they show one: on a
# device where a longer forward costs little, the first drafts that pass show it, and the fit lets
# the rest through. subtle: N varies only once some draft clears the prior's bar (at eight rows
# 0.51, above the 0.5 an unmeasured signal starts at: a signal measured surer, in hindsight, does)
# or the batch size changes; while nobody waits the bar is doubled (IDLE_VALUE, section 3), and
# from about eight rows under the prior nothing clears it until the batch size moves, as it does
# in a server while requests come and go. Where N never varies, any prior weight gives the same
# fit: the line through the steps' mean with the prior's slope. note: a row costs more than a draft token (the
# sampling and the engine's bookkeeping of a request come with it: about 7 ms against 5 on the AVX2
# CPU), so while the batch size moves, b lies between the two: the gate then errs on the side of
# sending less.

PRIOR_SLOPE = 0.13  # b / a before the steps show otherwise
PRIOR_WEIGHT = 1 / 16  # the prior's weight, times the mean N squared (StepTimes.fit)
PRIOR_HALF_LIFE = 32  # steps
PRIOR_FLOOR = 1e-3
HALF_LIFE = 256  # steps: a step's weight halves after this many more
SLOWEST = 3.0  # a step over 3x its predicted time (a pause, a page fault) is counted as 3x


class StepTimes:
    """t(N) = a + b·N seconds for a forward of N tokens, fitted online.

    >>> times = StepTimes()
    >>> for n in (8, 8, 12, 16, 8, 20):
    ...     times.add(n, 0.046 + 0.006 * n)
    >>> a, b = times.fit()
    >>> round(a * 1000, 1), round(b * 1000, 2)       # ms, ms per token
    (46.0, 6.0)
    """

    def __init__(self, prior_slope: float = PRIOR_SLOPE, half_life: float = HALF_LIFE):
        self.prior_slope = prior_slope
        self.decay = 0.5 ** (1 / half_life)
        self.prior_left = 1.0  # what is left of the prior's weight
        # the weighted sums of the least squares fit: weights, N, N², t, N·t
        self.w = 0.0
        self.wn = 0.0
        self.wnn = 0.0
        self.wt = 0.0
        self.wnt = 0.0
        self.steps = 0  # steps measured, all told

    def add(self, tokens: int, seconds: float) -> None:
        """One decode step of `tokens` tokens took `seconds`."""
        if self.steps >= 8:  # once the fit means something, a stray slow step is held to 3x
            a, b = self.fit()
            seconds = min(seconds, SLOWEST * (a + b * tokens))
        for name in ("w", "wn", "wnn", "wt", "wnt"):
            setattr(self, name, getattr(self, name) * self.decay)
        self.w += 1
        self.wn += tokens
        self.wnn += tokens * tokens
        self.wt += seconds
        self.wnt += tokens * seconds
        self.steps += 1
        self.prior_left = max(PRIOR_FLOOR, self.prior_left * 0.5 ** (1 / PRIOR_HALF_LIFE))

    def fit(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per token. Before any step: (1, PRIOR_SLOPE), in units of a.

        The normal equations of  sum w (a + b·N - t)²  +  λ N̄² (b - r·a)²  (r = the prior slope, λ
        its weight: PRIOR_WEIGHT, fading), so that it speaks for the slope only while the steps do
        not."""
        if self.w == 0:
            return 1.0, self.prior_slope
        r = self.prior_slope
        mean_n = self.wn / self.w
        prior = PRIOR_WEIGHT * self.prior_left * mean_n * mean_n
        # [[s_aa, s_ab], [s_ab, s_bb]] @ [a, b] = [y_a, y_b]
        s_aa = self.w + prior * r * r
        s_ab = self.wn - prior * r
        s_bb = self.wnn + prior
        y_a = self.wt
        y_b = self.wnt
        det = s_aa * s_bb - s_ab * s_ab
        a = (y_a * s_bb - y_b * s_ab) / det
        b = (s_aa * y_b - s_ab * y_a) / det
        if b < 0:  # a forward never gets cheaper with more tokens: the best fit with b = 0
            return self.wt / self.w, 0.0
        if a < 0:  # nor costs nothing at all: the best fit through the origin
            return 0.0, self.wnt / self.wnn
        return a, b

# ---- 2. Acceptance -----------------------------------------------------------------------------------------
#
# Each draft token carries a signal: a key the drafter gives it (the n-gram order and how often the
# context was followed by that token; Cacheback's table, its leader's fan-out and the depth). Its
# chance p(key) of being accepted when every token before it in the chain was, is counted per key:
#
#     server-wide   p_server = (hits + 1) / (trials + 2)             all requests; 1/2 until measured
#     per request   p = (own hits + SHRINK·p_server) / (own trials + SHRINK)
#
# so a request whose drafts keep failing is trusted less than the server's average for the same
# signal, and a new request starts at that average. A chain's token j is accepted with chance
# P_j = p_1 · ... · p_j.
#
# Counted how: every draft is scored once the text after it is known, in hindsight. For a chain
# the engine verified, that is exactly what it accepted: the accepted tokens are the text, and the
# first rejected one differs from the token the engine emitted in its place (greedy: the model's
# own; sampled: a token drawn without it), so len(sampled_token_ids[row]) - 1 draft tokens match.
# For a draft the gate held back, the text arrives one token a step and the draft is scored all the
# same. So a row that is gated off earns its drafts back: its signals keep being measured. Sampled,
# it holds too: a drafter without draft probabilities (ours) is verified by vLLM's rejection sampler
# as if the draft gave its token x probability 1, so x is accepted with the chance p(x) that the
# target draws it, and on a rejection the emitted token is drawn from the target with x left out;
# a held-back draft's x is followed by a plain draw from the target, x with chance p(x). Either way
# the text continues with x with chance p(x): the hindsight count is unbiased, sent or not.

SHRINK = 4.0  # a request's own trials weigh against this many of the server's


class Acceptance:
    """p(key): the chance that a draft token with this signal is accepted, given that every token
    before it in its chain was.

    >>> acceptance = Acceptance()
    >>> acceptance.p("4-gram")                      # never measured: a coin
    0.5
    >>> mine = {}
    >>> for hit in (True, True, True, False):
    ...     acceptance.record("4-gram", hit, mine)
    >>> acceptance.p("4-gram"), round(acceptance.p("4-gram", mine), 3)
    (0.6666666666666666, 0.708)
    """

    def __init__(self):
        self.hits: dict[Hashable, float] = {}
        self.trials: dict[Hashable, float] = {}

    def p(self, key: Hashable, own: dict | None = None) -> float:
        server = (self.hits.get(key, 0.0) + 1.0) / (self.trials.get(key, 0.0) + 2.0)
        if not own or key not in own:
            return server
        own_hits, own_trials = own[key]
        return (own_hits + SHRINK * server) / (own_trials + SHRINK)

    def record(self, key: Hashable, hit: bool, own: dict) -> None:
        """One trial of `key`, for the server and for the request whose counts are `own`."""
        self.hits[key] = self.hits.get(key, 0.0) + hit
        self.trials[key] = self.trials.get(key, 0.0) + 1
        own_hits, own_trials = own.get(key, (0, 0))
        own[key] = (own_hits + hit, own_trials + 1)

    def chain(self, keys: Sequence[Hashable], own: dict | None = None) -> list[float]:
        """P_j for each token of a chain: the chance that tokens 1..j are all accepted."""
        probs = []
        together = 1.0
        for key in keys:
            together *= self.p(key, own)
            probs.append(together)
        return probs


@dataclass
class DraftRecord:
    """A draft made when the request's text was `start` tokens long: its tokens, their keys, how
    many of them have been scored, and whether it is done. Scored in hindsight as the text grows.

    >>> acceptance, mine = Acceptance(), {}
    >>> record = DraftRecord(start=3, tokens=[7, 8, 9], keys=["a", "b", "c"])
    >>> record.score([1, 2, 3, 7], acceptance, mine)     # 7 matches; 8 is not known yet
    >>> record.done
    False
    >>> record.score([1, 2, 3, 7, 5], acceptance, mine)  # 5 is not 8: scored, done
    >>> record.done, acceptance.trials, acceptance.hits
    (True, {'a': 1.0, 'b': 1.0}, {'a': 1.0, 'b': 0.0})
    """

    start: int
    tokens: list[int]
    keys: list[Hashable]
    scored: int = 0
    done: bool = False  # a miss seen, or every token scored

    def score(self, text: Sequence[int], acceptance: Acceptance, own: dict) -> None:
        """Score the tokens the text now reaches. Tokens after the first miss are not trials: their
        context was wrong."""
        while not self.done and self.start + self.scored < len(text):
            hit = int(text[self.start + self.scored]) == self.tokens[self.scored]
            acceptance.record(self.keys[self.scored], hit, own)
            self.scored += 1
            self.done = not hit or self.scored == len(self.tokens)

# ---- 3. The rule -------------------------------------------------------------------------------------------
#
# Every draft token of every row is a candidate with its P. Sorted from the surest down, each is
# sent while it pays (P > b·S / t, S and t growing as tokens are added; with free slots a token
# counts for less, below); the first that does not ends the step's choice, since every later one
# is less sure still. A chain's P never rises along
# it, so what a row is sent is always a prefix of its draft. subtle: the bar b·S / t only rises as
# tokens are sent (a token is sent only when it lifts S / t). Worked, one row, a = 46 ms, b = 6 ms
# (the prior's numbers):
#
#     P = 0.8, 0.5, 0.2     S, t = 1, 52 ms   0.8 > 6·1/52 = 0.12    send   S, t = 1.8, 58 ms
#                                             0.5 > 6·1.8/58 = 0.19  send   S, t = 2.3, 64 ms
#                                             0.2 < 6·2.3/64 = 0.22  stop: two tokens sent
#
# When nobody waits. The rule counts an accepted token as worth t / S, a row's share of the step.
# That is right while requests wait for a slot (the row ends sooner and the next request takes its
# place), and for the requests' mean latency. With fewer rows than the engine's slots
# (max_num_seqs) nobody waits: the scheduler would have let them in. subtle: there, a token
# accepted on a row that is not the last to finish only lets that row end a step earlier, which
# saves its row's cost in a later step (about 2.3 ms of an 83 ms step at 14 rows on the AVX-512
# CPU, less than the 3-5 ms a draft token costs); only the last row's tokens save a whole step. A
# closed batch (14 requests submitted at once to 16 slots) lost 6-8% to drafts that paid by t / S
# (RESULTS.md, "Serving under load on the AVX-512 EPYC"). The proposer cannot tell which row ends
# last (it sees no request's max_tokens), so while nobody waits and more than one row runs, an
# accepted token counts for IDLE_VALUE of one: the gate maximizes (B + IDLE_VALUE·ΣP) / t instead
# of (B + ΣP) / t, and its rule reads IDLE_VALUE·P > b·S / t, with S = B + IDLE_VALUE·ΣP. One row
# alone is the last: its tokens count whole. IDLE_VALUE is a compromise, chosen on the tuning half
# with bench/serve_sim.py (the proposers in a simulated engine, at the step costs measured in
# vLLM; RESULTS.md, "The gate when nobody waits"): at 1 the closed batch of 16 loses, at 0.25
# requests arriving at random wait longer than at 1; 0.5 keeps both. Where the KV cache, not
# max_num_seqs, holds requests back, the gate takes it that nobody waits: it errs toward sending
# less.

IDLE_VALUE = 0.5  # what an accepted token counts for while nobody waits


@dataclass
class BatchGate:
    """gate = 'on': the draft tokens worth their share of the forward, batch-wide. slots: the
    engine's max_num_seqs (None: unknown, requests taken to wait). clock: the time source (tests
    inject one).

    >>> gate = BatchGate(slots=8)
    >>> for n in (1, 2, 3, 4, 1, 5):                  # a forward of n tokens: 46 ms + 6 ms a token
    ...     gate.times.add(n, 0.046 + 0.006 * n)
    >>> gate.choose({0: [0.8, 0.5, 0.2]})             # one row, its draft's P_j
    {0: 2}
    >>> gate.choose({0: [0.8], 1: [0.3]}, batch=8)    # all 8 slots full: 0.3 > 6·2.8/64 = 0.26
    {0: 1, 1: 1}
    >>> gate.choose({0: [0.8], 1: [0.3]})             # two rows, 6 free slots: 0.5·0.3 < 0.225
    {0: 1, 1: 0}
    """

    clock: Callable[[], float] = time.perf_counter
    slots: int | None = None  # the engine's max_num_seqs
    idle_value: float = IDLE_VALUE  # an accepted token's worth while nobody waits (bench/serve_sim.py)
    times: StepTimes = field(default_factory=StepTimes)
    acceptance: Acceptance = field(default_factory=Acceptance)
    last_start: float | None = None
    tokens_sent: int = 0  # draft tokens sent, all steps
    tokens_held: int = 0  # draft tokens held back, all steps

    def step_ended(self, last_forward_size: int | None) -> None:
        """The engine called the proposer again: the step since its last call (the proposer's own
        drafting, then the engine's forward) has ended; that forward held last_forward_size tokens
        (None: not a plain decode step, so its time says nothing of t(N))."""
        now = self.clock()
        if self.last_start is not None and last_forward_size is not None:
            self.times.add(last_forward_size, now - self.last_start)
        self.last_start = now

    def forget_step(self) -> None:
        """The step in progress is not to be timed (the drafting failed)."""
        self.last_start = None

    def choose(self, rows: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        """{row: its draft's P_j, non-increasing} -> {row: how many of its draft tokens to send}.
        batch: the rows the engine is running, drafted or not (default: len(rows))."""
        a, b = self.times.fit()
        batch = len(rows) if batch is None else batch
        nobody_waits = self.slots is not None and 1 < batch < self.slots
        value = self.idle_value if nobody_waits else 1.0  # what an accepted token counts for
        emitted = float(len(rows))  # S: each row's bonus token (a row without a draft included)
        seconds = a + b * len(rows)  # t: one token a row
        candidates = sorted((-p, j, row) for row, probs in rows.items() for j, p in enumerate(probs))
        lengths = {row: 0 for row in rows}
        # subtle: a row's P_j never rises along its chain and ties sort by j, so each row's tokens come
        # in chain order and what it is sent is a prefix of its draft
        for minus_p, _j, row in candidates:
            p = -minus_p
            if value * p * seconds <= b * emitted:  # P <= b·S / t: it would not pay for its share
                break
            lengths[row] += 1
            emitted += value * p
            seconds += b
        self.tokens_sent += sum(lengths.values())
        self.tokens_held += sum(len(probs) for probs in rows.values()) - sum(lengths.values())
        return lengths


@dataclass
class AllDrafts(BatchGate):
    """gate = 'off': every row is sent its whole draft (the proposers as they were before the gate)."""

    def choose(self, rows: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        lengths = {row: len(probs) for row, probs in rows.items()}
        self.tokens_sent += sum(lengths.values())
        return lengths

# ---- 4. A user's cap: vLLM's per-batch-size schedule -------------------------------------------------------


def schedule_cap(schedule, batch: int, k: int) -> int:
    """The most draft tokens a row may be sent at this batch size under a schedule of (low, high,
    K) ranges (vLLM's num_speculative_tokens_per_batch_size; K = 0 turns drafting off there). As
    vLLM reads its schedule: a batch size in a gap or past the last range takes the K of the range
    before it. No schedule: k.

    >>> schedule_cap([(1, 4, 4), (5, 16, 2), (17, 64, 0)], 8, 4)
    2
    >>> schedule_cap(None, 8, 4), schedule_cap([(1, 4, 3)], 8, 4), schedule_cap([(1, 2, 3), (9, 16, 1)], 5, 4)
    (4, 3, 3)
    """
    most = k
    for low, high, cap in sorted(schedule or (), key=lambda entry: int(entry[0])):
        if int(low) > batch:
            break
        most = min(k, int(cap))  # this range's, or the one before a gap
    return most
