# SPDX-License-Identifier: MIT
"""
cacheback.py -- Cacheback decoding: speculative decoding with nothing but LRU tables of token
n-grams. Zhiyao Ma, In Gim & Lin Zhong, "Cacheback: Speculative Decoding With Nothing But Cache",
EMNLP 2025, arXiv:2511.21699.

    DRAFT   query an LRU table  leader (last LL tokens) -> followers (FL-token continuations seen after it),
            recursively, breadth first, into a draft TREE of at most TDL tokens          (§3.1, §3.2)
    VERIFY  one forward with tree attention (verify.py)                                 (§3.2)
    ACCEPT  the longest branch the model agrees with, plus the bonus token
    UPDATE  slide a window of LL + FL tokens over the newly accepted tokens into the dynamic table (§3.2)

The paper, section by section, and where it is here (this file's sections in brackets):

    §3, §4          LL, FL, LC, FC, TDL, CRT           CachebackConfig                         [0]
    §3.1            the two-level LRU table            CacheTable: insert, query               [1]
    §3.2, §3.3      dual tables, dynamic and frozen    update_table, windows, check_frozen     [2]
    §3.2, Figure 2  the draft tree under TDL and CRT   grow_tree (the levels, the budget),     [3]
                    (§3.3: the frozen table's order)   add_followers (one node), DraftTree
    §3.2            draft, verify, accept, update      generate                                [4]
    beyond the paper: the tree cut to what pays here   verify.WhatPays (verify.py section 9)   [4]
                      followers cut to a small budget  hang_cut (follower_fit)                 [5]
                      one chain, for chain verifiers   first_branch (serve/vllm_proposers.py)  [5b]
    §3.3, §4        the frozen table's file            load_frozen, frozen_table_for           [6]
                    (built offline by tools/build_frozen.py)
    model.generate(..., custom_generate=...)           custom_generate                         [7]
    the CLI                                            prepare, main                           [8]

    python cacheback.py --prompt "Summarize: ..." --compare

    import cacheback                                         # from transformers' own generate()
    out = model.generate(input_ids, custom_generate=cacheback.custom_generate, max_new_tokens=128)

    from cacheback import CachebackConfig, generate          # as a library
    gen = generate(model, prompt_ids, 128, eos_ids, CachebackConfig.cpu())

Where this file differs from the published reference code (TUTORIAL.md §3): accepted tokens keep
their KV (compaction) instead of being fed again, shared prefixes are merged so no token is verified
twice, speculative lookups inside the tree do not refresh recency, and the frozen table fills only
the budget the dynamic tree leaves. On a CPU the defaults differ from the paper's
(CachebackConfig.cpu). Greedy and float32, the output is model.generate(do_sample=False)'s
(tests/test_cacheback.py). A "deviation:" comment marks each place this file departs from the paper,
and "ours" what the paper does not have; a difference from the authors' code is said as such, unmarked.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch

import verify
from verify import Generation, Tree

# the shipped frozen tables
CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
FROZEN_CORPORA = ("stdlib", "selfchat")
FROZEN_ORDERS = ("each-node", "after")  # CachebackConfig.frozen_order
# the presets a tool names (tools/offline.py, serve/vllm_proposers.py): CachebackConfig.cpu() and .paper()
PRESETS = ("cpu", "paper")

# ---- 0. Configuration (§3, §4) -----------------------------------------------------------------------------

@dataclass
class CachebackConfig:
    """The paper's parameters under its names, plus the two choices this file adds.

    >>> cfg = CachebackConfig.cpu()
    >>> (cfg.ll, cfg.tdl, cfg.crt, cfg.frozen, cfg.cost)
    (2, 16, 4, 'none', 'timed')
    """

    ll: int = 1  # LL, leader length: the tokens a lookup is keyed by
    fl: int = 3  # FL, follower length: the tokens of one continuation (one tree branch)
    lc: int = 2**20  # LC, leader capacity of a table (LRU)
    fc: int = 128  # FC, follower capacity per leader (LRU)
    tdl: int = 96  # TDL, total draft length: tree tokens not yet in the KV cache, root included
    crt: int = 16  # CRT, chaining-reserved tokens: TDL budget kept for tree levels 2 and deeper
    # the frozen table (§3.3): 'none', 'stdlib', 'selfchat' (section 6) or a file
    frozen: str = "none"
    # where the frozen table's followers enter the tree (§3.3; section 3 says how): 'each-node' =
    # at every node, right after the dynamic table's (the authors' code); 'after' = once the
    # dynamic tree is grown, in a second pass (ours)
    frozen_order: str = "after"
    # a follower longer than the budget left: 'whole' = it is not drafted, and the leader's later
    # followers neither (the paper); 'cut' = its first tokens, as many as the budget holds (ours,
    # for small budgets: section 5)
    follower_fit: str = "whole"
    # deviation: what a draft token costs (verify.WhatPays): 'free' verifies whole trees (the paper);
    # 'timed' keeps the subtree worth its time here; 'pinned' the same without timing (runs repeat)
    cost: str = "free"
    dynamic_table: bool = True  # False leaves the dynamic table empty: Table 1's "only frozen" row

    @classmethod
    def paper(cls) -> "CachebackConfig":
        """§4's values and whole trees. deviation: the frozen table is 'selfchat', the shipped corpus
        with the most accepted tokens, for the paper's 1% of OpenWebText (not available offline). Its
        followers enter 'after' the dynamic tree, an order §3.3 leaves open (the authors' code enters
        them at each node, 'each-node', where they take the budget of the text's own deeper
        continuations when an answer repeats itself: RESULTS.md, "The frozen table's order")."""
        return cls(frozen="selfchat")

    @classmethod
    def cpu(cls) -> "CachebackConfig":
        """A forward over many tokens is far from free on a CPU: small trees cut to what pays, a
        longer leader, no frozen table (RESULTS.md, "Cacheback on a CPU: Table 1 and the CPU
        defaults")."""
        return cls(ll=2, tdl=16, crt=4, frozen="none", cost="timed")

    @classmethod
    def for_device(cls, device) -> "CachebackConfig":
        """The paper's configuration on CUDA, the CPU one elsewhere. note: the shipped tables live
        in corpus/; a copy of only cacheback.py and verify.py runs without a frozen table."""
        if torch.device(device).type != "cuda":
            return cls.cpu()
        return cls.paper() if os.path.isdir(CORPUS_DIR) else cls()

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value."""
        for name in ("ll", "fl", "lc", "fc"):
            if getattr(self, name) < 1:
                raise verify.UserError(f"--{name} must be at least 1 (got {getattr(self, name)})")
        if self.tdl < 1 or not 0 <= self.crt < self.tdl:
            raise verify.UserError(f"need TDL >= 1 and 0 <= CRT < TDL (got TDL {self.tdl}, CRT {self.crt})")
        if self.follower_fit not in ("whole", "cut"):
            raise verify.UserError(f"--follower-fit must be whole or cut (got {self.follower_fit!r})")
        if self.frozen_order not in FROZEN_ORDERS:
            raise verify.UserError(f"--frozen-order must be {' or '.join(FROZEN_ORDERS)} (got "
                                   f"{self.frozen_order!r})")
        verify.check_cost(self.cost)
        if self.frozen not in ("none", *FROZEN_CORPORA) and not os.path.isfile(self.frozen):
            raise verify.UserError(f"--frozen {self.frozen}: expected none, {', '.join(FROZEN_CORPORA)} "
                                   "or a table file")

# ---- 1. The cache table (§3.1) -----------------------------------------------------------------------------
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
    def __init__(self, ll: int, fl: int, lc: int, fc: int, read_only: bool = False):
        assert ll >= 1 and fl >= 1 and lc >= 1 and fc >= 1
        self.ll, self.fl, self.lc, self.fc = ll, fl, lc, fc
        self.read_only = read_only  # a frozen table is filled once (by its builder) and then only queried
        self.leaders: OrderedDict[tuple, OrderedDict[tuple, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.leaders)

    def held_bytes(self) -> int:
        """Its token ids: each leader's LL, each follower's FL (verify.TOKEN_BYTES each)."""
        ids = sum(self.ll + self.fl * len(followers) for followers in self.leaders.values())
        return verify.TOKEN_BYTES * ids

    def insert(self, leader: tuple, follower: tuple) -> None:
        if self.read_only:
            raise RuntimeError("the frozen table is read-only during decoding (§3.3)")
        assert len(leader) == self.ll and len(follower) == self.fl
        followers = self.leaders.get(leader)
        if followers is None:
            if len(self.leaders) >= self.lc:
                # evict the LRU leader, together with its followers
                self.leaders.popitem(last=False)
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
        if refresh and not self.read_only:
            self.leaders.move_to_end(leader)  # querying refreshes the leader
        return reversed(followers)  # a view: O(1) to create, yields lazily

# ---- 2. Dual tables: the dynamic table learns from the text, the frozen one is read-only (§3.3) ------------
#
# The dynamic table sees every window of LL + FL consecutive tokens of the text: the leader is its
# first LL tokens, the follower the last FL. At the start it is filled by sliding the window over
# the whole prompt (chat template included); after each step exactly the NEW windows are inserted --
# those that end at a newly emitted token (accepted drafts and the bonus token):
#
#   LL=1, FL=2, text so far "At dawn the fox", the step emits "ran fast":
#       new windows ending at "ran":  (the,) -> (fox, ran)
#       new windows ending at "fast": (fox,) -> (ran, fast)

def windows(tokens: Sequence[int], ll: int, fl: int,
            first_end: int = 0) -> Iterator[tuple[tuple, tuple]]:
    """(leader, follower) for every window of ll + fl tokens whose LAST token has index >=
    first_end."""
    n = ll + fl
    for end in range(max(first_end, n - 1), len(tokens)):
        window = tuple(tokens[end - n + 1 : end + 1])
        yield window[:ll], window[ll:]

def update_table(table: CacheTable, tokens: Sequence[int], first_new: int) -> None:
    """Insert the windows that end at tokens[first_new:], i.e. at the tokens emitted by the last
    step."""
    for leader, follower in windows(tokens, table.ll, table.fl, first_new):
        table.insert(leader, follower)

def check_frozen(cfg: CachebackConfig, frozen_table: CacheTable | None) -> None:
    """The frozen table generate() was given must be the one cfg names, with its LL and FL."""
    if cfg.frozen != "none" and frozen_table is None:
        raise verify.UserError(f"cfg.frozen = {cfg.frozen!r}: pass "
                               "frozen_table=frozen_table_for(tok, cfg)")
    if frozen_table is not None and (frozen_table.ll, frozen_table.fl) != (cfg.ll, cfg.fl):
        raise verify.UserError(f"frozen table has LL={frozen_table.ll}, FL={frozen_table.fl}; "
                               f"this run uses LL={cfg.ll}, FL={cfg.fl}")

# ---- 3. The draft tree (§3.2): breadth-first growth under TDL and CRT --------------------------------------
#
# TDL (total draft length) bounds the tree: draft tokens + tokens not yet in the KV cache <= TDL.
# With KV compaction only the root (the last emitted token) is not cached, so the tree gets TDL - 1
# draft tokens. (The reference code feeds the accepted tokens again each step; they count against
# TDL there.)
#
# CRT (chaining-reserved tokens) keeps the first level from eating the whole budget: level 1 (the
# followers of the real context) may use TDL - 1 - CRT tokens; the CRT reserved ones are for level 2
# and deeper, where each leaf is extended by the followers of ITS last LL tokens (the tree
# "chains").
#
# Each follower becomes a branch of FL tokens below its parent. Branches are merged into a trie
# (verify.Tree): a follower that repeats a prefix already in the tree only costs its new tokens.
#
#   LL=2, FL=2, context "... the fox", TDL=8, CRT=2:
#     level 1: query (the, fox) -> (ran, fast) (hid, deep) (sat, still)   6 tokens > 8-1-2 = 5 allowed:
#              take (ran, fast), (hid, deep)                              4 tokens
#     level 2: leaf "fast": query (ran, fast) -> (and, far) ...           2 more: 6 <= 7 tokens
#     level 2: leaf "deep": query (hid, deep) -> nothing (or no budget left)
#
# Queries: the dynamic table first, then the frozen one "to further grow the tree if TDL still
# allows" (§3.3). The sentence fits two orders, cfg.frozen_order:
#   each-node  one breadth-first pass; at every node the dynamic table's followers, then the frozen
#              table's (the authors' code)
#   after      a first pass grows the whole tree from the dynamic table; a second walks it again,
#              breadth first, with both: the dynamic followers are there already (they merge for
#              free) and the frozen ones fill what budget is left (ours: frozen followers at level 1
#              cannot take the budget of the text's own deeper continuations)
# A follower found in both tables is added once. A leaf whose leader is in neither table stays a
# leaf (no backoff).
#
# deviation: only the level-1 query, made with the real, verified context, refreshes the leader's
# recency (§3.1: "Both querying and inserting a leader update that leader's recency"). Deeper queries
# are made with *speculative* tokens that may never appear in the text; letting them promote leaders
# would let guesses evict what the text actually contained. The reference code refreshes on every
# lookup.

MAX_RANK = 3  # ranks 3, 4, ... share one origin (DraftTree's docstring says why)

def fanout_bucket(followers: int) -> int:
    """0: the leader has one follower (or none yet); 1: two or three; 2: four or more."""
    if followers <= 1:
        return 0
    if followers <= 3:
        return 1
    return 2

@dataclass
class DraftTree(Tree):
    """A verify.Tree that also remembers where each node's token came from, its signal for the rule
    of verify.py section 9 (beyond the paper: the growth below never reads them; the rule learns an
    acceptance rate per origin). origins[i] = (source, rank, pos, fanout): the source table (0 dynamic,
    1 frozen), the follower's rank in that table's answer (0 = most recent; 3 = 4th or later), the
    node's position inside its follower, and how many followers its leader had (0: one, 1: 2-3, 2:
    more).

    Why these buckets: an origin's rate is learned from the steps of one prompt, a few hundred
    trials spread over every origin, so there must be few origins. A small tree (the CPU preset's
    16 tokens) holds three or four of a leader's followers: the 4th and later share one bucket
    (rank 3). A leader seen with one follower is a text repeating itself (the best bet), 2-3 a list
    or a template, more a common phrase ("of the") whose followers are weak guesses: three fanout
    buckets."""

    origins: list = field(default_factory=list)  # None for the root

    @classmethod
    def root_only(cls, root_token: int) -> "DraftTree":
        tree = super().root_only(root_token)
        tree.origins.append(None)
        return tree

    def add_follower(self, parent: int, follower: Sequence[int], source: int, rank: int,
                     fanout: int) -> list[int]:
        """Hang a follower below `parent` (merged into the trie); returns its node indices."""
        nodes = self.add_branch(follower, parent=parent)
        for pos, n in enumerate(nodes):
            # a new node (a shared prefix keeps the origin it was created with)
            if n == len(self.origins):
                self.origins.append((source, min(rank, MAX_RANK), pos, fanout))
        return nodes

    def new_tokens(self, node: int, follower: Sequence[int]) -> int:
        """How many nodes adding `follower` below `node` would create (the rest is a shared prefix
        already in the tree)."""
        for i, t in enumerate(follower):
            child = self.children[node].get(int(t))
            if child is None:
                return len(follower) - i
            node = child
        return 0

    def subtree(self, keep) -> "DraftTree":
        """verify.Tree.subtree, each kept node with its origin."""
        out = super().subtree(keep)
        out.origins = [self.origins[i] for i in range(len(self)) if i == 0 or keep(i)]
        return out

def grow_tree(root: int, context: Sequence[int], dynamic: CacheTable, frozen_table: CacheTable | None,
              tdl: int, crt: int, frozen_order: str = "after", cut: bool = False) -> DraftTree:
    """Build the draft tree for one step. `context` = the text so far, ending with `root` (the
    pending token). Returns a DraftTree whose node 0 is `root`. frozen_order: see above; cut:
    follower_fit = 'cut' (section 5, ours)."""
    if frozen_order not in FROZEN_ORDERS:
        raise ValueError(f"frozen_order must be one of {FROZEN_ORDERS} (got {frozen_order!r})")
    ll = dynamic.ll
    tree = DraftTree.root_only(root)
    budget = tdl - 1  # draft tokens; the root is the one token not yet in the KV cache
    # the tables asked at each node, pass by pass
    if frozen_table is None:
        passes = [[dynamic]]
    elif frozen_order == "each-node":
        passes = [[dynamic, frozen_table]]
    else:
        passes = [[dynamic], [dynamic, frozen_table]]
    for n_pass, tables in enumerate(passes):
        # Level 1 may not use the CRT reserved tokens. subtle: the check counts the WHOLE tree, so
        # in a second pass the limit must not be below what the first already grew (all levels):
        # else the first existing dynamic follower (0 new tokens) would already "not fit", and the
        # frozen table could never add anything once the dynamic tree holds more than TDL-1-CRT
        # tokens, against §3.3's "then the frozen one to further grow the tree if TDL still allows".
        limit = max(budget - crt, len(tree) - 1)
        # The leaves to extend, each with the last LL tokens of its root-to-leaf text (its leader).
        frontier = [(0, tuple(context[-ll:]))] if len(context) >= ll else []
        level = 1
        while frontier:
            # follower-end node -> its leader (dict: each node once)
            next_frontier: dict[int, tuple] = {}
            for node, leader in frontier:
                refresh = level == 1 and n_pass == 0  # the real context's query only (see above)
                add_followers(tree, node, leader, tables, limit, refresh, next_frontier, cut)
            if level == 1:
                limit = budget  # from level 2 on, the reserved CRT tokens are available too
            frontier = list(next_frontier.items())
            if len(tree) - 1 >= budget:
                return tree
            level += 1
    return tree

def add_followers(tree: DraftTree, node: int, leader: tuple, tables: list[CacheTable], limit: int,
                  refresh: bool, out: dict[int, tuple], cut: bool = False) -> None:
    """Hang the followers of `leader` below `node`: the dynamic table's first, then the frozen
    table's (when asked), each follower once, until one does not fit in `limit` draft tokens
    (cut: its first tokens that fit are hung too, section 5). Records each new branch end in
    `out`, with its leader for the next level."""
    ll = tables[0].ll
    seen = set()
    for source, table in enumerate(tables):
        # how many continuations this leader has been seen with, bucketed (DraftTree says why)
        fanout = fanout_bucket(len(table.leaders.get(leader, ())))
        for rank, follower in enumerate(table.query(leader, refresh=refresh)):
            if follower in seen:
                continue  # in both tables: add once
            seen.add(follower)
            new = tree.new_tokens(node, follower)
            if len(tree) - 1 + new > limit:
                # this follower does not fit: stop querying this leader (frozen table included)
                if cut:  # ours (section 5): hang the first tokens of it that fit
                    hang_cut(tree, node, leader, follower, new, limit, (source, rank, fanout), out)
                return
            nodes = tree.add_follower(node, follower, source, rank, fanout)
            out.setdefault(nodes[-1], (leader + follower)[-ll:])  # the last LL tokens of its text

# ---- 4. The decode loop ------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
             cfg: CachebackConfig, *, frozen_table: CacheTable | None = None,
             step_times: dict[int, float] | None = None, sampling: verify.Sampling = verify.GREEDY,
             on_emit=None, on_step=None, stop=None) -> Generation:
    """Cacheback decoding. A fresh dynamic table per call (stateful methods start from scratch for
    every prompt, as in the paper's SpecBench runs). frozen_table: the table cfg.frozen names
    (`frozen_table_for`; `prepare` loads it before the first call), shared and never modified.
    step_times: what a forward over n tokens takes here, {n: seconds} (verify.step_times: `prepare`
    reads it, else it is read now). `sampling`: greedy by default; sampled, the plain sampler's
    tokens."""
    cfg.check()
    check_frozen(cfg, frozen_table)
    # deviation: what of a tree pays for its time here (verify.py section 9; cost 'free': all of it)
    pays = verify.WhatPays.for_run(model, cfg.cost, step_times, cfg.tdl)
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step, stop=stop)
    dynamic = CacheTable(cfg.ll, cfg.fl, cfg.lc, cfg.fc)
    # the cache's capacity: prompt + output + the largest step (the root and up to TDL tree tokens)
    cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + cfg.tdl + 1)
    # the first forward is the prompt alone (the authors' code also verifies a first tree)
    pending = verify.first_token(verify.prefill(model, cache, prompt_ids), len(prompt_ids), sampling)
    text = list(prompt_ids) + [pending]  # prompt + emitted tokens: what the tables are queried with
    if cfg.dynamic_table:  # §3.3: the dynamic table starts from a sliding window over the prompt
        update_table(dynamic, text, 0)
    if gen.finish_prefill(pending):
        return gen
    while True:
        # -- DRAFT (§3.2): a tree below the pending token, at most TDL tokens including it
        t0 = time.perf_counter()
        tree = grow_tree(pending, text, dynamic, frozen_table, cfg.tdl, cfg.crt, cfg.frozen_order,
                         cut=cfg.follower_fit == "cut")
        grown = len(tree) - 1
        room = max_new_tokens - len(gen.tokens)  # a step emits at most depth + 1 tokens
        if max(tree.depths) >= room:
            depths = tree.depths
            tree = tree.subtree(lambda i: depths[i] < room)
        tree = pays.subtree(tree, tree.origins, text)  # deviation: the subtree worth its time here
        draft_s = time.perf_counter() - t0
        # -- VERIFY with tree attention, ACCEPT the longest agreeing branch + bonus, COMPACT the KV
        prefix_len = verify.cache_len(cache)
        logits = verify.tree_forward(model, cache, tree)  # [N, V]
        path, bonus = verify.accept(tree, logits, prefix_len, sampling)
        verify.compact_kv(cache, prefix_len, path)
        n_before = len(gen.tokens)
        # an on_step hook sees the tree (its origins: dynamic or frozen), the KV lengths before and
        # after the compaction, how many tokens were grown, and how many of them the rule withheld
        done = gen.finish_step(tree, path, bonus, draft_s, kv_before=prefix_len + len(tree),
                               kv_after=prefix_len + len(path), grown=grown, withheld=pays.withheld)
        # -- UPDATE the dynamic table with the windows ending at the newly emitted tokens (§3.2)
        first_new = len(text)
        text += gen.tokens[n_before:]
        if cfg.dynamic_table:  # False: Table 1's "only frozen" row
            update_table(dynamic, text, first_new)
        if done:
            gen.extra["rule"] = pays.summary()
            gen.extra["held_bytes"] = verify.tensor_bytes(cache) + dynamic.held_bytes() + (
                frozen_table.held_bytes() if frozen_table is not None else 0)
            return gen
        pending = bonus

# ---- Beyond the paper --------------------------------------------------------------------------------------
# ---- 5. Followers cut to the budget (ours, cfg.follower_fit = "cut") ---------------------------------------
#
# The paper hangs a follower whole or not at all. With FL = 3 and a budget of 4 draft tokens only one
# follower fits; the one token left is never drafted, though the next follower's first token is
# often right (it is the most recent continuation after the leader but one). 'cut' hangs the first
# tokens of the follower that no longer fits, as many as the budget holds, and stops there. The
# tables are the paper's. 'cut' is for budgets of a follower or two; the presets' budgets (15, 95) hold
# several, so they keep 'whole' (RESULTS.md, "Drafting quality offline").

def hang_cut(tree: DraftTree, node: int, leader: tuple, follower: tuple, new: int, limit: int,
             origin: tuple, out: dict[int, tuple]) -> None:
    """add_followers' follower that does not fit whole (`new` of its tokens are not in the tree
    yet), cut to the tokens the budget holds and hung below `node` (origin: its table, rank and
    fanout). E.g. follower (7, 8, 9), nothing shared, one token left: (7,) is hung. subtle: only
    when a new token fits at all, else the cut could be just a prefix the tree already has, and its
    end, a node inside another branch, would become a leaf to extend."""
    left = limit - (len(tree) - 1)  # draft tokens the budget still holds
    if left <= 0:
        return
    part = follower[: len(follower) - new + left]  # the shared prefix, then `left` new tokens
    nodes = tree.add_follower(node, part, *origin)
    out.setdefault(nodes[-1], (leader + part)[-len(leader) :])  # its leader: the last LL tokens

# ---- 5b. One chain from the tree, for engines that verify chains (ours) ------------------------------------
#
# A serving engine such as vLLM verifies one chain of draft tokens per request, not a tree
# (serve/vllm_proposers.py; TUTORIAL.md §7.3). The chain it gets is the tree's first branch: at each
# node the child added first, i.e. the leader's most recently seen follower (the dynamic table's
# before the frozen table's), then the follower chained below it -- the branch the paper ranks first.

def first_branch_nodes(tree: Tree) -> list[int]:
    """The node indices of the tree's first root-to-leaf branch, without the root."""
    node = 0
    nodes = []
    while tree.children[node]:
        node = next(iter(tree.children[node].values()))  # dicts keep insertion order
        nodes.append(node)
    return nodes

