"""
card.py -- CARD: cache-assisted parallel speculative decoding with the "query-and-correct" paradigm.
Enyu Zhou, Kai Sheng, Hao Chen & Xin He, "CARD: A Cache-Assisted Parallel Speculative Decoding Framework via
Query-and-Correct Paradigm for Accelerating LLM Inference", 2025, arXiv:2508.04462.

Classic speculative decoding is draft-THEN-verify: the target waits while the draft drafts, the draft waits
while the target verifies. CARD lets both run at the same time:

    DRAFT   (a worker, all the time) grows a scored tree of candidate continuations -- "the cache" -- one
            layer of at most K nodes per draft forward: the top-k children of every node of the newest
            layer, scored parent's cumulative probability x child probability, globally top-K'd
                                                                          (§2.2, Eq. 1-9; its mask: §2.3)
    QUERY   (the target) takes the highest-scoring path of up to r tokens below the verified text  (§2)
    VERIFY  one target forward over that CHAIN (not a tree: the target's work stays small); greedy
            acceptance plus the bonus token
    CORRECT prune the cache to the subtree that continues the accepted text (a hit) or restart it from the
            target's token (a miss), and compact the draft's KV cache to match                     (§2.4)

r, the communication ratio, is ~ t(target step) / t(draft step): how many tree layers the draft can add
while the target verifies once (§3.1).

File layout, in the paper's order:

    0. Configuration         K, k, r and the mode, under the paper's names            (§2, §3.1)
    1. The candidate cache   primary layers + secondary (token, score, parent) cache   (§2.2, Figure 3)
    2. The drafter           draft forwards over a layer with the §2.3 mask; correction (§2.3, §2.4)
    2b. Ablation             Table 2's "cache only": query without correcting
    3. The decode loop       lockstep (r layers per target step) and parallel (a worker thread)
    4. CLI

    python card.py --prompt "Explain what a hash map is." --compare

    from card import CardConfig, generate                    # as a library (draft: same tokenizer)
    gen = generate(target, prompt_ids, 128, eos_ids, CardConfig.cpu(), draft=draft)

The default pair is the default model in float32 (target) and THE SAME WEIGHTS in bfloat16 (draft): the
only pair available offline. It stands in for a real small/large pair, e.g. --draft
HuggingFaceTB/SmolLM2-135M-Instruct --target HuggingFaceTB/SmolLM2-1.7B-Instruct (hub ids need network
access or a local copy).

Greedy decoding, float32 target: the output is identical to the target's model.generate(do_sample=False) in
both modes, except at exact ties within rounding (see verify.py); measured on every prompt we run
(tests/test_card.py). Sampled (--temperature), the output is exactly the plain sampler's for the same seed
(verify.py section 4b; TUTORIAL.md §1.8 measures what drafting deterministically gives up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

import verify
from verify import Generation, Tree

# ----------------------------------------------------------------------------------------------------------
# 0. Configuration (§2, §3.1)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class CardConfig:
    """CARD's parameters under the paper's names, and how this reference runs them.

    >>> CardConfig.paper().k, CardConfig.cpu().k
    (100, 1)
    """

    k: int = 100  # K, the primary cache size: candidate sequences kept per tree layer (Eq. 7)
    topk: int = 100  # k, children proposed per node from the draft's top-k (Eq. 2)
    ratio: int | str = 7  # r, the communication ratio ~ t(target step) / t(draft layer); "auto" = measured
    mode: str = "parallel"  # "parallel": the draft in a worker thread; "lockstep": r layers, then one target step
    correct: bool = True  # False = Table 2's "cache only" ablation (section 2b)
    max_lead: int | None = None  # layers the cache may run ahead of the verified text (None: 2r, as the reference)
    draft: str | None = None  # the draft model's name for prepare() (None: the target's own weights)
    draft_dtype: str = "bfloat16"  # the draft's dtype
    draft_threads: int | None = None  # CPU, parallel mode: the worker's threads (None: half the cores)
    target_threads: int | None = None  # CPU, parallel mode: the target's threads (None: the rest)

    @classmethod
    def paper(cls) -> "CardConfig":
        """§3.1 for a 1B draft: K = 100, r = 7, in parallel. note: the paper gives no value for Eq. 2's k;
        its reference code expands each node by its own top-K, i.e. k = K (10^4 candidates per layer)."""
        return cls()

    @classmethod
    def cpu(cls) -> "CardConfig":
        """Measured on the tuning half of the shipped prompts (TUTORIAL.md §4.6): a one-node-wide cache,
        r = 4, lockstep. K = 1 keeps CARD's loop (query, verify, correct) but not its width."""
        return cls(k=1, topk=1, ratio=4, mode="lockstep")

    @classmethod
    def for_device(cls, device) -> "CardConfig":
        return cls.paper() if torch.device(device).type == "cuda" else cls.cpu()

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value; accept r as text too."""
        if self.ratio != "auto":
            try:
                self.ratio = int(self.ratio)
            except ValueError:
                raise verify.UserError(f"--ratio must be a whole number or 'auto' (got {self.ratio!r})") from None
        for name in ("k", "topk", "ratio"):
            v = getattr(self, name)
            if v != "auto" and v < 1:
                raise verify.UserError(f"--{name} must be at least 1 (got {v})")
        if self.mode not in ("lockstep", "parallel"):
            raise verify.UserError(f"--mode must be lockstep or parallel (got {self.mode!r})")


# ----------------------------------------------------------------------------------------------------------
# 1. The candidate cache (§2.2)
# ----------------------------------------------------------------------------------------------------------
#
# A tree rooted at the newest verified token (the one the target has not fed yet). Layer l holds at most K
# nodes: the primary cache C^(l). Each node stores
#   sigma = the draft's cumulative probability of the path root -> node              (Eq. 4)
#   cands = the top-k (token, p) of the draft's next-token distribution at the node  (Eq. 2), once the
#           node has been FED to the draft (its KV is then in the draft cache, at `slot`)
# The secondary cache B^(l) of Eq. 5 is every (child token, w = p * sigma(parent), parent) over the fed
# nodes of layer l. Growing the next layer = sort B^(l) by w, keep the top K (Eq. 6-9):
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
    def __init__(self, k: int, topk: int):
        assert k >= 1 and topk >= 1
        self.K, self.k = k, topk
        self.nodes: dict[int, Node] = {}
        self.layers: list[list[int]] = []
        self._next = 0

    def reset(self, root_token: int) -> None:
        """A new tree with just the (unfed) root."""
        self.nodes, self.layers = {}, []
        self.root = self._add(root_token, -1, 1.0)

    def _add(self, token: int, parent: int, sigma: float) -> int:
        i, self._next = self._next, self._next + 1
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
        return len(self.layers) - 1

    def frontier(self) -> list[int]:
        """The unfed newest layer ([] if every layer has been fed)."""
        last = self.layers[-1]
        return last if self.nodes[last[0]].slot is None else []

    def secondary(self, layer: int) -> list[tuple[int, float, int]]:
        """B^(l) (Eq. 3, 5): (token, w = p * sigma(parent), parent) for the top-k children of every fed node
        of `layer`."""
        out = []
        for i in self.layers[layer]:
            node = self.nodes[i]
            out += [(t, p * node.sigma, i) for t, p in node.cands]
        return out

    def grow(self) -> list[int]:
        """The next layer from the newest (fed) layer: sort B by score, keep the top K (Eq. 6-9)."""
        assert not self.frontier(), "the newest layer must be fed first"
        ranked = sorted(self.secondary(self.depth), key=lambda c: -c[1])[: self.K]  # Eq. 6, 7
        return [self._add(t, parent, w) for t, w, parent in ranked]  # Eq. 8, 9: s_m = s_{i_m} + y_m

    def path_to(self, i: int) -> list[int]:
        """Node ids from the root's child down to node i."""
        out = []
        while self.nodes[i].parent >= 0:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def query(self, r: int) -> list[int]:
        """QUERY: the highest-weight path of up to r tokens below the root -- the best sigma at depth
        min(r, depth). (sigma only falls along a path, so the deepest layer's best node IS the best path of
        that length in the cache.)"""
        d = min(r, self.depth)
        if d == 0:
            return []
        best = max(self.layers[d], key=lambda i: self.nodes[i].sigma)
        return self.path_to(best)


