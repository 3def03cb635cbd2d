# SPDX-License-Identifier: MIT
"""tools/offline.py: a drafter replayed over a greedy stream, with no model, gives exactly what an online run
gives: the same accepted length at every step, the same target forwards (so the same mean accepted tokens).
The oracle is each method's own generate() on the real default model, and for prompt lookup transformers' own
assisted generation, its target forwards counted by a hook."""


import pytest

import cacheback
import ngram_predictor
import verify
from conftest import REAL_PROMPTS, encode, run_main

from tools import offline  # noqa: E402


def online_against_offline(gen, ids, drafter) -> None:
    r = offline.replay(ids, gen.tokens, *drafter)
    assert r.accepted == gen.accepted, "per-step accepted lengths"
    assert r.drafted == gen.drafted, "per-step draft sizes"
    assert r.forwards == gen.target_forwards and r.tokens == len(gen.tokens)


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:2])
def test_ngram_offline_equals_online(real, prompt):
    ids, eos = encode(real, prompt)
    gen = ngram_predictor.generate(real[0], ids, 64, eos, ngram_predictor.NgramConfig.paper())  # the gate off
    assert sum(gen.accepted) > 0
    online_against_offline(gen, ids, offline.make_drafter("ngram", 4))


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:2])
def test_cacheback_offline_equals_online_at_the_cpu_geometry(real, prompt):
    ids, eos = encode(real, prompt)
    cfg = cacheback.CachebackConfig(ll=2, tdl=16, crt=4)  # the CPU preset with the pruning off
    gen = cacheback.generate(real[0], ids, 64, eos, cfg)
    assert sum(gen.accepted) > 0
    online_against_offline(gen, ids, offline.make_drafter("cacheback-cpu", 15))


def test_cacheback_offline_equals_online_with_followers_cut(real):
    ids, eos = encode(real, REAL_PROMPTS[3])
    cfg = cacheback.CachebackConfig(ll=2, tdl=5, crt=1, follower_fit="cut")  # B = 4: followers are cut
    gen = cacheback.generate(real[0], ids, 64, eos, cfg)
    online_against_offline(gen, ids, offline.make_drafter("cacheback-cpu", 4, follower_fit="cut"))


@pytest.fixture(scope="module")
def selfchat_table(real):
    return cacheback.frozen_table_for(real[1], cacheback.CachebackConfig.paper())


@pytest.mark.parametrize("order", ["after", "each-node"])
def test_cacheback_offline_equals_online_at_the_paper_preset(real, selfchat_table, order):
    ids, eos = encode(real, REAL_PROMPTS[4])
    cfg = cacheback.CachebackConfig(frozen="selfchat", frozen_order=order)  # §4's values, whole trees
    gen = cacheback.generate(real[0], ids, 48, eos, cfg, frozen_table=selfchat_table)
    drafter = offline.make_drafter("cacheback-paper", 95, frozen_table=selfchat_table, frozen_order=order)
    online_against_offline(gen, ids, drafter)


def test_prompt_lookup_offline_equals_transformers_own(real):
    """transformers' prompt lookup (prompt_lookup_num_tokens=4) on a prompt it can copy from: the offline
    replay, over HF greedy's own text, makes as many target forwards as HF's assisted generation did."""
    model, tok = real
    ids, eos = encode(real, "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.")
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        hf = verify.hf_generate(model, ids, 48, eos, prompt_lookup_num_tokens=4)
    finally:
        hook.remove()
    assert hf == verify.hf_generate(model, ids, 48, eos)  # greedy: the same text
    r = offline.replay(ids, hf, *offline.make_drafter("prompt-lookup", 4, eos_ids=eos))
    assert r.forwards == len(calls) < len(hf), (r.forwards, len(calls))


def test_the_walk_and_the_statistics_on_a_hand_made_tree():
    """Stream 7 8 9 after the pending 5; a tree 5 -> 7 -> 8 -> 4 and 5 -> 6: two accepted, the bonus 9."""
    tree = verify.Tree.from_branches(5, [[7, 8, 4], [6]])
    assert [tree.tokens[n] for n in offline.walk(tree, [5, 7, 8, 9], 1)] == [7, 8]
    r = offline.replay([1, 2], [5, 7, 8, 9], lambda prompt, first: {}, lambda state, room: tree,
                       lambda state, new: None)
    assert (r.accepted, r.drafted, r.forwards, r.tokens) == ([2], [4], 2, 4)
    assert r.reached[:4] == [1, 1, 1, 0] and r.hit[:4] == [1, 1, 0, 0]
    assert r.row()["mat"] == 2.0


def test_the_command_refuses_bad_input_in_one_line():
    status, _, err = run_main(offline, ["--budgets", "0"])
    assert status == 2 and err.count("\n") == 1 and "--budgets" in err
    status, _, err = run_main(offline, ["--drafters", "eagle"])
    assert status == 2 and "unknown eagle" in err
