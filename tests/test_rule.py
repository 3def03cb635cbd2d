# SPDX-License-Identifier: MIT
"""verify.py section 9: the one rule of what is worth verifying, against a brute force over every subtree;
the step-time fit against known lines; the acceptance counted after the fact, withheld drafts included; what
each preset and --cost free verify, against each method's own drafter replayed on the text (step for step);
and the one line a method that cannot win says."""

import dataclasses
import warnings

import numpy as np
import pytest

import cacheback
import card
import fafo
import ngram_predictor
import verify
from conftest import REAL_PROMPTS, encode

TIMES = {1: 0.040, 2: 0.066, 3: 0.070, 4: 0.072, 8: 0.080, 16: 0.095}  # T(n): a 2-core CPU's shape


def knowing(chances: dict, times: dict = TIMES, cost: str = "pinned") -> verify.WhatPays:
    """A rule whose acceptance rate of each key is exactly chances[key] (a thousand trials each)."""
    pays = verify.WhatPays(times, cost)
    for key, p in chances.items():
        pays.acceptance.hits[key], pays.acceptance.trials[key] = 1000 * p - 1, 1000 - 2
    return pays


def test_the_worked_step_by_hand():
    """best_prefix's example: a node of P .5 and its child of P .4, t(1..3) = 1, 1.65, 1.7: 1/1, then 1.5/1.65,
    then 1.9/1.7, so both; with t(3) = 2.0 a plain step (1.9/2.0 < 1)."""
    assert verify.best_prefix([0.5, 0.4], [1, 1], {1: 1.0, 2: 1.65, 3: 1.7}.__getitem__) == 2
    assert verify.best_prefix([0.5, 0.4], [1, 1], {1: 1.0, 2: 1.65, 3: 2.0}.__getitem__) == 0
    # whole guesses of 3 rows after 12 fixed rows: 1/t(13), then (1 + 1.2)/t(16)
    t = {13: 1.0, 16: 1.1, 19: 1.5}.__getitem__
    assert verify.best_prefix([1.2, 0.3], [3, 3], t, rows=13) == 1


def test_the_tutorials_worked_step():
    """TUTORIAL.md §1.10's step, from its figures: P = .40, .40·.44, ... against t = 1.15·T(1 + kept)."""
    times = {1: 0.0390, 2: 0.0437, 3: 0.0468, 4: 0.0588, 5: 0.0613}
    p_trigram = (3 + 1) / (8 + 2)
    p_fourgram = (3 + 1) / (7 + 2)
    chances = [p_trigram, p_trigram * p_fourgram, p_trigram * p_fourgram**2, p_trigram * p_fourgram**3]
    rates = [(1 + sum(chances[:kept])) / (1.15 * times[1 + kept]) for kept in range(5)]
    assert [round(rate, 1) for rate in rates] == [22.3, 27.9, 29.3, 24.5, 24.0]  # the table's last column
    assert verify.best_prefix(chances, [1] * 4, lambda rows: 1.15 * times[rows]) == 2


def closed_subsets(parents):
    n = len(parents)
    for bits in range(1 << (n - 1)):
        keep = {0} | {i for i in range(1, n) if bits >> (i - 1) & 1}
        if all(parents[i] in keep for i in keep if i):
            yield keep


def test_the_rule_keeps_the_best_subtree_by_brute_force():
    """Of every subtree of random trees, the rule's has the most expected tokens per second (the nodes most
    probable first are optimal for each size, since a child is never likelier than its parent)."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        n = int(rng.integers(1, 10))  # (n = 1: the root alone)
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        tree = verify.Tree.root_only(0)
        for i in range(1, n):
            tree.add(parents[i], 100 + i)  # distinct tokens: no merging
        keys = [None] + [f"k{i}" for i in range(1, n)]
        pays = knowing({key: float(rng.uniform(0.05, 0.95)) for key in keys[1:]})
        chance = [1.0]
        for i in range(1, n):
            chance.append(chance[parents[i]] * pays.acceptance.p(keys[i]))

        def rate(keep):
            return sum(chance[i] for i in keep) / verify.seconds_at(TIMES, len(keep))

        kept = pays.subtree(tree, keys, [7])
        best = max(rate(keep) for keep in closed_subsets(parents))
        kept_nodes = {0} | {i for i in range(1, n) if tree.tokens[i] in kept.tokens[1:]}
        assert rate(kept_nodes) == pytest.approx(best)
        assert pays.withheld == n - len(kept)


def test_a_chain_is_cut_to_the_prefix_that_pays():
    """A chain of four whose tokens are right 9, 5, 2 and 1 time in 10 (P .9, .45, .09, .009): the third
    token's .09 does not pay for t(4) - t(3) here, so two are verified; with every forward free, all four."""
    chain = verify.Tree.chain(5, [6, 7, 8, 9])
    keys = [None, "a", "b", "c", "d"]
    pays = knowing({"a": 0.9, "b": 0.5, "c": 0.2, "d": 0.1}, {1: 0.04, 2: 0.05, 3: 0.058, 4: 0.07, 5: 0.072})
    assert pays.subtree(chain, keys, [5]).tokens == [5, 6, 7] and pays.withheld == 2
    flat = knowing({"a": 0.9, "b": 0.5, "c": 0.2, "d": 0.1}, {n: 0.04 for n in range(1, 6)})
    assert flat.subtree(chain, keys, [5]).tokens == [5, 6, 7, 8, 9]
    free = verify.WhatPays({1: 1.0}, "free")
    assert free.subtree(chain, keys, [5]) is chain


