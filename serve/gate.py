# SPDX-License-Identifier: MIT
"""
serve/gate.py -- the batch gate: how many of its draft tokens each row of a serving engine's
batch is sent, decided every step from the step times measured in the server and each draft
token's chance of being accepted. serve/vllm_proposers.py feeds it; it imports nothing of vLLM.

A step is one forward over every running request, one token a row plus the drafts sent, and
takes t = a + c·B + b·D over B rows and D draft tokens. A step expected to emit S tokens (a bonus
token a row, plus the accepted drafts) gains from one more draft token of acceptance chance P when

    (S + P) / (t + b)  >  S / t        <=>        P  >  b·S / t

With no drafts the bar is b·B / (a + c·B): it rises with the batch.

    the rule       BatchGate.choose; AllDrafts, gate = 'off'                          [1]
    step times     StepTimes: a StepCost (a, c, b) fitted to the server's steps       [2]
    acceptance     Acceptance: P per signal; DraftRecord: a draft, scored in hindsight [3]
    a user's cap   schedule_cap: vLLM's num_speculative_tokens_per_batch_size         [4]

SmartSpec (Liu et al., 2024, arXiv:2406.14066) picks a model drafter's k so; this picks tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, NamedTuple, Sequence

import numpy as np

# ---- 1. The rule -------------------------------------------------------------------------------------------
#
# When nobody waits (fewer rows than the engine's slots, max_num_seqs), a token accepted on a row
# that is not the last to finish saves that row's cost in a later step, not a step. The proposer
# cannot tell which row ends last, so there an accepted token counts for IDLE_VALUE of one: the
# rule reads IDLE_VALUE·P > b·S / t, with S = B + IDLE_VALUE·ΣP. A row alone is last: it counts 1.

IDLE_VALUE = 0.5  # between a closed batch and arriving requests (RESULTS.md, "The gate when nobody waits")


class BatchGate:
    """gate = 'on'. slots: the engine's max_num_seqs (None: unknown, requests taken to wait).

    >>> gate = BatchGate(slots=8)
    >>> for rows, drafts in ((1, 0), (2, 1), (3, 0), (1, 3), (1, 1), (4, 1)):  # 46 ms + 6 ms each
    ...     gate.times.add(rows, drafts, 0.046 + 0.006 * (rows + drafts))
    >>> gate.choose({0: [0.8, 0.5, 0.2]})  # 0.8 > 6·1/52, 0.5 > 6·1.8/58, 0.2 < 6·2.3/64 = 0.22
    {0: 2}
    >>> gate.choose({0: [0.8], 1: [0.3]}, batch=8)    # all 8 slots full: 0.3 > 6·2.8/64 = 0.26
    {0: 1, 1: 1}
    >>> gate.choose({0: [0.8], 1: [0.3]})             # two rows, 6 free slots: 0.5·0.3 < 0.225
    {0: 1, 1: 0}
    """

    def __init__(self, slots: int | None = None):
        self.slots = slots
        self.idle_value = IDLE_VALUE  # bench/serve_sim.py tries others
        self.times = StepTimes()
        self.acceptance = Acceptance()
        self.clock = time.perf_counter  # the stand-in batchers put a simulated clock here
        self.last_start: float | None = None  # when the step in progress started

    def choose(self, rows: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        """{row: its draft's P_j, non-increasing} -> {row: how many of its draft tokens to send}.
        batch: the rows the engine is running, drafted or not (default: len(rows))."""
        cost = self.times.fit()
        value = self.token_value(len(rows) if batch is None else batch)  # an accepted token's worth
        emitted = float(len(rows))  # S: each row's bonus token (a row without a draft included)
        seconds = cost.seconds(len(rows), 0)  # t: one token a row
        # every draft token of every row, the surest first. subtle: P_j never rises along a chain
        # and ties sort by j, so a row is sent a prefix of its draft; the bar b·S / t only rises (a
        # token is sent only when it lifts S / t), so once one token fails every later one does too
        candidates = sorted((-p, j, row) for row, probs in rows.items()
                            for j, p in enumerate(probs))
        lengths = {row: 0 for row in rows}
        for minus_p, _j, row in candidates:
            p = -minus_p
            if value * p * seconds <= cost.per_draft * emitted:  # P <= b·S / t: it does not pay
                break
            lengths[row] += 1
            emitted += value * p
            seconds += cost.per_draft
        return lengths

    def worth_drafting(self, rows: int, batch: int | None = None) -> bool:
        """Whether choose() would send any token if each of `rows` rows had a one-token draft sure to
        be accepted. If not, it sends nothing whatever the drafts, and the proposer need not draft."""
        sure = {row: [1.0] for row in range(rows)}
        return any(self.choose(sure, batch).values())

    def token_value(self, batch: int) -> float:
        """What an accepted token counts for: 1, or idle_value while nobody waits."""
        nobody_waits = self.slots is not None and 1 < batch < self.slots
        return self.idle_value if nobody_waits else 1.0

    def step_ended(self, last_forward: tuple[int, int] | None) -> None:
        """The engine called the proposer again: the step since its last call has ended, and its
        forward held last_forward = (rows, draft tokens) (None: not a plain decode step)."""
        now = self.clock()
        if self.last_start is not None and last_forward is not None:
            self.times.add(*last_forward, now - self.last_start)
        self.last_start = now

    def forget_step(self) -> None:
        """The step in progress is not to be timed (the drafting failed)."""
        self.last_start = None


class AllDrafts(BatchGate):
    """gate = 'off': every row is sent its whole draft."""

    def choose(self, rows: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        return {row: len(probs) for row, probs in rows.items()}

# ---- 2. Step times -----------------------------------------------------------------------------------------
#
# The engine calls the proposer once per step, synchronously: from one call to the next is one
# step, the proposer's own drafting included. Only plain decode steps are fitted (a prefill costs
# what its prompt costs), by least squares, recent steps weighing most (the load changes).
# subtle: two slopes. Whether a row or a draft token costs more differs by machine, and one slope
# over B + D, fitted while the batch size moves, takes a row's cost for a draft token's.
#
# Until B and D vary the slopes cannot be seen: priors hold c = PRIOR_SLOPE·a and b = c, a CPU's,
# so that they err toward sending less. The row's prior fades as steps come in. subtle: the draft
# token's does not; it is outweighed only as draft tokens are measured, or the noise of the first
# few steps with a draft in them would set b.

PRIOR_SLOPE = 0.13  # c / a, above a 2-core CPU's (RESULTS.md, "The gate when nobody waits")
PRIOR_WEIGHT = 1 / 16  # the row prior's weight, times the mean tokens a step squared
PRIOR_HALF_LIFE = 32  # steps: the row prior's weight halves after this many...
PRIOR_FLOOR = 1e-3  # ...down to this share of it
DRAFT_PRIOR_TOKENS = 8.0  # b = c weighs as much as this many steps of one draft token each, always
HALF_LIFE = 256  # steps: a measured step's weight halves after this many more
SLOWEST = 3.0  # a step over SLOWEST times its predicted time (a pause, a page fault) counts as that...
SETTLED_STEPS = 8  # ...once this many steps have been fitted


class StepCost(NamedTuple):
    """A forward's seconds: fixed + per_row·B + per_draft·D (the a, c and b of the rule)."""

    fixed: float
    per_row: float
    per_draft: float

    def seconds(self, rows: int, drafts: int) -> float:
        return self.fixed + self.per_row * rows + self.per_draft * drafts


class StepTimes:
    """The StepCost of the engine's steps, fitted online."""

    def __init__(self):
        # the weighted sums of the least squares fit over x = (1, B, D): Σ w·x·xᵀ and Σ w·x·t
        self.xx = np.zeros((3, 3))
        self.xt = np.zeros(3)
        self.steps = 0  # steps measured, all told
        self.prior_left = 1.0  # what is left of the row prior's weight
        self.fitted: StepCost | None = None  # fit()'s answer until the next add()

    def add(self, rows: int, drafts: int, seconds: float) -> None:
        """One decode step over `rows` rows and `drafts` draft tokens took `seconds`."""
        if self.steps >= SETTLED_STEPS:
            seconds = min(seconds, SLOWEST * self.fit().seconds(rows, drafts))
        x = np.array([1.0, rows, drafts])
        decay = 0.5 ** (1 / HALF_LIFE)  # what one step more leaves of a step's weight
        self.xx = decay * self.xx + np.outer(x, x)
        self.xt = decay * self.xt + x * seconds
        self.steps += 1
        self.prior_left = max(PRIOR_FLOOR, self.prior_left * 0.5 ** (1 / PRIOR_HALF_LIFE))
        self.fitted = None  # a new step: solve again

    def fit(self) -> StepCost:
        """Solved once a step. Before any step: (1, PRIOR_SLOPE, PRIOR_SLOPE), in units of a."""
        if self.fitted is None:
            self.fitted = self.solve()
        return self.fitted

    def solve(self) -> StepCost:
        """The normal equations of  Σ w (a + c·B + b·D - t)²  +  λ N̄² (c - r·a)²  +  μ (b - c)²
        (r = PRIOR_SLOPE, N̄ the mean tokens a step, λ = PRIOR_WEIGHT·prior_left, μ the larger of
        λ N̄² and DRAFT_PRIOR_TOKENS), with no cost below 0."""
        if self.steps == 0:
            return StepCost(1.0, PRIOR_SLOPE, PRIOR_SLOPE)
        mean_tokens = (self.xx[0, 1] + self.xx[0, 2]) / self.xx[0, 0]
        row_weight = PRIOR_WEIGHT * self.prior_left * mean_tokens * mean_tokens
        draft_weight = max(row_weight, DRAFT_PRIOR_TOKENS)
        row_prior = np.array([-PRIOR_SLOPE, 1.0, 0.0])  # c - r·a
        draft_prior = np.array([0.0, -1.0, 1.0])  # b - c
        normal = (self.xx + np.outer(row_weight * row_prior, row_prior)
                  + np.outer(draft_weight * draft_prior, draft_prior))
        # never singular: the priors make it positive definite. subtle: a cost below 0 is held at
        # 0 and the rest refitted, one at a time, since holding one can lift the others above 0
        free = [0, 1, 2]  # the costs not held at 0
        while True:
            solution = np.zeros(3)
            solution[free] = np.linalg.solve(normal[np.ix_(free, free)], self.xt[free])
            negative = [i for i in free if solution[i] < 0]
            if not negative:  # (with none left free: all zeros)
                return StepCost(*solution.tolist())
            free.remove(negative[0])

# ---- 3. Acceptance -----------------------------------------------------------------------------------------
#
# Each draft token carries a key, its signal (serve/vllm_proposers.py, section 2). p(key), its
# chance of being accepted when every token before it in the chain was, is counted per key:
#
#     server-wide   p_server = (hits + 1) / (trials + 2)             1/2 until measured
#     per request   p = (own hits + SHRINK·p_server) / (own trials + SHRINK)
#
# and a chain's token j is accepted with chance P_j = p_1 · ... · p_j. Every draft is scored once
# the text after it is known, sent or not: a row whose drafts choose() holds back keeps being
# measured, and is sent them once they prove good. subtle: where worth_drafting() says no, no
# draft is made (those made before are still scored) and nothing probes; that answer reads only
# the step times and the batch size, so drafting resumes when those let a sure token pay: the
# batch size changes, or b's measured steps age out (HALF_LIFE) toward its prior b = c. Sampled
# too: a draft x sent without probabilities is accepted as often as the target draws x, so as
# often as a held-back x comes true.

SHRINK = 4.0  # a request's own trials weigh against this many of the server's


class Acceptance:
    """p(key): the chance that a draft token with this signal is accepted, given that every token
    before it in its chain was."""

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
    """A draft made when the request's text was `start` tokens long: its tokens and each one's key,
    then how many of them the growing text has scored, and whether it is done."""

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

# ---- 4. A user's cap: vLLM's per-batch-size schedule -------------------------------------------------------


def schedule_cap(schedule, batch: int, k: int) -> int:
    """The most draft tokens a row may be sent at this batch size under a schedule of (low, high,
    K) ranges (vLLM's num_speculative_tokens_per_batch_size; K = 0 turns drafting off there). As
    vLLM reads it, a batch size in a gap or past the last range takes the K of the range before it.
    No schedule: k."""
    most = k
    for low, high, cap in sorted(schedule or (), key=lambda entry: int(entry[0])):
        if int(low) > batch:
            break
        most = min(k, int(cap))  # this range's, or the one before a gap
    return most
