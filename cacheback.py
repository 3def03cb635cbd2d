"""
cacheback.py -- Cacheback decoding: speculative decoding with nothing but LRU tables of token n-grams.
Zhiyao Ma, In Gim & Lin Zhong, "Cacheback: Speculative Decoding With Nothing But Cache", EMNLP 2025,
arXiv:2511.21699.

    DRAFT   query an LRU table  leader (last LL tokens) -> followers (FL-token continuations seen after it),
            recursively, breadth first, into a draft TREE of at most TDL tokens          (§3.1, §3.2)
    VERIFY  one forward with tree attention (verify.py)                                 (§3.2)
    ACCEPT  the longest branch the model agrees with, plus the bonus token
    UPDATE  slide a window of LL + FL tokens over the newly accepted tokens into the dynamic table (§3.2)

File layout, in the paper's order:

    0. Configuration    the paper's parameters under its names: LL, FL, LC, FC, TDL, CRT (§3, §4)
    1. CacheTable       the two-level LRU of §3.1 (Figure 1)
    2. Dual tables      sliding-window updates of the dynamic table (§3.2, §3.3)
    3. Draft tree       BFS growth under TDL and CRT, prefixes merged into a trie (§3.2, Figure 2)
    4. Cost pruning     our deviation for CPUs, a separate pass: verify only the part worth its cost
    5. Decode loop      draft, verify with tree attention, accept, compact the KV, update (verify.py)
    6. CLI
    7. Frozen table     built offline from a corpus (§3.3, §4): the Python stdlib, or the model's own answers

    python cacheback.py --prompt "Summarize: ..." --compare

    from cacheback import CachebackConfig, generate          # as a library
    gen = generate(model, prompt_ids, 128, eos_ids, CachebackConfig.cpu())

Where this file differs from the published reference code (TUTORIAL.md §3): accepted tokens keep their KV
(compaction) instead of being fed again, shared prefixes are merged so no token is verified twice,
speculative lookups inside the tree do not refresh recency, and the frozen table fills only the budget the
dynamic tree leaves. On a CPU the defaults differ from the paper's (CachebackConfig.cpu: LL = 2, TDL = 16,
no frozen table, cost-aware pruning; measured in TUTORIAL.md §3.5).

Greedy and float32: the output is identical to model.generate(do_sample=False), except at exact ties within
rounding (see verify.py); measured on every prompt we run (tests/test_cacheback.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

import verify
from verify import Generation, Tree

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")  # section 7's corpora
FROZEN_CORPORA = ("stdlib", "selfchat")


# ----------------------------------------------------------------------------------------------------------
# 0. Configuration (§3, §4)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class CachebackConfig:
    """The paper's parameters under its names, plus the two choices this file adds.

    >>> cfg = CachebackConfig.cpu()
    >>> (cfg.ll, cfg.tdl, cfg.crt, cfg.frozen, cfg.prune)
    (2, 16, 4, 'none', 'cost')
    """

    ll: int = 1  # LL, leader length: the tokens a lookup is keyed by
    fl: int = 3  # FL, follower length: the tokens of one continuation (one tree branch)
    lc: int = 2**20  # LC, leader capacity of a table (LRU)
    fc: int = 128  # FC, follower capacity per leader (LRU)
    tdl: int = 96  # TDL, total draft length: tree tokens not yet in the KV cache, root included
    crt: int = 16  # CRT, chaining-reserved tokens: TDL budget kept for tree levels 2 and deeper
    frozen: str = "none"  # the frozen table (§3.3): 'none', 'stdlib', 'selfchat' (section 7) or a file
    prune: str = "none"  # 'none' verifies whole trees (the paper); 'cost' = our pruning pass (section 4)
    dynamic_table: bool = True  # False leaves the dynamic table empty: Table 1's "only frozen" row

    @classmethod
    def paper(cls) -> "CachebackConfig":
        """§4's values, whole trees, and a frozen table. The paper's corpus (1% of OpenWebText) is not
        available offline; 'selfchat' is our stand-in with the most accepted tokens (TUTORIAL.md §3.5)."""
        return cls(frozen="selfchat")

    @classmethod
    def cpu(cls) -> "CachebackConfig":
        """Measured on the tuning half of the shipped prompts (TUTORIAL.md §3.5): a verification forward is
        far from free on a CPU, so a small tree, cost pruning, a longer leader and no frozen table."""
        return cls(ll=2, tdl=16, crt=4, frozen="none", prune="cost")

    @classmethod
    def for_device(cls, device) -> "CachebackConfig":
        """The paper's configuration on CUDA, the measured one elsewhere. note: 'selfchat' needs corpus/
        beside this file; someone who copied only cacheback.py and verify.py gets 'stdlib' instead."""
        if torch.device(device).type != "cuda":
            return cls.cpu()
        return cls.paper() if os.path.isdir(CORPUS_DIR) else cls(frozen="stdlib")

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value."""
        for name in ("ll", "fl", "lc", "fc"):
            if getattr(self, name) < 1:
                raise verify.UserError(f"--{name} must be at least 1 (got {getattr(self, name)})")
        if self.tdl < 1 or not 0 <= self.crt < self.tdl:
            raise verify.UserError(f"need TDL >= 1 and 0 <= CRT < TDL (got TDL {self.tdl}, CRT {self.crt})")
        if self.prune not in ("cost", "none"):
            raise verify.UserError(f"--prune must be cost or none (got {self.prune!r})")
        if self.frozen not in ("none", *FROZEN_CORPORA) and not os.path.isfile(self.frozen):
            raise verify.UserError(f"--frozen {self.frozen}: expected none, {', '.join(FROZEN_CORPORA)} "
                                   "or a table file")


