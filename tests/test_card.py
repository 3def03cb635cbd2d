"""card.py: cache construction (Eq. 1-9) on a hand-made draft distribution, the §2.3 mask against a
hand-written one, hit and miss correction (§2.4) against fresh recomputation, losslessness against the
target's HF greedy decoding in both modes, and that the draft worker always shuts down."""

import threading
import types

import numpy as np
import pytest
import torch

import card
import verify
from conftest import REAL_PROMPTS, make_tiny_llama

# ---------------------------------------------------------------------------------------------- the cache


def toy_cache():
    """The worked example of card.py §1: K = 2, k = 2."""
    c = card.CandidateCache(k=2, topk=2)
    c.reset(10)  # root "The"
    root = c.nodes[c.root]
    root.slot, root.cands = 0, [(11, 0.6), (12, 0.3)]  # " cat" .6, " dog" .3
    layer1 = c.grow()
    cat, dog = layer1
    c.nodes[cat].slot, c.nodes[cat].cands = 1, [(13, 0.5), (14, 0.4)]  # " sat" .5, " ran" .4
    c.nodes[dog].slot, c.nodes[dog].cands = 2, [(14, 0.9), (13, 0.05)]  # " ran" .9, " sat" .05
    return c, cat, dog


def test_cache_construction_scores_topk_and_parents():
    c, cat, dog = toy_cache()
    assert [(c.nodes[i].token, c.nodes[i].sigma) for i in (cat, dog)] == [(11, 0.6), (12, 0.3)]
    # B^(1): every fed node's top-k children, w = p * sigma(parent)                         (Eq. 3, 5)
    b = sorted(c.secondary(1), key=lambda e: -e[1])
    assert [(t, round(w, 3), p) for t, w, p in b] == [(13, 0.3, cat), (14, 0.27, dog), (14, 0.24, cat), (13, 0.015, dog)]
    layer2 = c.grow()  # the global top-K = 2                                                   (Eq. 6-9)
    got = [(c.nodes[i].token, round(c.nodes[i].sigma, 3), c.nodes[i].parent) for i in layer2]
    assert got == [(13, 0.3, cat), (14, 0.27, dog)]
    assert c.depth == 2 and c.frontier() == layer2
    # QUERY: the best path of up to r tokens = the best sigma at depth min(r, depth), traced back
    assert [c.nodes[i].token for i in c.query(5)] == [11, 13]
    assert [c.nodes[i].token for i in c.query(1)] == [11]


def test_draft_mask_matches_the_hand_written_one():
    # card.py §2's example: prefix P P P, root at slot 3, layer 1 {cat, dog} at slots 4, 5; layer 2 fed next
    c, cat, dog = toy_cache()
    c.nodes[c.root].slot, c.nodes[cat].slot, c.nodes[dog].slot = 3, 4, 5
    front = c.grow()  # " sat" under cat, " ran" under dog
    want = np.array([
        # P  P  P  r  a  b | c  d
        [1, 1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1, 0, 1],
    ], dtype=bool)
    assert (card.draft_mask(c, front, dp=3, cache_len=6) == want).all()


# ---------------------------------------------------------------------------------------------- correction


def kv(cache, upto):
    return torch.cat([layer.keys[:, :, :upto] for layer in cache.layers])


def fresh_kv(model, ids):
    c = verify.new_cache(model)
    verify.prefill(model, c, ids)
    return kv(c, len(ids))


def grown_drafter(model, text, layers):
    d = card.Drafter(model, k=4, topk=3)
    d.start(text)
    for _ in range(layers):
        d.step()
    return d


def test_hit_keeps_the_continuing_subtree_and_its_kv():
    model = make_tiny_llama(0)
    text = [1, 5, 6, 7, 8]
    d = grown_drafter(model, text, 4)
    tree = d.tree
    a1 = tree.layers[1][0]  # accept the first layer-1 node, bonus = one of its children
    x = next(iter(tree.nodes[a1].children.values()))
    a1_tok, x_tok = tree.nodes[a1].token, tree.nodes[x].token
    below = {tree.nodes[i].token for i in tree.nodes[x].children.values()}
    assert d.correct([a1_tok], x_tok) is True
    assert d.text == text + [a1_tok, x_tok]
    assert d.tree.root == x and d.tree.nodes[x].depth == 0 and d.tree.nodes[x].sigma == 1.0
    assert {d.tree.nodes[i].token for i in d.tree.nodes[x].children.values()} >= below
    # the verified prefix of the draft cache is exactly what a fresh prefill computes
    assert d.dp == len(d.text) - 1
    torch.testing.assert_close(kv(d.cache, d.dp), fresh_kv(model, d.text[:-1]), atol=1e-5, rtol=1e-4)
    # x was fed inside the tree (tree mask, position by depth); a drafter started from scratch on the same
    # text feeds it as a plain causal root: both must see the same next-token distribution
    fresh = grown_drafter(model, d.text, 1)
    mine, theirs = d.tree.nodes[x].cands, fresh.tree.nodes[fresh.tree.root].cands
    assert [t for t, _ in mine] == [t for t, _ in theirs]
    assert [p for _, p in mine] == pytest.approx([p for _, p in theirs], abs=1e-5)


