# SPDX-License-Identifier: MIT
"""verify.PreallocatedKVCache, the one KV cache every method and the vanilla baseline use: the same logits and
the same logical keys/values as transformers' DynamicCache (the oracle), rollback by a length, compaction in
place, no allocation on a step within capacity, and growth by doubling beyond it."""

import pytest
import torch
from transformers import DynamicCache

import cacheback
import card
import fafo
import ngram_predictor
import verify
from conftest import REAL_PROMPTS


def run_steps(model, cache, prompt, trees):
    """prefill + a sequence of verification steps, each compacted to the path given: the logits of each step."""
    out = [verify.prefill(model, cache, prompt)]
    for tree, path in trees:
        p = verify.cache_len(cache)
        out.append(verify.tree_forward(model, cache, tree))
        verify.compact_kv(cache, p, path)
    return out


def some_steps():
    """A chain fully accepted, a chain cut short, a tree whose accepted path skips nodes (a real compaction)."""
    t = verify.Tree.from_branches(7, [[8, 9, 10], [8, 11], [12]])
    n8 = t.children[0][8]
    return [(verify.Tree.chain(5, [6, 7]), [0, 1, 2]),
            (verify.Tree.chain(9, [3, 4, 5, 6]), [0, 1]),
            (t, [0, n8, t.children[n8][11]]),  # skips the 9, 10 branch: rows move down
            (verify.Tree.root_only(4), [0])]


@pytest.mark.compat
def test_same_logits_and_kv_as_a_dynamic_cache(tiny):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    ours, theirs = verify.new_cache(tiny, capacity=64), DynamicCache()
    a = run_steps(tiny, ours, prompt, some_steps())
    b = run_steps(tiny, theirs, prompt, some_steps())
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)  # the same arithmetic on the same numbers: bit for bit
    assert verify.cache_len(ours) == verify.cache_len(theirs)
    for la, lb in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=0)
        torch.testing.assert_close(la.values, lb.values, rtol=0, atol=0)


@pytest.mark.compat
def test_a_step_within_capacity_allocates_no_new_buffer(tiny):
    """Appends write in place and rollback moves a length: every layer keeps the same storage, and the keys a
    layer hands to attention are a view of it (data pointers unchanged across steps)."""
    cache = verify.new_cache(tiny, capacity=64)
    verify.prefill(tiny, cache, [1, 5, 6, 7])
    ptrs = [(layer.k_buf.data_ptr(), layer.v_buf.data_ptr()) for layer in cache.layers]
    for tree, path in some_steps() * 3:
        p = verify.cache_len(cache)
        verify.tree_forward(tiny, cache, tree)
        verify.compact_kv(cache, p, path)
        assert [(layer.k_buf.data_ptr(), layer.v_buf.data_ptr()) for layer in cache.layers] == ptrs
        assert all(layer.keys.data_ptr() == layer.k_buf.data_ptr() for layer in cache.layers)
    assert cache.grown == 0


def test_overflow_grows_by_doubling_and_stays_exact(tiny):
    """A capacity that is far too small is never silently wrong: the buffer doubles, the output is HF's."""
    prompt = [1] + [5, 6, 7, 8] * 3
    want = verify.hf_generate(tiny, prompt, 40, [95])
    cache = verify.new_cache(tiny, capacity=4)
    got = [int(verify.prefill(tiny, cache, prompt).argmax())]  # a 13-token prompt > 4: it grows here already
    while len(got) < 40:
        got.append(int(verify.tree_forward(tiny, cache, verify.Tree.root_only(got[-1]))[0].argmax()))
    assert got[: len(want)] == want
    assert cache.grown >= 2 and cache.layers[0].capacity >= verify.cache_len(cache) == len(prompt) + 39


def test_rollback_is_a_length():
    layer = verify.PreallocatedLayer(capacity=8)
    k = torch.arange(2 * 6 * 4, dtype=torch.float32).view(1, 2, 6, 4)
    layer.update(k, k.clone())
    layer.crop(-4)  # transformers' "drop the last 4"
    assert layer.get_seq_length() == 2 and torch.equal(layer.keys, k[:, :, :2])
    layer.crop(1)  # transformers 4.x's "keep 1"
    assert layer.get_seq_length() == 1
    new = -torch.ones(1, 2, 3, 4)
    layer.update(new, new)  # the stale rows are overwritten, not appended after
    assert torch.equal(layer.keys, torch.cat([k[:, :, :1], new], dim=2))


# -------------------------------------------------------------------------------- every method sizes it right


def _record_caches(monkeypatch):
    made = []
    real_new_cache = verify.new_cache

    def recording(model, capacity=256):
        made.append(real_new_cache(model, capacity))
        return made[-1]

    monkeypatch.setattr(verify, "new_cache", recording)
    return made


def test_every_method_knows_its_capacity(real, draft_bf16, monkeypatch):
    """Each generate() passes prompt + max_new_tokens + its largest step, so no step of a whole run grows the
    cache (a grown buffer would mean a full copy mid-run): checked for every cache each method makes."""
    model, tok = real
    ids = verify.encode_prompt(tok, REAL_PROMPTS[4])
    eos = verify.eos_ids_of(model, tok)
    cost = {1: 1.0, 2: 1.6, 4: 1.8, 8: 2.0, 16: 2.2}
    n = 24  # the capacity is prompt + n + the largest step: the last steps of any run test it
    runs = {
        "vanilla": lambda: verify.vanilla_generate(model, ids, n, eos),
        "ngram": lambda: ngram_predictor.generate(model, ids, n, eos, ngram_predictor.NgramConfig.paper()),
        "cacheback": lambda: cacheback.generate(model, ids, n, eos, cacheback.CachebackConfig.cpu(), step_times=cost),
        "card": lambda: card.generate(model, ids, n, eos, card.CardConfig(K=4, k=2, ratio=4, mode="lockstep"),
                                      draft_model=draft_bf16),
        "fafo": lambda: fafo.generate(model, ids, n, eos, fafo.FafoConfig.cpu()),
        "lookahead": lambda: fafo.generate(model, ids, n, eos, fafo.FafoConfig(n_guess=4, k=3, m=3, compress="none", lookback=1)),
    }
    for name, run in runs.items():
        made = _record_caches(monkeypatch)
        run()
        assert made and all(c.grown == 0 for c in made), name
        monkeypatch.undo()
