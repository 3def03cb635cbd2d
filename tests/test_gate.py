# SPDX-License-Identifier: MIT
"""serve/gate.py, the batch gate, and the proposers' fault guard, without vLLM: the stand-in batcher of
test_serve.py runs the proposers with an injected clock that each step moves by the cost of its forward.

- a free forward (its time does not grow with its tokens) passes every draft, a costly one (time ∝ tokens) none;
- a row with surer drafts is sent more of them than one with worse drafts;
- the acceptance counts converge on a synthetic stream of known acceptance, and a row the gate held back earns
  its drafts back (its drafts are scored in hindsight);
- a schedule of k by batch size is a cap; prefill steps are not timed;
- the rule, the fit, the counts and the cap against values worked by hand;
- a fault while drafting sends no drafts that step, is logged once and counted, and drafting goes on; chains
  over k or with ids outside the vocabulary are cut."""

import itertools
import json
import logging
import random

import numpy as np
import pytest

import verify
from serve import gate as batch_gate
from serve import vllm_proposers as proposers
from test_serve import serve_batch, vllm_config
from vllm_faults import FaultyNgramProposer


def logged_steps(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def second_half(entries):
    return entries[len(entries) // 2:]


def test_the_step_time_fit_finds_a_row_and_a_draft_token_and_holds_its_priors_where_nothing_varies():
    times = batch_gate.StepTimes()
    for rows, drafts in ((8, 0), (8, 4), (12, 2), (16, 0), (8, 8), (20, 4), (9, 1), (8, 0)) * 16:
        times.add(rows, drafts, 0.020 + 0.0001 * rows + 0.00005 * drafts)  # a GPU's forward: almost free
    a, c, b = times.fit()
    assert a == pytest.approx(0.020, rel=0.1) and c < 0.0005 and b < 0.0005
    cpu = batch_gate.StepTimes()  # the AVX-512 CPU at 11-14 rows: a row 2.3 ms, a draft token 4
    for rows, drafts in ((14, 0), (14, 0), (13, 2), (12, 0), (11, 5), (14, 1)) * 30:
        cpu.add(rows, drafts, 0.051 + 0.0023 * rows + 0.004 * drafts)
    a, c, b = cpu.fit()
    # (c within 0.15 ms: the draft token's prior, b = c, pulls it a little; gate.DRAFT_PRIOR_TOKENS)
    assert 1000 * c == pytest.approx(2.3, abs=0.15) and 1000 * b == pytest.approx(4.0, abs=0.1)
    assert 1000 * a == pytest.approx(51, abs=1.5)
    cheap = batch_gate.StepTimes()  # a draft token far cheaper than a row: the steps outweigh the prior b = c
    fitted = []
    for _ in range(3):
        for rows, drafts in ((4, 0), (4, 4), (6, 2), (8, 0), (5, 3), (8, 4)) * 10:
            cheap.add(rows, drafts, 0.046 + 0.006 * rows + 0.001 * drafts)
        fitted.append(1000 * cheap.fit()[2])
    # b after 60, 120, 180 steps: 1.22, 1.13, 1.09 ms (the prior's pull shrinks as drafts are measured)
    assert fitted[0] > fitted[1] > fitted[2] and fitted[2] == pytest.approx(1.0, abs=0.1) and fitted[0] < 1.3
    flat = batch_gate.StepTimes()
    for _ in range(50):
        flat.add(8, 0, 0.1)  # nothing varies: the plane through that point with the priors' slopes
    a, c, b = flat.fit()
    assert a + 8 * c == pytest.approx(0.1) and c / a == pytest.approx(batch_gate.PRIOR_SLOPE) and b == pytest.approx(c)
    free = batch_gate.StepTimes()
    for rows, drafts in ((4, 0), (4, 4), (4, 8)) * 20:
        free.add(rows, drafts, 0.05 - 0.0001 * drafts)  # a step that got faster with drafts: held at 0, not below
    assert free.fit()[2] == 0.0


def test_two_slow_steps_with_a_draft_in_them_do_not_make_a_draft_token_cost_a_step():
    """A closed batch of 14 on the AVX-512 CPU (45 ms + 3.7 ms a row, steps +-5 ms) that sends one draft
    token twice, each time in a step 15 ms slow: the fit keeps b within a few ms of a row's cost (b =
    5.9 ms), so the batch's last rows are still sent drafts. (Faded with the steps, the prior left b to
    those two steps: b = 19 ms; one row alone was sent one token of [0.6, 0.4], and two rows nothing.)"""
    rng = random.Random(0)
    gate = batch_gate.BatchGate(slots=16)
    for step in range(300):
        rows = 14 if step < 250 else max(1, 14 - (step - 250) // 4)  # the batch empties at the end
        drafts = 1 if step in (100, 200) else 0
        slow = 0.015 if drafts else rng.gauss(0, 0.005)
        gate.times.add(rows, drafts, 0.045 + 0.0037 * rows + 0.004 * drafts + slow)
    a, c, b = gate.times.fit()
    assert 1000 * c == pytest.approx(3.7, abs=0.3) and b < 2 * c
    assert gate.choose({0: [0.6, 0.4]}, batch=1) == {0: 2}
    assert gate.choose({0: [0.6], 1: [0.6]}, batch=2) == {0: 1, 1: 1}  # two rows of 16 slots: 0.5·0.6 > 0.23
    assert not gate.worth_drafting(14, batch=14)


def test_the_rule_sends_a_token_only_while_it_pays():
    """The brute force: over every prefix length per row, the best rate; the gate's choice reaches it."""
    gate = batch_gate.BatchGate()
    for rows, drafts in ((2, 0), (4, 2), (6, 0), (4, 8), (3, 1), (8, 4)) * 10:
        gate.times.add(rows, drafts, 0.046 + 0.003 * rows + 0.006 * drafts)
    a, c, b = gate.times.fit()
    rows = {0: [0.9, 0.7, 0.4, 0.1], 1: [0.3, 0.05], 2: [], 3: [0.6, 0.55, 0.5, 0.45]}
    chosen = gate.choose(rows)

    def rate(lengths):
        emitted = len(rows) + sum(sum(rows[r][:n]) for r, n in lengths.items())
        return emitted / (a + c * len(rows) + b * sum(lengths.values()))

    import itertools
    best = max(itertools.product(*[range(len(rows[r]) + 1) for r in rows]), key=lambda ls: rate(dict(zip(rows, ls))))
    assert rate(chosen) == pytest.approx(rate(dict(zip(rows, best))))
    assert 0 < sum(chosen.values()) < sum(map(len, rows.values()))


def test_with_free_slots_an_accepted_token_counts_for_less():
    """Nobody waits (fewer rows than slots): the choice maximizes (B + IDLE_VALUE·ΣP) / t, by brute force; with
    every slot full it is the rule's usual choice, and one row alone counts its tokens whole."""
    gate = batch_gate.BatchGate(slots=8)
    for rows, drafts in ((2, 0), (4, 2), (6, 0), (4, 8), (3, 1), (8, 4)) * 10:
        gate.times.add(rows, drafts, 0.046 + 0.003 * rows + 0.006 * drafts)
    a, c, b = gate.times.fit()
    rows = {0: [0.9, 0.7, 0.4, 0.1], 1: [0.3, 0.05], 2: [], 3: [0.6, 0.55, 0.5, 0.45]}

    def best(value):
        import itertools

        def rate(lengths):
            emitted = len(rows) + value * sum(sum(rows[r][:n]) for r, n in zip(rows, lengths))
            return emitted / (a + c * len(rows) + b * sum(lengths))
        top = max(itertools.product(*[range(len(rows[r]) + 1) for r in rows]), key=rate)
        return dict(zip(rows, top))

    idle = gate.choose(rows)  # 4 rows, 8 slots
    full = gate.choose(rows, batch=8)  # the same 4 drafted rows among 8 running: nobody is let in
    assert idle == best(batch_gate.IDLE_VALUE) and full == best(1.0)
    assert sum(idle.values()) < sum(full.values())
    assert gated(batch_gate.BatchGate(slots=None), gate.times).choose(rows) == full  # slots unknown: requests wait
    alone = gate.choose({0: rows[0]})
    assert alone == gated(batch_gate.BatchGate(slots=1), gate.times).choose({0: rows[0]}) == {0: 3}


def gated(gate, times):
    """The gate, deciding by the given step times."""
    gate.times = times
    return gate


class KnownCost:
    """A gate's step times with a known answer, for the rule's arithmetic worked by hand."""

    def __init__(self, fixed, per_row, per_draft):
        self.cost = batch_gate.StepCost(fixed, per_row, per_draft)

    def fit(self):
        return self.cost


def test_the_rule_by_hand():
    """46 ms + 6 ms a row + 6 ms a draft token. One row, P = 0.8, 0.5, 0.2: S, t = 1, 52 ms: 0.8 > 6·1/52 = 0.12,
    sent; 1.8, 58 ms: 0.5 > 6·1.8/58 = 0.19, sent; 2.3, 64 ms: 0.2 < 6·2.3/64 = 0.22, not. Eight such rows: the
    bar starts at 6·8/94 = 0.51 and is 6·14.4/142 = 0.61 once every row's 0.8 is in: no 0.5 passes."""
    gate = gated(batch_gate.BatchGate(), KnownCost(0.046, 0.006, 0.006))
    assert gate.choose({0: [0.8, 0.5, 0.2]}) == {0: 2}
    assert gate.choose({row: [0.8, 0.5, 0.2] for row in range(8)}) == {row: 1 for row in range(8)}
    # two rows of 8 slots, nobody waiting: 0.5·0.8·58 > 6·2 sends the 0.8; then 0.5·0.3·64 = 9.6 < 6·2.4 = 14.4
    idle = gated(batch_gate.BatchGate(slots=8), KnownCost(0.046, 0.006, 0.006))
    assert idle.choose({0: [0.8], 1: [0.3]}) == {0: 1, 1: 0}
    assert idle.choose({0: [0.8], 1: [0.3]}, batch=8) == {0: 1, 1: 1}  # every slot full: 0.3 > 6·2.8/64 = 0.26
    assert batch_gate.AllDrafts().choose({0: [0.1, 0.01], 1: []}) == {0: 2, 1: 0}


def test_worth_drafting_by_hand():
    """50 ms + 2.5 ms a row + 4 ms a draft token, 16 slots. A sure token pays where value·(a + c·B) > b·B:
    14 of 16 rows, nobody waiting: 0.5·85 = 42.5 < 56, no; the same 14 with every slot full: 85 > 56, yes;
    8 rows: 0.5·70 = 35 > 32, yes; 10 rows: 0.5·75 = 37.5 < 40, no; one row counts whole: 52.5 > 4."""
    gate = gated(batch_gate.BatchGate(slots=16), KnownCost(0.050, 0.0025, 0.004))
    assert not gate.worth_drafting(14, batch=14)
    assert gate.worth_drafting(14, batch=16)
    assert gate.worth_drafting(8) and not gate.worth_drafting(10)
    assert gate.worth_drafting(1) and not gate.worth_drafting(0)
    assert gated(batch_gate.BatchGate(slots=None), gate.times).worth_drafting(14)  # slots unknown: requests wait
    assert batch_gate.AllDrafts().worth_drafting(3) and not batch_gate.AllDrafts().worth_drafting(0)


def test_the_fit_of_a_known_stream():
    """51 ms + 2.3 ms a row + 4 ms a draft token, 120 steps: the fit finds them, but for the priors' pull on the
    fixed cost; before any step it is the priors, in units of the fixed cost; a step is predicted as a + c·B + b·D."""
    assert batch_gate.StepTimes().fit() == (1.0, batch_gate.PRIOR_SLOPE, batch_gate.PRIOR_SLOPE)
    times = batch_gate.StepTimes()
    for rows, drafts in ((8, 0), (8, 4), (12, 0), (12, 8), (14, 2), (14, 6)) * 20:
        times.add(rows, drafts, 0.051 + 0.0023 * rows + 0.004 * drafts)
    assert [round(1000 * x, 1) for x in times.fit()] == [50.6, 2.3, 4.0]
    assert batch_gate.StepCost(0.05, 0.002, 0.004).seconds(10, 5) == pytest.approx(0.05 + 0.02 + 0.02)


def test_the_counts_and_the_cap_by_hand():
    acceptance = verify.Acceptance()
    assert acceptance.p("4-gram") == 0.5  # never measured: a coin
    mine = {}
    for hit in (True, True, True, False):
        acceptance.record("4-gram", hit, mine)
    assert acceptance.p("4-gram") == pytest.approx(4 / 6)  # (3 + 1) / (4 + 2)
    own = (3 + verify.SHRINK * 4 / 6) / (4 + verify.SHRINK)  # 0.708
    assert acceptance.p("4-gram", mine) == pytest.approx(own) and round(own, 3) == 0.708
    assert acceptance.chain(["4-gram", "4-gram", "new"], mine) == pytest.approx([own, own * own, own * own * 0.5])
    scored = verify.Acceptance()
    record = verify.DraftRecord(start=3, tokens=[7, 8, 9], keys=["a", "b", "c"])
    record.score([1, 2, 3, 7], scored, {})  # 7 matches; 8 is not known yet
    assert not record.done and record.scored == 1
    record.score([1, 2, 3, 7, 5], scored, {})  # 5 is not 8: scored, done; 9 is no trial
    assert record.done and scored.trials == {"a": 1.0, "b": 1.0} and scored.hits == {"a": 1.0, "b": 0.0}
    cap = batch_gate.schedule_cap
    assert cap([(1, 4, 4), (5, 16, 2), (17, 64, 0)], 8, 4) == 2
    assert cap(None, 8, 4) == 4 and cap([(1, 64, 8)], 8, 4) == 4  # no schedule, or one above k: k
    assert cap([(1, 4, 3)], 8, 4) == 3  # past the last range: its K
    assert cap([(1, 2, 3), (9, 16, 1)], 5, 4) == 3  # in a gap: the K of the range before


def test_where_no_token_could_pay_nothing_is_drafted(tmp_path):
    """Three requests that repeat themselves (sure drafts), a step of 20 ms + 10 ms a token. With every slot
    full (3 of 3) a sure token pays (1 > 10·3 / 50) and drafting goes on; with a slot free an accepted token
    counts for IDLE_VALUE = 0.5, not even a sure one pays (0.5 < 30 / 50), and once the fit has seen what a
    draft token costs the proposer skips drafting altogether."""
    streams = [(text[:40], text[40:300]) for text in (periodic(300, 7, seed) for seed in (1, 2, 3))]
    (tmp_path / "full").mkdir()
    full = run_gated(streams, lambda n: 0.02 + 0.01 * n, tmp_path / "full", max_num_seqs=3)[0]
    assert full.undrafted_steps < 0.1 * full.calls and full.tokens_sent > 100
    proposer, _, steps = run_gated(streams, lambda n: 0.02 + 0.01 * n, tmp_path, max_num_seqs=4)
    late = second_half(steps)
    assert sum(len(s["draft"]) for s in late) == 0 and sum(len(s["sent"]) for s in late) == 0
    assert proposer.undrafted_steps > 0.5 * proposer.calls


def run_gated(streams, step_cost, tmp_path, method="ngram", max_num_seqs=3, **options):
    log = str(tmp_path / f"{method}-{len(streams)}.jsonl")
    make = getattr(proposers, proposers.PROPOSERS[method])
    proposer = make(vllm_config(method, 4, max_num_seqs=max_num_seqs, log=log, **options))
    served = serve_batch(proposer, streams, max_num_seqs=max_num_seqs, step_cost=step_cost)
    return proposer, served, logged_steps(log)


@pytest.mark.parametrize("method", ["ngram", "cacheback"])
def test_a_free_forward_passes_every_draft(byte_streams, tmp_path, method):
    proposer, _, steps = run_gated(byte_streams, lambda n: 0.05, tmp_path, method)
    late = second_half(steps)
    assert sum(len(s["draft"]) for s in late) > 100
    assert all(s["sent"] == s["draft"] for s in late)
    a, c, b = proposer.gate.times.fit()
    assert b < 0.001 * a and c < 0.001 * a


@pytest.mark.parametrize("method", ["ngram", "cacheback"])
def test_a_costly_forward_passes_none(byte_streams, tmp_path, method):
    """Time in proportion to the tokens: a draft token pays only if it is sure to be accepted."""
    proposer, _, steps = run_gated(byte_streams, lambda n: 0.01 * n, tmp_path, method)
    late = second_half(steps)
    assert sum(len(s["draft"]) for s in late) > 100
    # the bar is b·S / t = 1 here: only a token the counts call all but sure could pass (one did, once the
    # fit had a row's and a draft token's cost apart, each to within a rounding)
    assert sum(len(s["sent"]) for s in late) <= 0.01 * sum(len(s["draft"]) for s in late)
    assert proposer.tokens_held > 0


def periodic(length, period, seed):
    rng = random.Random(seed)
    pattern = [rng.randrange(256) for _ in range(period)]
    return [pattern[i % period] for i in range(length)]


def noise(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(20) for _ in range(length)]  # a small alphabet: the tables always draft something


def test_a_row_with_surer_drafts_keeps_more(tmp_path):
    """Two requests side by side: one repeats itself (its drafts are right), one is noise (its drafts are
    mostly wrong). With a forward whose tokens cost, the first is sent most of its drafts, the second few."""
    sure = periodic(400, 7, seed=1)
    unsure = noise(400, seed=2)
    streams = [(sure[:40], sure[40:]), (unsure[:40], unsure[40:])]
    proposer, _, steps = run_gated(streams, lambda n: 0.05 + 0.01 * n, tmp_path, max_num_seqs=2)
    sent = {}
    drafted = {}
    for who, prompt in (("sure", sure[:40]), ("unsure", unsure[:40])):
        late = second_half([s for s in steps if s["tokens"][:40] == prompt])  # each request's later steps
        sent[who] = sum(len(s["sent"]) for s in late)
        drafted[who] = sum(len(s["draft"]) for s in late)
    assert sent["sure"] > 0.8 * drafted["sure"]
    assert sent["unsure"] < 0.2 * drafted["unsure"]


def test_the_acceptance_counts_converge_on_a_stream_of_known_acceptance():
    """A synthetic stream: the first draft token is right with chance 0.3 (key 'first'), the second, given the
    first was, with chance 0.8 ('second'). Scored in hindsight, the counts find both."""
    rng = random.Random(0)
    acceptance = verify.Acceptance()
    own = {}
    for _ in range(3000):
        first_right = rng.random() < 0.3
        second_right = rng.random() < 0.8
        text = [1, 2, 5, 6]  # the text after the draft's start: 5, 6
        draft = [5 if first_right else 9, 6 if second_right else 9]
        record = verify.DraftRecord(start=2, tokens=draft, keys=["first", "second"])
        record.score(text, acceptance, own)
        assert record.done
    assert acceptance.p("first") == pytest.approx(0.3, abs=0.03)
    assert acceptance.p("second") == pytest.approx(0.8, abs=0.03)
    assert acceptance.trials["second"] == pytest.approx(acceptance.hits["first"])  # only after a hit


def test_a_row_held_back_earns_its_drafts_back(tmp_path):
    """The server's counts say that every n-gram draft fails (a poor stretch before this request), and this
    request repeats itself. Its drafts are held back at first (by choose(): a sure token would pay, so they are
    drafted); scored in hindsight though never sent, they show the gate that they are right now, and it sends
    them."""
    log = str(tmp_path / "drafts.jsonl")
    proposer = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=1, log=log))
    # every n-gram key: order, count, share, place
    for key in itertools.product(["ngram"], (2, 3, 4), (1, 2, 3), (0, 1, 2), (0, 1, 2)):
        proposer.gate.acceptance.hits[key] = 0.0
        proposer.gate.acceptance.trials[key] = 200.0
    text = periodic(300, 9, seed=4)
    serve_batch(proposer, [(text[:40], text[40:])], max_num_seqs=1, step_cost=lambda n: 0.05 + 0.05 * n)
    steps = logged_steps(log)
    first = next(s for s in steps if s["draft"])
    assert first["sent"] == []
    late = second_half(steps)
    assert sum(len(s["sent"]) for s in late) > 0.8 * sum(len(s["draft"]) for s in late)


def test_prefill_steps_are_not_timed(byte_streams):
    """The stand-in's prefill steps cost 100 s; the fit only sees the decode steps' 50 ms + 10 ms a token."""
    proposer = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=3))
    serve_batch(proposer, byte_streams, max_num_seqs=3, sit_out_every=3,
                step_cost=lambda n: 100.0 if n > 20 else 0.05 + 0.01 * n)
    a, c, b = proposer.gate.times.fit()
    assert a == pytest.approx(0.05, rel=0.05) and c == pytest.approx(0.01, rel=0.05) and b == pytest.approx(0.01, rel=0.1)