def test_whole_guesses_by_hand():
    """FAFO's guesses (3, 4), (3, 5), (6, 7) as a trie below 9: the second shares its first token with the first,
    so it adds one node, keyed by its rank and place (rank 1 token 1). With p = 1/2 everywhere a guess's gain is
    the chance of the nodes it adds: .5 + .25, .25, .5 + .25. Each guess costs 2 rows after 4 fixed ones; with
    T flat every guess pays; where each row costs a whole step and nothing is fixed, none does."""
    guesses = [(3, 4), (3, 5), (6, 7)]
    flat = knowing({}, {n: 0.04 for n in range(1, 12)})
    assert flat.guesses(9, guesses, [1, 9], fixed=4, size=2) == 3 and flat.rows == 1 + 4 + 6
    record = flat.pending[0]
    assert (record.tokens, record.parents) == ([3, 4, 5, 6, 7], [-1, 0, 0, -1, 3])
    assert record.keys == ["rank 0 token 0", "rank 0 token 1", "rank 1 token 1", "rank 2 token 0", "rank 2 token 1"]
    steep = knowing({}, {n: 0.04 * (1 + 0.1 * (n - 1)) for n in range(1, 12)})
    # after 4 fixed rows: 1 / 1.4 = .714; + the first guess (.75) for 2 rows: 1.75 / 1.6 = 1.09; + the second
    # (.25): 2 / 1.8 = 1.11; + the third (.75): 2.75 / 2.0 = 1.375: all three pay even here, the rows are cheap
    assert steep.guesses(9, guesses, [1, 9], fixed=4, size=2) == 3
    dear = knowing({}, {n: 0.04 * n for n in range(1, 12)})  # a row costs a whole step, nothing fixed: none pays
    assert dear.guesses(9, guesses, [1, 9], fixed=0, size=2) == 0 and dear.withheld == 5
    free = verify.WhatPays({1: 1.0}, "free")
    assert free.guesses(9, guesses, [1, 9], fixed=4, size=2) == 3


def test_every_draft_is_scored_after_the_fact_withheld_nodes_too():
    """A tree root -> 6 -> 7, root -> 8, filed at text length 3; then the text goes on 6, 9: node 6 hit, node 8
    missed (both a trial: their parent, the root, came true), node 7 missed; nothing else. Every row costs a
    whole forward here, so the rule withholds the tree, and it is scored all the same."""
    pays = knowing({}, {1: 0.04, 2: 0.08, 3: 0.12, 4: 0.16})
    tree = verify.Tree.from_branches(5, [[6, 7], [8]])
    keys = [None, "first", "second", "other"]
    assert pays.subtree(tree, keys, [1, 2, 5]).tokens == [5] and pays.withheld == 3
    pays.subtree(verify.Tree.root_only(9), [None], [1, 2, 5, 6, 9])  # the next step: the text is known
    trials = pays.acceptance.trials
    assert (trials, pays.acceptance.hits) == ({"first": 1, "other": 1, "second": 1},
                                              {"first": 1, "other": 0, "second": 0})
    assert pays.pending == []  # a miss ends the record


def test_a_tree_record_waits_for_the_text():
    record = verify.DraftRecord(start=2, tokens=[6, 7, 8], keys=["a", "b", "c"], parents=[-1, 0, -1])
    acceptance = verify.Acceptance()
    record.score([1, 2], acceptance)  # nothing after the draft's start yet
    assert acceptance.trials == {} and not record.done
    record.score([1, 2, 6], acceptance)  # 6 (node 0) came true, 8 (node 2) did not
    assert acceptance.trials == {"a": 1, "c": 1} and acceptance.hits == {"a": 1, "c": 0} and not record.done
    record.score([1, 2, 6, 7], acceptance)  # node 1 came true too, and is a leaf: done
    assert acceptance.hits["b"] == 1 and record.done