# ----------------------------------------------------------------------------------------------------------
# 2. The drafter: draft forwards (§2.2, §2.3) and correction (§2.4)
# ----------------------------------------------------------------------------------------------------------
#
# The draft's KV cache holds  [ verified text[:dp] | fed tree nodes, layer by layer ].
# Feeding a layer = one draft forward over its (at most K) tokens, with the §2.3 mask:
#   - every node sees the verified prefix,
#   - "causal history inheritance": every node sees the slots of its ancestors in the tree,
#   - "intra-step independence": among the nodes fed in this step, a node sees only itself (identity).
# Position ids: a node at depth d stands at position (len(text) - 1) + d -- its position in the text if
# its path were accepted. (The reference code skips one position from depth 1 on; that only hurts the
# draft's quality, never correctness, but it is wrong.)
#
#   prefix P P P, root r fed at slot 3, layer 1 = {a, b} fed at slots 4, 5; feeding layer 2 = {c (under a),
#   d (under b)} at slots 6, 7:
#              P P P r a b | c d
#          c:  1 1 1 1 1 0 | 1 0
#          d:  1 1 1 1 0 1 | 0 1


def draft_mask(tree: CandidateCache, front: Sequence[int], dp: int, cache_len: int) -> np.ndarray:
    """The §2.3 mask, bool [n, cache_len + n], for feeding the nodes `front` after `cache_len` cached
    entries of which the first `dp` are the verified prefix."""
    n = len(front)
    allowed = np.zeros((n, cache_len + n), dtype=bool)
    allowed[:, :dp] = True  # the verified prefix
    for row, i in enumerate(front):
        j = tree.nodes[i].parent
        while j >= 0:  # causal history inheritance: the slot of every ancestor
            allowed[row, tree.nodes[j].slot] = True
            j = tree.nodes[j].parent
        allowed[row, cache_len + row] = True  # intra-step independence: among its peers, itself only
    return allowed


