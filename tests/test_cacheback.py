# SPDX-License-Identifier: MIT
"""cacheback.py: the LRU rules of §3.1 one by one, sliding-window updates, tree growth under TDL/CRT on
hand-built tables, the tree's attention mask, and losslessness against HF greedy on the real model."""

import dataclasses
import types

import numpy as np
import pytest
import torch

import cacheback as cb
import tools.build_frozen as bf
import verify
from conftest import REAL_PROMPTS, encode

# step times measured on a 2-core CPU: T(n) for n = 1 .. 16 tokens, in seconds
CPU_STEP_TIMES = {1: 0.040, 2: 0.066, 4: 0.072, 8: 0.074, 16: 0.088}

# ---------------------------------------------------------------------------------------------- LRU rules


def followers(table, leader):
    return list(table.query(leader, refresh=False))


def test_insert_creates_leader_then_extends_its_followers():
    t = cb.CacheTable(ll=1, fl=2, lc=4, fc=4)
    t.insert((1,), (2, 3))
    t.insert((1,), (4, 5))
    t.insert((1,), (2, 3))  # already present: not duplicated, refreshed
    assert len(t) == 1 and followers(t, (1,)) == [(2, 3), (4, 5)]  # most recent first
    assert followers(t, (9,)) == []


def test_leader_eviction_takes_the_least_recent_leader_with_its_followers():
    t = cb.CacheTable(ll=1, fl=1, lc=2, fc=4)
    t.insert((1,), (10,))
    t.insert((2,), (20,))
    t.insert((3,), (30,))  # evicts leader 1 (least recently used)
    assert list(t.leaders) == [(2,), (3,)] and followers(t, (1,)) == []


def test_query_refreshes_the_leader():
    t = cb.CacheTable(ll=1, fl=1, lc=2, fc=4)
    t.insert((1,), (10,))
    t.insert((2,), (20,))
    list(t.query((1,)))  # leader 1 becomes most recent
    t.insert((3,), (30,))  # so leader 2 is evicted
    assert list(t.leaders) == [(1,), (3,)]


def test_lookup_without_refresh_leaves_recency_alone():
    t = cb.CacheTable(ll=1, fl=1, lc=2, fc=4)
    t.insert((1,), (10,))
    t.insert((2,), (20,))
    list(t.query((1,), refresh=False))
    t.insert((3,), (30,))
    assert list(t.leaders) == [(2,), (3,)]


def test_insert_refreshes_the_leader():
    t = cb.CacheTable(ll=1, fl=1, lc=2, fc=4)
    t.insert((1,), (10,))
    t.insert((2,), (20,))
    t.insert((1,), (11,))
    t.insert((3,), (30,))
    assert list(t.leaders) == [(1,), (3,)]


def test_follower_eviction_and_follower_recency_only_on_insertion():
    t = cb.CacheTable(ll=1, fl=1, lc=4, fc=2)
    t.insert((1,), (10,))
    t.insert((1,), (11,))
    list(t.query((1,)))  # a query does NOT refresh followers
    t.insert((1,), (12,))  # evicts follower 10, the least recently inserted
    assert followers(t, (1,)) == [(12,), (11,)]
    t.insert((1,), (11,))  # re-insertion refreshes 11
    t.insert((1,), (13,))  # so 12 is evicted
    assert followers(t, (1,)) == [(13,), (11,)]


def test_followers_compete_only_within_their_leader():
    t = cb.CacheTable(ll=1, fl=1, lc=4, fc=1)
    t.insert((1,), (10,))
    t.insert((2,), (20,))  # another leader's follower evicts nothing of leader 1
    assert followers(t, (1,)) == [(10,)] and followers(t, (2,)) == [(20,)]


def test_frozen_table_never_changes():
    t = cb.CacheTable(ll=1, fl=1, lc=2, fc=2)
    t.insert((1,), (10,))
    t.insert((2,), (20,))
    t.read_only = True
    before = [(k, list(v)) for k, v in t.leaders.items()]
    list(t.query((1,)))  # no refresh either
    with pytest.raises(RuntimeError):
        t.insert((3,), (30,))
    assert [(k, list(v)) for k, v in t.leaders.items()] == before