def first_branch(tree: Tree) -> list[int]:
    """The tokens of the tree's first branch, without the root.

    >>> first_branch(Tree.from_branches(7, [[1, 2, 3], [1, 5], [9]]))
    [1, 2, 3]
    """
    return [tree.tokens[node] for node in first_branch_nodes(tree)]

# ---- 6. The frozen table's file (§3.3, §4; tools/build_frozen.py builds it) --------------------------------
#
# File format: gzipped JSON, no pickled classes --
#   {"format": "cacheback-frozen/1", "tokenizer": {"vocab_size": V, "vocab_sha1": "..."}, "ll", "fl", "lc",
#    "fc", "corpus", "seed", "tokens", "leaders": [[leader, [follower, ...]], ...]}
# leaders and followers as lists of token ids, followers least frequent first, so that loading them
# with insert() leaves the most frequent one as the most recent, i.e. drafted first (as the
# reference does).

FROZEN_FORMAT = "cacheback-frozen/1"

def tokenizer_identity(tok) -> dict:
    """What must match between the tokenizer that built a frozen table and the one that uses it."""
    import hashlib
    import json

    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    return {"vocab_size": len(tok.get_vocab()), "vocab_sha1": hashlib.sha1(vocab).hexdigest()}

def save_frozen(table: CacheTable, path: str, tok, meta: dict) -> None:
    import gzip
    import json

    doc = {"format": FROZEN_FORMAT, "tokenizer": tokenizer_identity(tok), "ll": table.ll,
           "fl": table.fl,
           "lc": table.lc, "fc": table.fc, **meta,
           "leaders": [[list(lead), [list(f) for f in fs]] for lead, fs in table.leaders.items()]}
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
        raise verify.UserError(f"--frozen {path}: built with LL={doc['ll']}, FL={doc['fl']}; this run uses "
                               f"LL={ll}, FL={fl}")
    table = CacheTable(ll, fl, doc["lc"], doc["fc"])
    for leader, followers in doc["leaders"]:
        for follower in followers:
            table.insert(tuple(leader), tuple(follower))
    table.read_only = True
    return table