# ----------------------------------------------------------------------------------------------------------
# 1. The cache table (§3.1)
# ----------------------------------------------------------------------------------------------------------
#
#   leaders (LRU over at most LC leaders)          followers (one LRU per leader, at most FC each)
#   ('the',)  -> [('cat','sat','on'), ('dog','ran','to'), ...]     oldest ... most recent
#   ('cat',)  -> [('sat','down','.')]
#
# Both levels are OrderedDicts with the most recently used entry at the END, so that
#   - "refresh" = move_to_end          O(1)
#   - "evict the LRU entry" = popitem(last=False)   O(1)
#   - lookup = a hash lookup           O(1)
# which is exactly the "hash map + doubly linked list" of §3.1 (an OrderedDict is that).
#
# The recency rules of §3.1, one by one:
#   - insert(l, f) creates leader l (evicting the LRU leader AND its followers if LC leaders exist), or
#     refreshes l; then appends follower f (evicting l's LRU follower if it has FC), or refreshes f.
#   - query(l) refreshes l. It never refreshes a follower: "the table updates a follower's recency only
#     upon insertion", and a follower competes only with the followers of the same leader.


class CacheTable:
    def __init__(self, ll: int, fl: int, lc: int, fc: int, frozen: bool = False):
        assert ll >= 1 and fl >= 1 and lc >= 1 and fc >= 1
        self.ll, self.fl, self.lc, self.fc = ll, fl, lc, fc
        self.frozen = frozen  # a frozen table is filled once (by its builder) and then only queried
        self.leaders: OrderedDict[tuple, OrderedDict[tuple, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.leaders)

    def insert(self, leader: tuple, follower: tuple) -> None:
        if self.frozen:
            raise RuntimeError("the frozen table is read-only during decoding (§3.3)")
        assert len(leader) == self.ll and len(follower) == self.fl
        followers = self.leaders.get(leader)
        if followers is None:
            if len(self.leaders) >= self.lc:
                self.leaders.popitem(last=False)  # evict the LRU leader, together with its followers
            followers = self.leaders[leader] = OrderedDict()
        else:
            self.leaders.move_to_end(leader)  # insertion refreshes the leader
        if follower in followers:
            followers.move_to_end(follower)  # re-insertion refreshes the follower
        else:
            if len(followers) >= self.fc:
                followers.popitem(last=False)  # evict this leader's LRU follower
            followers[follower] = None

    def query(self, leader: tuple, refresh: bool = True) -> Iterator[tuple]:
        """The followers of `leader`, MOST recent first (those are drafted first). Empty if absent.
        refresh=False looks without touching recency (see `grow_tree` for when we do that)."""
        followers = self.leaders.get(leader)
        if not followers:
            return iter(())
        if refresh and not self.frozen:
            self.leaders.move_to_end(leader)  # querying refreshes the leader
        return reversed(followers)  # a view: O(1) to create, yields lazily


# ----------------------------------------------------------------------------------------------------------
# 2. Dual tables: the dynamic table learns from the text, the frozen one is read-only (§3.3)
# ----------------------------------------------------------------------------------------------------------
#
# The dynamic table sees every window of LL + FL consecutive tokens of the text: the leader is its first
# LL tokens, the follower the last FL. At the start it is filled by sliding the window over the whole
# prompt (chat template included); after each step exactly the NEW windows are inserted -- those that end
# at a newly emitted token (accepted drafts and the bonus token):
#
#   LL=1, FL=2, text so far "At dawn the fox", the step emits "ran fast":
#       new windows ending at "ran":  (the,) -> (fox, ran)
#       new windows ending at "fast": (fox,) -> (ran, fast)


def windows(tokens: Sequence[int], ll: int, fl: int, first_end: int = 0) -> Iterator[tuple[tuple, tuple]]:
    """(leader, follower) for every window of ll + fl tokens whose LAST token has index >= first_end."""
    n = ll + fl
    for end in range(max(first_end, n - 1), len(tokens)):
        window = tuple(tokens[end - n + 1 : end + 1])
        yield window[:ll], window[ll:]


def update_table(table: CacheTable, tokens: Sequence[int], first_new: int) -> None:
    """Insert the windows that end at tokens[first_new:], i.e. at the tokens emitted by the last step."""
    for leader, follower in windows(tokens, table.ll, table.fl, first_new):
        table.insert(leader, follower)


# ----------------------------------------------------------------------------------------------------------
# 3. The draft tree (§3.2): breadth-first growth under TDL and CRT
# ----------------------------------------------------------------------------------------------------------
#
# TDL (total draft length) bounds the tree: draft tokens + tokens not yet in the KV cache <= TDL. With KV
# compaction only the root (the last emitted token) is not cached, so the tree gets TDL - 1 draft tokens.
# (The reference code feeds the accepted tokens again each step; they count against TDL there.)
#
# CRT (chaining-reserved tokens) keeps the first level from eating the whole budget: level 1 (the followers
# of the real context) may use TDL - 1 - CRT tokens; the CRT reserved ones are for level 2 and deeper,
# where each leaf is extended by the followers of ITS last LL tokens (the tree "chains").
#
# Each follower becomes a branch of FL tokens below its parent. Branches are merged into a trie (verify.Tree):
# a follower that repeats a prefix already in the tree only costs its new tokens.
#
#   LL=2, FL=2, context "... the fox", TDL=8, CRT=2:
#     level 1: query (the, fox) -> (ran, fast) (hid, deep) (sat, still)   6 tokens > 8-1-2 = 5 allowed:
#              take (ran, fast), (hid, deep)                              4 tokens
#     level 2: leaf "fast": query (ran, fast) -> (and, far) ...           2 more: 6 <= 7 tokens
#     level 2: leaf "deep": query (hid, deep) -> nothing (or no budget left)
#
# Queries: the dynamic table first, then the frozen one "to further grow the tree if TDL still allows": the
# whole dynamic tree is grown first, then the frozen table's followers are hung into it breadth first while
# budget is left. A follower found in both is added once. A leaf whose leader is in neither table stays a
# leaf (no backoff).
#
# Design choice (ours): only the level-1 query, made with the real, verified context, refreshes the
# leader's recency. Deeper queries are made with *speculative* tokens that may never
# appear in the text; letting them promote leaders would let guesses evict what the text actually
# contained. The reference code refreshes on every lookup.


@dataclass
class DraftTree(Tree):
    """A verify.Tree that also remembers where each node's token came from: origins[i] = (table, rank, pos,
    fanout) -- the table (0 dynamic, 1 frozen), the follower's rank in that table's answer (0 = most recent;
    3 = 4th or later), the node's position inside its follower, and how many followers its leader had (0:
    one, 1: 2-3, 2: more). The growth below does not read them; section 4's pruning learns from them."""

    origins: list = field(default_factory=list)  # None for the root

    @classmethod
    def root_only(cls, root_token: int) -> "DraftTree":
        tree = super().root_only(root_token)
        tree.origins.append(None)
        return tree

    def add_follower(self, parent: int, follower: Sequence[int], table: int, rank: int, fanout: int) -> list[int]:
        """Hang a follower below `parent` (merged into the trie); returns its node indices."""
        nodes = self.add_branch(follower, parent=parent)
        for pos, n in enumerate(nodes):
            if n == len(self.origins):  # a new node (a shared prefix keeps the origin it was created with)
                self.origins.append((table, min(rank, 3), pos, fanout))
        return nodes

    def subtree(self, keep) -> "DraftTree":
        """A copy with the nodes for which keep(i) is true (a kept node's parent must be kept too)."""
        out = DraftTree.root_only(self.tokens[0])
        remap = {0: 0}
        for i in range(1, len(self)):
            if keep(i):
                remap[i] = out.add(remap[self.parents[i]], self.tokens[i])
                out.origins.append(self.origins[i])
        return out


def grow_tree(root: int, context: Sequence[int], dynamic: CacheTable, frozen: CacheTable | None, tdl: int,
              crt: int) -> DraftTree:
    """Build the draft tree for one step. `context` = the text so far, ending with `root` (the pending
    token). Returns a DraftTree whose node 0 is `root`."""
    ll = dynamic.ll
    tree = DraftTree.root_only(root)
    budget = tdl - 1  # draft tokens; the root is the one token not yet in the KV cache
    # Pass 1 grows the tree from the dynamic table alone; pass 2 walks it again, breadth first, with both
    # tables: the dynamic followers are already there (they merge for free), the frozen ones fill what
    # budget is left. (One pass with both tables would let frozen followers at level 1 take the budget
    # that the dynamic table's deeper levels -- the text's own continuations -- should get.)
    passes = [[dynamic]] + ([[dynamic, frozen]] if frozen is not None else [])
    for n_pass, tables in enumerate(passes):
        # Level 1 may not use the CRT reserved tokens. subtle: the check below counts the WHOLE tree, so in
        # pass 2 the limit must not be below what pass 1 already grew (all levels): else the first existing
        # dynamic follower (0 new tokens) would already "not fit", and the frozen table could never add
        # anything once the dynamic tree holds more than TDL-1-CRT tokens, against §3.3's "then the frozen
        # one to further grow the tree if TDL still allows".
        limit = max(budget - crt, len(tree) - 1)
        # The leaves to extend, each with the last LL tokens of its root-to-leaf text (its leader).
        frontier = [(0, tuple(context[-ll:]))] if len(context) >= ll else []
        level = 1
        while frontier:
            next_frontier: dict[int, tuple] = {}  # follower-end node -> its leader (dict: each node once)
            for node, leader in frontier:
                _add_followers(tree, node, leader, tables, limit, refresh=(level == 1 and n_pass == 0),
                               out=next_frontier)
            if level == 1:
                limit = budget  # from level 2 on, the reserved CRT tokens are available too
            frontier = list(next_frontier.items())
            if len(tree) - 1 >= budget:
                return tree
            level += 1
    return tree


def _add_followers(tree: DraftTree, node: int, leader: tuple, tables: list[CacheTable], limit: int,
                   refresh: bool, out: dict[int, tuple]) -> None:
    """Hang the followers of `leader` below `node`: the dynamic table's first, then the frozen table's, each
    follower once, until one does not fit in `limit` draft tokens. Records each new branch end in `out`."""
    ll = tables[0].ll
    seen = set()
    for source, table in enumerate(tables):
        fanout = len(table.leaders.get(leader, ()))  # how many continuations this leader has been seen with
        fanout = 0 if fanout <= 1 else 1 if fanout <= 3 else 2
        for rank, follower in enumerate(table.query(leader, refresh=refresh)):
            if follower in seen:
                continue  # in both tables: add once
            seen.add(follower)
            if len(tree) - 1 + _new_tokens(tree, node, follower) > limit:
                return  # this follower does not fit: stop querying this leader (frozen table included)
            nodes = tree.add_follower(node, follower, source, rank, fanout)
            out.setdefault(nodes[-1], (leader + follower)[-ll:])  # the last LL tokens of its text


def _new_tokens(tree: Tree, node: int, follower: Sequence[int]) -> int:
    """How many nodes adding `follower` below `node` would create (the rest is a shared prefix)."""
    for i, t in enumerate(follower):
        child = tree.children[node].get(int(t))
        if child is None:
            return len(follower) - i
        node = child
    return 0



# ----------------------------------------------------------------------------------------------------------
# 4. Cost-aware pruning: a separate pass after the tree is built (our deviation, for CPUs)
# ----------------------------------------------------------------------------------------------------------
#
# The paper verifies the whole tree every step: on a GPU a 96-token forward costs about what a 1-token one
# does. On a 2-core CPU it does not (TUTORIAL.md §1.1): with the default model t(2) ~ 1.65 t(1), t(16) ~
# 2.2 t(1), t(96) ~ 5.4 t(1). A tree that is mostly rejected then makes the step slower than plain decoding.
# So before verifying we keep only the part of the tree that is worth its cost -- the per-step rule of
# ngram_predictor.py's cost gate, applied per node:
#
#   q(o)    = P(node accepted | its parent accepted), learned online for each origin o = (table, rank, pos,
#             fanout) (DraftTree.origins): a leader seen with one follower so far is a far safer bet than
#             one with twenty
#   P(node) = P(parent) * q(origin(node)),   P(root) = 1    (the probability that the node is on the
#                                                            accepted path: the tree's branches are
#                                                            mutually exclusive, so)
#   E[tokens of the step] = 1 + sum over kept draft nodes of P(node)
#
# Keep the k nodes with the highest P (a subtree: a child's P never exceeds its parent's), with k chosen to
# maximise  E[tokens] / cost(1 + k)  over k = 0 .. N-1, where cost(n) = t(n)/t(1) is measured at start-up
# (verify.measure_cost_curve). k = 0 is a plain one-token step: 1 token for 1 unit of cost.
#
#   q: dynamic rank 0 pos 0 = 0.5, pos 1 = 0.8;  cost(1)=1, cost(2)=1.65, cost(3)=1.7
#   tree  root -> a (P .5) -> b (P .4):  k=0: 1/1 = 1.00   k=1: 1.5/1.65 = 0.91   k=2: 1.9/1.7 = 1.12  -> keep both
#
# subtle: as in the n-gram gate the prior must be optimistic (q = 3/4 until measured): a node that is never
# verified teaches nothing, so a pessimistic prior would prune every tree forever.


class CostPruner:
    def __init__(self, cost: dict[int, float], prior_hits: float = 0.75, prior_trials: float = 1.0):
        self.sizes = sorted(cost)  # measured sizes, 1 first
        self.cost = cost  # {n: t(n)/t(1)}
        self.prior = (prior_hits, prior_trials)
        self.hits: dict[tuple, float] = {}
        self.trials: dict[tuple, float] = {}

    def q(self, origin: tuple) -> float:
        """P(node accepted | parent accepted) for nodes of this origin: hits / trials, with the prior."""
        return (self.hits.get(origin, 0) + self.prior[0]) / (self.trials.get(origin, 0) + self.prior[1])

    def cost_of(self, n: int) -> float:
        """cost(n) = t(n)/t(1), linearly interpolated between the measured sizes (extrapolated past them)."""
        xs = self.sizes
        if n in self.cost:
            return self.cost[n]
        lo = max([x for x in xs if x < n], default=xs[0])
        hi = min([x for x in xs if x > n], default=None)
        if hi is None:  # past the last measured size: continue the last segment's slope
            lo, hi = xs[-2], xs[-1]
        return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (n - lo) / (hi - lo)

    def node_probs(self, tree: DraftTree) -> list[float]:
        """P(node) = P(parent) * q(origin(node)), P(root) = 1."""
        p = [1.0]
        for i in range(1, len(tree)):  # parents come before children
            p.append(p[tree.parents[i]] * self.q(tree.origins[i]))
        return p

    def choose(self, tree: DraftTree) -> set[int]:
        """The nodes to verify, root included: the k most probable, k maximising E[tokens] / cost(1 + k)."""
        p = self.node_probs(tree)
        order = sorted(range(1, len(tree)), key=lambda i: (-p[i], i))  # parent before child on ties
        best_k, best_rate, e = 0, 1.0, 1.0  # k = 0: a plain step, 1 token for 1 unit of cost
        for k, i in enumerate(order, start=1):
            e += p[i]  # E[tokens] with the k most probable nodes
            rate = e / self.cost_of(1 + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return {0, *order[:best_k]}

    def update(self, tree: DraftTree, path: Sequence[int]) -> None:
        """Every verified node whose parent was accepted is one trial of its origin; a hit if it was accepted
        too. (Nodes below a rejected node were never really tested.)"""
        on_path = set(path)
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:
                o = tree.origins[i]
                self.trials[o] = self.trials.get(o, 0) + 1
                self.hits[o] = self.hits.get(o, 0) + (i in on_path)


def prune(tree: DraftTree, pruner: CostPruner) -> DraftTree:
    """The pruning pass: the part of the tree worth verifying on this device."""
    if len(tree) == 1:
        return tree
    return tree.subtree(pruner.choose(tree).__contains__)


# ----------------------------------------------------------------------------------------------------------
# 5. The decode loop
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], cfg: CachebackConfig,
             *, frozen_table: CacheTable | None = None, cost: dict[int, float] | None = None,
             sampling: verify.Sampling = verify.GREEDY, on_emit=None, on_step=None) -> Generation:
    """Cacheback decoding. A fresh dynamic table per call (stateful methods start from scratch for every
    prompt, as in the paper's SpecBench runs). frozen_table: the table cfg.frozen names (`frozen_table_for`
    builds or loads it; `prepare` does both once per process); it is shared and never modified. cost: the
    measured curve {n: t(n)/t(1)} for cfg.prune == 'cost', measured now if not given. `sampling`: greedy by
    default; sampled, the output is exactly the plain sampler's for the same seed (verify.py section 4b)."""
    cfg.check()
    if cfg.frozen != "none" and frozen_table is None:
        raise verify.UserError(f"cfg.frozen = {cfg.frozen!r}: pass frozen_table=frozen_table_for(tok, cfg, model)")
    if frozen_table is not None and (frozen_table.ll, frozen_table.fl) != (cfg.ll, cfg.fl):
        raise verify.UserError(f"frozen table has LL={frozen_table.ll}, FL={frozen_table.fl}; "
                               f"this run uses LL={cfg.ll}, FL={cfg.fl}")
    pruner = None
    if cfg.prune == "cost":
        pruner = CostPruner(cost if cost is not None else measure_cost(model, cfg.tdl))
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step)
    gen.extra.update(grown=0, pruned=0)  # draft tokens grown / removed by the pruning, over all steps
    dynamic = CacheTable(cfg.ll, cfg.fl, cfg.lc, cfg.fc)
    learn = update_table if cfg.dynamic_table else (lambda *a: None)
    text = list(prompt_ids)  # prompt + emitted tokens: the context the tables are queried with
    learn(dynamic, text, 0)  # §3.3: initialise the dynamic table with a sliding window over the prompt

    # the cache's capacity: prompt + output + the largest step (the root and up to TDL tree tokens)
    cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + cfg.tdl + 1)
    pending = verify.first_token(verify.prefill(model, cache, prompt_ids), len(prompt_ids), sampling)
    text.append(pending)
    learn(dynamic, text, len(text) - 1)
    if gen.finish_prefill(pending):
        return gen

    while True:
        # -- DRAFT (§3.2): a tree below the pending token, at most TDL tokens including it
        t0 = time.perf_counter()
        tree = grow_tree(pending, text, dynamic, frozen_table, cfg.tdl, cfg.crt)
        grown = len(tree) - 1
        room = max_new_tokens - len(gen.tokens)  # a step emits at most depth + 1 tokens; deeper is wasted
        if max(tree.depths) >= room:
            depths = tree.depths
            tree = tree.subtree(lambda i: depths[i] < room)
        if pruner is not None:  # our deviation (section 4): keep what is worth its cost on this device
            tree = prune(tree, pruner)
        gen.extra["grown"] += grown
        gen.extra["pruned"] += grown - (len(tree) - 1)
        draft_s = time.perf_counter() - t0

        # -- VERIFY with tree attention, ACCEPT the longest agreeing branch + bonus, COMPACT the KV
        prefix_len = verify.cache_len(cache)
        logits = verify.tree_forward(model, cache, tree)  # [N, V]
        path, bonus = verify.accept(tree, logits, prefix_len, sampling)
        verify.compact_kv(cache, prefix_len, path)
        if pruner is not None:
            pruner.update(tree, path)

        n_before = len(gen.tokens)
        done = gen.finish_step(tree, path, bonus, draft_s)
        # -- UPDATE the dynamic table with the windows ending at the newly emitted tokens (§3.2)
        first_new = len(text)
        text += gen.tokens[n_before:]
        learn(dynamic, text, first_new)
        if done:
            return gen
        pending = bonus