# ---------------------------------------------------------------------------------------------- updates


def test_windows_slide_over_the_text():
    assert list(cb.windows([1, 2, 3, 4, 5], ll=1, fl=2)) == [((1,), (2, 3)), ((2,), (3, 4)), ((3,), (4, 5))]
    # only windows that END at the new tokens (index >= 3): the paper's "newly observed" pairs
    assert list(cb.windows([1, 2, 3, 4, 5], ll=2, fl=1, first_end=3)) == [((2, 3), (4,)), ((3, 4), (5,))]
    assert list(cb.windows([1, 2], ll=2, fl=2)) == []


# ---------------------------------------------------------------------------------------------- tree


def table_with(pairs, ll=1, fl=2, fc=8):
    t = cb.CacheTable(ll, fl, lc=100, fc=fc)
    for leader, follower in pairs:  # inserted oldest first: the last one is drafted first
        t.insert(leader, follower)
    return t


def test_tree_grows_breadth_first_and_chains():
    # context ... 5, root 5: level 1 = followers of (5,); level 2 = followers of each branch's last token
    dyn = table_with([((5,), (7, 8)), ((5,), (6, 7)), ((7,), (1, 2)), ((8,), (3, 4))])
    tree = cb.grow_tree(5, [9, 5], dyn, None, tdl=100, crt=0)
    branches = [[tree.tokens[n] for n in b] for b in tree.branches()]
    assert branches == [[6, 7, 1, 2], [7, 8, 3, 4]]
    assert tree.depths == [0, 1, 2, 1, 2, 3, 4, 3, 4]


