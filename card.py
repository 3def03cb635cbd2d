# SPDX-License-Identifier: MIT
"""
card.py -- CARD: cache-assisted parallel speculative decoding with the "query-and-correct" paradigm.
Enyu Zhou, Kai Sheng, Hao Chen & Xin He, "CARD: A Cache-Assisted Parallel Speculative Decoding
Framework via Query-and-Correct Paradigm for Accelerating LLM Inference", 2025, arXiv:2508.04462.

Classic speculative decoding is draft-THEN-verify: each model waits while the other works. CARD runs
both at once: the draft keeps growing a scored tree of candidate continuations, "the cache" (§2.2);
the target QUERIES its best path of up to r tokens (r, the communication ratio ~ t(target step) /
t(draft layer), §3.1), VERIFIES that chain in one forward, then CORRECTS the cache to the subtree
that continues the accepted text, or restarts it on a miss (§2.4). Below the paper's banner
(ours): the draft's own process, drafts derived from the target (int8 on a CPU, bfloat16 on CUDA),
and on a CPU mode and r chosen by the speed this machine's step times predict, said in one line
where CARD cannot win. A "deviation:" comment marks each place this file departs from the paper,
and "ours" what the paper does not have; the authors' code is cited unmarked.

The paper, section by section, and where it is here (this file's sections in brackets):

    §2.2, Eq. 2-9   the candidate cache: top-k children, top-K   CandidateCache                 [1]
                    kept per layer (C^(l), B^(l))
    §2.3            draft forwards: causal history inheritance,  draft_mask, Drafter.step        [2]
                    intra-step independence
    §2.4            correction: keep the subtree, or restart     Drafter.correct                [2]
    §2, Figure 2    draft, query, verify, correct: the loop      Drafter.advance, .query [2],
                                                                 generate                       [3]
    §1, §2          the parallel mode: the draft keeps drafting  draft_continuously             [3b]
                    while the target verifies, and answers
    §3.1            r, the communication ratio; K and k          CardConfig                     [0]
                    r's rule, ceil(t_target / t_draft)           measure_ratio                  [0]
    beyond the paper: the draft in its own process (parallel)    DraftProcess                   [4]
                      drafts derived from the target (int8)      int8_draft, load_draft         [5]
                      the mode and r by their predicted speed    predicted_speedup, choose,     [5b]
                      on this machine; when CARD cannot win      choose_configuration
                      model.generate(..., custom_generate=...)   custom_generate                [6]

    python card.py --prompt "Explain what a hash map is." --compare
    python card.py --prompt "..." --draft HuggingFaceTB/SmolLM2-135M-Instruct --target DIR_OF_A_1.7B_MODEL

    import card                                            # from transformers' own generate()
    out = model.generate(input_ids, custom_generate=card.custom_generate, max_new_tokens=128)

    from card import CardConfig, generate, prepare         # as a library
    cfg, extra = prepare(target, tok, CardConfig.cpu())    # the draft (and on a CPU its mode and r)
    gen = generate(target, prompt_ids, 128, eos_ids, cfg, **extra)
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

import verify
from verify import Generation, Tree

# ---- 0. Configuration (§2, §3.1) ---------------------------------------------------------------------------

BEST = "best"  # a mode or ratio chosen at set-up by its predicted speed (section 5b, ours)

@dataclass
class CardConfig:
    """CARD's parameters under the paper's names, and how this reference runs them.

    >>> CardConfig.paper().K, CardConfig.paper().ratio, CardConfig.paper_7b("DRAFT").ratio
    (100, 'auto', 5)
    """

    K: int = 100  # the primary cache size: candidate sequences kept per tree layer (Eq. 7)
    k: int = 100  # children proposed per node, from the draft's top-k (Eq. 2)
    # r, the communication ratio ~ t(target step) / t(draft layer); "auto" = measured (§3.1's
    # rule); "best" = chosen at set-up with the mode: the highest speedup the cost model predicts
    # on this machine (section 5b, ours), even where it is below 1
    ratio: int | str = 7
    # "parallel": the draft in its own process; "lockstep": r layers, then verify; "best": as r's
    mode: str = "parallel"
    correct: bool = True  # False = Table 2's "cache only" ablation (Drafter.correct)
    # layers the cache may lead the verified text by (None: 2r, the reference's)
    max_lead: int | None = None
    # parallel: layers the cache must lead by before a query is answered (None: r). deviation: the
    # paper's "never wait" is 0 (the chain is whatever the cache holds); r matches the
    # communication ratio's intent, r draft layers per target step (TUTORIAL.md §4.5)
    wait: int | None = None
    draft: str = "self"  # the draft prepare() builds: int8, self or a model name (section 5)
    draft_dtype: str = "bfloat16"  # the dtype of draft "self" or a named draft
    # deviation: what a draft token costs (verify.WhatPays): 'timed' verifies the chain's prefix
    # worth its time here; 'pinned' the same without timing; 'free' the whole chain (the paper)
    cost: str = "timed"

    @classmethod
    def paper(cls, draft: str = "self") -> "CardConfig":
        """§3.1 for a 1B draft: K = 100, in parallel, and r by §3.1's own rule, r = ceil(t_target /
        t_draft), measured once per machine ("auto"). The paper's 1B draft beside a 70B target gives 7;
        for the self-draft (the target's own weights in bfloat16), hardly cheaper than the target,
        the rule gives a small r.
        note: the paper gives no value for Eq. 2's k; its reference code expands each node by its
        own top-K, i.e. k = K (10^4 candidates per layer). deviation: the draft is the self-draft
        unless one is named (no 1B draft here), and a query waits for r layers (`wait`)."""
        return cls(ratio="auto", draft=draft, cost="free")

    @classmethod
    def paper_7b(cls, draft: str) -> "CardConfig":
        """§3.1's row for a 7B draft beside a 70B target: K = 50, r = 5 (k = K); deviation: as paper()'s."""
        return cls(K=50, k=50, ratio=5, draft=draft, cost="free")

    @classmethod
    def gpu(cls) -> "CardConfig":
        """The CUDA default: §3.1's 1B-draft numbers (K = 100, r = 7) with the self-draft.
        deviation: r = 7, the setting measured on a GPU (RESULTS.md, "On one GPU"), not §3.1's rule
        for this draft (that is paper())."""
        return cls(K=100, k=100, ratio=7)

    @classmethod
    def cpu(cls) -> "CardConfig":
        """A one-node-wide cache (CARD's loop, not its width) whose query waits 3 layers (RESULTS.md,
        "CARD on a CPU"); the int8 draft; the mode and r chosen at set-up by their predicted speed on
        this machine (section 5b)."""
        return cls(K=1, k=1, ratio=BEST, mode=BEST, wait=3, draft="int8")

    @classmethod
    def for_device(cls, device) -> "CardConfig":
        return cls.gpu() if torch.device(device).type == "cuda" else cls.cpu()

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value; accept r as text too."""
        if self.ratio not in ("auto", BEST) and not str(self.ratio).lstrip("-").isdigit():
            raise verify.UserError(f"--ratio must be a whole number, 'auto' or 'best' (got {self.ratio!r})")
        self.ratio = self.ratio if self.ratio in ("auto", BEST) else int(self.ratio)
        for name, low in (("K", 1), ("k", 1), ("ratio", 1), ("wait", 0), ("max_lead", 1)):
            v = getattr(self, name)
            if v not in (None, "auto", BEST) and v < low:
                raise verify.UserError(f"--{name.replace('_', '-')} must be at least {low} (got {v})")
        if self.mode not in ("lockstep", "parallel", BEST):
            raise verify.UserError(f"--mode must be lockstep, parallel or best (got {self.mode!r})")
        verify.check_cost(self.cost)

# §3.1's rule for r: how many draft layers fit in one target step, measured once per machine.

def measure_ratio(model, draft_model, K: int) -> int:
    """§3.1's r = ceil(t_target / t_draft): how many K-node draft layers fit in one one-token
    target step (verify.step_times, kept on disk)."""
    t_draft = verify.seconds_at(verify.step_times(draft_model, K), K)
    return max(1, math.ceil(verify.step_times(model)[1] / t_draft))

# ---- 1. The candidate cache (§2.2) -------------------------------------------------------------------------
#
# A tree rooted at the newest verified token (the target's pending token: emitted, not yet in the
# target's KV cache). Layer l holds at
# most K nodes: the primary cache C^(l). Each node stores
#   sigma = the draft's cumulative probability of the path root -> node              (Eq. 4)
#   cands = the top-k (token, p) of the draft's next-token distribution at the node  (Eq. 2), once the
#           node has been FED to the draft (its KV is then in the draft cache, at `slot`)
# The secondary cache B^(l) of Eq. 5 is every (child token, w = p * sigma(parent), parent) over the
# fed nodes of layer l. Growing the next layer = sort B^(l) by w, keep the top K (Eq. 6-9):
#
#   K = 2, k = 2.  layer 0: root "The" (sigma 1), fed: cands (" cat" .6) (" dog" .3)
#                  layer 1: " cat" sigma .6, " dog" sigma .3                       (B^(0) has only 2 entries)
#   feed layer 1:  " cat" -> (" sat" .5) (" ran" .4);  " dog" -> (" ran" .9) (" sat" .05)
#   B^(1) = [(" sat", .30, cat), (" ran", .24, cat), (" ran", .27, dog), (" sat", .015, dog)]
#   top-2 -> layer 2: " sat" under " cat" (.30),  " ran" under " dog" (.27)
#
# Only the newest layer can be unfed ("the frontier"); every older layer has been fed.

@dataclass
class Node:
    token: int
    parent: int  # node id; -1 for the root
    depth: int  # 0 for the root
    sigma: float  # cumulative draft probability root -> node (the root: 1)
    slot: int | None = None  # draft KV cache slot once fed
    cands: list | None = None  # [(token, p)] top-k next tokens once fed
    children: dict = field(default_factory=dict)  # token -> node id (materialized children)

class CandidateCache:
    def __init__(self, K: int, k: int):
        self.K = K  # nodes kept per layer (the primary cache C^(l))
        self.k = k  # children proposed per fed node (its top-k)
        self._next = 0  # the next node id
        self.nodes: dict[int, Node] = {}
        self.layers: list[list[int]] = []

    def reset(self, root_token: int) -> None:
        """A new tree with just the (unfed) root."""
        self.nodes, self.layers = {}, []
        self.root = self._add(root_token, -1, 1.0)

    def _add(self, token: int, parent: int, sigma: float) -> int:
        i = self._next
        self._next += 1
        depth = 0 if parent < 0 else self.nodes[parent].depth + 1
        self.nodes[i] = Node(int(token), parent, depth, sigma)
        if parent >= 0:
            self.nodes[parent].children[int(token)] = i
        if depth == len(self.layers):
            self.layers.append([])
        self.layers[depth].append(i)
        return i

    @property
    def depth(self) -> int:
        """The newest layer's depth (the root's layer is 0)."""
        return len(self.layers) - 1

    def frontier(self) -> list[int]:
        """The unfed newest layer ([] if every layer has been fed)."""
        last = self.layers[-1]
        return last if self.nodes[last[0]].slot is None else []

    def secondary(self, layer: int) -> list[tuple[int, float, int]]:
        """B^(l) (Eq. 3, 5): (token, w = p * sigma(parent), parent) over the fed nodes of
        `layer`."""
        return [(t, p * self.nodes[i].sigma, i) for i in self.layers[layer] for t,
                p in self.nodes[i].cands]

    def grow(self) -> list[int]:
        """The next layer from the newest (fed) layer: sort B by score, keep the top K (Eq. 6-9)."""
        assert not self.frontier(), "the newest layer must be fed first"
        ranked = sorted(self.secondary(self.depth), key=lambda c: -c[1])[: self.K]  # Eq. 6, 7
        # Eq. 8, 9: s_m = s_{i_m} ⊕ y_m (the parent's sequence, then the token); w is its sigma
        return [self._add(t, parent, w) for t, w, parent in ranked]

    def path_to(self, i: int) -> list[int]:
        """Node ids from the root's child down to node i."""
        out = []
        while self.nodes[i].parent >= 0:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def query(self, r: int, below: int | None = None) -> list[int]:
        """QUERY: the best path of up to r tokens below the root (or node `below`): the node of best
        sigma at depth min(r, depth), and the path to it (sigma only falls along a path, so that
        node ends the best path of that length).

        The released code walks greedily instead (the best node of the first layer, then the
        best child at each layer). Both take the paper's "highest-confidence path"; ours is the
        best path of that length by the cache's own score (Eq. 4), the greedy walk can miss it when
        a weaker first token has a much stronger continuation (TUTORIAL.md, the appendix)."""
        top = self.root if below is None else below
        base = self.nodes[top].depth
        d = min(r, self.depth - base)
        if d == 0:
            return []
        ends = [i for i in self.layers[base + d] if top == self.root or top in self.path_to(i)]
        if not ends:
            return []
        best = max(ends, key=lambda i: self.nodes[i].sigma)
        return self.path_to(best)[base:]

    def as_ids(self, top: int | None = None) -> list[list[tuple[int, int, float, bool]]]:
        """The tree below node `top` (None: the root), layer by layer, as plain values that a pipe
        carries (tools/replay.py draws them): per node (token, its parent's index in the layer
        above, sigma relative to top's, fed?).

            root "The", layer 1 " cat" (.6, fed), " dog" (.3, fed), layer 2 " sat" under " cat" (.3)
            -> [[(The, -1, 1, True)], [(cat, 0, .6, True), (dog, 0, .3, True)], [(sat, 0, .3, False)]]
        """
        top = self.root if top is None else top
        s0 = self.nodes[top].sigma or 1.0  # (0 only where a long --no-correct path underflowed)
        layers = []
        level = [top]
        index_above = {}  # node id -> its index in the layer above
        while level:
            layer = []
            for i in level:
                n = self.nodes[i]
                layer.append((n.token, index_above.get(n.parent, -1), n.sigma / s0, n.slot is not None))
            layers.append(layer)
            index_above = {i: j for j, i in enumerate(level)}
            level = [c for i in level for c in self.nodes[i].children.values()]
        return layers

# ---- 2. The drafter: draft forwards (§2.2, §2.3) and correction (§2.4) -------------------------------------
#
# The draft's KV cache holds  [ verified text[:dp] | fed tree nodes, layer by layer ].
# Feeding a layer = one draft forward over its (at most K) tokens, with the §2.3 mask:
#   - every node sees the verified prefix,
#   - "causal history inheritance": every node sees the slots of its ancestors in the tree,
#   - "intra-step independence": among the nodes fed in this step, a node sees only itself (identity).
# Position ids: a node at depth d stands at position (len(text) - 1) + d -- its position in the text
# if its path were accepted. (The reference code skips one position from depth 1 on; that only hurts
# the draft's quality, never correctness, but it is wrong.)
#
#   prefix P P P, root r fed at slot 3, layer 1 = {a, b} fed at slots 4, 5; feeding layer 2 = {c (under a),
#   d (under b)} at slots 6, 7:
#              P P P r a b | c d
#          c:  1 1 1 1 1 0 | 1 0
#          d:  1 1 1 1 0 1 | 0 1

def draft_mask(candidates: CandidateCache, front: Sequence[int], dp: int, cache_len: int) -> np.ndarray:
    """The §2.3 mask, bool [n, cache_len + n], for feeding the nodes `front` after `cache_len`
    cached entries of which the first `dp` are the verified prefix."""
    n = len(front)
    allowed = np.zeros((n, cache_len + n), dtype=bool)
    allowed[:, :dp] = True  # the verified prefix
    for row, i in enumerate(front):
        j = candidates.nodes[i].parent
        while j >= 0:  # causal history inheritance: the slot of every ancestor
            allowed[row, candidates.nodes[j].slot] = True
            j = candidates.nodes[j].parent
        # intra-step independence: among its peers, itself only
        allowed[row, cache_len + row] = True
    return allowed

class Drafter:
    """The draft side of CARD: the draft model, its KV cache and the candidate cache it grows.
    generate() drives it in four calls: start() once, then per step advance(r), query(r) and, after
    the target's verification, correct(). (The parallel mode's DraftProcess, below the banner,
    answers the same four calls from its own process, where this same class does the work.)"""

    def __init__(self, model, K: int, k: int, correct: bool = True):
        self.model = model
        # two caches, two names: the paper's "cache" of candidates (section 1), and the draft
        # model's KV cache (verify.PreallocatedKVCache, made by start())
        self.candidates = CandidateCache(K, k)
        self.kv_cache = None
        self.correcting = correct  # False: Table 2's "cache only" ablation (see correct())
        self.layers_fed = 0  # draft forwards done (one per layer)
        self.hits = 0  # corrections whose bonus token was in the cache
        self.misses = 0  # corrections that restarted the cache
        self.hit_tokens = 0  # the tokens of the steps that hit (accepted + bonus)
        self.model_bytes = None  # the draft model's weights, counted at the first statistics()
        self.show = False  # report the cache to an on_step hook (start(show=True))

    def start(self, text: Sequence[int], capacity: int = 256, max_lead: int = 14,
              show: bool = False) -> None:
        """text = the verified tokens, its last one the (unfed) root; capacity: the draft's KV
        cache's size; max_lead: the most layers the candidate cache may lead the verified text by
        (the reference's 2r; 14 = 2 x §3.1's r = 7). show: report the candidate cache to an on_step
        hook (shown())."""
        self.show = show
        self.text = list(text)
        self.kv_cache = verify.new_cache(self.model, capacity)
        self.max_lead = max_lead
        self.dp = 0  # verified tokens whose KV is in the draft's KV cache (text[:dp])
        self.candidates.reset(self.text[-1])
        self.root_pos = len(self.text) - 1  # the text position of the candidate cache's root
        # cache only: the node the verified text has reached in the candidate cache (None: the root)
        self.qroot = None

    def advance(self, r: int) -> None:
        """DRAFT: up to r more layers, one draft forward each, none once the cache leads the
        verified text by max_lead layers (after a hit it may already lead by more than r)."""
        for _ in range(r):
            if self.lead() < self.max_lead:
                self.step()

    def _topk(self, logits: torch.Tensor) -> list[list[tuple[int, float]]]:
        """Eq. 1-2: the draft's distribution at each fed node, reduced to its top-k (token, p)."""
        probs = torch.softmax(logits.float(), dim=-1)  # [N, V]
        p, t = probs.topk(self.candidates.k, dim=-1)
        return [list(zip(ti, pi)) for ti, pi in zip(t.tolist(), p.tolist())]

    @torch.no_grad()
    def step(self) -> None:
        """One draft forward: feed the frontier (or, first, the root) and grow the next layer."""
        candidates = self.candidates  # the candidate cache (§2.2)
        model = self.model
        root = candidates.nodes[candidates.root]
        if root.slot is None:
            # Catch up: feed the verified tokens the draft has not seen, ending with the root
            # (causal).
            assert verify.cache_len(self.kv_cache) == self.dp
            ids = torch.tensor([self.text[self.dp :]], device=model.device)
            out = verify.model_forward(model, self.kv_cache, input_ids=ids,
                                       **verify.last_logits_only(model))
            self.dp = len(self.text) - 1
            root.slot = self.dp
            root.cands = self._topk(out.logits[0, -1:])[0]
        else:
            front = candidates.frontier()
            c = verify.cache_len(self.kv_cache)  # n = len(front) new nodes after c cached entries
            allowed = draft_mask(candidates, front, self.dp, c)  # [n, c+n]
            mask = verify.additive_mask(allowed, model.dtype, model.device)  # [1, 1, n, c+n]
            # [1, n]
            ids = torch.tensor([[candidates.nodes[i].token for i in front]], device=model.device)
            pos = torch.tensor([[self.root_pos + candidates.nodes[i].depth for i in front]],
                               device=model.device)
            out = verify.model_forward(model, self.kv_cache, input_ids=ids, attention_mask=mask,
                                       position_ids=pos)
            for row, (i, cands) in enumerate(zip(front, self._topk(out.logits[0]))):
                candidates.nodes[i].slot = c + row
                candidates.nodes[i].cands = cands
        self.layers_fed += 1
        candidates.grow()

    def lead(self) -> int:
        """How many layers the candidate cache reaches below the verified text."""
        return self.candidates.depth - (0 if self.qroot is None else self.candidates.nodes[self.qroot].depth)

    def query(self, r: int) -> list[int]:
        """The tokens of the best path of up to r tokens below the verified text (§2, Figure 2)."""
        return [self.candidates.nodes[i].token for i in self.candidates.query(r, self.qroot)]

    def shown(self) -> dict:
        """What an on_step hook is shown of the draft side (start(show=True); else {}): the cache
        as the last query saw it, below the verified text (as_ids), and how many corrections so
        far hit or missed."""
        if not self.show:
            return {}
        return dict(layers=self.candidates.as_ids(self.qroot), hits=self.hits, misses=self.misses)

    def correct(self, accepted: Sequence[int], bonus: int) -> bool:
        """CORRECT (§2.4) after the target accepted `accepted` (tokens of the queried path) and
        emitted `bonus`: keep the subtree below the bonus token if the cache holds it (a hit), else
        restart the cache from the bonus token (a miss). Returns True on a hit, and counts it.

        Table 2's "cache only" ablation (correct=False) queries but does not correct: on a hit it
        follows the text down the cache (`qroot`) and prunes nothing, so the draft keeps growing
        branches the text has left; only on a miss is the cache restarted, as the full method
        does."""
        self.text += list(accepted) + [int(bonus)]
        nodes = self.candidates.nodes
        # where the verified text stood in the candidate cache before this step
        top = self.candidates.root if self.qroot is None else self.qroot
        node = top
        walked = []  # the accepted tokens ARE a path of the cache: they were queried from it
        for t in accepted:
            node = nodes[node].children[t]
            walked.append(node)
        x = nodes[node].children.get(int(bonus))  # the bonus token's node: None on a miss
        if x is not None and not self.correcting:
            self.qroot = x  # cache only: follow the text, prune nothing
        else:
            self.qroot = None
            self._prune_or_restart(top, walked, x, bonus)
        if x is not None:
            self.hits += 1
            self.hit_tokens += len(accepted) + 1
        else:
            self.misses += 1
        return x is not None

    def statistics(self) -> dict:
        """The counts generate() reports: draft forwards, hits and misses, the tokens of hit steps,
        and the bytes the draft side holds (its model's weights and its KV cache)."""
        if self.model_bytes is None:
            self.model_bytes = verify.tensor_bytes(self.model)  # once: the weights do not change
        return dict(draft_layers=self.layers_fed, hits=self.hits, misses=self.misses,
                    hit_tokens=self.hit_tokens,
                    draft_held_bytes=self.model_bytes + verify.tensor_bytes(self.kv_cache))

    def _prune_or_restart(self, top: int, walked: list[int], x: int | None, bonus: int) -> None:
        """§2.4: the fed nodes of the verified text (root .. top, then `walked`) become the draft's
        verified KV prefix, the fed nodes below the bonus token's node x keep their KV (compacted
        behind it), and the rest is forgotten. A hit: x becomes the new root (_reroot); a miss (x
        None): the candidate cache restarts from the bonus token."""
        candidates = self.candidates
        verified = [n for n in [candidates.root, *candidates.path_to(top), *walked]
                    if candidates.nodes[n].slot is not None]
        keep = []
        if x is not None:
            keep = [n for n in self._subtree(x) if candidates.nodes[n].slot is not None]
        # slot order (BFS order can differ within a layer)
        keep.sort(key=lambda n: candidates.nodes[n].slot)
        slots = [candidates.nodes[n].slot for n in verified + keep]
        assert slots == sorted(slots)
        # subtle: corrections can come before the first draft forward (a DraftProcess still
        # starting queues them): the draft's KV cache is then empty, with nothing to keep or drop
        if verify.cache_len(self.kv_cache) > 0:
            verify.compact_kv(self.kv_cache, self.dp, [s - self.dp for s in slots])
        self.dp += len(verified)
        self.root_pos = len(self.text) - 1
        if x is None:  # MISS: restart the cache from the target's token
            candidates.reset(bonus)
        else:  # HIT: keep x's subtree
            self._reroot(x, {n: self.dp + j for j, n in enumerate(keep)})

    def _subtree(self, x: int) -> list[int]:
        """x and its descendants, layer by layer."""
        out, level = [], [x]
        while level:
            out += level
            level = [c for i in level for c in self.candidates.nodes[i].children.values()]
        return out

    def _reroot(self, x: int, new_slot: dict[int, int]) -> None:
        """Make x the root: depths shift, sigmas are renormalized by sigma(x) (no underflow), fed
        nodes move to their compacted slots, and the unfed frontier is rebuilt from the surviving
        parents' B."""
        old = self.candidates
        new = CandidateCache(old.K, old.k)
        new._next = old._next
        base = old.nodes[x].depth
        s0 = old.nodes[x].sigma
        for i in self._subtree(x):
            n = old.nodes[i]
            new.nodes[i] = Node(n.token, -1 if i == x else n.parent, n.depth - base, n.sigma / s0,
                                new_slot.get(i), n.cands)
            if n.depth - base == len(new.layers):
                new.layers.append([])
            new.layers[n.depth - base].append(i)
        for i, n in new.nodes.items():
            if n.parent >= 0:
                new.nodes[n.parent].children[n.token] = i
        new.root = x
        self.candidates = new
        # deviation: §2.4 prunes to the subtree, "freeing resources for more accurate candidates"; how
        # is ours. The unfed frontier was the top K of B over the whole fed layer, dead branches
        # included, so it is dropped and grown again from B below x: its top K (a cache whose layers
        # were all fed gets its next layer, as after any feed).
        if new.nodes[x].slot is not None:
            if new.frontier():
                for i in new.layers.pop():
                    parent = new.nodes[i].parent
                    del new.nodes[parent].children[new.nodes[i].token]
                    del new.nodes[i]
            new.grow()

# ---- 3. The decode loop ------------------------------------------------------------------------------------
#
# Per step (§2, Figure 2): the draft DRAFTS layers into the candidate cache, the target QUERIES the
# cache's best chain of up to r tokens, VERIFIES it in one forward, and the draft CORRECTS the cache
# with what the target accepted. Where the draft runs, cfg.mode says (drafter_for):
#   lockstep  a Drafter in this process (a DraftProcess passed in lends it its model), up to r layers
#             per step. Deterministic, what the authors' code effectively does (both sides block on
#             each other over NCCL), and what the tests pin down.
#   parallel  a DraftProcess (section 4): one passed in, or one started for this call. The same
#             Drafter in its own process (section 3b), drafting while the target verifies, so after a
#             hit the next chain is (partly) ready when the target asks:
#
#     target:  query ─> verify the chain (r + 1 rows) ─────────────> correct, query ─> verify ...
#     draft:   answer   layer  layer  layer  layer (below the chain)  answer          layer ...

@contextlib.contextmanager
def drafter_for(draft_model, cfg: CardConfig):
    """The object behind generate()'s advance(r) / query(r) / correct(): a Drafter in this process
    (lockstep mode, and parallel where no process can be spawned from this call: cannot_spawn), or
    a DraftProcess (parallel mode: the one passed in, which prepare() or the caller started and
    which outlives the call, or one started for this call and stopped after it)."""
    # (a spawned process would run this call again: lockstep instead, said once; section 4)
    if cfg.mode == "lockstep" or (not isinstance(draft_model, DraftProcess) and cannot_spawn()):
        model = draft_model.model if isinstance(draft_model, DraftProcess) else draft_model
        yield Drafter(model, cfg.K, cfg.k, cfg.correct)
    elif isinstance(draft_model, DraftProcess):
        with draft_model.serving(cfg):
            yield draft_model
    else:
        with DraftProcess(draft_model, cfg) as process, process.serving(cfg):
            yield process

@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
             cfg: CardConfig, *, draft_model, step_times: dict[int, float] | None = None,
             sampling: verify.Sampling = verify.GREEDY, on_emit=None, on_step=None,
             stop=None) -> Generation:
    """CARD decoding. `model` is the target, `draft_model` the draft (same tokenizer; `load_draft`
    builds the one cfg.draft names) or a running DraftProcess. Both modes emit the same tokens, greedy or
    sampled: the target decides every one. The loop reads as lockstep; in parallel mode `drafter`
    is a DraftProcess: advance(r) returns at once (its process drafts all the
    time) and query(r) waits on the pipe for the chain. step_times: what a forward over n
    tokens takes here, {n: seconds} (verify.step_times: `prepare` reads it, else it is read now)."""
    cfg.check()
    if draft_model is None or cfg.ratio in ("auto", BEST) or cfg.mode == BEST:
        raise verify.UserError("CARD needs a draft model (draft_model=...), a whole r and a mode (prepare() "
                               "measures auto and chooses best)")
    r = cfg.ratio
    max_lead = 2 * r if cfg.max_lead is None else cfg.max_lead  # the reference's 2r
    # deviation: what of the chain pays for its time here (verify.py section 9; cost 'free': all of it)
    pays = verify.WhatPays.for_run(model, cfg.cost, step_times, r + 1)
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step, stop=stop)
    gen.extra.update(verified=0)
    # the target's cache: prompt + output + the largest step (the pending token and a chain of r)
    kv_cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + r + 1)
    pending = verify.first_token(verify.prefill(model, kv_cache, prompt_ids), len(prompt_ids),
                                 sampling)
    if gen.finish_prefill(pending):
        return gen
    # the draft's KV cache: the verified text + at most max_lead + 1 fed layers of K nodes (the lead,
    # then the layer being fed), and one layer of slack
    capacity = len(prompt_ids) + max_new_tokens + (max_lead + 2) * cfg.K
    with drafter_for(draft_model, cfg) as drafter:
        # show: any on_step hook (--trace too) is also sent the candidate cache, at a cost (as_ids)
        drafter.start(list(prompt_ids) + [pending], capacity, max_lead, show=on_step is not None)
        while True:
            started = time.perf_counter()
            # -- DRAFT: r layers of the candidate cache (parallel: the process drafts on its own)
            drafter.advance(r)
            # -- QUERY: the cache's best chain of at most r tokens below the verified text
            chain = drafter.query(r)  # (parallel: waits until the cache leads by cfg.wait, else r)
            room = max(max_new_tokens - len(gen.tokens) - 1, 0)  # a step emits <= len(chain) + 1
            chain = chain[:room]
            # deviation: the chain's prefix worth its time here, each token's signal its place in it
            places = [None, *(f"token {j + 1}" for j in range(len(chain)))]
            chain_tree = pays.subtree(Tree.chain(pending, chain), places, gen.tokens)
            draft_s = time.perf_counter() - started  # what the target waited for the draft
            # -- VERIFY the chain in one target forward (parallel: the draft keeps drafting)
            prefix_len = verify.cache_len(kv_cache)
            logits = verify.tree_forward(model, kv_cache, chain_tree)
            path, bonus = verify.accept(chain_tree, logits, prefix_len, sampling)
            verify.rollback(kv_cache, prefix_len + len(path))
            gen.extra["verified"] += len(chain_tree)
            # an on_step hook is shown the KV lengths before and after the rollback, and the cache
            if gen.finish_step(chain_tree, path, bonus, draft_s, kv_before=prefix_len + len(chain_tree),
                               kv_after=prefix_len + len(path), withheld=pays.withheld,
                               **drafter.shown()):
                break
            # -- CORRECT the cache: keep the subtree below the accepted text, or restart on a miss
            accepted = [chain_tree.tokens[i] for i in path[1:]]
            drafter.correct(accepted, bonus)
            pending = bonus
        gen.extra.update(drafter.statistics())
    gen.extra["rule"] = pays.summary()
    gen.extra["held_bytes"] = verify.tensor_bytes(kv_cache) + gen.extra["draft_held_bytes"]
    steps = max(gen.steps, 1)
    corrections = max(gen.extra["hits"] + gen.extra["misses"], 1)
    gen.extra.update(hit_rate=gen.extra["hits"] / corrections,
                     draft_layers_per_step=gen.extra["draft_layers"] / steps,
                     verified_per_step=gen.extra["verified"] / steps)
    return gen