def frozen_path(tok, cfg: CachebackConfig, model_name: str = verify.DEFAULT_MODEL,
                built: bool = False):
    """Where the table of corpus cfg.frozen for this tokenizer and LL, FL, LC, FC lies: shipped in
    corpus/, else built by tools/build_frozen.py into the cache folder; None if neither (built=True:
    the latter)."""
    ident = tokenizer_identity(tok)["vocab_sha1"][:10]
    if cfg.frozen == "selfchat":  # the answers are this model's: the name says whose
        ident += "-" + os.path.basename(str(model_name).rstrip("/"))
    name = f"cacheback-frozen-{cfg.frozen}-{ident}-ll{cfg.ll}-fl{cfg.fl}-lc{cfg.lc}-fc{cfg.fc}.json.gz"
    cached = os.path.join(os.path.dirname(verify.converted_dir()), name)
    if built:
        return cached
    return next((p for p in (os.path.join(CORPUS_DIR, name), cached) if os.path.exists(p)), None)

def frozen_table_for(tok, cfg: CachebackConfig,
                     model_name: str = verify.DEFAULT_MODEL) -> CacheTable:
    """The frozen table cfg.frozen names: a table file, or a corpus ('stdlib': the Python standard
    library's source; 'selfchat': the model's own answers), shipped for the default model or built
    by the tool."""
    if cfg.frozen not in FROZEN_CORPORA:
        return load_frozen(cfg.frozen, tok, cfg.ll, cfg.fl)
    path = frozen_path(tok, cfg, model_name)
    if path is None:
        raise verify.UserError(
            f"--frozen {cfg.frozen}: no table for this model with LL={cfg.ll} FL={cfg.fl} LC={cfg.lc} "
            f"FC={cfg.fc}; build it: python tools/build_frozen.py --corpus {cfg.frozen} --model {model_name} "
            f"--ll {cfg.ll} --fl {cfg.fl} --lc {cfg.lc} --fc {cfg.fc}")
    return load_frozen(path, tok, cfg.ll, cfg.fl)