def measure_cost(model, tdl: int) -> dict[int, float]:
    """The pruning's cost curve: t(n)/t(1) at powers of two up to TDL (a few seconds on a CPU)."""
    sizes = sorted({min(2**i, tdl) for i in range(tdl.bit_length() + 1)} | {tdl})
    return verify.measure_cost_curve(model, sizes, repeats=3)


# ----------------------------------------------------------------------------------------------------------
# 6. CLI
# ----------------------------------------------------------------------------------------------------------


def prepare(model, tok, cfg: CachebackConfig, name: str = verify.DEFAULT_MODEL) -> tuple[CachebackConfig, dict]:
    """Once per process, before timing: the frozen table cfg.frozen names and the pruning's cost curve.
    `name` (the --model given) identifies the model's shipped or cached selfchat answers."""
    extra = {}
    if cfg.frozen != "none":
        extra["frozen_table"] = frozen_table_for(tok, cfg, model, name)
    if cfg.prune == "cost":
        extra["cost"] = measure_cost(model, cfg.tdl)
    return cfg, extra


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build-frozen"]:
        return build_frozen_main(argv[1:])
    about = __doc__.split("\n\n")[0].strip()
    parser = verify.common_parser(about + "\n\nAlso: python cacheback.py build-frozen --out FILE")
    def default(name):
        return verify.defaults_help(CachebackConfig, name)

    g = parser.add_argument_group("Cacheback (the paper's names; CUDA defaults: §4's; CPU: TUTORIAL.md §3.5)")
    g.add_argument("--ll", type=int, help="LL, leader length: tokens a lookup is keyed by" + default("ll"))
    g.add_argument("--fl", type=int, help="FL, follower length: tokens per follower / tree branch" + default("fl"))
    g.add_argument("--lc", type=int, help="LC, leader capacity of a table" + default("lc"))
    g.add_argument("--fc", type=int, help="FC, follower capacity per leader" + default("fc"))
    g.add_argument("--tdl", type=int,
                   help="TDL, total draft length: tree tokens not in the KV cache" + default("tdl"))
    g.add_argument("--crt", type=int,
                   help="CRT, chaining-reserved tokens: TDL kept for tree levels 2+" + default("crt"))
    g.add_argument("--frozen",
                   help="frozen table (§3.3): none, stdlib, selfchat, or a build-frozen file" + default("frozen"))
    g.add_argument("--prune", choices=["cost", "none"],
                   help="ours: cost = verify only what is worth its measured cost" + default("prune"))
    config = lambda args, device: verify.config_from_args(CachebackConfig.for_device(device), args)
    return verify.run_cli(parser, "cacheback", generate, config, prepare, argv=argv)