# ---- 3b. The draft's side of the parallel mode (§1, §2: "the draft model continuously generates") --------
#
# The draft does not wait for the target's verification: in its own process (section 4) it drafts a
# layer whenever the cache leads the verified text by fewer than max_lead layers, and between two
# layers it reads the target's messages, which are token ids (with show, the cache too), never tensors.
# deviation: a query waits until the cache leads by `wait` layers (the paper's "never wait" is 0).
# max_lead is the reference code's 2r. The messages:
#
#   target -> draft   ("start", run, text, capacity, max_lead, show)   a new prompt: a new Drafter
#                     ("correct", run, accepted, bonus)   CORRECT the cache (§2.4)
#                     ("query", run, r, wait)             answer once the cache leads by wait (or max_lead)
#                     ("done",)                           generate() returned: stop drafting
#                     ("stop",)                           exit
#   draft -> target   ("chain", run, tokens, statistics, shown)   the queried chain, with Drafter's
#                                                                  statistics() and shown()
# `run` numbers the generate() calls, so an answer that an interrupted call left behind is dropped.

def draft_continuously(conn, draft_model, K: int, k: int, correct: bool) -> None:
    """The draft's loop in its own process: DRAFT, answer QUERIES, CORRECT, until "stop" (EOFError once
    the target's process is gone)."""
    drafter, max_lead, run, asked = None, 0, None, None
    while True:
        # QUERY, once the cache leads by far enough
        if asked is not None and drafter.lead() >= min(asked[1], max_lead):
            conn.send(("chain", run, drafter.query(asked[0]), drafter.statistics(), drafter.shown()))
            asked = None
        if drafter is not None and drafter.lead() < max_lead and not conn.poll():
            drafter.step()  # DRAFT: nothing is asked of us right now, so one more layer
            continue
        msg = conn.recv()  # idle, or a message is waiting
        if msg[0] == "stop":
            return
        if msg[0] == "done":  # wait for the next prompt
            drafter = None
            asked = None
        elif msg[0] == "start":
            _, run, text, capacity, max_lead, show = msg
            drafter = Drafter(draft_model, K, k, correct)
            asked = None
            drafter.start(text, capacity, max_lead, show=show)
        elif msg[0] == "correct":
            _, run, accepted, bonus = msg
            drafter.correct(accepted, bonus)  # CORRECT (§2.4)
        elif msg[0] == "query":
            _, run, r, wait = msg
            asked = (r, wait)

