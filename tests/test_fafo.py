# SPDX-License-Identifier: MIT
"""fafo.py and verify.py's FlexAttention compacted-block path.

Oracles: hand-written expectations (pool, streams, selections, the Figure 4 mask, Algorithm 4), the dense
additive-mask path (for the flex path), a plain logical copy of the KV (for the swaps) and HF greedy
generate on the real model (losslessness)."""

import numpy as np
import pytest
import torch

import fafo
import verify
from conftest import REAL_PROMPTS, encode


def cpu(**fields) -> fafo.FafoConfig:
    """The CPU configuration with some fields changed."""
    import dataclasses

    return dataclasses.replace(fafo.FafoConfig.cpu(), **fields)


# -- 1. the pool (Algorithms 2 and 3) --------------------------------------------------------------------


def test_pool_files_a_guess_under_every_suffix_of_the_buffer():
    pool = fafo.NgramPool(k=3, cap=4)
    pool.add_guess([7, 8, 9], (1, 2, 3))
    assert set(pool.table) == {(9,), (8, 9), (7, 8, 9)}
    pool.add_guess([5], (4, 4, 4))  # a short buffer (warm-up): only the keys it has
    assert set(pool.table) == {(9,), (8, 9), (7, 8, 9), (5,)}
    assert len(pool) == 4


def test_pool_keeps_at_most_cap_values_per_key_lru():
    pool = fafo.NgramPool(k=2, cap=2)
    pool.add((1,), (10, 11))
    pool.add((1,), (20, 21))
    pool.add((1,), (10, 11))  # re-filed: now the most recent
    pool.add((1,), (30, 31))  # evicts the least recent, (20, 21)
    assert list(pool.table[(1,)]) == [(10, 11), (30, 31)]


def test_retrieval_prefers_the_longest_suffix_then_the_most_recent_and_dedupes():
    pool = fafo.NgramPool(k=3, cap=4)
    pool.add((9,), (1, 1, 1))
    pool.add((9,), (2, 2, 2))
    pool.add((8, 9), (3, 3, 3))
    pool.add((8, 9), (1, 1, 1))
    pool.add((7, 8, 9), (4, 4, 4))
    pool.add((5, 8, 9), (6, 6, 6))  # does not match the text
    text = [0, 7, 8, 9]
    assert pool.retrieve(text, m=10) == [(4, 4, 4), (1, 1, 1), (3, 3, 3), (2, 2, 2)]
    assert pool.retrieve(text, m=2) == [(4, 4, 4), (1, 1, 1)]
    assert pool.retrieve([1, 2], m=3) == []


def test_lookback_one_is_lookaheads_pool_keyed_by_the_last_token_only():
    pool = fafo.NgramPool(k=3, cap=4, lookback=1)
    pool.add_guess([7, 8, 9], (1, 2, 3))
    pool.add_guess([6, 8, 9], (4, 5, 6))
    assert list(pool.table) == [(9,)]  # FAFO (lookback k) would also file under (8, 9) and (7, 8, 9)
    assert pool.retrieve([0, 7, 8, 9], m=4) == [(4, 5, 6), (1, 2, 3)]  # most recent first, no longer key tried
    two = fafo.NgramPool(k=3, cap=4, lookback=2)
    two.add_guess([7, 8, 9], (1, 2, 3))
    assert set(two.table) == {(9,), (8, 9)}


def test_lookback_is_checked():
    for bad in (0, 4):
        with pytest.raises(verify.UserError, match="--lookback"):
            cpu(k=3, lookback=bad).check()


def test_prompt_seeding_files_each_kgram_under_its_preceding_tokens():
    pool = fafo.NgramPool(k=2, cap=4)
    pool.add_prompt([1, 2, 3, 4])
    assert pool.table[(1,)] == {(2, 3): None}
    assert pool.table[(2,)] == {(3, 4): None} and pool.table[(1, 2)] == {(3, 4): None}
    assert (3,) not in pool.table  # (4, ?) is not a full 2-gram


# -- 2. the guess streams --------------------------------------------------------------------------------


