# SPDX-License-Identifier: MIT
"""
serve/gate.py -- the batch gate: how many of its draft tokens each row of a serving engine's batch is
sent, decided every step from the step times measured in the running server and each draft token's
chance of being accepted. It knows nothing of vLLM: serve/vllm_proposers.py feeds it.

A step of the engine is one forward over every running request: one token per row, plus the drafts
sent. On a GPU at small batch that forward is memory-bound, and a draft token costs almost nothing;
on a CPU, or on any device once the batch is large, the forward grows with its tokens, and a rejected
draft token costs nearly what an accepted one brings. Model a step as t = a + c·B + b·D over B
rows and D draft tokens (c a row's cost, b a draft token's). A step with B rows, S expected tokens
emitted (B bonus tokens plus the accepted drafts) and time t gains from one more draft token of
acceptance chance P when

    (S + P) / (t + b)  >  S / t        <=>        P  >  b·S / t

so a token is sent only when its expected gain pays for its share of the forward. With no drafts,
S / t = B / (a + c·B): the bar is ρ(B) = b·B / (a + c·B), which rises with the batch. Worked with
the 2-core AVX2 CPU's vLLM steps (RESULTS.md, "Serving under load": 67.7 ms at one row, 117.6 ms at
eight, about 5 ms more for each draft token), the bar b·B / t(B) is 0.07 at one row, 0.34 at eight.

The file, section by section:

    step times        StepTimes: t = a + c·B + b·D, fitted online to the engine's steps   [1]
    acceptance        Acceptance: P(token accepted | the ones before it were), per signal [2]
                      DraftRecord: a draft scored in hindsight, sent or not
    the rule          BatchGate.choose: the draft tokens worth their forward, batch-wide   [3]
                      AllDrafts: gate = 'off', every draft sent
    a user's cap      schedule_cap: vLLM's num_speculative_tokens_per_batch_size           [4]

What SmartSpec (Liu et al., 2024, arXiv:2406.14066) does for model drafters -- pick k to maximise
goodput from profiled latencies and online acceptance -- done here per draft token, for drafters
without a model, from the method's own signals (the n-gram order, count and share behind a token,
Cacheback's table, fan-out, depth and siblings), with the step times measured inside the server itself.
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
# recent steps count most, as t = a + c·B + b·D: a the step's fixed cost, c a row's, b a draft
# token's. subtle: two slopes, not one. A row costs more than a draft token on the AVX2 CPU (its
# sampling and the engine's bookkeeping of a request: about 7 ms against 5) and less on the AVX-512
# one at 14 rows (2.3 ms against 3-5; RESULTS.md, "Serving under load on the AVX-512 EPYC"). One
# slope over N = B + D tokens, fitted while the batch size moves, takes a row's cost for a draft
# token's: there it let drafts through that cost more than it thought (a closed batch of 16, one
# run in six with Cacheback: 435 draft tokens sent, 0.92x; RESULTS.md, "The gate when nobody
# waits").
#
# While the batch size holds and the gate sends nothing, the slopes cannot be seen. Priors give
# them until the steps do: c = PRIOR_SLOPE·a, the 2-core AVX-512 CPU's cost of a row over its fixed
# cost (no speculation ran 19.2 tokens/s at one row and 85.4 at eight: 52 and 94 ms a step,
# throughput with its prefills, so 6 ms a row over 46 ms; RESULTS.md, "Serving with vLLM"), and
# b = c, a draft token costing what a row does. A CPU is where a longer forward costs most, so the
# priors err toward sending less. The row's prior fades with a half-life of PRIOR_HALF_LIFE steps
# (never below PRIOR_FLOOR of its weight); the draft token's keeps its weight and is outweighed
# as draft tokens are measured (below). So the steps' own slopes take over as soon as they show
# them: on a device where a longer forward costs little, the first few dozen steps with drafts
# show it, and the fit lets the rest through. subtle: D varies only once some draft clears the
# prior's bar (at eight rows 0.51, above the 0.5 an unmeasured signal starts at: a signal measured
# surer, in hindsight, does); while nobody waits the bar is doubled (IDLE_VALUE, section 3), and
# from about eight rows under the priors nothing clears it until the batch size moves and c with
# it. Where nothing varies, any prior weight gives the same fit: the plane through the steps' mean
# with the priors' slopes.
#
# subtle: the draft token's prior (b = c) does not fade as steps pass: it weighs as much as
# DRAFT_PRIOR_TOKENS steps of one draft token each, and the steps' Σ w·D² outweighs it only once
# drafts have been sent in a few dozen steps. Faded by the step count, it left b to the first
# few steps with a draft in them, and one step's noise (5-10 ms of a 100 ms step at 14 rows) is
# several draft tokens' cost: Cacheback's paper preset in a closed batch of 16 fitted b = 15-22 ms
# (a row: 3-4 ms) from the 2 draft tokens it had sent, and then drafted nothing more, not even for
# the batch's last two or three rows, where a draft token of a few ms pays. (The steps' sums forget
# with HALF_LIFE; the prior does not: it is what b is thought to be where drafts are rare.) Where
# the batch size varies little, c follows b through it; where both vary, the pull on c is small
# (2.41 ms for 2.3 in tests/test_gate.py's AVX-512 stream).

PRIOR_SLOPE = 0.13  # c / a before the steps show otherwise (and b = c)
PRIOR_WEIGHT = 1 / 16  # each prior's weight, times the mean tokens a step squared (StepTimes.fit)
PRIOR_HALF_LIFE = 32  # steps
PRIOR_FLOOR = 1e-3
DRAFT_PRIOR_TOKENS = 8.0  # b = c weighs as much as this many steps of one draft token each, always
HALF_LIFE = 256  # steps: a step's weight halves after this many more
SLOWEST = 3.0  # a step over 3x its predicted time (a pause, a page fault) is counted as 3x


class StepTimes:
    """t = a + c·B + b·D seconds for a forward over B rows and D draft tokens, fitted online.

    >>> times = StepTimes()
    >>> for rows, drafts in ((8, 0), (8, 4), (12, 0), (12, 8), (14, 2), (14, 6)) * 20:
    ...     times.add(rows, drafts, 0.051 + 0.0023 * rows + 0.004 * drafts)
    >>> [round(1000 * x, 1) for x in times.fit()]      # ms: a, a row (c), a draft token (b)
    [50.6, 2.3, 4.0]

    (51, 2.3 and 4 ms made the steps; the rest is the priors' pull: the draft token's does not fade
    with the steps, it is outweighed by the drafts measured.)
    """

    def __init__(self, prior_slope: float = PRIOR_SLOPE, half_life: float = HALF_LIFE):
        self.prior_slope = prior_slope
        self.decay = 0.5 ** (1 / half_life)
        self.prior_left = 1.0  # what is left of the priors' weight
        # the weighted sums of the least squares fit over x = (1, B, D): Σ w·x·xᵀ [3][3] and Σ w·x·t [3],
        # w = 0.5^(age in steps / half_life). Plain floats, not numpy: on three unknowns numpy's call
        # overhead was half a solve (35 µs, now 17, outside vLLM; RESULTS.md, "Batch 4 against suffix")
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xt = [0.0] * 3
        self.steps = 0  # steps measured, all told
        self.fitted: tuple[float, float, float] | None = None  # fit()'s answer until the next add()

    def predict(self, rows: int, drafts: int) -> float:
        a, c, b = self.fit()
        return a + c * rows + b * drafts

    def add(self, rows: int, drafts: int, seconds: float) -> None:
        """One decode step over `rows` rows and `drafts` draft tokens took `seconds`."""
        if self.steps >= 8:  # once the fit means something, a stray slow step is held to 3x
            seconds = min(seconds, SLOWEST * self.predict(rows, drafts))
        x = (1.0, float(rows), float(drafts))
        for i in range(3):
            self.xt[i] = self.decay * self.xt[i] + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = self.decay * self.xx[i][j] + x[i] * x[j]
        self.steps += 1
        self.prior_left = max(PRIOR_FLOOR, self.prior_left * 0.5 ** (1 / PRIOR_HALF_LIFE))
        self.fitted = None  # a new step: solve again

    def fit(self) -> tuple[float, float, float]:
        """(a, c, b): seconds, seconds a row, seconds a draft token. Before any step: (1,
        PRIOR_SLOPE, PRIOR_SLOPE), in units of a.

        The normal equations of  Σ w (a + c·B + b·D - t)²  +  λ N̄² (c - r·a)²  +  μ (b - c)²  (r =
        the prior slope, N̄ the mean tokens a step, λ the row prior's weight: PRIOR_WEIGHT, fading;
        μ the draft token's: the larger of λ N̄² and DRAFT_PRIOR_TOKENS, which the steps' Σ w D²
        outweighs once drafts have been sent), so that the priors speak for the slopes only while
        the steps do not. A cost never below 0: a fit that gives one is redone with it held
        at 0. Solved once per step: a call of the proposer reads it two or three times."""
        if self.fitted is None:
            self.fitted = self.solve()
        return self.fitted

    def solve(self) -> tuple[float, float, float]:
        r = self.prior_slope
        if self.steps == 0:
            return 1.0, r, r
        mean_n = (self.xx[0][1] + self.xx[0][2]) / self.xx[0][0]
        row_weight = PRIOR_WEIGHT * self.prior_left * mean_n * mean_n
        draft_weight = max(row_weight, DRAFT_PRIOR_TOKENS)
        row_prior = (-r, 1.0, 0.0)  # c - r·a
        draft_prior = (0.0, -1.0, 1.0)  # b - c
        normal = [[self.xx[i][j] + row_weight * row_prior[i] * row_prior[j]
                   + draft_weight * draft_prior[i] * draft_prior[j] for j in range(3)] for i in range(3)]
        # never singular: the two priors' terms plus the steps' make the matrix positive definite.
        # A negative cost is held at 0 and the rest refitted, one at a time: freeing one can move the
        # others back above 0. With nothing left free the answer is all zeros, and the loop ends.
        free = [0, 1, 2]  # the unknowns not held at 0
        while True:
            solution = [0.0] * 3
            part = solve_linear([[normal[i][j] for j in free] for i in free], [self.xt[i] for i in free])
            for i, value in zip(free, part):
                solution[i] = value
            negative = [i for i in free if solution[i] < 0]
            if not negative:
                break
            free.remove(negative[0])
        a, c, b = solution
        return a, c, b


def solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """x with matrix·x = rhs, for the fit's few unknowns: Gaussian elimination with partial pivoting
    (in each column, the row with the largest entry is swapped up before it is used).

    >>> solve_linear([[2.0, 1.0], [1.0, 3.0]], [3.0, 5.0])
    [0.8, 1.4]
    """
    n = len(rhs)
    augmented = [list(row) + [value] for row, value in zip(matrix, rhs)]  # [n][n + 1]
    for col in range(n):
        # dividing by the largest entry of the column keeps the rounding error small
        pivot = max(range(col, n), key=lambda i: abs(augmented[i][col]))
        pivot_row = augmented[pivot]
        augmented[pivot] = augmented[col]
        augmented[col] = pivot_row
        for i in range(col + 1, n):
            factor = augmented[i][col] / pivot_row[col]
            for j in range(col, n + 1):
                augmented[i][j] -= factor * pivot_row[j]
    x = [0.0] * n
    for i in reversed(range(n)):  # back substitution
        x[i] = (augmented[i][n] - sum(augmented[i][j] * x[j] for j in range(i + 1, n))) / augmented[i][i]
    return x

# ---- 2. Acceptance -----------------------------------------------------------------------------------------
#
# Each draft token carries a signal: a key the drafter gives it (the n-gram order, how often the
# context was followed by that token and what share of its continuations that is, the place in the
# chain; Cacheback's table, its leader's fan-out, the depth and the token's siblings). Its
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
# sent while it pays (P > b·S / t, b a draft token's cost, S and t growing as tokens are added;
# with free slots a token counts for less, below); the first that does not ends the step's choice,
# since every later one is less sure still. A chain's P never rises along it, so what a row is
# sent is always a prefix of its draft. subtle: the bar b·S / t only rises as tokens are sent (a
# token is sent only when it lifts S / t). Worked, one row, a = 46 ms, b = c = 6 ms (the priors'
# numbers):
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
# vLLM; RESULTS.md, "The gate when nobody waits"): at 1 the closed batch of 16 loses (0.94x), at
# 0.5 it holds (1.00x) and requests arriving at random into 16 slots keep most of their gain (mean
# latency at most 3.5 points above 1's), at 0.25 they lose up to 13 points. Where the KV cache, not
# max_num_seqs, holds requests back, the gate takes it that nobody waits: it errs toward sending
# less.

IDLE_VALUE = 0.5  # what an accepted token counts for while nobody waits


@dataclass
class BatchGate:
    """gate = 'on': the draft tokens worth their share of the forward, batch-wide. slots: the
    engine's max_num_seqs (None: unknown, requests taken to wait). clock: the time source (tests
    inject one).

    >>> gate = BatchGate(slots=8)
    >>> for rows, drafts in ((1, 0), (2, 1), (3, 0), (1, 3), (1, 1), (4, 1)):  # 46 ms + 6 ms each
    ...     gate.times.add(rows, drafts, 0.046 + 0.006 * (rows + drafts))
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

    def step_ended(self, last_forward: tuple[int, int] | None) -> None:
        """The engine called the proposer again: the step since its last call (the proposer's own
        drafting, then the engine's forward) has ended; that forward held last_forward = (rows,
        draft tokens) (None: not a plain decode step, so its time says nothing of t)."""
        now = self.clock()
        if self.last_start is not None and last_forward is not None:
            self.times.add(*last_forward, now - self.last_start)
        self.last_start = now

    def forget_step(self) -> None:
        """The step in progress is not to be timed (the drafting failed)."""
        self.last_start = None

    def token_value(self, batch: int) -> float:
        """What an accepted token counts for at this batch size: 1, or IDLE_VALUE while nobody waits."""
        nobody_waits = self.slots is not None and 1 < batch < self.slots
        return self.idle_value if nobody_waits else 1.0

    def worth_drafting(self, rows: int, batch: int | None = None) -> bool:
        """Whether a sure draft token (P = 1) would pay for its share of a step over `rows` drafted
        rows (batch: as in choose). If not, choose() sends nothing whatever the drafts, and the
        proposer need not draft at all (the paper preset's trees cost 2.5 ms a call at 14 rows).

        >>> gate = BatchGate(slots=16)
        >>> for rows, drafts in ((14, 0), (12, 2), (10, 0), (14, 5), (13, 1), (11, 3)):
        ...     gate.times.add(rows, drafts, 0.050 + 0.0023 * rows + 0.004 * drafts)
        >>> gate.worth_drafting(1), gate.worth_drafting(14)  # 1 > 4/52.3 = 0.08; 0.5 < 4·14/82.2 = 0.68
        (True, False)
        """
        a, c, b = self.times.fit()
        batch = rows if batch is None else batch
        return rows > 0 and self.token_value(batch) * (a + c * rows) > b * rows  # choose()'s bar at P = 1

    def choose(self, rows: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        """{row: its draft's P_j, non-increasing} -> {row: how many of its draft tokens to send}.
        batch: the rows the engine is running, drafted or not (default: len(rows))."""
        a, c, b = self.times.fit()  # a step's fixed cost, a row's, a draft token's
        value = self.token_value(len(rows) if batch is None else batch)  # what an accepted token counts for
        emitted = float(len(rows))  # S: each row's bonus token (a row without a draft included)
        seconds = a + c * len(rows)  # t: one token a row
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

    def worth_drafting(self, rows: int, batch: int | None = None) -> bool:
        return rows > 0

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