# ---- 7. From model.generate: the drop-in (verify.py section 13 reads the call) -----------------------------

def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                    cacheback_config: CachebackConfig | None = None, frozen_table: CacheTable | None = None,
                    step_times: dict[int, float] | None = None, seed: int | None = None, **model_kwargs):
    """Run this file's generate() from transformers' own call, in place of its loop:

        out = model.generate(input_ids, custom_generate=cacheback.custom_generate, max_new_tokens=128)

    Returns what model.generate returns (prompt + new tokens), honouring its GenerationConfig, its
    stopping criteria (per emitted token) and its streamer, and refusing in one line what it cannot
    reproduce (verify.check_generate_call).

    Keywords of this method, passed to model.generate beside its own:
        - cacheback_config: a CachebackConfig (default: CachebackConfig.for_device(model.device),
          the script's default on that device; on a model other than SmolLM2-135M-Instruct without
          a frozen table, which ships for that model only)
        - frozen_table: a frozen table, cacheback.load_frozen(path, tokenizer, ll, fl) (default: the
          one the config names, loaded at the model's first call with the tokenizer saved beside
          the model, and kept for its later calls)
        - step_times: what a forward over n tokens takes here, {n: seconds} (default:
          verify.step_times, measured once on this machine and kept in
          ~/.cache/specdec-reference, or $SPECDEC_CACHE)
        - seed: the sampling noise's key under do_sample=True (default: drawn from torch's
          generator, so torch.manual_seed repeats a call)
    """
    call = verify.GenerateCall.read(model, input_ids, logits_processor, stopping_criteria,
                                    generation_config, model_kwargs, seed)
    cfg = CachebackConfig.for_device(model.device) if cacheback_config is None else cacheback_config
    if cacheback_config is None and verify.model_name_of(model) != verify.DEFAULT_MODEL:
        # the CUDA default's frozen table ships for the default model only: another model runs the
        # default without one (Table 1's "no frozen" row) rather than fail; name one to use it
        cfg = replace(cfg, frozen="none")
    cfg.check()
    # the script's set-up (prepare), once per model: the frozen table, the step times
    cfg, extra = verify.prepare_once(model, prepare, cfg, frozen_table=frozen_table, step_times=step_times)
    gen = generate(model, call.prompt_ids, call.max_new_tokens, call.eos_ids, cfg, sampling=call.sampling,
                   **call.hooks(), **extra)
    return call.output(gen)