def test_streams_shift_and_file_their_new_window_only_after_the_warm_up():
    # k = 3: the initial windows are random prompt tokens (Lookahead's initialisation). For 3 advances a
    # window still holds some of them, so nothing is filed; from the 4th on, the model's own guesses are.
    s = fafo.Streams([[1, 2, 3], [4, 5, 6]], k=3)
    pool = fafo.NgramPool(k=3, cap=4)
    s.advance([7, 8], pool)
    assert s.windows == [[2, 3, 7], [5, 6, 8]] and s.buffers == [[], []] and len(pool) == 0
    s.advance([9, 9], pool)
    s.advance([10, 11], pool)
    assert s.windows == [[7, 9, 10], [8, 9, 11]] and len(pool) == 0  # all guesses now, but no guessed key yet
    s.advance([12, 13], pool)
    assert s.buffers == [[7], [8]]  # the first guessed token dropped: the first key
    assert pool.table == {(7,): {(9, 10, 12): None}, (8,): {(9, 11, 13): None}}
    s.advance([14, 14], pool)
    assert s.buffers[0] == [7, 9] and pool.table[(7, 9)] == {(10, 12, 14): None}
    assert pool.table[(9,)] == {(10, 12, 14): None, (11, 13, 14): None}


def test_guess_rows_are_inside_the_context_check(tiny):
    # tiny's context is 512: 500 + 4 new tokens fit, but the guess rows reach 500 + 4 + n + k = 514
    with pytest.raises(verify.UserError, match="guess rows"):
        fafo.generate(tiny, [5] * 500, 4, [], cpu(n_guess=5, k=5, m=2))
    assert len(fafo.generate(tiny, [5] * 500, 4, [], cpu(n_guess=4, k=3, m=2)).tokens) == 4


# -- 3. the compression functions ------------------------------------------------------------------------


def test_streaming_llm_keeps_sinks_and_recent():
    c = fafo.StreamingLLM(sink=2, recent=4)
    assert c.select(12) == [0, 1, 8, 9, 10, 11]
    assert c.select(5) == [0, 1, 2, 3, 4]  # shorter than the budget: everything, no duplicates
    assert fafo.FullKV().select(3) == [0, 1, 2]


def test_quest_bound_worked_example():
    q = torch.tensor([[1.0, -1.0]])  # one head, D = 2
    keys = torch.tensor([[0.0, 2.0], [3.0, -1.0]])
    kmin, kmax = keys.amin(0)[None, None], keys.amax(0)[None, None]  # [P=1, H_kv=1, D]
    assert fafo.quest_page_scores(q, kmin, kmax).tolist() == [4.0]
    assert (keys @ q[0]).max() <= 4.0  # an upper bound of every q.k in the page


class FakeKV:
    """keys(start, end) over hand-made keys [L, H_kv, n, D]."""

    def __init__(self, keys):
        self.K = keys

    @property
    def length(self):
        return self.K.shape[2]

    def keys(self, start, end):
        return self.K[:, :, start:end]


def test_quest_selects_the_pages_whose_keys_can_score_highest():
    # 1 layer, 1 KV head, 2 query heads (GQA), D = 2; 5 pages of 2 positions; query points along +x
    keys = torch.zeros(1, 1, 10, 2)
    keys[0, 0, 2] = torch.tensor([5.0, 0.0])  # page 1 has a strong +x key
    keys[0, 0, 7] = torch.tensor([3.0, 0.0])  # page 3 a weaker one
    keys[0, 0, 8] = torch.tensor([-9.0, 0.0])  # page 4 points away: its bound is 0 for q=+x
    quest = fafo.Quest(page_size=2, top_pages=2)
    queries = torch.tensor([[[1.0, 0.0], [0.5, 0.0]]])  # [L=1, H=2, D]
    quest.observe(FakeKV(keys), queries)
    assert quest.select(10) == [2, 3, 6, 7]
    # a query pointing the other way ranks page 4 first (its -9 key now scores 9)
    quest.observe(FakeKV(keys), -queries)
    assert {8, 9} <= set(quest.select(10)) and int(quest.scores.argmax()) == 4


