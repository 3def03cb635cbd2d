# SPDX-License-Identifier: MIT
"""Greedy acceptance and the stopping rule, on hand-built logits and end to end on the tiny model."""

import torch

import verify
from verify import Generation, Tree


def logits_choosing(choices, vocab=50):
    """Logits [N, V] whose argmax in row i is choices[i]."""
    out = torch.zeros(len(choices), vocab)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return out


def test_nothing_accepted():
    tree = Tree.chain(3, [10, 11, 12])
    path, bonus = verify.accepted_path(tree, logits_choosing([20, 11, 12, 13]))
    assert path == [0] and bonus == 20


def test_everything_accepted_gives_bonus_from_last_row():
    tree = Tree.chain(3, [10, 11, 12])
    path, bonus = verify.accepted_path(tree, logits_choosing([10, 11, 12, 13]))
    assert path == [0, 1, 2, 3] and bonus == 13


def test_partial_chain():
    tree = Tree.chain(3, [10, 11, 12])
    path, bonus = verify.accepted_path(tree, logits_choosing([10, 11, 40, 13]))
    assert path == [0, 1, 2] and bonus == 40


def test_tree_follows_the_matching_branch():
    # nodes: 0:3  1:10 2:11  3:20 4:21 5:22
    tree = Tree.from_branches(3, [[10, 11], [20, 21, 22]])
    path, bonus = verify.accepted_path(tree, logits_choosing([20, 0, 0, 21, 9, 0]))
    assert path == [0, 3, 4] and bonus == 9


def test_root_only_tree_is_plain_decoding():
    path, bonus = verify.accepted_path(Tree.root_only(3), logits_choosing([7]))
    assert path == [0] and bonus == 7


def test_eos_inside_accepted_draft_stops_there():
    gen = Generation(max_new_tokens=100, eos_ids=[2])
    assert gen.emit([5, 6, 2, 7, 8], bonus=9) is True
    assert gen.tokens == [5, 6, 2] and gen.from_draft == [True, True, True]


def test_eos_as_bonus_token():
    gen = Generation(max_new_tokens=100, eos_ids=[2])
    assert gen.emit([5], bonus=2) is True and gen.tokens == [5, 2] and gen.from_draft == [True, False]


def test_max_new_tokens_reached_inside_a_draft():
    gen = Generation(max_new_tokens=4, eos_ids=[2])
    assert gen.emit([5], bonus=6) is False
    assert gen.emit([7, 8, 9], bonus=10) is True
    assert gen.tokens == [5, 6, 7, 8]


def oracle_draft_decode(model, prompt, max_new, eos, future, spoil_every=3):
    """A decode loop whose 'drafter' reads the true greedy continuation `future` (spoiling every few
    guesses so that partial acceptance happens too). Exercises acceptance, compaction and the stopping
    rule together."""
    gen = Generation(max_new, eos)
    cache = verify.new_cache(model)
    pending = int(verify.prefill(model, cache, prompt).argmax())
    gen.target_forwards += 1
    if gen.emit([], pending):
        return gen
    while True:
        done = len(gen.tokens)
        draft = list(future[done : done + 5])
        if gen.steps % spoil_every == 2 and len(draft) > 2:
            draft[2] = (draft[2] + 1) % model.config.vocab_size  # a wrong guess in the middle
        # a tree: the (possibly spoiled) chain plus a decoy branch
        tree = Tree.from_branches(pending, [draft, [(pending + 7) % model.config.vocab_size]])
        prefix_len = verify.cache_len(cache)
        path, bonus = verify.accepted_path(tree, verify.tree_forward(model, cache, tree))
        verify.compact_kv(cache, prefix_len, path)
        if gen.finish_step(tree, path, bonus):
            return gen
        pending = bonus


def test_end_to_end_eos_and_max_tokens_inside_drafts(tiny):
    prompt = [1, 40, 41, 42]
    future = verify.hf_generate(tiny, prompt, 40, eos_ids=[95])  # 95: effectively no EOS
    # EOS = a token that occurs in the middle of the continuation -> it will fall inside an accepted draft
    eos = future[13]
    want = verify.hf_generate(tiny, prompt, 40, eos_ids=[eos])
    assert want[-1] == eos and len(want) < 40
    gen = oracle_draft_decode(tiny, prompt, 40, [eos], future)
    assert gen.tokens == want
    assert gen.target_forwards < len(want)  # drafts were actually accepted
    # max_new_tokens cut: 17 is not a multiple of the accepted run lengths
    gen = oracle_draft_decode(tiny, prompt, 17, [95], future)
    assert gen.tokens == future[:17]