def test_tdl_bounds_draft_tokens_plus_the_uncached_root():
    dyn = table_with([((5,), (i, i + 1)) for i in range(10, 30, 2)])  # 10 followers of 2 tokens
    for tdl in (1, 2, 3, 7, 12):
        tree = cb.grow_tree(5, [5], dyn, None, tdl=tdl, crt=0)
        assert len(tree) <= tdl  # the root + draft tokens
        assert len(tree) - 1 == 2 * ((tdl - 1) // 2)  # whole followers only


def test_crt_reserves_budget_for_deeper_levels():
    # 5 followers of (5,), each chaining further: without CRT level 1 takes everything
    pairs = [((5,), (i, i + 1)) for i in range(10, 20, 2)] + [((i + 1,), (40 + i, 41 + i)) for i in range(10, 20, 2)]
    dyn = table_with(pairs)
    no_crt = cb.grow_tree(5, [5], dyn, None, tdl=11, crt=0)
    assert max(no_crt.depths) == 2 and len(no_crt) == 11  # five level-1 followers, no chaining
    with_crt = cb.grow_tree(5, [5], dyn, None, tdl=11, crt=4)
    assert sum(d <= 2 for d in with_crt.depths[1:]) == 6  # level 1 limited to 10 - 4 = 6 tokens
    assert max(with_crt.depths) == 4 and len(with_crt) == 11  # the reserve went to level 2


def test_frozen_table_only_fills_the_remaining_budget_and_shared_prefixes_merge():
    dyn = table_with([((5,), (6, 7))])
    frozen = table_with([((5,), (6, 9)), ((5,), (6, 7)), ((5,), (8, 8))])
    frozen.read_only = True
    tree = cb.grow_tree(5, [5], dyn, frozen, tdl=100, crt=0)
    # dynamic first; then the frozen followers most recent first: (8,8), (6,7) (already there), (6,9)
    assert [[tree.tokens[n] for n in b] for b in tree.branches()] == [[6, 7], [8, 8], [6, 9]]
    assert len(tree) == 6  # (6,9) shares the 6 with (6,7): one new node
    tree = cb.grow_tree(5, [5], dyn, frozen, tdl=3, crt=0)
    assert tree.tokens == [5, 6, 7]  # the dynamic table's follower first, no room for the frozen ones


def test_frozen_followers_fill_the_budget_after_a_big_dynamic_tree():
    # TDL 16, CRT 4: level 1 may use 15 - 4 = 11 tokens. The dynamic tree: three level-1 followers (9 tokens)
    # and one level-2 follower below "12" -> 12 tokens, more than 11. The frozen table then still adds a
    # follower at level 2 (below "22"), filling the tree to 15 = TDL - 1 (§3.3: "if TDL still allows").
    dyn = table_with([((5,), (30, 31, 32)), ((5,), (20, 21, 22)), ((5,), (10, 11, 12)), ((12,), (13, 14, 15))],
                     fl=3)
    frozen = table_with([((5,), (40, 41, 42)), ((22,), (26, 27, 28))], fl=3)
    frozen.read_only = True
    alone = cb.grow_tree(5, [5], dyn, None, tdl=16, crt=4)
    assert len(alone) - 1 == 12
    tree = cb.grow_tree(5, [5], dyn, frozen, tdl=16, crt=4)
    assert len(tree) - 1 == 15  # before the fix: 12 (the frozen pass stopped at its first dynamic follower)
    assert [tree.tokens[n] for n in tree.branches()[-1]] == [20, 21, 22, 26, 27, 28]
    assert 40 not in tree.tokens  # level 1 stays within its TDL-1-CRT share (already used up)


def test_the_two_frozen_orders_on_a_hand_made_tree():
    """TDL 6 (5 draft tokens), CRT 0, FL 2. Dynamic: 5 -> (6, 7), 7 -> (8, 9); frozen: 5 -> (1, 2).
    'after' grows the dynamic chain first (6 7 8 9: 4 tokens) and the frozen follower no longer fits;
    'each-node' (the authors' order) asks both tables at the root, so (1, 2) takes level 1's budget and the
    dynamic table's level-2 follower (8, 9) no longer fits."""
    dyn = table_with([((5,), (6, 7)), ((7,), (8, 9))])
    frozen = table_with([((5,), (1, 2))])
    frozen.read_only = True
    after = cb.grow_tree(5, [5], dyn, frozen, tdl=6, crt=0, frozen_order="after")
    assert [[after.tokens[n] for n in b] for b in after.branches()] == [[6, 7, 8, 9]]
    each = cb.grow_tree(5, [5], dyn, frozen, tdl=6, crt=0, frozen_order="each-node")
    assert [[each.tokens[n] for n in b] for b in each.branches()] == [[6, 7], [1, 2]]
    assert [o[0] for o in each.origins[1:]] == [0, 0, 1, 1]  # dynamic, dynamic, frozen, frozen
    with pytest.raises(ValueError, match="frozen-order"):
        cb.CachebackConfig(frozen_order="first").check()


def test_a_follower_cut_to_the_budget():
    """TDL 5 (4 draft tokens), CRT 0, FL 3, two followers of 5: 'whole' drafts the first only (the second
    does not fit whole); 'cut' also hangs the second's first token, the one the budget holds."""
    dyn = table_with([((5,), (1, 2, 3)), ((5,), (6, 7, 8))], fl=3)  # (6, 7, 8) the most recent
    whole = cb.grow_tree(5, [5], dyn, None, tdl=5, crt=0)
    assert [[whole.tokens[n] for n in b] for b in whole.branches()] == [[6, 7, 8]]
    cut = cb.grow_tree(5, [5], dyn, None, tdl=5, crt=0, cut=True)
    assert [[cut.tokens[n] for n in b] for b in cut.branches()] == [[6, 7, 8], [1]]
    assert len(cut) - 1 == 4
    # no budget left at level 1: nothing is cut, so no node inside (6, 7, 8) becomes a leaf to extend
    shared = table_with([((5,), (6, 9, 9)), ((5,), (6, 7, 8)), ((6,), (4, 4, 4))], fl=3)
    tree = cb.grow_tree(5, [5], shared, None, tdl=5, crt=1, cut=True)  # level 1 may use 3 tokens
    assert [[tree.tokens[n] for n in b] for b in tree.branches()] == [[6, 7, 8]]


def test_lossless_with_followers_cut(tiny):
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    for tdl in (3, 5, 9):
        gen = cb.generate(tiny, prompt, 24, [95], cb.CachebackConfig(tdl=tdl, crt=1, follower_fit="cut"))
        assert gen.tokens == verify.hf_generate(tiny, prompt, 24, [95]) and sum(gen.accepted) > 0


def test_a_corpus_table_is_built_by_the_tool_with_lc_and_fc_then_found(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    seen = {}

    def fake_build(tok, ll, fl, lc, fc, **kw):
        seen.update(ll=ll, fl=fl, lc=lc, fc=fc)
        t = cb.CacheTable(ll, fl, lc, fc)
        t.read_only = True
        return t, {"corpus": "test", "seed": 0, "tokens": 0}

    monkeypatch.setattr(bf, "build_frozen", fake_build)
    tok = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    model = types.SimpleNamespace(device=torch.device("cpu"))
    cfg = cb.CachebackConfig(ll=1, fl=3, lc=7, fc=5, tdl=16, crt=4, frozen="stdlib", cost="free")
    with pytest.raises(verify.UserError, match="tools/build_frozen.py --corpus stdlib .* --lc 7 --fc 5"):
        cb.prepare(model, tok, cfg)  # not shipped, not built: one line naming the command
    bf.ensure_table(tok, cfg)
    _, extra = cb.prepare(model, tok, cfg)
    assert seen == dict(ll=1, fl=3, lc=7, fc=5)
    assert (extra["frozen_table"].lc, extra["frozen_table"].fc) == (7, 5)


def test_the_default_models_tables_for_the_papers_parameters_are_shipped(tokenizer):
    for corpus in cb.FROZEN_CORPORA:
        cfg = cb.CachebackConfig(frozen=corpus)
        assert cb.frozen_path(tokenizer, cfg).startswith(cb.CORPUS_DIR)
        table = cb.frozen_table_for(tokenizer, cfg)
        assert table.read_only and (table.ll, table.fl, table.lc, table.fc) == (1, 3, 2**20, 128) and len(table) > 1000


def test_only_the_first_level_query_refreshes_recency():
    dyn = table_with([((5,), (7, 8)), ((8,), (1, 2)), ((3,), (4, 4))], fl=2)
    cb.grow_tree(5, [5], dyn, None, tdl=100, crt=0)
    assert list(dyn.leaders)[-1] == (5,)  # the real context was refreshed, the speculative (8,) was not
    assert list(dyn.leaders)[0] == (8,)


def test_mask_of_a_cacheback_tree():
    dyn = table_with([((5,), (7, 8)), ((5,), (6, 7)), ((7,), (1, 2))])
    tree = cb.grow_tree(5, [5], dyn, None, tdl=100, crt=0)
    # level 1: (5,) -> (6,7), (7,8) most recent first; level 2: (7,) -> (1,2) below "6 7"; (8,) has none
    assert tree.tokens == [5, 6, 7, 7, 8, 1, 2] and tree.parents == [-1, 0, 1, 0, 3, 2, 5]
    expected = np.array([[1, 0, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0],
                         [1, 0, 0, 1, 0, 0, 0],
                         [1, 0, 0, 1, 1, 0, 0],
                         [1, 1, 1, 0, 0, 1, 0],
                         [1, 1, 1, 0, 0, 1, 1]], dtype=bool)
    mask = (verify.tree_attention_mask(tree.parents, 3, torch.float32)[0, 0] == 0).numpy()
    assert mask[:, :3].all()  # everybody sees the prefix
    assert np.array_equal(mask[:, 3:], expected)


# ---------------------------------------------------------------------------------------------- frozen builder


@pytest.fixture(scope="module")
def tokenizer(real):
    return real[1]


def test_builder_is_deterministic_and_keeps_top_followers(tokenizer, tmp_path):
    a, meta_a = bf.build_frozen(tokenizer, 1, 3, lc=50, fc=4, max_tokens=20_000, seed=1, progress=False)
    b, meta_b = bf.build_frozen(tokenizer, 1, 3, lc=50, fc=4, max_tokens=20_000, seed=1, progress=False)
    assert meta_a == meta_b and meta_a["tokens"] == 20_000
    assert [(k, list(v)) for k, v in a.leaders.items()] == [(k, list(v)) for k, v in b.leaders.items()]
    assert len(a) == 50 and all(len(f) <= 4 for f in a.leaders.values()) and a.read_only
    c, _ = bf.build_frozen(tokenizer, 1, 3, lc=50, fc=4, max_tokens=20_000, seed=2, progress=False)
    assert [(k, list(v)) for k, v in a.leaders.items()] != [(k, list(v)) for k, v in c.leaders.items()]
    # round trip through the portable file format
    cb.save_frozen(a, tmp_path / "t.json.gz", tokenizer, meta_a)
    back = cb.load_frozen(tmp_path / "t.json.gz", tokenizer, 1, 3)
    assert [(k, list(v)) for k, v in back.leaders.items()] == [(k, list(v)) for k, v in a.leaders.items()]


def test_builder_keeps_the_most_frequent_leaders_and_followers(tokenizer):
    from collections import Counter

    n = 30_000
    table, _ = bf.build_frozen(tokenizer, 1, 3, lc=3, fc=2, max_tokens=n, seed=0, progress=False)
    # brute force over the same token stream: the same files in the same seeded order, cut at n tokens
    stream = []
    for path in bf.stdlib_corpus(0):
        stream += tokenizer(open(path, encoding="utf-8", errors="replace").read(), add_special_tokens=False).input_ids
        if len(stream) >= n:
            break
    stream = stream[:n]
    lead = Counter(tuple(stream[i : i + 1]) for i in range(len(stream) - 3))
    top = sorted(lead, key=lambda leader: (-lead[leader], leader))[:3]
    assert list(table.leaders) == top[::-1]  # most frequent = most recent (drafted from first)
    for leader in top:
        fol = Counter(tuple(stream[i + 1 : i + 4]) for i in range(len(stream) - 3) if (stream[i],) == leader)
        best = sorted(fol, key=lambda f: (-fol[f], f))[:2]
        assert list(table.query(leader)) == best  # most frequent follower first


def test_loading_refuses_mismatches(tokenizer, tmp_path):
    import gzip
    import json

    table, meta = bf.build_frozen(tokenizer, 1, 3, lc=10, fc=2, max_tokens=5_000, progress=False)
    path = tmp_path / "t.json.gz"
    cb.save_frozen(table, path, tokenizer, meta)
    with pytest.raises(verify.UserError, match="LL=1, FL=3"):
        cb.load_frozen(path, tokenizer, 2, 3)
    doc = json.loads(gzip.open(path, "rt").read())
    doc["tokenizer"]["vocab_sha1"] = "0" * 40
    with gzip.open(tmp_path / "other.json.gz", "wt") as f:
        json.dump(doc, f)
    with pytest.raises(verify.UserError, match="different tokenizer"):
        cb.load_frozen(tmp_path / "other.json.gz", tokenizer, 1, 3)
    (tmp_path / "junk.json.gz").write_bytes(b"not gzip")
    with pytest.raises(verify.UserError, match="not a frozen table"):
        cb.load_frozen(tmp_path / "junk.json.gz", tokenizer, 1, 3)


# ---------------------------------------------------------------------------------------------- lossless


@pytest.fixture(scope="module")
def small_frozen(tokenizer):
    """A frozen table from the first 100k tokens of the standard library (the full one: 2M, ~25 s)."""
    return bf.build_frozen(tokenizer, 1, 3, lc=2**20, fc=128, max_tokens=100_000, progress=False)[0]


REAL_CONFIGS = {
    "tdl 16": cb.CachebackConfig(tdl=16, crt=4),
    # the CPU defaults (LL = 2, the rule on a fixed curve, so the run is deterministic)
    "cpu": dataclasses.replace(cb.CachebackConfig.cpu(), cost="pinned"),
    "dual tables, cut by the rule": cb.CachebackConfig(tdl=16, crt=4, frozen="stdlib", cost="pinned"),
    "dual tables, the authors' order": cb.CachebackConfig(tdl=16, crt=4, frozen="stdlib", frozen_order="each-node"),
}


@pytest.mark.parametrize("prompt", REAL_PROMPTS)
def test_lossless_on_real_prompts(real, oracle, small_frozen, prompt):
    """Each prompt once, the configurations in turn."""
    ids, eos = encode(real, prompt)
    name = list(REAL_CONFIGS)[REAL_PROMPTS.index(prompt) % len(REAL_CONFIGS)]
    cfg = REAL_CONFIGS[name]
    gen = cb.generate(real[0], ids, 48, eos, cfg, step_times=CPU_STEP_TIMES,
                      frozen_table=small_frozen if cfg.frozen != "none" else None)
    assert gen.tokens == oracle(ids, 48, eos), name
    assert sum(gen.accepted) > 0


def test_lossless_with_the_paper_defaults_and_eos_in_a_draft(real, oracle):
    ids, eos = encode(real, "Repeat exactly: The cat sat on the mat.")
    gen = cb.generate(real[0], ids, 40, eos, cb.CachebackConfig())  # §4's values, without a frozen table
    assert gen.tokens == oracle(ids, 40, eos) and gen.tokens[-1] in eos and gen.from_draft[-1]


def test_max_new_tokens_inside_a_tree(tiny):
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    for n in (1, 2, 5, 13):
        gen = cb.generate(tiny, prompt, n, [95], cb.CachebackConfig(tdl=12, crt=2))
        assert gen.tokens == verify.hf_generate(tiny, prompt, n, [95])


def test_selfchat_instructions_are_disjoint_from_the_bench_prompts():
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "prompts", "prompts.jsonl")) as f:
        bench = {t.strip().lower() for line in f for t in json.loads(line)["turns"]}
    with open(os.path.join(cb.CORPUS_DIR, "instructions.jsonl")) as f:
        instructions = [json.loads(line)["instruction"] for line in f]
    assert len(instructions) == len(set(instructions)) >= 200
    assert not {i.strip().lower() for i in instructions} & bench
    with open(os.path.join(cb.CORPUS_DIR, "selfchat-SmolLM2-135M-Instruct.jsonl")) as f:
        answers = [json.loads(line) for line in f]
    assert [a["instruction"] for a in answers] == instructions  # the shipped answers are to these instructions


def test_selfchat_table_is_deterministic_and_learns_the_models_phrasing(tokenizer):
    answers = bf.selfchat_answers(None, tokenizer, verify.DEFAULT_MODEL, progress=False)  # shipped: no model needed
    seqs = bf.selfchat_sequences(tokenizer, answers)
    a, meta = bf.build_frozen(tokenizer, 1, 3, lc=1000, fc=8, sequences=seqs, corpus="selfchat", progress=False)
    b, _ = bf.build_frozen(tokenizer, 1, 3, lc=1000, fc=8, sequences=seqs, corpus="selfchat", progress=False)
    assert meta["corpus"] == "selfchat" and meta["tokens"] == sum(len(s) for s in seqs) > 30_000
    assert list(a.leaders.items()) == list(b.leaders.items())
    # the chat template's "assistant" turn start is among the leaders, with the answer openings as followers
    start = tuple(verify.encode_prompt(tokenizer, "x")[-1:])
    assert start in a.leaders and len(a.leaders[start]) >= 4