def test_quest_page_statistics_are_updated_incrementally():
    torch.manual_seed(0)
    keys = torch.randn(2, 1, 11, 4)
    quest = fafo.Quest(page_size=4, top_pages=1)
    q = torch.randn(2, 1, 4)
    for n in (3, 5, 9, 11):  # grow the cache step by step
        quest.observe(FakeKV(keys[:, :, :n]), q)
    fresh = fafo.Quest(page_size=4, top_pages=1)
    fresh.observe(FakeKV(keys), q)
    assert torch.equal(quest.kmin, fresh.kmin) and torch.equal(quest.kmax, fresh.kmax)
    assert quest.kmin.shape == (2, 3, 1, 4)


def test_snapkv_votes_are_the_models_own_attention_weights():
    """Oracle: the eager attention weights transformers returns for the prompt (output_attentions=True).
    SnapKV's votes = what the window's rows paid to each earlier position, summed over rows, heads, layers."""
    from conftest import make_tiny_llama

    model = make_tiny_llama(seed=3)
    model.config._attn_implementation = "eager"  # the only back-end that returns the weights
    try:
        ids = torch.randint(3, 90, (1, 21), generator=torch.Generator().manual_seed(4))
        cache = verify.new_cache(model, 32)
        out = verify.model_forward(model, cache, input_ids=ids, output_hidden_states=True,
                                   output_attentions=True)
    finally:
        model.config._attn_implementation = "sdpa"
    P, w = 21, 5
    window = list(range(P - w, P))
    queries = fafo.layer_queries(model, out.hidden_states, window, window)  # [L, H, w, D]
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, H_kv, P, D]
    got = fafo.snapkv_votes(queries, keys, fafo.attention_scale(model))
    want = sum(a[0, :, P - w :, : P - w].sum(dim=(0, 1)) for a in out.attentions)  # [P - w]
    assert got.shape == (P - w,) and torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_snapkv_keeps_the_pooled_top_positions_and_the_window():
    # 1 layer, 1 KV head, 1 query head, D = 2; 12 positions, window 2 (positions 10, 11)
    keys = torch.zeros(1, 1, 12, 2)
    keys[0, 0, 3] = torch.tensor([4.0, 0.0])  # the window's queries point along +x: position 3 wins the vote
    keys[0, 0, 8] = torch.tensor([3.9, 0.0])  # and 8 comes a close second; every other position ties
    queries = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).view(1, 1, 2, 2)  # [L, H, w, D]
    votes = fafo.snapkv_votes(queries, keys, 1.0)
    assert votes.shape == (10,) and votes.argsort(descending=True)[:2].tolist() == [3, 8]
    # capacity 4 = the window + 2 chosen; no pooling (kernel 1): the two best positions
    snap = fafo.SnapKV(window_size=2, max_capacity_prompt=4, kernel_size=1, recent=3)
    snap.observe_prompt(FakeKV(keys), queries, scale=1.0)
    assert snap.kept == [3, 8, 10, 11]
    assert snap.select(14) == [3, 8, 10, 11, 12, 13]  # + the 3 most recent positions
    # pooling over 3 neighbours: the winner's neighbourhood (2, 3, 4) now outranks the runner-up itself
    pooled = fafo.SnapKV(window_size=2, max_capacity_prompt=5, kernel_size=3, recent=1)
    pooled.observe_prompt(FakeKV(keys), queries, scale=1.0)
    assert pooled.kept == [2, 3, 4, 10, 11]
    short = fafo.SnapKV(window_size=2, max_capacity_prompt=20, kernel_size=5, recent=1)
    short.observe_prompt(FakeKV(keys), queries, scale=1.0)  # a prompt within the capacity: keep it all
    assert short.kept == list(range(12))


def test_snapkv_settings_are_checked():
    for bad, flag in ((dict(window_size=0), "--window-size"), (dict(max_capacity_prompt=32), "--max-capacity-prompt"),
                      (dict(kernel_size=4), "--kernel-size")):
        with pytest.raises(verify.UserError, match=flag):
            cpu(compress="snapkv", **bad).check()


# -- 4. the step layout and the combined mask (Figure 4) -------------------------------------------------