# ----------------------------------------------------------------------------------------------------------
# 7. The frozen table: built offline from a corpus (§3.3, §4)
# ----------------------------------------------------------------------------------------------------------
#
# §4: "The building procedure first picks the most frequent LC n-grams of length LL as the leaders in the
# table. Then, for each leader, it selects the most frequent FC n-grams of length FL that appear after the
# leader." The paper samples 1% of OpenWebText. Nothing like that is available offline here, so the corpus
# is one every Python install carries: the standard library's own source (English docstrings and comments,
# the reference-manual text in pydoc_data/topics.py, and code), under the PSF licence. Files are sampled in a
# seeded order until `max_tokens`, so a build is deterministic. Ties in the counts are broken by token ids.
#
# File format: gzipped JSON, no pickled classes --
#   {"format": "cacheback-frozen/1", "tokenizer": {"vocab_size": V, "vocab_sha1": "..."}, "ll", "fl", "lc",
#    "fc", "corpus", "seed", "tokens", "leaders": [[leader, [follower, ...]], ...]}
# leaders and followers as lists of token ids, followers least frequent first, so that loading them with
# insert() leaves the most frequent one as the most recent, i.e. drafted first (as the reference does).

FROZEN_FORMAT = "cacheback-frozen/1"


def tokenizer_identity(tok) -> dict:
    """What must match between the tokenizer that built a frozen table and the one that uses it."""
    import hashlib
    import json

    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    return {"vocab_size": len(tok.get_vocab()), "vocab_sha1": hashlib.sha1(vocab).hexdigest()}