# ---- Beyond the paper --------------------------------------------------------------------------------------
# ---- 4. The draft in its own process -----------------------------------------------------------------------
#
# A process, not a thread: a small model's step is mostly host work, and two threads of one process
# take turns on the GIL (the published code runs two processes too). They share a pipe and section
# 3b's messages, and two more from the draft: ("ready",) once it is up, ("error", "ValueError: ...")
# where it failed (it then exits).

class DraftProcessError(verify.UserError):
    """The draft process died or failed (the CLI prints it as one line and exits non-zero)."""

# "spawn" starts the draft process as a fresh interpreter that imports the main module again, running
# its top level once more: a script that calls model.generate at its top level, outside an `if
# __name__ == "__main__":` block, would make that call again in the child (a page of traceback), and a
# program read from stdin cannot be imported at all. Such a caller gets lockstep, said in one line.

LOCKSTEP_SAID: list[str] = []  # cannot_spawn's line, once per process
GUARDS = ("__name__ == '__main__'", "'__main__' == __name__")

def cannot_spawn() -> bool:
    """Whether a draft process spawned from this call would fail (the first time: why, on stderr)."""
    reason = spawn_obstacle()
    if reason is not None and not LOCKSTEP_SAID:
        LOCKSTEP_SAID.append(reason)
        print(f"[card] lockstep instead of parallel: {reason}", file=sys.stderr)
    return reason is not None

