# SPDX-License-Identifier: MIT
"""Tree machinery: trie construction, the tree attention mask, position ids, and the central claim that one
tree forward computes the same logits as separate left-to-right forwards of every branch."""

import numpy as np
import pytest
import torch

import verify
from verify import Tree


def example_tree():
    # The tree drawn in verify.py's comments.
    return Tree.from_branches(4, [[5, 6, 7], [5, 6, 9], [8]])


def test_trie_merges_shared_prefixes():
    t = example_tree()
    assert t.tokens == [4, 5, 6, 7, 9, 8]
    assert t.parents == [-1, 0, 1, 2, 2, 0]
    assert t.depths == [0, 1, 2, 3, 3, 1]
    assert t.branches() == [[1, 2, 3], [1, 2, 4], [5]]
    # adding a branch that is already there adds no node
    assert t.add_branch([5, 6]) == [1, 2] and len(t) == 6
    assert not t.is_chain and Tree.chain(4, [5, 6, 7]).is_chain and Tree.root_only(4).is_chain


def test_mask_matches_hand_written_matrix():
    t = example_tree()
    mask = verify.tree_attention_mask(t.parents, prefix_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 6, 8)
    # rows: nodes 0..5 (tokens 4 5 6 7 9 8); columns: 2 prefix slots, then nodes 0..5
    expected = np.array([
        # P  P  n0 n1 n2 n3 n4 n5
        [1, 1, 1, 0, 0, 0, 0, 0],  # 4 (root)
        [1, 1, 1, 1, 0, 0, 0, 0],  # 5
        [1, 1, 1, 1, 1, 0, 0, 0],  # 6
        [1, 1, 1, 1, 1, 1, 0, 0],  # 7: 4 5 6 7
        [1, 1, 1, 1, 1, 0, 1, 0],  # 9: 4 5 6 9 -- not its sibling 7
        [1, 1, 1, 0, 0, 0, 0, 1],  # 8: 4 8
    ], dtype=bool)
    assert np.array_equal((mask[0, 0] == 0).numpy(), expected)
    # additive: blocked entries hold the most negative float, not 1/0
    assert mask.min().item() == torch.finfo(torch.float32).min and mask.max().item() == 0.0
    assert verify.tree_position_ids(t.depths, 2).tolist() == [[2, 3, 4, 5, 5, 3]]


def ancestor_matrix_bruteforce(parents):
    """The obviously correct oracle: for each node, walk up to the root. visible[i, j]: j is i or an ancestor."""
    n = len(parents)
    visible = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j != -1:
            visible[i, j] = True
            j = parents[j]
    return visible


@pytest.mark.parametrize("seed", range(20))
def test_fast_ancestor_matrix_matches_bruteforce_walk(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    assert np.array_equal(verify.ancestor_matrix(parents), ancestor_matrix_bruteforce(parents))


def tree_vs_sequential(model, prefix, branches, root):
    """Largest |logit difference| between a tree forward (prefix cached) and, for every node, a fresh
    full forward over prefix + the node's own path."""
    cache = verify.new_cache(model)
    verify.prefill(model, cache, prefix)
    tree = Tree.from_branches(root, branches)
    logits = verify.tree_forward(model, cache, tree)  # [N, V]
    assert verify.cache_len(cache) == len(prefix) + len(tree)
    worst = 0.0
    for node in range(len(tree)):
        path, j = [], node
        while j != -1:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        ids = torch.tensor([prefix + path[::-1]])
        with torch.no_grad():
            ref = model(ids).logits[0, -1]
        worst = max(worst, (ref - logits[node]).abs().max().item())
    return worst


def test_tree_forward_equals_sequential_forwards_tiny(tiny):
    prefix = [1, 17, 33, 9, 50, 61, 7]
    branches = [[11, 12, 13], [11, 12, 14, 15], [11, 20], [30, 31], [40]]
    assert tree_vs_sequential(tiny, prefix, branches, root=5) < 1e-4


def test_tree_forward_equals_sequential_forwards_real(real):
    model, tok = real
    prefix = verify.encode_prompt(tok, "Tell me about cats.")
    branches = [tok(s, add_special_tokens=False).input_ids for s in
                [" Cats are small", " Cats are often", " Cats have", " Sure, cats", " They"]]
    worst = tree_vs_sequential(model, prefix, branches, root=tok("Cats", add_special_tokens=False).input_ids[0])
    print(f"\nlargest |tree - sequential| logit difference on the default model: {worst:.3g}")
    assert worst < 1e-4


def test_chain_causal_path_equals_explicit_tree_mask(tiny):
    prefix = [1, 5, 6, 7]
    tree = Tree.chain(8, [9, 10, 11])
    c1, c2 = verify.new_cache(tiny), verify.new_cache(tiny)
    verify.prefill(tiny, c1, prefix)
    verify.prefill(tiny, c2, prefix)
    a = verify.tree_forward(tiny, c1, tree)  # chain -> model's own causal mask
    mask = verify.tree_attention_mask(tree.parents, len(prefix), torch.float32)
    pos = verify.tree_position_ids(tree.depths, len(prefix))
    with torch.no_grad():
        b = verify.model_forward(tiny, c2, input_ids=torch.tensor([tree.tokens]), attention_mask=mask,
                                 position_ids=pos).logits[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", [[0, 4, 5], [0, 1, 2, 3], [0], [0, 6]])
def test_compaction_then_next_step_equals_fresh_forward(tiny, path):
    prefix = [1, 17, 33, 9, 50]
    tree = Tree.from_branches(5, [[11, 12, 13], [21, 22], [31]])  # nodes: 0:5 1:11 2:12 3:13 4:21 5:22 6:31
    assert tree.parents == [-1, 0, 1, 2, 0, 4, 0]
    cache = verify.new_cache(tiny)
    verify.prefill(tiny, cache, prefix)
    verify.tree_forward(tiny, cache, tree)
    verify.compact_kv(cache, len(prefix), path)
    assert verify.cache_len(cache) == len(prefix) + len(path)

    kept = prefix + [tree.tokens[i] for i in path]
    nxt = verify.tree_forward(tiny, cache, Tree.chain(40, [41, 42]))  # the next step, on the compacted cache
    with torch.no_grad():
        fresh = tiny(torch.tensor([kept + [40, 41, 42]])).logits[0, -3:]
    torch.testing.assert_close(nxt, fresh, atol=1e-4, rtol=0)


def test_rollback_truncates(tiny):
    cache = verify.new_cache(tiny)
    verify.prefill(tiny, cache, [1, 2, 3, 4, 5, 6])
    verify.rollback(cache, 4)
    assert verify.cache_len(cache) == 4
    with torch.no_grad():
        fresh = tiny(torch.tensor([[1, 2, 3, 4, 9]])).logits[0, -1]
    step = verify.tree_forward(tiny, cache, Tree.root_only(9))[0]
    torch.testing.assert_close(step, fresh, atol=1e-4, rtol=0)


def test_sliding_window_model_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    with pytest.raises(verify.UserError, match="sliding-window"):
        verify.new_cache(MistralForCausalLM(cfg))