def test_miss_restarts_from_the_targets_token():
    model = make_tiny_llama(0)
    text = [1, 5, 6, 7, 8]
    d = grown_drafter(model, text, 3)
    a1 = d.tree.layers[1][0]
    a1_tok = d.tree.nodes[a1].token
    absent = next(t for t in range(3, 96) if t not in d.tree.nodes[a1].children)
    assert d.correct([a1_tok], absent) is False
    assert d.tree.depth == 0 and d.tree.nodes[d.tree.root].token == absent and d.tree.nodes[d.tree.root].slot is None
    assert d.dp == verify.cache_len(d.cache) == len(text) + 1  # the old root and the accepted node are kept
    torch.testing.assert_close(kv(d.cache, d.dp), fresh_kv(model, d.text[:-1]), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("mode", ["lockstep", "parallel"])
def test_lossless_on_a_tiny_pair_including_a_bad_draft(mode):
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6 + [11, 12]
    want = verify.hf_generate(target, prompt, 60, [95])
    for draft in (make_tiny_llama(0).to(torch.bfloat16), make_tiny_llama(1)):
        for correct in (True, False):
            gen = card.generate(target, prompt, 60, [95], card.CardConfig(k=6, topk=3, ratio=4, mode=mode, correct=correct),
                                draft=draft)
            assert gen.tokens == want


@pytest.mark.parametrize("mode", ["lockstep", "parallel"])
@pytest.mark.parametrize("prompt", REAL_PROMPTS)
def test_lossless_on_real_prompts(real, draft_bf16, prompt, mode):
    model, tok = real
    ids = verify.encode_prompt(tok, prompt)
    eos = verify.eos_ids_of(model, tok)
    want = verify.hf_generate(model, ids, 48, eos)
    gen = card.generate(model, ids, 48, eos, card.CardConfig(k=4, topk=2, ratio=4, mode=mode), draft=draft_bf16)
    assert gen.tokens == want
    if mode == "lockstep":  # the bf16 copy agrees with its fp32 original nearly always (a broken cache: ~1)
        assert len(gen.tokens) / gen.target_forwards > 2.0


def test_max_new_tokens_and_eos_boundaries():
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    for n in (1, 2, 5, 13):
        gen = card.generate(target, prompt, n, [95], card.CardConfig(k=4, topk=2, ratio=4, mode="lockstep"), draft=target)
        assert gen.tokens == verify.hf_generate(target, prompt, n, [95])
    full = verify.hf_generate(target, prompt, 30, [95])
    eos = full[7]  # pretend the 8th token is EOS: generation must stop right there, inside an accepted chain
    gen = card.generate(target, prompt, 30, [eos], card.CardConfig(k=4, topk=2, ratio=4, mode="lockstep"), draft=target)
    assert gen.tokens == verify.hf_generate(target, prompt, 30, [eos])


# ---------------------------------------------------------------------------------------------- shutdown


def workers():
    return [t for t in threading.enumerate() if t.name == "card-draft"]


def test_worker_stops_at_the_end_on_errors_and_on_ctrl_c():
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    card.generate(target, prompt, 20, [95], card.CardConfig(k=4, topk=2, ratio=4, mode="parallel"), draft=target)
    assert workers() == []

    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        def on_emit(tokens, flags, exc=exc):
            raise exc
        with pytest.raises(type(exc)):
            card.generate(target, prompt, 20, [95], card.CardConfig(k=4, topk=2, ratio=4, mode="parallel"), draft=target, on_emit=on_emit)
        assert workers() == []

    class Broken(torch.nn.Module):  # a draft whose forward fails inside the worker thread
        device, dtype = torch.device("cpu"), torch.float32
        config, generation_config = target.config, target.generation_config

        def forward(self, **kw):
            raise ValueError("draft exploded")

    with pytest.raises(ValueError, match="draft exploded"):
        card.generate(target, prompt, 20, [95], card.CardConfig(k=4, topk=2, ratio=4, mode="parallel"), draft=Broken())
    assert workers() == []
    assert torch.get_num_threads() >= 1


def test_refuses_a_draft_with_another_vocabulary(monkeypatch):
    target = make_tiny_llama(0)
    tok = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    other = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "c": 1})
    monkeypatch.setattr(verify, "load_model", lambda *a, **k: (target, other))
    card._DRAFTS.clear()
    cfg = card.CardConfig(draft="other-model")
    with pytest.raises(verify.UserError, match="do not share a vocabulary"):
        card.load_draft(target, tok, cfg, "target-model")
    card._DRAFTS.clear()


def test_ratio_auto_is_the_ceiling_of_the_step_time_ratio(monkeypatch):
    # §3.1: r = ceil(t_target / t_draft); here a 60 ms target step against a 25 ms draft layer -> 3
    times = {"target": 0.060, "draft": 0.025}
    monkeypatch.setattr(card, "step_time", lambda model, n: times[model])
    assert card.measure_ratio("target", "draft", k=4) == 3
    times["draft"] = 0.5  # a draft slower than the target still gets one layer per step
    assert card.measure_ratio("target", "draft", k=4) == 1