def stdlib_corpus(seed: int) -> list[str]:
    """The standard library's .py files (tests and site-packages excluded), in a seeded random order."""
    import glob
    import os
    import random
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files = sorted(
        f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        if not any(part in f for part in ("site-packages", os.sep + "test", "idlelib"))
    )
    random.Random(seed).shuffle(files)
    return files


def build_frozen(tok, ll: int, fl: int, lc: int, fc: int, max_tokens: int = 2_000_000, seed: int = 0,
                 progress: bool = True, sequences=None, corpus: str = "python-stdlib") -> tuple[CacheTable, dict]:
    """Count leaders and their followers over the corpus; keep the top LC leaders and their top FC followers.

    The corpus is `sequences` (token-id lists; `selfchat_sequences` gives the model's own answers) or, by
    default, the Python standard library's source, tokenized with `tok`, up to max_tokens tokens."""
    from collections import Counter, defaultdict

    from tqdm import tqdm

    leader_counts: Counter = Counter()
    follower_counts: dict[tuple, Counter] = defaultdict(Counter)
    used = 0
    if sequences is None:
        def read(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return tok(f.read(), add_special_tokens=False).input_ids

        sequences = (read(path) for path in stdlib_corpus(seed))
    bar = tqdm(total=max_tokens, desc="frozen table: counting n-grams", unit="tok", disable=not progress, file=sys.stderr)
    for ids in sequences:
        ids = list(ids)[: max_tokens - used]
        for leader, follower in windows(ids, ll, fl):
            leader_counts[leader] += 1
            follower_counts[leader][follower] += 1
        used += len(ids)
        bar.update(len(ids))
        if used >= max_tokens:
            break
    bar.close()

    table = CacheTable(ll, fl, lc, fc)
    # the top-LC leaders, least frequent inserted first (so the most frequent ends most recent)
    top = sorted(leader_counts, key=lambda l: (-leader_counts[l], l))[:lc]
    for leader in reversed(top):
        best = sorted(follower_counts[leader].items(), key=lambda kv: (-kv[1], kv[0]))[:fc]
        for follower, _ in reversed(best):
            table.insert(leader, follower)
    table.frozen = True
    meta = {"corpus": corpus, "seed": seed, "tokens": used}
    return table, meta


# A second corpus, for chat text: the target model's OWN greedy answers to a shipped instruction set
# (corpus/instructions.jsonl, 247 instructions written for this project, disjoint from the benchmark
# prompts). Still training-free: nothing is learned, the table caches the model's habitual phrasing ("Here
# are some tips for", "In summary,", the chat template's own tokens), which the Python source cannot.
# The answers of the default model are shipped (corpus/selfchat-<model>.jsonl); for another model they are
# generated once (batched greedy, a few minutes on a CPU) and cached.

INSTRUCTIONS = os.path.join(CORPUS_DIR, "instructions.jsonl")
SELFCHAT_TOKENS = 192  # answer length: most answers of the default model end before it


def selfchat_answers(model, tok, model_name: str, progress: bool = True, batch: int = 16) -> list[dict]:
    """[{id, instruction, answer}]: the model's greedy answers, from the shipped file if it is this model's,
    else generated now and cached. Deterministic: greedy decoding of fixed batches in a fixed order."""
    import json

    from tqdm import tqdm

    safe = os.path.basename(str(model_name).rstrip("/")).replace(os.sep, "_")
    shipped = os.path.join(CORPUS_DIR, f"selfchat-{safe}.jsonl")
    cached = os.path.join(verify.cache_root(), f"selfchat-{safe}.jsonl")
    for path in (shipped, cached):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f]
    if not os.path.exists(INSTRUCTIONS):
        raise verify.UserError(f"--frozen selfchat: {INSTRUCTIONS} is missing (copy the corpus/ folder beside "
                               "cacheback.py, or use --frozen stdlib)")
    with open(INSTRUCTIONS, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    eos = verify.eos_ids_of(model, tok)
    side, tok.padding_side = tok.padding_side, "left"  # batched decoding pads on the left
    out = []
    try:
        for i in tqdm(range(0, len(rows), batch), desc="selfchat: the model answers", unit="batch",
                      disable=not progress, file=sys.stderr):
            texts = [tok.apply_chat_template([{"role": "user", "content": r["instruction"]}],
                                             add_generation_prompt=True, tokenize=False) for r in rows[i : i + batch]]
            enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(model.device)
            with torch.no_grad():
                ids = model.generate(**enc, do_sample=False, max_new_tokens=SELFCHAT_TOKENS, eos_token_id=eos,
                                     pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
            for r, row in zip(rows[i : i + batch], ids[:, enc.input_ids.shape[1] :].tolist()):
                out.append({**r, "answer": tok.decode(row, skip_special_tokens=True)})
    finally:
        tok.padding_side = side
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with open(cached, "w", encoding="utf-8") as f:
        for r in out:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return out


def selfchat_sequences(tok, answers: list[dict]) -> list[list[int]]:
    """Each instruction in the chat template, followed by the model's answer: token ids as the model sees them."""
    return [verify.encode_prompt(tok, r["instruction"]) + tok(r["answer"], add_special_tokens=False).input_ids
            for r in answers]


def save_frozen(table: CacheTable, path: str, tok, meta: dict) -> None:
    import gzip
    import json

    doc = {"format": FROZEN_FORMAT, "tokenizer": tokenizer_identity(tok), "ll": table.ll, "fl": table.fl,
           "lc": table.lc, "fc": table.fc, **meta,
           "leaders": [[list(l), [list(f) for f in fs]] for l, fs in table.leaders.items()]}
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))