class Drafter:
    def __init__(self, model, k: int, topk: int):
        self.model = model
        self.tree = CandidateCache(k, topk)
        self.cache = None
        self.layers_fed = 0  # draft forwards done (one per layer)
        self.kv_ready = None  # CUDA: an event recorded after correct() compacted the draft KV (see step())

    def start(self, text: Sequence[int], capacity: int = 256) -> None:
        """text = the verified tokens, its last one the (unfed) root; capacity: the most KV positions the draft
        cache will hold (verify.new_cache)."""
        self.text = list(text)
        self.cache = verify.new_cache(self.model, capacity)
        self.dp = 0  # verified tokens whose KV is in the draft cache (text[:dp])
        self.tree.reset(self.text[-1])
        self.root_pos = len(self.text) - 1  # the text position of the tree's root

    def _topk(self, logits: torch.Tensor) -> list[list[tuple[int, float]]]:
        """Eq. 1-2: the draft's distribution at each fed node, reduced to its top-k (token, p)."""
        probs = torch.softmax(logits.float(), dim=-1)  # [N, V]
        p, t = probs.topk(self.tree.k, dim=-1)
        return [list(zip(ti, pi)) for ti, pi in zip(t.tolist(), p.tolist())]

    @torch.no_grad()  # subtle: grad mode is per thread; the worker thread needs its own no_grad
    def step(self) -> None:
        """One draft forward: feed the frontier (or, first, the root) and grow the next layer."""
        tree, model = self.tree, self.model
        if self.kv_ready is not None:
            # subtle (CUDA, parallel mode): correct() compacted the draft KV on the TARGET thread's stream,
            # and this forward runs on the worker's own stream. CUDA orders work only within a stream, so
            # without this wait the forward could read the KV while the compaction is still moving it. The
            # wait is queued on the GPU (the host thread does not block); in lockstep mode both run on one
            # stream and it costs nothing.
            torch.cuda.current_stream(model.device).wait_event(self.kv_ready)
            self.kv_ready = None
        root = tree.nodes[tree.root]
        if root.slot is None:
            # Catch up: feed the verified tokens the draft has not seen, ending with the root (causal).
            assert verify.cache_len(self.cache) == self.dp
            ids = torch.tensor([self.text[self.dp :]], device=model.device)
            out = model(input_ids=ids, past_key_values=self.cache, use_cache=True, **verify.last_logits_only(model))
            self.dp = len(self.text) - 1
            root.slot, root.cands = self.dp, self._topk(out.logits[0, -1:])[0]
        else:
            front = tree.frontier()
            c = verify.cache_len(self.cache)  # n = len(front) new nodes after c cached entries
            allowed = draft_mask(tree, front, self.dp, c)  # [n, c+n]
            mask = verify.additive_mask(allowed, model.dtype, model.device)  # [1, 1, n, c+n]
            ids = torch.tensor([[tree.nodes[i].token for i in front]], device=model.device)  # [1, n]
            pos = torch.tensor([[self.root_pos + tree.nodes[i].depth for i in front]], device=model.device)  # [1, n]
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=self.cache, use_cache=True)
            for row, (i, cands) in enumerate(zip(front, self._topk(out.logits[0]))):
                tree.nodes[i].slot, tree.nodes[i].cands = c + row, cands
        self.layers_fed += 1
        tree.grow()

    def lead(self) -> int:
        """How many layers the cache reaches below the verified text."""
        return self.tree.depth

    def query(self, r: int) -> list[int]:
        """The tokens of the best path of up to r tokens below the verified text (§2, Figure 2)."""
        return [self.tree.nodes[i].token for i in self.tree.query(r)]

    def correct(self, accepted: Sequence[int], bonus: int) -> bool:
        """CORRECT (§2.4) after the target accepted `accepted` (tokens of the queried path) and emitted
        `bonus`. Returns True on a cache hit (the bonus token is in the cache below the accepted path)."""
        self.text += list(accepted) + [int(bonus)]
        return self._correct(self.tree.root, accepted, bonus)

    def _correct(self, start: int, accepted: Sequence[int], bonus: int) -> bool:
        """Prune the cache to the subtree below the verified text, which runs from the root through `start`
        and then `accepted`, and compact the draft KV to match."""
        tree = self.tree
        node, walked = start, []
        for t in accepted:  # the accepted tokens ARE a path of the cache (they were queried from it)
            node = tree.nodes[node].children[t]
            walked.append(node)
        x = tree.nodes[node].children.get(int(bonus))
        # Verified nodes that are fed become the new verified prefix of the draft cache.
        verified = [n for n in [tree.root] + self._path_from_root(start) + walked if tree.nodes[n].slot is not None]
        keep = [n for n in self._subtree(x) if tree.nodes[n].slot is not None] if x is not None else []
        keep.sort(key=lambda n: tree.nodes[n].slot)  # slot order (BFS order can differ within a layer)
        slots = [tree.nodes[n].slot for n in verified + keep]
        assert slots == sorted(slots)
        verify.compact_kv(self.cache, self.dp, [s - self.dp for s in slots])
        if self.model.device.type == "cuda":  # the worker's next step() waits for this (see there)
            self.kv_ready = torch.cuda.Event()
            self.kv_ready.record(torch.cuda.current_stream(self.model.device))
        self.dp += len(verified)
        self.root_pos = len(self.text) - 1
        if x is None:  # MISS: restart the cache from the target's token
            tree.reset(bonus)
            return False
        self._reroot(x, {n: self.dp + k for k, n in enumerate(keep)})  # HIT: keep x's subtree
        return True

    def _path_from_root(self, node: int) -> list[int]:
        return self.tree.path_to(node) if node != self.tree.root else []

    def _subtree(self, x: int) -> list[int]:
        """x and its descendants, layer by layer."""
        out, level = [], [x]
        while level:
            out += level
            level = [c for i in level for c in self.tree.nodes[i].children.values()]
        return out

    def _reroot(self, x: int, new_slot: dict[int, int]) -> None:
        """Make x the root: depths shift, sigmas are renormalized by sigma(x) (so they do not underflow),
        fed nodes move to their compacted slots. The unfed frontier is rebuilt from the secondary cache:
        its pruned-away entries leave room for the next-best candidates of the surviving parents."""
        old = self.tree
        new = CandidateCache(old.K, old.k)
        new._next = old._next
        base, s0 = old.nodes[x].depth, old.nodes[x].sigma
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
        self.tree = new
        if new.nodes[x].slot is not None:  # rebuild the unfed frontier from B of the newest fed layer
            if new.frontier():
                for i in new.layers.pop():
                    p = new.nodes[i].parent
                    del new.nodes[p].children[new.nodes[i].token]
                    del new.nodes[i]
            new.grow()