def test_the_curve_between_and_past_its_sizes():
    """Linear between measured sizes (a dip measured is a dip kept); past the last, its slope continued, but a
    falling last slope is held flat: a bigger forward never costs less than the biggest measured."""
    times = {1: 0.04, 2: 0.06, 4: 0.07, 8: 0.05}
    assert [round(verify.seconds_at(times, n), 4) for n in (3, 6, 8, 16)] == [0.065, 0.06, 0.05, 0.05]
    assert round(verify.seconds_at({1: 0.04, 2: 0.06, 4: 0.07}, 8), 4) == 0.09


def test_the_fit_reads_the_loops_steps():
    """Steps that cost 3 ms + 1.1 T(n), n varying: the fit finds both. Before any step it is the curve; steps of
    one size 20% slower than measured read mostly as a slower machine (s), little as a fixed cost (a)."""
    pays = verify.WhatPays(TIMES)
    assert pays.fit.coefficients() == pytest.approx([0.0, 1.0])
    for step in range(200):
        n = (1, 2, 4, 8, 16)[step % 5]
        pays.add_step(n, 0.003 + 1.1 * verify.seconds_at(TIMES, n))
    a, s = pays.fit.coefficients()  # the prior on a = 0 holds a little of it back
    assert a == pytest.approx(0.003, abs=6e-4) and s == pytest.approx(1.1, abs=0.01)
    one_size = verify.WhatPays(TIMES)
    for _ in range(100):
        one_size.add_step(2, 1.2 * TIMES[2])
    a, s = one_size.fit.coefficients()
    assert one_size.seconds(2) == pytest.approx(1.2 * TIMES[2], rel=0.01)
    assert s > 1.18 and a < 0.1 * 0.2 * TIMES[2]  # 20% slower: s, and under a tenth of it a


def test_a_pause_counts_as_three_predicted_steps():
    pays = verify.WhatPays(TIMES)
    for _ in range(verify.SETTLED_STEPS):
        pays.add_step(1, TIMES[1])
    pays.add_step(1, 100.0)  # a page fault, a pause
    assert pays.seconds(1) < 2 * TIMES[1]


def test_a_timed_rule_times_the_steps_from_one_call_to_the_next(monkeypatch):
    """The rule times each step from its call to the next, charged to the rows the earlier call verified."""
    clock = iter([10.0, 10.1, 10.25])
    monkeypatch.setattr(verify.time, "perf_counter", lambda: next(clock))
    pays = verify.WhatPays(TIMES, "timed")
    added = []
    monkeypatch.setattr(pays, "add_step", lambda rows, seconds: added.append((rows, round(seconds, 6))))
    pays.times = {n: 0.04 for n in range(1, 17)}  # every row free: each draft is verified
    pays.subtree(verify.Tree.chain(5, [6, 7]), [None, "a", "b"], [5])
    pays.subtree(verify.Tree.chain(6, [7]), [None, "a"], [5, 6])
    pays.subtree(verify.Tree.root_only(7), [None], [5, 6, 7])
    assert added == [(3, 0.1), (2, 0.15)]


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:2])
def test_the_papers_and_cost_free_verify_every_draft_step_for_step(real, prompt):
    """What a preset verifies stays what it verifies: with cost 'free' (paper(), --cost free) each step verifies
    exactly what the method's drafter makes at that text, replayed here on the emitted tokens (the n-gram
    predictor's chain, Cacheback's tree; FAFO: every candidate the pool returns)."""
    model, tok = real
    ids, eos = encode(real, prompt)

    ng_cfg = ngram_predictor.NgramConfig.paper()
    steps = []
    gen = ngram_predictor.generate(model, ids, 32, eos, ng_cfg,
                                   on_step=lambda g, tree, path, bonus: steps.append((len(g.tokens), tree.tokens)))
    for n_before, tokens in steps:
        predictor = ngram_predictor.NGramPredictor(ng_cfg.max_order, ng_cfg.draft_count, ng_cfg.max_history)
        predictor.update_batch(list(ids) + gen.tokens[:n_before])
        drafted = predictor.draft()[: 32 - n_before - 1]
        assert tokens == [gen.tokens[n_before - 1]] + [t for t, _ in drafted]

    cb_cfg = dataclasses.replace(cacheback.CachebackConfig.cpu(), cost="free")
    steps = []
    gen = cacheback.generate(model, ids, 32, eos, cb_cfg,
                             on_step=lambda g, tree, path, bonus: steps.append((len(g.tokens), tree.tokens)))
    for n_before, tokens in steps:
        text = list(ids) + gen.tokens[:n_before]
        dynamic = cacheback.CacheTable(cb_cfg.ll, cb_cfg.fl, cb_cfg.lc, cb_cfg.fc)
        cacheback.update_table(dynamic, text, 0)  # every window in the text's order, as the loop inserts them
        tree = cacheback.grow_tree(text[-1], text, dynamic, None, cb_cfg.tdl, cb_cfg.crt, cb_cfg.frozen_order)
        room = 32 - n_before
        assert tokens == tree.subtree(lambda i: tree.depths[i] < room).tokens

    fafo_cfg = dataclasses.replace(fafo.FafoConfig.cpu(), cost="free")
    retrieved, verified = [], []
    real_retrieve = fafo.NgramPool.retrieve

    def retrieve(pool, context, m):
        out = real_retrieve(pool, context, m)
        retrieved.append(len(out))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fafo.NgramPool, "retrieve", retrieve)
        fafo.generate(model, ids, 32, eos, fafo_cfg, on_step=lambda g, tree, path, bonus: verified.append(
            g.step_facts["layout"].m))
    assert verified == retrieved and sum(verified) > 0