def load_frozen(path: str, tok, ll: int, fl: int) -> CacheTable:
    """Load a frozen table, refusing one built for another tokenizer or another LL/FL."""
    import gzip
    import json

    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise verify.UserError(f"--frozen {path}: not a frozen table ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FROZEN_FORMAT:
        raise verify.UserError(f"--frozen {path}: unknown format (expected {FROZEN_FORMAT})")
    if doc["tokenizer"] != tokenizer_identity(tok):
        raise verify.UserError(f"--frozen {path}: built with a different tokenizer than this model's")
    if (doc["ll"], doc["fl"]) != (ll, fl):
        raise verify.UserError(f"--frozen {path}: built with LL={doc['ll']}, FL={doc['fl']}; this run uses LL={ll}, FL={fl}")
    table = CacheTable(ll, fl, doc["lc"], doc["fc"])
    for leader, followers in doc["leaders"]:
        for follower in followers:
            table.insert(tuple(leader), tuple(follower))
    table.frozen = True
    return table


def build_corpus_table(tok, corpus: str, ll: int, fl: int, lc: int, fc: int, model=None,
                       model_name: str = verify.DEFAULT_MODEL, max_tokens: int = 2_000_000, seed: int = 0):
    """build_frozen over one of FROZEN_CORPORA: (table, meta). selfchat needs the model for its answers
    unless they are shipped or cached."""
    if corpus == "selfchat":
        seqs = selfchat_sequences(tok, selfchat_answers(model, tok, model_name))
        return build_frozen(tok, ll, fl, lc, fc, max_tokens=max_tokens, sequences=seqs, corpus="selfchat")
    return build_frozen(tok, ll, fl, lc, fc, max_tokens=max_tokens, seed=seed)


def frozen_table_for(tok, cfg: CachebackConfig, model=None, model_name: str = verify.DEFAULT_MODEL) -> CacheTable:
    """The frozen table cfg.frozen names, for cfg.ll / cfg.fl: a file from `build-frozen`, or one of the
    corpora, built once and cached beside the converted model: 'stdlib' = the Python standard library's
    source (~25 s), 'selfchat' = the model's own answers to the shipped instructions (needs `model`; seconds
    with the shipped answers, minutes to generate them)."""
    corpus, ll, fl, lc, fc = cfg.frozen, cfg.ll, cfg.fl, cfg.lc, cfg.fc
    if corpus not in FROZEN_CORPORA:
        if not os.path.isfile(corpus):
            raise verify.UserError(f"--frozen {corpus}: expected none, {', '.join(FROZEN_CORPORA)} or a table file")
        return load_frozen(corpus, tok, ll, fl)
    ident = tokenizer_identity(tok)["vocab_sha1"][:10]
    if corpus == "selfchat":  # the answers are this model's: the key names it
        ident += "-" + os.path.basename(str(model_name).rstrip("/"))
    path = os.path.join(verify.cache_root(), f"cacheback-frozen-{corpus}-{ident}-ll{ll}-fl{fl}-lc{lc}-fc{fc}.json.gz")
    if not os.path.exists(path):
        table, meta = build_corpus_table(tok, corpus, ll, fl, lc, fc, model=model, model_name=model_name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_frozen(table, tmp, tok, meta)
        os.replace(tmp, path)
    return load_frozen(path, tok, ll, fl)


def build_frozen_main(argv) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="cacheback.py build-frozen",
                                description="Build a frozen Cacheback table (§3.3, §4): from the Python standard "
                                            "library's source (--corpus stdlib) or from the model's own greedy answers "
                                            "to corpus/instructions.jsonl (--corpus selfchat).")
    p.add_argument("--out", required=True, help="output file (.json.gz)")
    p.add_argument("--corpus", default="stdlib", choices=list(FROZEN_CORPORA),
                   help="stdlib = Python source; selfchat = the model's answers (shipped for the default model, "
                        "else generated: minutes on a CPU). Default: stdlib")
    p.add_argument("--model", default=verify.DEFAULT_MODEL, help="whose tokenizer (and, for selfchat, answers) to use")
    d = CachebackConfig.paper()
    p.add_argument("--ll", type=int, default=d.ll, help=f"LL, leader length (default: {d.ll})")
    p.add_argument("--fl", type=int, default=d.fl, help=f"FL, follower length (default: {d.fl})")
    p.add_argument("--lc", type=int, default=d.lc, help=f"LC: keep the LC most frequent leaders (default: {d.lc})")
    p.add_argument("--fc", type=int, default=d.fc, help=f"FC: keep each leader's FC most frequent followers (default: {d.fc})")
    p.add_argument("--max-tokens", type=int, default=2_000_000, help="corpus size in tokens (default: 2,000,000)")
    p.add_argument("--seed", type=int, default=0, help="stdlib: order in which corpus files are sampled (default: 0)")
    args = p.parse_args(argv)
    try:
        if min(args.ll, args.fl, args.lc, args.fc, args.max_tokens) < 1:
            raise verify.UserError("--ll, --fl, --lc, --fc and --max-tokens must be positive")
        t0 = time.perf_counter()
        if args.corpus == "selfchat":  # the model itself writes this corpus
            model, tok = verify.load_model(args.model)
        else:
            from transformers import AutoTokenizer

            model, tok = None, AutoTokenizer.from_pretrained(verify.resolve_model(args.model))
        table, meta = build_corpus_table(tok, args.corpus, args.ll, args.fl, args.lc, args.fc, model=model,
                                         model_name=args.model, max_tokens=args.max_tokens, seed=args.seed)
        save_frozen(table, args.out, tok, meta)
    except verify.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    n = sum(len(f) for f in table.leaders.values())
    print(f"wrote {args.out}: {len(table)} leaders, {n} followers from {meta['tokens']} tokens ({meta['corpus']}) in "
          f"{time.perf_counter() - t0:.1f} s, {os.path.getsize(args.out) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