# ----------------------------------------------------------------------------------------------------------
# 2b. Ablation: "cache only" (Table 2) -- query, but do not correct
# ----------------------------------------------------------------------------------------------------------
#
# The only place the ablation lives. On a hit the verified text is followed down the cache (to `qroot`) and
# nothing is pruned or compacted: the draft keeps growing every branch, including the ones the text has
# left. Only on a miss, when the text has left the cache altogether, is the cache corrected (restarted from
# the target's token), as the full method does.


class CacheOnlyDrafter(Drafter):
    def start(self, text: Sequence[int], capacity: int = 256) -> None:
        super().start(text, capacity)
        self.qroot = None  # the node the verified text has reached inside the tree (None: the root)

    def lead(self) -> int:
        base = 0 if self.qroot is None else self.tree.nodes[self.qroot].depth
        return self.tree.depth - base

    def query(self, r: int) -> list[int]:
        """The best path of up to r tokens below qroot."""
        if self.qroot is None:
            return super().query(r)
        tree = self.tree
        base = tree.nodes[self.qroot].depth
        d = min(r, tree.depth - base)
        below = [i for i in tree.layers[base + d] if self.qroot in tree.path_to(i)] if d else []
        if not below:
            return []
        best = max(below, key=lambda i: tree.nodes[i].sigma)
        return [tree.nodes[i].token for i in tree.path_to(best)[base:]]

    def correct(self, accepted: Sequence[int], bonus: int) -> bool:
        tree = self.tree
        start = tree.root if self.qroot is None else self.qroot
        node = start
        for t in accepted:
            node = tree.nodes[node].children[t]
        self.text += list(accepted) + [int(bonus)]
        x = tree.nodes[node].children.get(int(bonus))
        if x is not None:  # a hit: follow the text down the tree, prune nothing
            self.qroot = x
            return True
        self.qroot = None  # a miss: correct from where the text was, i.e. restart the cache
        return self._correct(start, accepted, bonus)