def test_the_paper_presets_set_cost_free():
    assert ngram_predictor.NgramConfig.paper().cost == "free"
    assert cacheback.CachebackConfig.paper().cost == "free" and cacheback.CachebackConfig().cost == "free"
    assert fafo.FafoConfig.paper().cost == "free"
    import card

    assert card.CardConfig.paper().cost == card.CardConfig.paper_7b("d").cost == "free"


@pytest.fixture
def fresh_line(monkeypatch):
    monkeypatch.setattr(verify, "SAID_WILL_NOT_WIN", {})


def test_the_one_line_is_said_once_a_process_per_method(fresh_line, capsys, monkeypatch):
    monkeypatch.setattr(verify, "speed_over_plain", lambda *a: 0.5)
    verify.say_if_slower(None, None, None, ("fafo",), "[fafo] at {:.2f}x here")
    verify.say_if_slower(None, None, None, ("fafo",), "[fafo] at {:.2f}x here")
    verify.say_if_slower(None, None, None, ("card",), "[card] at {:.1f}x here")
    assert capsys.readouterr().err == "[fafo] at 0.50x here\n[card] at 0.5x here\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error", verify.WillNotWin)
        verify.SAID_WILL_NOT_WIN.clear()
        with pytest.raises(verify.WillNotWin):  # a warning of its own class, as the caller's filters decide
            verify.say_if_slower(None, None, None, ("ngram",), "x")
    monkeypatch.setattr(verify, "speed_over_plain", lambda *a: None)  # no tokenizer: nothing measured, nothing said
    verify.SAID_WILL_NOT_WIN.clear()
    verify.say_if_slower(None, None, None, ("fafo",), "x")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("speedup,said", [(0.62, True), (0.999, True), (1.0, False), (1.3, False)])
def test_fafo_says_so_when_it_is_slower_than_plain_decoding_and_only_then(fresh_line, capsys, monkeypatch,
                                                                          speedup, said):
    """FAFO's set-up measures its speed over plain decoding once per machine; below 1 the line appears, once."""
    monkeypatch.setattr(verify, "speed_over_plain", lambda *a: speedup)
    monkeypatch.setattr(verify, "step_times", lambda *a, **k: TIMES)
    cfg = fafo.FafoConfig.cpu()
    assert fafo.prepare(None, None, cfg) == (cfg, {"step_times": TIMES})
    err = capsys.readouterr().err
    assert (err.count("\n"), err.startswith(f"[fafo] on this machine FAFO runs at {speedup:.2f}x")) == (
        (1, True) if said else (0, False))


def test_the_drop_in_says_it_too(fresh_line, capsys, monkeypatch, tiny):
    """model.generate(custom_generate=fafo.custom_generate) runs FAFO's set-up once per model, line and all."""
    import torch

    measured = []
    monkeypatch.setattr(verify, "speed_over_plain", lambda *a: measured.append(1) or 0.7)
    cfg = fafo.FafoConfig(n_guess=2, k=2, m=2, sink=2, recent=8, cost="pinned")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6, 7]])
    for _ in range(2):
        tiny.generate(ids, custom_generate=fafo.custom_generate, fafo_config=cfg, max_new_tokens=4, do_sample=False)
    err = capsys.readouterr().err
    assert err.startswith("[fafo] on this machine FAFO runs at 0.70x plain decoding") and err.count("\n") == 1
    assert len(measured) == 1  # the second call reuses the first's set-up


@pytest.mark.parametrize("module,config", [(ngram_predictor, "NgramConfig"), (cacheback, "CachebackConfig"),
                                           (card, "CardConfig"), (fafo, "FafoConfig")])
def test_every_methods_command_line_takes_the_rules_cost(module, config):
    """--cost reaches the method's config in each script's options (and so in tools/replay.py, which reads them)."""
    for cost in verify.COSTS:
        args = module.make_parser().parse_args(["--prompt", "x", "--cost", cost])
        assert verify.config_from_args(getattr(module, config)(), args).cost == cost