def test_combined_mask_for_a_tiny_configuration():
    # n = 2 streams, k = 2, m = 1; cache of 4 positions of which C(kv) = {0, 3}
    lay = fafo.StepLayout(n=2, k=2, m=1)
    got = fafo.combined_mask(lay, cache_len=4, selected=[0, 3]).astype(int)
    want = np.array([
        # cache     | x  y11 y21 y12 y22 a1 a2
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # x (last token): full cache
        [1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0],  # y^1_1: C(kv), x
        [1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0],  # y^2_1
        [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0],  # y^1_2: its own stream's earlier token
        [1, 0, 0, 1, 1, 0, 1, 0, 1, 0, 0],  # y^2_2
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0],  # a_1: full cache, x
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1],  # a_2: causal within the candidate
    ])
    assert (got == want).all()
    tokens, positions = lay.inputs(50, 4, [[11, 12], [21, 22]], [(31, 32)])
    assert tokens == [50, 11, 21, 12, 22, 31, 32]
    assert positions == [4, 5, 6, 6, 7, 5, 6]


# -- 5. Find Out (Algorithm 4) ---------------------------------------------------------------------------


def test_find_out_takes_the_longest_greedy_match_plus_bonus():
    cands = [(5, 9, 9), (5, 6, 1), (4, 4, 4)]
    choices = [[6, 0, 0], [6, 7, 0], [0, 0, 0]]  # model's choice after each candidate row
    assert fafo.find_out(cands, 5, choices) == (1, 2, 7)
    assert fafo.find_out(cands, 3, choices) == (-1, 0, 3)  # nothing matches: the bonus alone
    assert fafo.find_out([(5, 6), (5, 6)], 5, [[6, 2], [6, 3]]) == (0, 2, 2)  # full match; ties: the first


# -- 6. the compacted buffer: swaps keep the logical cache ------------------------------------------------