# ----------------------------------------------------------------------------------------------------------
# 3. The decode loop
# ----------------------------------------------------------------------------------------------------------
#
# lockstep  per target step the draft does exactly r layers, then the target queries: deterministic, one
#           thread (what the released code effectively does; the fallback for one-core machines).
# parallel  a worker thread feeds layers as long as the cache leads the verified text by < max_lead layers.
#           The target queries, verifies (while the worker keeps drafting), then corrects. The tree is
#           guarded by a lock: the worker holds it during one draft forward, so the target waits at most
#           one draft step (~1/r of its own) to query or correct. On CUDA the worker has its own stream;
#           on a CPU the cores are split between the two models (torch threads are per Python thread).


def _worker(drafter: Drafter, cond: threading.Condition, turn: threading.Event, stop: threading.Event,
            max_lead: int, errors: list, threads: int | None, stream) -> None:
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while not stop.is_set():
                with cond:
                    # subtle: a lock is not fair. Released and re-taken at once, it would starve the target
                    # thread; so whenever the target is waiting for the cache, the worker steps aside.
                    while turn.is_set() and not stop.is_set():
                        cond.wait(timeout=0.05)
                    if stop.is_set():
                        break
                    if drafter.lead() < max_lead:
                        drafter.step()
                        if stream is not None:
                            # the tree's tokens are read by the target thread, and correct()'s compaction
                            # (on the target's stream) moves the KV this step wrote: both need it finished
                            stream.synchronize()
                    else:
                        cond.wait(timeout=0.05)  # nothing to do until a correction: woken by it
    except BaseException as e:  # reported to the target thread, which re-raises it
        errors.append(e)
        stop.set()
        with cond:
            cond.notify_all()