def spawn_obstacle() -> str | None:
    """Why the child could not start, or None: the main program is not a file, or this call is made
    from the main file's top level outside an `if __name__ == "__main__":` block."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)  # python -m: the child runs the module again by name,
    if spec is not None and spec.name.split(".")[-1] == "__main__":
        return None  # but not a package's __main__ (multiprocessing.spawn's own rule)
    path = spec.origin if spec is not None else getattr(main, "__file__", None)
    if path is None:  # python -c, a REPL, a notebook: nothing to run again
        return None
    if not os.path.isfile(path):
        return f"the main program ({path}) is not a file that the draft process can import"
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    # not from the main file's top level: from a function it calls later, or typed at python -i
    if frame is None or os.path.abspath(frame.f_code.co_filename) != os.path.abspath(path):
        return None
    try:
        with open(path, "rb") as f:  # bytes: ast honours a coding cookie or a BOM
            module = ast.parse(f.read())
    except (SyntaxError, ValueError):
        return f"{os.path.basename(path)} cannot be read to find its `if __name__ == \"__main__\":` guard"
    # subtle: ast.unparse writes either quote style and either order as one of GUARDS
    guards = [node for node in module.body if isinstance(node, ast.If) and ast.unparse(node.test) in GUARDS]
    if any(node.lineno <= frame.f_lineno <= node.end_lineno for node in guards):
        return None
    return (f"{os.path.basename(path)} calls generate at its top level, which the draft process would run "
            'again; put the call under `if __name__ == "__main__":`')

def parallel_possible(model) -> bool:
    """Two cores at least (or a GPU) and a program a draft process can be spawned from."""
    if model.device.type != "cpu":
        return not cannot_spawn()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, torch.get_num_threads()) >= 2 and not cannot_spawn()

def _draft_process(conn, K: int, k: int, correct: bool, threads: int | None) -> None:
    """The draft process's whole life (spawned by DraftProcess)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches us too; the target's process stops us
    torch.set_grad_enabled(False)
    try:
        engine, int8, parts = conn.recv()  # the model, its tensors in shared memory
        draft_model = assemble(*parts)
        if threads:  # our share of the cores first: the target may be decoding meanwhile
            torch.set_num_threads(threads)
        if int8:  # the target came: quantized here, with the parent's quantized engine
            torch.backends.quantized.engine = engine
            draft_model = int8_draft(draft_model)
        conn.send(("ready",))
        draft_continuously(conn, draft_model, K, k, correct)
    except (EOFError, OSError):
        return  # the target's process is gone: nothing left to draft for
    except BaseException as e:  # reported to the target, which raises DraftProcessError
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))