def _prefilled(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
    cache = verify.new_cache(model)
    verify.prefill(model, cache, ids)
    return ids, cache


def _logical_equal(kv, cache):
    for i, layer in enumerate(cache.layers):
        s = kv.logical_slots()
        k, v = kv.key_buffer[i][:, :, s], kv.value_buffer[i][:, :, s]  # [1, H_kv, n, D] in logical order
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_reselect_and_commit_never_change_the_logical_cache(tiny):
    ids, cache = _prefilled(tiny, 40)
    kv = verify.CompactedKVCache(tiny, head_slots=16, input_rows=5, tail_slots=128, block_size=16)
    kv.load(cache)
    kv.reselect([0, 1, 2, 3])
    _logical_equal(kv, cache)
    rng = np.random.default_rng(0)
    for step in range(30):
        n = kv.length
        sel = sorted(rng.choice(n, size=int(rng.integers(0, 17)), replace=False).tolist())
        kv.reselect(sel)
        assert sorted(kv.slot_pos[: kv.n_head].tolist()) == sel  # the head holds exactly C(kv)...
        assert (kv.slot_pos[kv.n_head : kv.head_slots] == -1).all()  # ...contiguously
        _logical_equal(kv, cache)
        # a "forward" writes 5 rows into the input region; keep two of them, as the decode loop does
        new_k = torch.randn_like(kv.key_buffer[:, :, :, kv.head_slots : kv.head_slots + 5])
        kv.key_buffer[:, :, :, kv.head_slots : kv.head_slots + 5] = new_k
        kv.value_buffer[:, :, :, kv.head_slots : kv.head_slots + 5] = new_k + 1
        kv.commit([0, 3], [n, n + 1])
        for i, layer in enumerate(cache.layers):
            layer.keys = torch.cat([layer.keys, new_k[i][:, :, [0, 3]]], dim=2)
            layer.values = torch.cat([layer.values, new_k[i][:, :, [0, 3]] + 1], dim=2)
        _logical_equal(kv, cache)
    assert kv.head_len.item() == kv.n_head and kv.tail_len.item() == kv.n_tail


def test_streaming_swap_moves_one_slot_pair_per_new_token(tiny):
    _, cache = _prefilled(tiny, 30)
    kv = verify.CompactedKVCache(tiny, head_slots=16, input_rows=1, tail_slots=40, block_size=16)
    stream = fafo.StreamingLLM(sink=2, recent=6)
    kv.load(cache)
    kv.reselect(stream.select(30))
    kv.commit([0], [30])  # one new token
    assert kv.reselect(stream.select(31)) == 2  # Appendix H: the new entry and the evicted one trade slots
    assert sorted(kv.slot_pos[: kv.n_head].tolist()) == stream.select(31)


# -- 7. the flex path matches the dense path -------------------------------------------------------------


def _one_step(model, compress, p=37, n=3, k=3, m=2):
    """A prefilled cache of p random tokens, one step's inputs with random streams and candidates, and the
    compressor's selection C(kv): (cache, layout, selection, tokens, positions)."""
    ids, cache = _prefilled(model, p, seed=1)
    lay = fafo.StepLayout(n, k, m)
    comp = fafo.make_compressor(fafo.FafoConfig(compress=compress, sink=2, recent=6, page_size=4, top_pages=2))
    if comp.needs_query:
        comp.observe(fafo.DenseKV(model, cache, lay),
                     torch.randn(model.config.num_hidden_layers, model.config.num_attention_heads, 16))
    g = torch.Generator().manual_seed(2)
    windows = torch.randint(3, 90, (n, k), generator=g).tolist()
    cands = [tuple(torch.randint(3, 90, (k,), generator=g).tolist()) for _ in range(m)]
    tokens, positions = lay.inputs(ids[-1], p, windows, cands)
    return cache, lay, comp.select(p), tokens, positions


def _one_step_both_ways(model, compress, attn):
    cache, lay, sel, tokens, positions = _one_step(model, compress)
    comp = fafo.make_compressor(fafo.FafoConfig(compress=compress, sink=2, recent=6, page_size=4, top_pages=2))
    dense = fafo.DenseKV(model, cache, lay)

    import copy
    flex = fafo.FlexKV(model, copy.deepcopy(cache), lay, comp.budget, 64, block_size=16, compiled=attn == "flex-compiled")
    # make the unused slots hostile: if the valid-length bounds leaked, these would change the output
    unused = torch.tensor(np.nonzero(flex.cache.slot_pos < 0)[0])
    flex.cache.key_buffer[:, :, :, unused] = 50.0
    flex.select(sel)
    dense.select(sel)
    want, _ = dense.forward(tokens, positions)
    got, _ = flex.forward(tokens, positions)
    return want, got


def test_split_groups_cover_exactly_the_allowed_entries():
    """Oracle: rebuild the dense mask from the groups (rows x gathered columns, where the group's mask
    allows) and compare with the mask it was cut from, for every compressor's selection."""
    lay = fafo.StepLayout(3, 3, 2)
    for selected in ([0, 1, 30, 31, 32, 33, 34, 35], list(range(8, 16)) + [40], list(range(41))):
        allowed = fafo.combined_mask(lay, 41, selected)  # [q, 41 + q]
        groups = fafo.split_groups(allowed, lay.guess_rows(), torch.float32)
        rebuilt = np.zeros_like(allowed)
        for rows, cols, mask in groups:
            cols = np.arange(allowed.shape[1]) if cols is None else cols.numpy()
            rebuilt[np.ix_(rows.numpy(), cols)] = (mask[0, 0] == 0).numpy()
        assert (rebuilt == allowed).all()
        assert sorted(r for rows, _, _ in groups for r in rows.tolist()) == list(range(lay.rows))
    # StreamingLLM's 8 of 41: the guess rows read 8 cached + 1 + n*k step columns, not 41 + q
    groups = fafo.split_groups(fafo.combined_mask(lay, 41, [0, 1, 35, 36, 37, 38, 39, 40]), lay.guess_rows(),
                               torch.float32)
    assert [None if cols is None else len(cols) for _, cols, _ in groups] == [None, 8 + 1 + 9]


@pytest.mark.parametrize("compress", ["stream", "quest", "none"])
def test_split_matches_dense(tiny, compress):
    cache, lay, sel, tokens, positions = _one_step(tiny, compress)
    dense = fafo.DenseKV(tiny, cache, lay)
    # hostile: the entries the guess rows must NOT see get huge values. The dense mask hides them from the
    # guess rows, so if the plan leaked one, the guess rows' logits would move far beyond the tolerance.
    hidden = [x for x in range(37) if x not in set(sel)]
    for layer in cache.layers:
        layer.values[:, :, hidden] = 50.0
    dense.select(sel)
    want, _ = dense.forward(tokens, positions)
    verify.rollback(cache, 37)
    split = fafo.SplitKV(tiny, cache, lay)
    split.select(sel)
    got, _ = split.forward(tokens, positions)
    assert torch.allclose(want, got, atol=1e-4, rtol=1e-4)
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    assert tiny.config._attn_implementation != fafo.SPLIT  # the context manager put the model back


@pytest.mark.parametrize("backend", [fafo.DenseKV, fafo.SplitKV])
def test_head_on_the_read_rows_only_gives_those_rows_logits(tiny, backend):
    cache, lay, sel, tokens, positions = _one_step(tiny, "stream")
    kv = backend(tiny, cache, lay)
    kv.select(sel)
    every, _ = kv.forward(tokens, positions)  # [q, V]
    verify.rollback(cache, 37)
    read = lay.read_rows()
    assert read == (0, 7, 8, 9, 10, 11, 12, 13, 14, 15)  # n = k = 3, m = 2: fumble levels 1-2 (rows 1-6) unread
    some, _ = kv.forward(tokens, positions, rows=read)
    assert some.shape == (len(read), every.shape[1])
    assert torch.allclose(some, every[list(read)], atol=1e-5, rtol=1e-5)
    assert torch.equal(some.argmax(-1), every[list(read)].argmax(-1))


@pytest.mark.parametrize("compress", ["stream", "quest"])
def test_flex_eager_matches_dense(tiny, compress):
    want, got = _one_step_both_ways(tiny, compress, "flex")
    assert torch.allclose(want, got, atol=1e-4, rtol=1e-4)
    assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_flex_compiled_matches_dense(tiny):
    pytest.importorskip("torch._inductor")
    want, got = _one_step_both_ways(tiny, "stream", "flex-compiled")
    assert torch.allclose(want, got, atol=1e-4, rtol=1e-4)


def test_block_mask_lets_guess_rows_skip_the_tail(tiny):
    kv = verify.CompactedKVCache(tiny, head_slots=16, input_rows=16, tail_slots=64, block_size=16)
    guess = np.zeros(16, dtype=bool)
    guess[:8] = True  # the first q block: guess rows only
    bm = kv.block_mask(np.tril(np.ones((16, 16), dtype=bool)), np.r_[guess[:8], np.zeros(8, bool)])
    # 6 kv blocks: head (1), input (1), tail (4). q block 0 holds guess AND verification rows -> all 6.
    assert bm.kv_num_blocks.flatten().tolist() == [6]
    kv2 = verify.CompactedKVCache(tiny, head_slots=16, input_rows=32, tail_slots=64, block_size=16)
    bm2 = kv2.block_mask(np.tril(np.ones((32, 32), dtype=bool)), np.r_[np.ones(16, bool), np.zeros(16, bool)])
    # q block 0 = guess rows: head + its input block only; q block 1: everything
    assert bm2.kv_num_blocks.flatten().tolist() == [2, 7]
    assert bm2.kv_indices[0, 0, 0, :2].tolist() == [0, 1]


# -- 8. losslessness and boundaries ----------------------------------------------------------------------


def test_lossless_on_the_tiny_model_all_paths(tiny):
    ids = list(range(3, 40)) * 2
    want = verify.hf_generate(tiny, ids, 40, [2])
    for compress in ("stream", "quest", "snapkv", "none"):
        for attn in ("dense", "split", "flex") if compress != "none" else ("dense", "split"):
            gen = fafo.generate(tiny, ids, 40, [2], cpu(n_guess=3, k=3, m=2, compress=compress, sink=2, recent=6,
                                                        page_size=4, top_pages=2, window_size=4, max_capacity_prompt=12,
                                                        kernel_size=3, attn=attn, block_size=16))
            assert gen.tokens == want, (compress, attn)


# Small budgets, so that the compression really drops most of the cache on these short prompts.
SMALL = dict(n_guess=4, k=4, m=3, sink=2, recent=12, page_size=8, top_pages=2, window_size=8, max_capacity_prompt=16)
REAL_CONFIGS = {  # on the CPU configuration's back-end, split, unless named
    "stream": dict(compress="stream"),
    "quest": dict(compress="quest"),
    "snapkv": dict(compress="snapkv"),
    "none": dict(compress="none"),
    "prompt pool": dict(prompt_pool=True),
    "lookahead": dict(compress="none", lookback=1),  # Lookahead Decoding: full-KV guesses, one-token keys
    "quest dense": dict(compress="quest", attn="dense"),
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_lossless_on_real_prompts(real, oracle, name):
    """Each configuration once, the prompts in turn."""
    ids, eos = encode(real, REAL_PROMPTS[list(REAL_CONFIGS).index(name) % len(REAL_PROMPTS)])
    gen = fafo.generate(real[0], ids, 40, eos, cpu(**SMALL, **REAL_CONFIGS[name]))
    assert gen.tokens == oracle(ids, 40, eos)


@pytest.mark.compat
def test_lossless_flex_on_a_real_prompt(real, oracle):
    ids, eos = encode(real, REAL_PROMPTS[3])
    gen = fafo.generate(real[0], ids, 24, eos, cpu(n_guess=3, k=3, m=2, sink=2, recent=12, attn="flex", block_size=16))
    assert gen.tokens == oracle(ids, 24, eos) and gen.extra["slots_swapped_per_step"] > 0


def test_max_new_tokens_and_eos_inside_an_accepted_run(tiny):
    ids = list(range(3, 30)) * 3  # repetitive: the pool's candidates get accepted
    kw = dict(n_guess=3, k=3, m=2, sink=2, recent=8, prompt_pool=True)
    full = fafo.generate(tiny, ids, 40, [], cpu(**kw))
    assert max(full.accepted) >= 2, "the test needs multi-token steps"
    for n in (1, 2, 7, 40):
        assert fafo.generate(tiny, ids, n, [], cpu(**kw)).tokens == full.tokens[:n]
    # pick an EOS that the run emits in the MIDDLE of an accepted candidate
    i = next(i for i in range(1, len(full.tokens) - 1) if full.from_draft[i] and full.from_draft[i + 1])
    eos = [full.tokens[i]]
    gen = fafo.generate(tiny, ids, 40, eos, cpu(**kw))
    want = verify.hf_generate(tiny, ids, 40, eos)
    assert gen.tokens == want and gen.tokens[-1] == eos[0] and len(gen.tokens) <= i + 1


def test_warm_up_with_an_empty_pool_still_emits_one_token_per_step(tiny):
    gen = fafo.generate(tiny, [5, 6, 7], 3, [], cpu(n_guess=2, k=4, m=2))
    assert gen.accepted[0] == 0 and gen.drafted[0] == 0  # nothing to verify in the first step
    assert len(gen.tokens) == 3


def test_flex_refuses_an_unbounded_compressor(tiny):
    with pytest.raises(verify.UserError, match="fixed compression budget"):
        fafo.generate(tiny, [5, 6, 7], 3, [], cpu(compress="none", attn="flex"))


def test_pool_refresh_use_makes_a_retrieval_count_as_a_use():
    """Appendix F's LRU with refresh="use": a retrieved k-gram becomes the most recent under every key of
    the text it is filed under, so a later insertion evicts one that was not retrieved (oracle: the
    orders written out by hand)."""
    A, B, C = (10, 11), (20, 21), (30, 31)
    for refresh, kept in (("insert", [B, C]), ("use", [A, C])):
        pool = fafo.NgramPool(k=2, cap=2, refresh=refresh)
        pool.add((1,), A)
        pool.add((1,), B)  # key (1,): A, then B (the most recent)
        pool.add((0, 1), A)
        assert pool.retrieve([0, 1], m=1) == [A]  # the longest key first
        pool.add((1,), C)  # evicts key (1,)'s least recently used
        assert list(pool.table[(1,)]) == kept, refresh