@contextlib.contextmanager
def _targets_turn(cond: threading.Condition, turn: threading.Event, errors: list):
    """The target's exclusive access to the cache (correct + query), ahead of the worker."""
    turn.set()
    with cond:
        try:
            if errors:
                raise errors[0]
            yield
        finally:
            turn.clear()
            cond.notify_all()


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], cfg: CardConfig,
             *, draft, sampling: verify.Sampling = verify.GREEDY, on_emit=None, on_step=None) -> Generation:
    """CARD decoding. `model` is the target, `draft` the draft model (same tokenizer; `load_draft` loads the
    one cfg names). cfg.mode "lockstep" is deterministic (the tests use it); "parallel" runs the draft in a
    worker thread, as the paper. `sampling`: the target samples with keyed noise (verify.py section 4b) and
    accepts the queried chain where it equals those samples; the draft still proposes its top-k tokens."""
    cfg.check()
    if draft is None:
        raise verify.UserError("CARD needs a draft model (draft=...)")
    if cfg.ratio == "auto":
        raise verify.UserError("cfg.ratio = 'auto' is measured by prepare() (or set r = measure_ratio(...))")
    ratio = cfg.ratio
    max_lead = 2 * ratio if cfg.max_lead is None else cfg.max_lead
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step)
    gen.extra.update(hits=0, misses=0, verified=0)

    # the target's cache: prompt + output + the largest step (the pending token and a chain of r)
    cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + ratio + 1)
    pending = verify.first_token(verify.prefill(model, cache, prompt_ids), len(prompt_ids), sampling)
    if gen.finish_prefill(pending):
        return gen
    drafter = (Drafter if cfg.correct else CacheOnlyDrafter)(draft, cfg.k, cfg.topk)
    # the draft's cache: the verified text + up to max_lead + 1 layers of K nodes ahead of it
    drafter.start(list(prompt_ids) + [pending], capacity=len(prompt_ids) + max_new_tokens + (max_lead + 2) * cfg.k)

    cond, turn, stop, errors, worker = threading.Condition(), threading.Event(), threading.Event(), [], None
    main_threads = torch.get_num_threads()
    if cfg.mode == "parallel":
        stream, draft_threads = None, None
        if draft.device.type == "cuda":
            stream = torch.cuda.Stream(device=draft.device)
        else:
            draft_threads = cfg.draft_threads or max(1, main_threads // 2)
            target = cfg.target_threads or max(1, main_threads - draft_threads)
            torch.set_num_threads(target)
        worker = threading.Thread(target=_worker, name="card-draft", daemon=True,
                                  args=(drafter, cond, turn, stop, max_lead, errors, draft_threads, stream))
        worker.start()

    def next_chain() -> list[int]:
        """QUERY the cache (lockstep: after exactly r new draft layers)."""
        if worker is None:
            for _ in range(ratio):
                if drafter.lead() < max_lead:
                    drafter.step()
        chain = drafter.query(ratio)
        return chain[: max(max_new_tokens - len(gen.tokens) - 1, 0)]  # a step emits at most len(chain) + 1

    try:
        t0 = time.perf_counter()
        with _targets_turn(cond, turn, errors):
            chain = next_chain()
        draft_s = time.perf_counter() - t0
        while True:
            # -- VERIFY the chain with the target (in parallel mode the worker keeps drafting meanwhile)
            tree = Tree.chain(pending, chain)
            prefix_len = verify.cache_len(cache)
            logits = verify.tree_forward(model, cache, tree)
            path, bonus = verify.accept(tree, logits, prefix_len, sampling)
            verify.rollback(cache, prefix_len + len(path))
            gen.extra["verified"] += len(tree)
            if gen.finish_step(tree, path, bonus, draft_s if worker is None else 0.0):
                return gen
            pending = bonus

            # -- CORRECT the cache with what the target accepted, then QUERY it for the next step
            t0 = time.perf_counter()
            with _targets_turn(cond, turn, errors):
                hit = drafter.correct([tree.tokens[i] for i in path[1:]], bonus)
                chain = next_chain()
            draft_s = time.perf_counter() - t0
            gen.extra["hits" if hit else "misses"] += 1
    finally:
        stop.set()
        if worker is not None:
            with cond:
                cond.notify_all()
            worker.join()
            torch.set_num_threads(main_threads)
        gen.extra["draft_layers"] = drafter.layers_fed
        steps = max(gen.steps, 1)
        queries = max(gen.extra["hits"] + gen.extra["misses"], 1)
        gen.extra.update(hit_rate=gen.extra["hits"] / queries, draft_layers_per_step=drafter.layers_fed / steps,
                         verified_per_step=gen.extra["verified"] / steps)


# ----------------------------------------------------------------------------------------------------------
# 4. CLI
# ----------------------------------------------------------------------------------------------------------


def same_vocabulary(tok_a, tok_b) -> bool:
    """Speculation compares token ids, so the two models must map the same strings to the same ids."""
    return tok_a.get_vocab() == tok_b.get_vocab()


_DRAFTS: dict = {}  # (name, device, dtype) -> (model, tokenizer): bench.py's card and hf-assisted share one


def load_draft(model, tok, cfg: CardConfig, target_name: str = verify.DEFAULT_MODEL):
    """The draft model cfg names (default: the target's own weights) in cfg.draft_dtype, on the target's
    device and with its attention implementation."""
    name = cfg.draft or target_name
    key = (name, str(model.device), cfg.draft_dtype)
    if key not in _DRAFTS:
        attn = getattr(model.config, "_attn_implementation", None)
        _DRAFTS[key] = verify.load_model(name, device=str(model.device), dtype=cfg.draft_dtype,
                                         attn_implementation=attn if attn in verify.MASK_HONOURING else "auto")
    draft, draft_tok = _DRAFTS[key]
    if not same_vocabulary(tok, draft_tok):
        raise verify.UserError(f"--draft {name} and --target {target_name} do not share a vocabulary; CARD "
                               "compares token ids, so both models need the same tokenizer")
    return draft


def step_time(model, n: int) -> float:
    """Seconds for one forward of `model` over n new tokens after 256 cached ones (verify's timing loop).
    n = 1: a target step; n = K: one draft layer of the candidate cache."""
    return verify.measure_step_times(model, [n], repeats=3)[n]


def measure_ratio(model, draft, k: int) -> int:
    """§3.1's communication ratio r = ceil(t_target / t_draft): how many K-node draft layers fit in the time
    of one target step (here: a one-token target step against one draft layer of K tokens)."""
    return max(1, math.ceil(step_time(model, 1) / step_time(draft, k)))


def prepare(model, tok, cfg: CardConfig, name: str = verify.DEFAULT_MODEL) -> tuple[CardConfig, dict]:
    """Once per process, untimed: load the draft model; r = 'auto' is measured here."""
    draft = load_draft(model, tok, cfg, name)
    if cfg.ratio == "auto":
        cfg = dataclasses.replace(cfg, ratio=measure_ratio(model, draft, cfg.k))
        print(f"[card] --ratio auto: measured r = {cfg.ratio}", file=sys.stderr)
    return cfg, {"draft": draft}


def main(argv=None) -> int:
    import argparse

    parser = verify.common_parser(__doc__.split("\n\n")[0].strip())
    def default(name):
        return verify.defaults_help(CardConfig, name)

    g = parser.add_argument_group("CARD (the paper's names; CUDA defaults: §3.1's; CPU: TUTORIAL.md §4.6)")
    g.add_argument("--target", dest="model", default=argparse.SUPPRESS, help="the target model (same as --model)")
    g.add_argument("--draft",
                   help="the draft model, same tokenizer (default: the target's weights in bfloat16, a stand-in)")
    g.add_argument("--draft-dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft's dtype (default: bfloat16)")
    g.add_argument("--k", type=int,
                   help="K, the primary cache size: candidates kept per tree layer (Eq. 7)" + default("k"))
    g.add_argument("--topk", type=int,
                   help="k, children proposed per node from the draft's top-k (Eq. 2)" + default("topk"))
    g.add_argument("--ratio",
                   help="r, the communication ratio: chain length per target step; auto = measured (§3.1)"
                        + default("ratio"))
    g.add_argument("--mode", choices=["parallel", "lockstep"],
                   help="parallel: draft in a worker thread; lockstep: r layers, then verify" + default("mode"))
    g.add_argument("--no-correct", dest="correct", action="store_const", const=False,
                   help="Table 2's 'cache only' ablation: query without correcting (section 2b)")
    config = lambda args, device: verify.config_from_args(CardConfig.for_device(device), args)
    return verify.run_cli(parser, "card", generate, config, prepare, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