def _stop_process(process, conn, child_end) -> None:
    """Ask the draft process to stop, else kill it: at close(), garbage collection and exit."""
    child_end.close()  # (already closed once the process started)
    if process.pid is None:  # never started (block=False, and no run came)
        conn.close()
        return
    with contextlib.suppress(Exception):
        conn.send(("stop",))
    process.join(timeout=5)  # subtle: the draft reads messages between two layers, one forward at most
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()

class DraftProcess:
    """The draft model in its own process (the parallel mode). Starting one takes seconds, so a caller
    that decodes many prompts starts it once (generate() given a plain model starts one per call):

        with card.DraftProcess(draft_model, cfg) as proc:  # cfg: the K, k and correction it drafts with
            for ids in prompts: card.generate(target, ids, 128, eos, cfg, draft_model=proc)

    It stops at close(), garbage collection or exit, and by itself if its parent dies. block=False
    returns before the process is up: generate() verifies no draft (a plain step) until it is, so a
    first call streams at once. int8=True: `draft_model` is the target, which the process quantizes."""

    def __init__(self, draft_model, cfg: CardConfig, threads: int | None = None, block=True, int8=False):
        reason = spawn_obstacle()
        if reason is not None:  # before Python prints a page of traceback from the child
            raise verify.UserError(f"a DraftProcess cannot start here: {reason}")
        # subtle: an int8 model cannot cross (its tensors do not rebuild from shared memory): its
        # float32 target crosses, to be quantized there. Weakly: a kept process must not keep the model
        self.int8 = int8 or hasattr(draft_model, "int8_of")
        self.source = draft_model.int8_of if hasattr(draft_model, "int8_of") else weakref.ref(draft_model)
        self._model = None if int8 else draft_model  # its weights here (int8=True: made when asked)
        self.drafts_with = (cfg.K, cfg.k, cfg.correct)  # what its Drafter is made with
        if threads is None and draft_model.device.type == "cpu":  # on a CPU half the threads (2 cores: one)
            threads = max(1, torch.get_num_threads() // 2)
        self.threads = threads
        self.run = 0  # generate() calls served so far
        self.busy = threading.Lock()  # one generate() at a time: a second thread's call waits
        self.wait = 0  # layers the cache must lead by before a query is answered (serving() sets it)
        ctx = torch.multiprocessing.get_context("spawn")  # fork is unsafe with threads and CUDA
        self.conn, self._child_end = ctx.Pipe()
        self.process = ctx.Process(target=_draft_process, name="card-draft", daemon=True,
                                   args=(self._child_end, cfg.K, cfg.k, cfg.correct, threads))
        self._stop = weakref.finalize(self, _stop_process, self.process, self.conn, self._child_end)
        self.sent = False
        self.ready = False
        # block=False: spawned and sent at the first start(), after the prompt's first token (a process
        # starting beside the prefill would take a core from it)
        if block:
            self._send_model()
            self._receive("ready")
            self.ready = True

    def _send_model(self) -> None:
        """Spawn the process and send it the draft's parts (or the target's, to quantize), once.
        subtle: through the pipe, not as a Process argument: pickled at start(), its shared tensors
        would be freed before the child opens them."""
        if self.sent:
            return
        if self.source() is None:
            raise verify.UserError("the draft's model is gone before its process got it")
        if self.process.pid is None:  # (a send that failed leaves it started)
            self.process.start()
            self._child_end.close()  # subtle: now only the child holds that end: its death reads as EOF
        self._send((torch.backends.quantized.engine, self.int8, portable(self.source())))
        self.sent = True

    def alive(self) -> bool:
        """Not dead: running, or not yet spawned (block=False)."""
        return self.process.pid is None or self.process.is_alive()

    @property
    def model(self):
        """The draft's weights in this process (lockstep, measuring; int8=True: quantized if asked)."""
        if self._model is None and self.source() is None:
            raise verify.UserError("the int8 draft's target model is gone: build the draft again")
        if self._model is None:
            self._model = int8_draft(self.source())
        return self._model

    def started(self) -> bool:
        """Whether the process is up, without waiting: its "ready" is read if it has come."""
        self._send_model()
        while not self.ready and self.conn.poll():
            self.ready = self._next_message()[0] == "ready"
        if not self.ready and not self.process.is_alive():
            self._died()
        return self.ready

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # a broken pipe: the draft process is gone
            self._died()

    def _died(self):
        self.close()
        raise DraftProcessError(f"the draft process died (exit code {self.process.exitcode})")

    def _next_message(self) -> tuple:
        """The message waiting on the pipe; the draft's failure or death raised here."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self._died()
        if msg[0] == "error":
            self.close()
            raise DraftProcessError(f"the draft process failed: {msg[1]}")
        return msg

    def _receive(self, kind: str) -> tuple:
        while True:
            while not self.conn.poll(0.05):  # wakes as soon as a message comes; checks the draft lives
                if not self.process.is_alive():
                    self._died()
            msg = self._next_message()
            if msg[0] == kind and (kind == "ready" or msg[1] == self.run):
                return msg  # (an answer left over from an interrupted run is dropped)

    @contextlib.contextmanager
    def serving(self, cfg: CardConfig):
        """For one generate() call: a query waits until the cache leads by cfg.wait layers (None: r),
        the target takes the threads this process leaves, and afterwards the process stops drafting."""
        if self.drafts_with != (cfg.K, cfg.k, cfg.correct):
            raise verify.UserError(f"this DraftProcess drafts with (K, k, correct) = {self.drafts_with}, "
                                   "unlike the config")
        with self.busy:
            self.wait = cfg.ratio if cfg.wait is None else cfg.wait
            main_threads = torch.get_num_threads()
            if self.threads:
                torch.set_num_threads(max(1, main_threads - self.threads))
            try:
                yield self
            finally:
                torch.set_num_threads(main_threads)
                self.done()

    # generate()'s four calls, as the Drafter takes them (section 3)

    def start(self, text: Sequence[int], capacity: int, max_lead: int, show: bool = False) -> None:
        self.run += 1
        self.counts = dict(draft_layers=0, hits=0, misses=0, hit_tokens=0, draft_held_bytes=0)
        self.cache_shown = {}  # the last answer's Drafter.shown() ({} unless show)
        self._send_model()  # (block=False: the first call's first token is out by now)
        self._send(("start", self.run, list(text), capacity, max_lead, show))

    def advance(self, r: int) -> None:
        pass  # the process drafts all the time, while it leads by fewer than max_lead layers

    def query(self, r: int) -> list[int]:
        if not self.started():  # still starting (block=False): this step verifies no draft
            return []
        self._send(("query", self.run, r, self.wait))
        _, _, chain, self.counts, self.cache_shown = self._receive("chain")
        return chain

    def correct(self, accepted: Sequence[int], bonus: int) -> None:
        # no reply: the hit or miss is counted there and comes back with the next chain
        self._send(("correct", self.run, list(accepted), int(bonus)))

    def statistics(self) -> dict:
        return self.counts

    def shown(self) -> dict:
        return self.cache_shown

    def done(self) -> None:  # generate() is over: stop drafting, leave the cores to the caller
        if self.process.is_alive():
            with contextlib.suppress(DraftProcessError):
                self._send(("done",))

    def close(self) -> None:
        self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

# ---- 5. Drafts derived from the target, and the set-up ---------------------------------------------------
#
# No second model is available offline, so CARD's cheaper draft is derived from the target (`--draft`):
# int8 (its linear layers in dynamic int8: cheaper on a CPU, close to the target), self (its weights in
# --draft-dtype: the best acceptance, hardly cheaper), or NAME/PATH, any model with its tokenizer.

def portable(model) -> tuple:
    """A transformers model's parts for another process, which assemble() puts together. subtle: not
    the module itself, whose hooks are often unpicklable."""
    return (type(model), model.config, model.state_dict(), dict(model.named_buffers()),
            model.generation_config)

def assemble(cls, config, tensors: dict, buffers: dict, generation_config):
    """A model of class `cls` whose tensors ARE the given ones: a skeleton on the meta device (no
    memory, no initialization) handed the tensors; buffers outside the state dict (rotary
    frequencies) set one by one."""
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(tensors, strict=False, assign=True)  # assign: keep these tensors, no copy
    for name, _ in list(model.named_buffers()):
        if name in buffers:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, buffers[name])
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise verify.UserError(f"{cls.__name__}: some tensors of the draft could not be shared")
    model.generation_config = generation_config
    return model.eval()

def int8_draft(model):
    """A copy of the target with every nn.Linear in torch's dynamic int8 (weights per channel)."""
    if model.device.type != "cpu":
        raise verify.UserError("--draft int8 runs on a CPU only (torch's dynamic quantization has no "
                               "GPU kernels)")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # note: torch >= 2.10 marks torch.ao.quantization deprecated
        quantized = {torch.nn.Linear: per_channel_dynamic_qconfig}
        draft_model = quantize_dynamic(model, quantized, dtype=torch.qint8)
    draft_model.int8_of = weakref.ref(model)  # what a DraftProcess sends instead (weakly: see there)
    return draft_model

def load_draft(model, tok, cfg: CardConfig, target_name: str = verify.DEFAULT_MODEL):
    """The draft cfg.draft names (see above), on the target's device."""
    if cfg.draft == "int8":
        return int8_draft(model)
    if cfg.draft == "self":
        return copy.deepcopy(model).to(verify.pick_dtype(cfg.draft_dtype, model.device))
    attn = getattr(model.config, "_attn_implementation", None)
    attn = attn if attn in verify.MASK_HONOURING else "auto"
    draft_model, draft_tok = verify.load_model(cfg.draft, device=str(model.device), dtype=cfg.draft_dtype,
                                               attn_implementation=attn, option="--draft")
    if tok.get_vocab() != draft_tok.get_vocab():  # speculation compares token ids
        raise verify.UserError(f"--draft {cfg.draft} and --target {target_name} do not share a vocabulary")
    return draft_model

def prepare(model, tok, cfg: CardConfig, name: str = verify.DEFAULT_MODEL,
            draft_model=None, block: bool = True) -> tuple[CardConfig, dict]:
    """The set-up before the first call, untimed, like loading: what cfg leaves BEST (section 5b), the
    draft cfg.draft names unless `draft_model` is given, r if "auto", in parallel mode the draft's
    process (block=False: not waited for), and the step times the rule reads (verify.step_times). tok
    None: the model's own tokenizer checks a named draft's vocabulary."""
    chosen_here = draft_model is None and BEST in (cfg.mode, cfg.ratio)
    if draft_model is None:  # our choice by the cost model (section 5b)
        cfg = choose_configuration(model, tok, cfg, name)
    else:  # a draft of the caller's, not measured here: fixed defaults for what is BEST
        cfg = dataclasses.replace(cfg, ratio=5 if cfg.ratio == BEST else cfg.ratio)
        if cfg.mode == BEST:
            cfg = dataclasses.replace(cfg, mode="parallel" if parallel_possible(model) else "lockstep")
    in_process = draft_model is None and cfg.mode == "parallel" and not cannot_spawn()
    # an int8 draft in its process needs no copy here: the process quantizes its own
    quantized_there = in_process and cfg.draft == "int8" and cfg.ratio != "auto"
    if draft_model is None and not quantized_there:
        named = cfg.draft not in ("int8", "self")
        tok = tok or (verify.tokenizer_of(model, instead="draft_model") if named else None)
        draft_model = load_draft(model, tok, cfg, name)
    if cfg.ratio == "auto":
        draft_weights = draft_model.model if isinstance(draft_model, DraftProcess) else draft_model
        cfg = dataclasses.replace(cfg, ratio=measure_ratio(model, draft_weights, cfg.K))
        print(f"[card] --ratio auto: measured r = {cfg.ratio}", file=sys.stderr)
    if in_process:
        draft_model = DraftProcess(model if quantized_there else draft_model, cfg, block=block,
                                   int8=quantized_there)
    threads = None  # the target's in generate(): all, or what a draft process leaves it
    if isinstance(draft_model, DraftProcess) and draft_model.threads:
        threads = max(1, torch.get_num_threads() - draft_model.threads)
    times = {} if cfg.cost == "free" else {"step_times": verify.step_times(model, threads=threads)}
    if chosen_here:  # the choice's speed here, said where it is below plain decoding (section 5b)
        say_if_slower(model, tok, cfg, draft_model, times.get("step_times"))
    return cfg, {"draft_model": draft_model, **times}

def prepare_without_waiting(model, tok, cfg: CardConfig, name: str = verify.DEFAULT_MODEL,
                            draft_model=None):
    """prepare() for custom_generate: a process it starts is not waited for (the first call streams)."""
    return prepare(model, tok, cfg, name, draft_model=draft_model, block=False)

# ---- 5b. Which configuration, on this machine: a cost model (ours) -----------------------------------------
#
# The CPU default runs the mode and r predicted fastest on this machine (TUTORIAL.md §4.6).
BEST_RATIOS = range(1, 9)  # the r the choice tries

def predicted_speedup(costs: dict, mode: str, r: int, wait: int, mat: float, hit_rate: float,
                      hit_len: float, max_lead: int) -> float:
    """A step's speedup over plain decoding (TUTORIAL.md §4.6): mat tokens a step, hit_rate of the
    steps hits, each consuming hit_len layers of a cache at most max_lead ahead; costs in seconds."""
    t_v = costs["t_verify"]
    t_d = costs["t_draft"]
    plain = mat * costs["t_target"]  # the time plain decoding takes for mat tokens
    if mode == "lockstep":
        return plain / (r * t_d + t_v)
    d = max(0.0, wait + hit_len - max_lead)  # the layers a hit still waits for
    hit = max(t_v + d * t_d, hit_len * t_d)
    miss = t_v + wait * t_d
    return plain / (hit_rate * hit + (1 - hit_rate) * miss)

def walk_chains(agreement: Sequence[Sequence[int]], q_hit: int, q_miss: int) -> tuple[float, float]:
    """(mat, hit rate): CARD's K = 1 steps walked over each answer (1: the draft guessed that token),
    a chain of q_hit after a hit, q_miss after a miss; a hit: the chain and the bonus guessed."""
    steps = emitted = hits = 0
    for answer in agreement:
        pos = 1  # answer[0] came from the target's prefill
        q = q_miss
        while pos < len(answer):
            chain = answer[pos:pos + q]  # the draft's guesses this step verifies
            accepted = chain.index(0) if 0 in chain else len(chain)  # up to its first wrong guess
            bonus = pos + accepted  # the token the target emits itself
            hit = accepted == q and bonus < len(answer) and answer[bonus] == 1
            steps += 1
            emitted += min(accepted + 1, len(answer) - pos)
            hits += hit
            pos = bonus + 1
            q = q_hit if hit else q_miss
    return emitted / max(steps, 1), hits / max(steps, 1)

@dataclass
class DraftMeasure:
    on_all: float  # seconds a K-node draft layer takes on all threads
    on_share: float  # the same on the draft process's share of them
    agreement: list  # per calibration answer, per token: 1 where the draft guessed it, else 0
    prefill_all: float = 0.0  # seconds the draft's prefill of a typical prompt takes on all threads
    prefill_share: float = 0.0  # the same on its share

def choose(cfg: CardConfig, t_target: float, t_verify: dict, measured: DraftMeasure,
           can_split: bool) -> tuple[float, CardConfig]:
    """(speedup, cfg with the fastest predicted of its mode and r: every candidate where BEST), ties
    to the smaller r. t_verify = {"all": {n: s}, "share": {n: s}}: the target's forward over n tokens
    on every thread and on what a draft process leaves it; can_split: a draft process can run."""
    modes = ["parallel", "lockstep"] if can_split else ["lockstep"]
    modes = modes if cfg.mode == BEST else [cfg.mode]
    ratios = BEST_RATIOS if cfg.ratio == BEST else [cfg.ratio]
    greedy = verify.TYPICAL_TOKENS * t_target  # a typical call's time, plain
    best = (0.0, cfg)
    for mode in modes:
        split = mode == "parallel" and can_split  # the draft in its process, on its share of the threads
        t_draft = measured.on_share if split else measured.on_all
        t_prefill = measured.prefill_share if split else measured.prefill_all
        times = t_verify["share" if split else "all"]
        for r in ratios:
            max_lead = 2 * r if cfg.max_lead is None else cfg.max_lead  # as the draft process
            wait = min(r if cfg.wait is None else cfg.wait, max_lead)
            q_hit = q_miss = r  # lockstep: r layers from a restarted cache, every step
            if mode == "parallel":  # a hit: what was drafted during the verification; a miss: w layers
                q_hit = min(r, max(wait, math.floor(verify.seconds_at(times, r + 1) / t_draft)))
                q_miss = min(wait, r)
            mat, hit_rate = walk_chains(measured.agreement, q_hit, q_miss)
            t_verify_q = verify.seconds_at(times, q_hit + 1)
            costs = {"t_target": t_target, "t_verify": t_verify_q, "t_draft": t_draft}
            per_step = predicted_speedup(costs, mode, r, wait, mat, hit_rate, q_hit + 1, max_lead)
            speedup = greedy / (greedy / per_step + t_prefill)  # the draft prefills once a call
            if speedup > best[0] + 1e-9:
                best = (speedup, dataclasses.replace(cfg, mode=mode, ratio=r))
    return best

def choose_configuration(model, tok, cfg: CardConfig, name: str) -> CardConfig:
    """cfg with its BEST fields chosen here (cfg itself, measuring nothing, where none is BEST)."""
    if BEST not in (cfg.mode, cfg.ratio):
        return cfg
    can_split = cfg.mode != "lockstep" and parallel_possible(model)
    t_target, t_verify, measured = measure_for_choice(model, tok, cfg, name)
    if cfg.ratio == "auto":  # §3.1's rule, as measure_ratio takes it
        cfg = dataclasses.replace(cfg, ratio=max(1, math.ceil(t_target / measured.on_all)))
        print(f"[card] --ratio auto: measured r = {cfg.ratio}", file=sys.stderr)
    return choose(cfg, t_target, t_verify, measured, can_split)[1]

def say_if_slower(model, tok, cfg: CardConfig, draft_model, step_times: dict | None) -> None:
    """Where cfg runs slower than plain decoding here (verify.say_if_slower), one line says so."""
    def run(model, prompt_ids, n, eos_ids):
        while isinstance(draft_model, DraftProcess) and not draft_model.started():  # (the drop-in's)
            time.sleep(0.05)
        return generate(model, prompt_ids, n, eos_ids, cfg, draft_model=draft_model, step_times=step_times)

    verify.say_if_slower(model, tok, run, ("card", repr(cfg)), "[card] on this machine CARD runs at {:.2f}x "
                         f"plain decoding ({cfg.draft} draft, {cfg.mode}, r = {cfg.ratio}: the fastest "
                         "its step times predict, measured once): its draft's steps cost too much of the "
                         "target's here; another core, a smaller draft or a GPU would help; it runs anyway")

def measure_for_choice(model, tok, cfg: CardConfig, name: str) -> tuple:
    """(t_target, t_verify, DraftMeasure of cfg.draft), kept on disk (verify.measured_costs)."""
    threads = torch.get_num_threads()
    share = max(1, threads // 2)  # the draft process's threads (DraftProcess); the target keeps the rest
    largest = max(BEST_RATIOS) + 1
    # the rule's measurement (verify.py section 9), on every thread and on what parallel leaves
    t_verify = {"all": verify.step_times(model, largest),
                "share": verify.step_times(model, largest, threads=max(1, threads - share))}
    what = ("card: a draft", cfg.draft, cfg.draft_dtype, cfg.K, share, verify.CALIBRATION,
            verify.CALIBRATION_TOKENS, verify.TYPICAL_TOKENS)
    measure = functools.partial(measure_draft, model, tok, cfg, name, share)
    return t_verify["all"][1], t_verify, DraftMeasure(*verify.measured_costs(model, what, measure))

def measure_draft(model, tok, cfg: CardConfig, name: str, share: int) -> list:
    """DraftMeasure's fields in order (a forward over TYPICAL_TOKENS stands for the prefill)."""
    tok = tok or verify.tokenizer_of(model, instead="card_config (a CardConfig with its mode and ratio)")
    draft_model = load_draft(model, tok, cfg, name)
    typical = verify.TYPICAL_TOKENS
    on_all = verify.measure_step_times(draft_model, [cfg.K, typical], repeats=3)
    on_share = verify.measure_step_times(draft_model, [cfg.K, typical], repeats=3, threads=share)
    eos = verify.eos_ids_of(model, tok)
    agreement = []
    for prompt in verify.CALIBRATION:
        prompt_ids = verify.encode_prompt(tok, prompt)
        answer = verify.hf_generate(model, prompt_ids, verify.CALIBRATION_TOKENS, eos)
        cache = verify.new_cache(draft_model, len(prompt_ids) + len(answer) + 1)
        guesses = [int(verify.prefill(draft_model, cache, prompt_ids)[-1].argmax())]  # for answer[0]
        for token in answer[:-1]:  # fed answer[i], the draft guesses answer[i + 1]
            logits = verify.tree_forward(draft_model, cache, Tree.chain(token, []))
            guesses.append(int(logits[-1].argmax()))
        agreement.append([int(guess == token) for guess, token in zip(guesses, answer)])
    return [on_all[cfg.K], on_share[cfg.K], agreement, on_all[typical], on_share[typical]]

# ---- 6. From model.generate: the drop-in (verify.py section 13 reads the call) -----------------------------

def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                    card_config: CardConfig | None = None, draft_model=None, seed: int | None = None,
                    **model_kwargs):
    """Run this file's generate() from transformers' own call, in place of its loop:

        out = model.generate(input_ids, custom_generate=card.custom_generate, max_new_tokens=128)

    Returns what model.generate returns (prompt + new tokens), honouring its GenerationConfig, its
    stopping criteria (per emitted token) and its streamer, and refusing in one line what it cannot
    reproduce (verify.check_generate_call). (Not transformers' assistant_model, its own method.)

    Keywords of this method, passed to model.generate beside its own:
        - card_config: a CardConfig (default: CardConfig.for_device(model.device); on a CPU the mode
          and r predicted fastest here (section 5b), measured once and kept in
          ~/.cache/specdec-reference or $SPECDEC_CACHE; one line on stderr where CARD cannot win)
        - draft_model: a draft model with the model's tokenizer, or a running card.DraftProcess
          (default: the config's, built at the model's first call; its process serves the model's
          later calls and ends with it). A draft model given drafts in a process for that call alone.
        - seed: the sampling noise's key under do_sample=True (default: drawn from torch's
          generator, so torch.manual_seed repeats a call)
    """
    call = verify.GenerateCall.read(model, input_ids, logits_processor, stopping_criteria,
                                    generation_config, model_kwargs, seed)
    cfg = CardConfig.for_device(model.device) if card_config is None else card_config
    cfg.check()
    # the script's set-up (prepare), once per model: the draft, r if auto, the draft process (kept)
    kept_cfg, extra = verify.prepare_once(model, prepare_without_waiting, cfg, draft_model=draft_model)
    process = extra["draft_model"]
    if isinstance(process, DraftProcess) and draft_model is None and not process.alive():
        # the kept process died (a failed draft, a kill): this call starts a new one
        verify.forget_per_model(model, verify.prepared_key(model, prepare_without_waiting, cfg))
        kept_cfg, extra = verify.prepare_once(model, prepare_without_waiting, cfg)
    cfg = kept_cfg
    gen = generate(model, call.prompt_ids, call.max_new_tokens, call.eos_ids, cfg, sampling=call.sampling,
                   **call.hooks(), **extra)
    return call.output(gen)

# ---- 7. CLI ------------------------------------------------------------------------------------------------

def make_parser():
    """The options: verify.common_parser's, then the paper's parameters (tools/replay.py takes them too)."""
    import argparse

    parser = verify.common_parser(__doc__.split("\n\n")[0].strip())
    default = functools.partial(verify.defaults_help, CardConfig)  # ' (default: ...)' for a help line
    g = parser.add_argument_group("CARD (the paper's names; CUDA: CardConfig.gpu(); CPU: .cpu())")
    add = g.add_argument
    add("--target", dest="model", default=argparse.SUPPRESS, help="the target model (same as --model)")
    add("--draft",
        help="the draft: int8 (the target's linear layers in int8; CPU), self (the target's "
        "weights in --draft-dtype) or a model name/path with the same tokenizer" + default("draft"))
    add("--draft-dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="the dtype of --draft self or a named draft (default: bfloat16)")
    add("--K", type=int, help="K, the primary cache size: candidates kept per layer (Eq. 7)" + default("K"))
    add("--k", type=int, help="k, children proposed per node from the draft's top-k (Eq. 2)" + default("k"))
    add("--ratio",
        help="r, the communication ratio: chain length per target step; auto = §3.1's rule, "
        "ceil(t_target / t_draft), measured; best = the cost model's choice" + default("ratio"))
    add("--mode", choices=["parallel", "lockstep", BEST],
        help="parallel: the draft in its own process; lockstep: r layers, then verify; best: the "
        "faster predicted on this machine" + default("mode"))
    add("--wait", type=int,
        help="parallel: layers the cache must lead by before a query is answered; 0 = "
        "take what it holds (default: r on CUDA, 3 on CPU)")
    add("--no-correct", dest="correct", action="store_const", const=False,
        help="Table 2's 'cache only' ablation: query without correcting")
    add("--cost", choices=verify.COSTS, help=verify.COST_HELP + default("cost"))
    return parser

def main(argv=None) -> int:
    return verify.run_cli(make_parser(), "card", generate, CardConfig, prepare, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