# ---- 8. CLI ------------------------------------------------------------------------------------------------

def prepare(model, tok, cfg: CachebackConfig, name: str = verify.DEFAULT_MODEL,
            frozen_table: CacheTable | None = None, step_times: dict[int, float] | None = None):
    """The set-up before the first call (the script's, and custom_generate's through
    verify.prepare_once): the frozen table cfg.frozen names (`name`, the model's, says whose
    selfchat table; tok None: the tokenizer beside the model tells the table's identity) and the
    step times the rule reads (measured once per machine: verify.step_times), each unless given."""
    extra = {}
    if frozen_table is None and cfg.frozen != "none":
        tok = tok or verify.tokenizer_of(model, instead="frozen_table")
        frozen_table = frozen_table_for(tok, cfg, name)
    if frozen_table is not None:
        extra["frozen_table"] = frozen_table
    if cfg.cost != "free":
        extra["step_times"] = step_times or verify.step_times(model, cfg.tdl)
    return cfg, extra

def make_parser():
    """The options: the common ones (verify.common_parser), then the paper's parameters
    (tools/replay.py takes them too)."""
    parser = verify.common_parser(__doc__.split("\n\n")[0].strip() + "\n\nFrozen tables of other corpora, "
                                  "models or LL/FL/LC/FC: python tools/build_frozen.py --help")
    default = functools.partial(verify.defaults_help, CachebackConfig)  # ' (default: ...)' for a help line
    g = parser.add_argument_group("Cacheback (the paper's names; CUDA defaults: §4's; CPU: RESULTS.md)")
    g.add_argument("--ll", type=int,
                   help="LL, leader length: tokens a lookup is keyed by" + default("ll"))
    g.add_argument("--fl", type=int,
                   help="FL, follower length: tokens per follower / branch" + default("fl"))
    g.add_argument("--lc", type=int, help="LC, leader capacity of a table" + default("lc"))
    g.add_argument("--fc", type=int, help="FC, follower capacity per leader" + default("fc"))
    g.add_argument("--tdl", type=int,
                   help="TDL, total draft length: tree tokens not in the KV cache" + default("tdl"))
    g.add_argument("--crt", type=int,
                   help="CRT, chaining-reserved tokens: TDL kept for tree levels 2+" + default("crt"))
    g.add_argument("--frozen", help="frozen table (§3.3): none, stdlib, selfchat, or a file from "
                   "tools/build_frozen.py" + default("frozen"))
    g.add_argument("--frozen-order", choices=list(FROZEN_ORDERS),
                   help="where frozen followers enter the tree: each-node = after the dynamic table's at "
                   "every node (the authors' code); after = once the dynamic tree is grown (ours)"
                   + default("frozen_order"))
    g.add_argument("--follower-fit", choices=["whole", "cut"],
                   help="ours: a follower the budget cannot hold whole is cut to what it holds (small TDL)"
                   + default("follower_fit"))
    g.add_argument("--cost", choices=verify.COSTS, help=verify.COST_HELP + default("cost"))
    return parser

def main(argv=None) -> int:
    return verify.run_cli(make_parser(), "cacheback", generate, CachebackConfig, prepare, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