@pytest.mark.parametrize("gate", ["on", "off"])
def test_a_schedule_of_k_by_batch_size_is_a_cap(byte_streams, gate):
    schedule = [(1, 2, 1), (3, 64, 0)]
    proposer = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=3, schedule=schedule, gate=gate))
    served = serve_batch(proposer, byte_streams, max_num_seqs=3, step_cost=lambda n: 0.05)
    chains = [chain for request in served.values() for chain in request.values()]
    assert max(map(len, chains)) == 1  # batches of 1 and 2 rows, at the end
    assert sum(map(len, chains)) < len(chains) / 2  # three rows most of the time: none
    # a batch size past the schedule's last range takes its K, as vLLM reads a schedule
    carried = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=3, schedule=[(1, 2, 2)], gate=gate))
    served = serve_batch(carried, byte_streams, max_num_seqs=3, step_cost=lambda n: 0.05)
    chains = [chain for request in served.values() for chain in request.values()]
    assert max(map(len, chains)) == 2 and sum(map(len, chains)) > 0


def test_a_held_back_draft_is_scored_as_vllm_would_have_accepted_it_when_sampling():
    """Sampled decoding: a draft token x sent to vLLM is accepted with chance p(x) and, rejected, replaced by a
    token drawn from the target without x; held back, x is followed by a plain draw from the target. The text
    continues with x as often either way, so scoring held-back drafts in hindsight counts what sending would."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.25, 0.15, 0.1])  # the target's distribution at one position
    x = 1  # the draft token
    without_x = np.delete(p, x) / (1 - p[x])
    counts = {}
    for way in ("sent", "held"):
        acceptance = verify.Acceptance()
        for _ in range(20000):
            if way == "sent":
                accepted = rng.random() < p[x]  # vLLM's rejection sampler, with no draft probabilities
                token = x if accepted else [0, 2, 3][rng.choice(3, p=without_x)]
            else:
                token = rng.choice(4, p=p)
            record = verify.DraftRecord(start=1, tokens=[x], keys=["k"])
            record.score([9, int(token)], acceptance, {})
        counts[way] = acceptance.hits["k"] / acceptance.trials["k"]
    assert counts["sent"] == pytest.approx(p[x], abs=0.01) and counts["held"] == pytest.approx(p[x], abs=0.01)


def test_at_batch_8_on_a_cpus_step_costs_the_gate_does_not_lose(byte_streams):
    """The stand-in at 8 rows with the 2-core CPU's step costs (46 ms + 6 ms a token, RESULTS.md): the time it
    takes to serve the eight streams with the gate is no more than without drafts; without the gate, more."""
    def cost(n):
        return 0.046 + 0.006 * n

    def served_in(**options):
        proposer = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=8, **options))
        serve_batch(proposer, byte_streams, max_num_seqs=8, step_cost=cost)
        return proposer.gate.clock.now

    plain = served_in(schedule=[(1, 64, 0)])  # k = 0 at every batch size: no drafts
    gated = served_in()
    ungated = served_in(gate="off")
    assert gated <= plain and ungated > gated


@pytest.mark.parametrize("gate", ["on", "off"])
def test_a_fault_while_drafting_sends_no_drafts_and_drafting_goes_on(byte_streams, caplog, gate):
    """The faulty proposer (tests/vllm_faults.py) raises every 5th call (its message naming the call), sends
    chains k + 3 long every 7th and an id outside the vocabulary every 11th. Every chain that leaves is at most k
    long and inside the vocabulary; a raising call sends nothing; each kind (the exception's type and place, an
    over-long chain, a bad id) is logged once and counted; later calls draft."""
    config = vllm_config("ngram", 4, max_num_seqs=3, gate=gate)
    proposer = FaultyNgramProposer(config)
    calls = []
    original = proposer.propose

    def recording(sampled, *args):
        chains = original(sampled, *args)
        calls.append((proposer.tries, chains))
        return chains

    proposer.propose = recording
    with caplog.at_level(logging.WARNING, logger="vllm.specdec"):
        serve_batch(proposer, byte_streams, max_num_seqs=3, step_cost=lambda n: 0.01)  # a cheap forward
    vocab = config.model_config.get_vocab_size()
    assert all(len(c) <= 4 and all(0 <= t < vocab for t in c) for _, chains in calls for c in chains)
    raising = [chains for tries, chains in calls if tries % 5 == 0]
    assert raising and all(c == [] for chains in raising for c in chains)
    assert sum(len(c) for tries, chains in calls if tries % 5 == 1 and tries > 5 for c in chains) > 0
    assert proposer.faults["RuntimeError at vllm_faults.py:21"] == len(raising)
    assert proposer.faults["a chain over k tokens"] > 0 and proposer.faults["a draft id outside the vocabulary"] > 0
    lines = [r.getMessage() for r in caplog.records]
    for kind in ("RuntimeError at vllm_faults.py:21", "a chain over k tokens", "a draft id outside the vocabulary"):
        assert sum(kind in line for line in lines) == 1, kind
    assert len(lines) == 3 and all(line.startswith("ngram proposer: ") and "the engine goes on" in line
                                   for line in lines)


def test_an_exception_in_any_part_of_a_call_is_caught():
    """Even rows it cannot read (a broken token array) give an undrafted step, not an exception."""
    proposer = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=2))
    assert proposer.propose([[5], [6]], np.array([10, 10]), None) == [[], []]
    assert sum(proposer.faults.values()) == 1
