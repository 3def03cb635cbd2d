# SPDX-License-Identifier: MIT
"""
serve/gate.py -- the batch gate: how many draft tokens each row of a serving engine's batch is sent,
every step: verify.py section 9's rule with a batch's terms. A step is one forward over B rows and D
draft tokens, t = a + c·B + b·D, emitting S = B + ΣP tokens, so a token accepted with chance P pays
when P > b·S / t (less while nobody waits). serve/vllm_proposers.py feeds it; it imports nothing of vLLM.
SmartSpec (Liu et al., 2024, arXiv:2406.14066) picks a model drafter's k so; this picks tokens.

    the rule       BatchGate.choose; AllDrafts, gate = 'off'                          [1]
    step times     StepTimes: a StepCost (a, c, b), fitted by verify.StepFit          [2]
    acceptance     verify.Acceptance, server-wide and per request                      [3]
    a user's cap   schedule_cap: vLLM's num_speculative_tokens_per_batch_size         [4]
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

import verify

# ---- 1. The rule -------------------------------------------------------------------------------------------
#
# When nobody waits (fewer rows than slots), a token accepted on a row that does not finish last saves
# that row's cost in a later step, not a step; the proposer cannot tell which row ends last, so there it
# counts IDLE_VALUE of one: IDLE_VALUE·P > b·S / t, S = B + IDLE_VALUE·ΣP. A row alone is last: 1.
IDLE_VALUE = 0.5  # between a closed batch and arriving requests (RESULTS.md, "The gate when nobody waits")

class BatchGate:
    """gate = 'on'. slots: the engine's max_num_seqs (None: unknown, requests taken to wait).

    >>> gate = BatchGate(slots=8)
    >>> for rows, drafts in ((1, 0), (2, 1), (3, 0), (1, 3), (1, 1), (4, 1)):  # 46 ms + 6 ms each
    ...     gate.times.add(rows, drafts, 0.046 + 0.006 * (rows + drafts))
    >>> gate.choose({0: [0.8, 0.5, 0.2]})  # 0.8 > 6·1/52, 0.5 > 6·1.8/58, 0.2 < 6·2.3/64 = 0.22
    {0: 2}
    >>> gate.choose({0: [0.8], 1: [0.3]}, batch=8)    # 8 rows run: a token counts whole, 0.3 > 6·2.8/64
    {0: 1, 1: 1}
    >>> gate.choose({0: [0.8], 1: [0.3]})             # two rows, 6 free slots: 0.5·0.3 < 0.225
    {0: 1, 1: 0}
    """

    def __init__(self, slots: int | None = None):
        self.slots = slots
        self.idle_value = IDLE_VALUE  # bench/serve_sim.py tries others
        self.times = StepTimes()
        self.acceptance = verify.Acceptance()
        self.clock = time.perf_counter  # the stand-in batchers put a simulated clock here
        self.last_start: float | None = None  # when the step in progress started

    def choose(self, chances: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        """{row: its draft's P_j, non-increasing} -> {row: how many of its draft tokens to send}.
        batch: the rows the engine is running, drafted or not (default: len(chances))."""
        cost = self.times.fit()
        value = self.token_value(len(chances) if batch is None else batch)  # an accepted token's worth
        emitted = float(len(chances))  # S: each row's bonus token (a row without a draft included)
        seconds = cost.seconds(len(chances), 0)  # t: one token a row
        # subtle: P_j never rises along a chain and ties sort by j, so a row is sent a prefix of its
        # draft; the bar b·S / t rises (each token sent lifts S / t): once one fails, all later do
        candidates = sorted((-p, j, row) for row, probs in chances.items()  # every token, surest first
                            for j, p in enumerate(probs))
        lengths = {row: 0 for row in chances}
        for minus_p, _j, row in candidates:
            p = -minus_p
            if value * p * seconds <= cost.per_draft * emitted:  # P <= b·S / t: it does not pay
                break
            lengths[row] += 1
            emitted += value * p
            seconds += cost.per_draft
        return lengths

    def worth_drafting(self, rows: int, batch: int | None = None) -> bool:
        """Whether choose() would send any of `rows` rows a sure one-token draft; if not, no draft pays."""
        sure = {row: [1.0] for row in range(rows)}
        return any(self.choose(sure, batch).values())

    def token_value(self, batch: int) -> float:
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

    def choose(self, chances: dict[int, list[float]], batch: int | None = None) -> dict[int, int]:
        return {row: len(probs) for row, probs in chances.items()}

# ---- 2. Step times -----------------------------------------------------------------------------------------
#
# The engine calls the proposer once per step, synchronously: from one call to the next is one step,
# its drafting included. Only plain decode steps are fitted (a prefill costs what its prompt costs).
# subtle: two slopes. Whether a row or a draft token costs more differs by machine, and one slope
# over B + D, fitted while the batch size moves, takes a row's cost for a draft token's. Until B and
# D vary the slopes cannot be seen: priors hold c = PRIOR_SLOPE·a and b = c, a CPU's, erring toward
# sending less. The row's prior fades as steps come in. subtle: the draft token's does not; only
# measured draft tokens outweigh it, or the noise of the first few steps with a draft would set b.
PRIOR_SLOPE = 0.13  # c / a, above a 2-core CPU's (RESULTS.md, "The gate when nobody waits")
PRIOR_WEIGHT = 1 / 16  # the row prior's weight, times the mean tokens a step squared
PRIOR_HALF_LIFE = 32  # steps: the row prior's weight halves after this many...
PRIOR_FLOOR = 1e-3  # ...down to this share of it
DRAFT_PRIOR_TOKENS = 8.0  # b = c weighs as much as this many steps of one draft token each, always
HALF_LIFE = 256  # steps: a measured step's weight halves after this many more (the load changes)

class StepCost(NamedTuple):
    """A forward's seconds: fixed + per_row·B + per_draft·D (the a, c and b of the rule)."""

    fixed: float
    per_row: float
    per_draft: float

    def seconds(self, rows: int, drafts: int) -> float:
        return self.fixed + self.per_row * rows + self.per_draft * drafts

class StepTimes(verify.StepFit):
    """The StepCost of the engine's steps, fitted online over x = (1, B, D)."""

    def __init__(self):
        super().__init__(3, HALF_LIFE)
        self.prior_left = 1.0  # what is left of the row prior's weight

    def add(self, rows: int, drafts: int, seconds: float) -> None:
        super().add((1.0, rows, drafts), seconds)
        self.prior_left = max(PRIOR_FLOOR, self.prior_left * 0.5 ** (1 / PRIOR_HALF_LIFE))

    def fit(self) -> StepCost:
        if self.steps == 0:
            return StepCost(1.0, PRIOR_SLOPE, PRIOR_SLOPE)  # no step yet: the priors, in units of a
        return StepCost(*self.coefficients())

    def prior(self) -> list[tuple]:
        """λ N̄² (c - r·a)² and μ (b - c)² (r = PRIOR_SLOPE, N̄ the mean tokens a step, λ =
        PRIOR_WEIGHT·prior_left, μ the larger of λ N̄² and DRAFT_PRIOR_TOKENS)."""
        mean_tokens = (self.xx[0, 1] + self.xx[0, 2]) / self.xx[0, 0]
        row_weight = PRIOR_WEIGHT * self.prior_left * mean_tokens * mean_tokens
        draft_weight = max(row_weight, DRAFT_PRIOR_TOKENS)
        return [(row_weight, np.array([-PRIOR_SLOPE, 1.0, 0.0]), 0.0),  # c - r·a
                (draft_weight, np.array([0.0, -1.0, 1.0]), 0.0)]  # b - c

# ---- 3. Acceptance -----------------------------------------------------------------------------------------
#
# p(key) and P_j: verify.Acceptance (signals: serve/vllm_proposers.py, section 2). subtle: where
# worth_drafting() says no, no draft is made (earlier ones are still scored) and nothing probes; it
# reads only step times and batch size, so drafting resumes once a sure token would pay: the batch
# size changes, or b's measured steps age out (HALF_LIFE) toward b = c. Sampled too: a draft x sent
# without probabilities is accepted as often as the target draws x: as often as a held-back x comes true.

# ---- 4. A user's cap: vLLM's per-batch-size schedule -------------------------------------------------------

def schedule_cap(schedule, batch: int, k: int) -> int:
    """The most draft tokens a row may be sent at this batch size under a schedule of (low, high,
    K) ranges (vLLM's num_speculative_tokens_per_batch_size; K = 0: none). As vLLM reads it, a
    batch size in a gap or past the last range takes the K of the range before. No schedule: k."""
    most = k
    for low, high, cap in sorted(schedule or (), key=lambda entry: int(entry[0])):
        if int(low) > batch:
            break
        most = min(k, int(cap))  # this range's, or the one before a gap
    return most
