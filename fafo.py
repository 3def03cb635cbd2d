# SPDX-License-Identifier: MIT
"""
fafo.py -- FAFO: "Fumble Around and Find Out", lossless n-gram decoding whose guesses come from a
compressed KV cache. Paper: "FAFO: Lossy KV Cache Compression for Lossless Inference Acceleration
via Draftless Fumble Decoding", anonymous authors, ICLR 2026 submission, 2025,
https://openreview.net/forum?id=oSk9tP5Mgs. Built on Lookahead Decoding: Fu, Bailis, Stoica & Zhang,
"Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", ICML 2024,
arXiv:2402.02057.

Lookahead Decoding keeps n "guess streams" running beside normal decoding: each is a window of k
tokens the model extends by one token per step, throwing off plausible n-grams into a POOL; when the
text ends with an n-gram's key, the n-gram is a candidate and is verified. Guessing and verifying
share ONE forward:

    one forward over  [ last token | fumble branch: n streams x k tokens | find-out branch: m candidates x k ]
                        full KV       sees only C(kv), a compressed cache    full KV, causal per candidate

FAFO's contributions: guesses only need to be plausible, so the guess rows attend to a compressed
selection C(kv) of the cache (§4.1, §4.2; StreamingLLM here, Quest and SnapKV in section 8): many
more guesses become affordable, and the verification rows see the full cache, so the output stays
the target's; and the pool is keyed by longer suffixes of the text (§4.3). §4.4's buffer (C(kv) kept
at its head, so FlexAttention skips other blocks) is verify.py's CompactedKVCache (`--attn flex`).
Beyond the paper: the split back-end (the CPU default). A "deviation:" comment marks each place this file
departs from the paper (TUTORIAL.md §5.5 lists them), and "ours" what the paper does not have; a
difference from Lookahead's code is said as such.

The paper, section by section, and where it is here (this file's sections in brackets):

    §4.2, §4.3, App. F  n, k, m (Lookahead's W, N - 1, G), C   FafoConfig                      [0]
    App. F, Alg. 2, 3   the n-gram pool: add, retrieve (LRU)   NgramPool                       [1]
    §4.2, Eq. 1         Fumble Around: the n guess streams     Streams                         [2]
    §4.1, §4.2, Tables 2, 8  the compression C                 Compressor, StreamingLLM        [3]
                                                               Quest, SnapKV                   [8]
    App. E, Figure 4    one step's rows and attention mask     StepLayout, combined_mask       [4]
    §4.3, Alg. 4        Find Out: verify, accept               find_out                        [5]
    the loop            fumble, find out, pool, compress       generate                        [7]
    §4.4, Alg. 1, App. H  compacted blocks for FlexAttention   FlexKV, verify.CompactedKVCache [10]
    KV back-ends: dense [6] (Figure 4's mask as a tensor, the spec); beyond the paper: split [9]
    beyond the paper: one line if slower than plain decoding   prepare                        [11]
    model.generate(..., custom_generate=...)                   custom_generate                [12]

    python fafo.py --prompt "Write a limerick about a cat." --compare
    python fafo.py --prompt "..." --compress none --lookback 1   # Lookahead Decoding: full-KV guesses

    import fafo                                              # from transformers' own generate()
    out = model.generate(input_ids, custom_generate=fafo.custom_generate, max_new_tokens=128)

    from fafo import FafoConfig, generate                    # as a library
    gen = generate(model, prompt_ids, 128, eos_ids, FafoConfig.cpu())
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

import verify
from verify import Generation, Tree, UserError

# ---- 0. Configuration (§4.2, §4.3, Appendix F) -------------------------------------------------------------

@dataclass
class FafoConfig:
    """FAFO's parameters under the paper's names. The step has 1 + n*k + m*k rows.

    >>> c = FafoConfig.cpu()
    >>> 1 + c.n_guess * c.k + c.m * c.k      # rows of one CPU step
    22
    """

    # n: guess streams in the fumble branch (§4.2; Tables 11, 12); Lookahead's window W
    n_guess: int = 40
    # k: tokens per stream = length of a guessed n-gram = longest pool key (§4.2, Algorithm 2);
    # Lookahead's N - 1 (its n-gram size N counts the key token too)
    k: int = 6
    # m: candidates retrieved and verified per step (Algorithm 3; Lookahead's guess set size G). Two
    # readings: §4.3's text retrieves "n guesses" and Figure 4 is symmetric, so m = n (paper());
    # Algorithms 3 and 4 take a separate m with no value. 8 is ours (gpu()); the CPU's is measured.
    m: int = 8
    # C: "stream" (StreamingLLM), "quest", "snapkv", or "none" (full KV: Lookahead)
    compress: str = "stream"
    sink: int = 4  # StreamingLLM: attention-sink tokens kept from the start
    # StreamingLLM and SnapKV: most recent positions kept (StreamingLLM: sink + recent = 256, two
    # flex blocks; the paper gives no budget for short prompts)
    recent: int = 252
    page_size: int = 16  # Quest: positions per page (Quest's own page size)
    top_pages: int = 16  # Quest: pages selected per step (16 x 16 = the same budget of 256)
    window_size: int = 32  # SnapKV's own observation window: the prompt's last rows, which vote
    max_capacity_prompt: int = 256  # SnapKV: prompt positions kept, the window included (256 again)
    kernel_size: int = 5  # SnapKV's own pooling width over the votes (keeps neighbours together)
    # "dense" mask (the spec), "split" (two SDPA calls), "flex"/"flex-compiled" (§4.4)
    attn: str = "dense"
    pool_cap: int | None = None  # k-grams kept per pool key, LRU (Appendix F; None: n)
    # what refreshes a k-gram in that LRU: "use", also being retrieved (Appendix F's
    # "least-recently-used"), or "insert", only being filed again (Lookahead's code); the paper's
    # rule is the default (RESULTS.md, "FAFO")
    pool_refresh: str = "use"
    # deviation: what a guess's rows cost (verify.WhatPays): 'timed' verifies the guesses worth their rows
    # here, the lookahead rows a fixed cost; 'pinned' the same without timing; 'free': all m (the paper)
    cost: str = "timed"
    # longest pool key, the "lookback window" of §4.3 (None: k; Lookahead: 1)
    lookback: int | None = None
    prompt_pool: bool = False  # also fill the pool with the prompt's k-grams (not in the paper)
    block_size: int = 128  # flex: KV block size, B_z in Algorithm 1 (FlexAttention's default block)
    stream_seed: int = 0  # the streams' random initial tokens

    @classmethod
    def paper(cls) -> "FafoConfig":
        """n and k from the ablation (Tables 11, 12), m = n as §4.3 reads ("retrieves n guesses");
        no short-prompt budget is given (Table 13's best is ~760): 256, two flex blocks."""
        return cls(m=40, cost="free")

    @classmethod
    def gpu(cls) -> "FafoConfig":
        """The CUDA default: the paper's n and k; dense, the fastest back-end on a GPU (RESULTS.md,
        "On one GPU"), and m = 8, the H100 run's setting, where paper() reads the open m as m = n."""
        return cls()

    @classmethod
    def cpu(cls) -> "FafoConfig":
        """Every row costs time on a CPU, so a small step (22 rows), the split back-end, our budget
        of 256 (StreamingLLM; Quest 4 pages of 16 = 64); RESULTS.md, "FAFO" and "FAFO at long context"."""
        return cls(n_guess=4, k=3, m=3, top_pages=4, attn="split")

    @classmethod
    def for_device(cls, device) -> "FafoConfig":
        return cls.gpu() if torch.device(device).type == "cuda" else cls.cpu()

    def check(self) -> None:  # raise verify.UserError (a ValueError) for an impossible value
        verify.check_cost(self.cost)
        for name in ("n_guess", "k", "m", "recent", "page_size", "top_pages", "window_size",
                     "kernel_size", "sink", "pool_cap"):
            low = 0 if name == "sink" else 1
            v = getattr(self, name)
            if v is not None and v < low:
                raise UserError(f"--{name.replace('_', '-')} must be at least {low} (got {v})")
        for ok, what in ((self.lookback is None or 1 <= self.lookback <= self.k,
                          f"--lookback must be between 1 and k = {self.k} (got {self.lookback})"),
                         (self.pool_refresh in ("insert", "use"),
                          f"--pool-refresh must be insert or use (got {self.pool_refresh!r})"),
                         (self.compress in ("stream", "quest", "snapkv", "none"),
                          f"--compress must be stream, quest, snapkv or none (got {self.compress!r})"),
                         (self.max_capacity_prompt > self.window_size,
                          "--max-capacity-prompt must exceed --window-size (SnapKV keeps the window)"),
                         (self.kernel_size % 2 == 1,
                          "--kernel-size must be odd (pooling keeps the length)"),
                         (self.attn in ("dense", "split", "flex", "flex-compiled"),
                          f"--attn must be dense, split, flex or flex-compiled (got {self.attn!r})"),
                         (not (self.attn.startswith("flex") and self.compress == "none"),
                          "--attn flex needs a fixed compression budget (--compress stream, quest, snapkv)"),
                         (self.block_size >= 16 and not self.block_size & (self.block_size - 1),
                          f"--block-size must be a power of two >= 16 (got {self.block_size})")):
            if not ok:
                raise UserError(what)

# ---- 1. The n-gram pool (Appendix F, Algorithms 2 and 3) ---------------------------------------------------
#
# Values are guessed k-grams; keys are the tokens that came right before them in their stream. Each
# stream remembers its last k discarded tokens (the "buffer"), and a new k-gram is filed under every
# suffix of that buffer -- the last discarded token, the last two, ... up to k (Algorithm 2).
# Lookahead keys by one token only; a longer key matches less often but, when it matches, the
# candidate shares more context with the text (Proposition F.1), so retrieval tries the LONGEST
# suffix of the decoded text first (Algorithm 3).
#
#   stream buffer ['The', ' cat'], new 3-gram (' sat', ' on', ' the')   k = 3
#   -> pool[(' cat',)]        gets (' sat', ' on', ' the')
#      pool[('The', ' cat')]  gets (' sat', ' on', ' the')
#   text "... The cat" -> retrieve: key ('The', ' cat') first, then (' cat',)
#
# note: key lengths. The text says 1..k (§4.2, §4.3); the pseudo-code (Algorithms 2, 3) uses k+2,
# more than a buffer of k discarded tokens holds. We follow the text (TUTORIAL.md §5.5).

class NgramPool:
    """key (tuple of 1..lookback tokens) -> at most `cap` k-grams, LRU. lookback = k is FAFO's
    prefix caching (the default); lookback = 1 is Lookahead's pool, keyed "solely on x_|x|" (§4.3).

    >>> pool = NgramPool(k=2, cap=4, lookback=1)
    >>> pool.add_guess(['The', ' cat'], [' sat', ' on'])   # filed under (' cat',) only
    >>> pool.retrieve(['A', ' dog', 'The', ' cat'], m=2), pool.retrieve(['My', ' cat'], m=2)
    ([(' sat', ' on')], [(' sat', ' on')])
    """

    def __init__(self, k: int, cap: int, lookback: int | None = None, refresh: str = "use"):
        self.k = k
        self.cap = cap
        self.lookback = k if lookback is None else lookback  # longest key: FAFO k, Lookahead 1
        self.refresh = refresh  # what makes a k-gram recent (FafoConfig.pool_refresh)
        self.table: dict[tuple, OrderedDict] = {}
        # the key of each k-gram the last retrieve() returned (a new list each call: a step hook keeps it)
        self.found_under: list[tuple] = []

    @classmethod
    def for_run(cls, cfg: "FafoConfig", pool: "NgramPool | None",
                prompt_ids: Sequence[int]) -> "NgramPool":
        """The pool generate() uses: the caller's (same k; it keeps its own cap and lookback), or a
        new one with cfg's; given the prompt's k-grams too when cfg.prompt_pool."""
        if pool is None:
            pool = cls(cfg.k, cfg.pool_cap or cfg.n_guess, cfg.lookback, cfg.pool_refresh)
        if pool.k != cfg.k:
            raise UserError(f"the pool given was built for k = {pool.k}, not k = {cfg.k}")
        if cfg.prompt_pool:
            pool.add_prompt(prompt_ids)
        return pool

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())

    def held_bytes(self) -> int:
        """Its token ids, keys and k-grams (verify.TOKEN_BYTES each)."""
        ids = sum(len(key) + self.k * len(bucket) for key, bucket in self.table.items())
        return verify.TOKEN_BYTES * ids

    def add(self, key: Sequence[int], value: Sequence[int]) -> None:
        bucket = self.table.setdefault(tuple(key), OrderedDict())
        value = tuple(value)
        if value in bucket:
            bucket.move_to_end(value)  # used again: now the most recent
        else:
            bucket[value] = None
            if len(bucket) > self.cap:
                bucket.popitem(last=False)  # LRU eviction

    def add_guess(self, discarded: Sequence[int], ngram: Sequence[int]) -> None:
        """Algorithm 2 for one stream: file `ngram` under every suffix (length 1..lookback) of its
        buffer."""
        for length in range(1, min(self.lookback, len(discarded)) + 1):
            self.add(discarded[-length:], ngram)

    def add_prompt(self, tokens: Sequence[int]) -> None:
        """Optional (--prompt-pool): file each prompt k-gram under its preceding 1..k tokens."""
        for t in range(1, len(tokens) - self.k + 1):
            self.add_guess(tokens[max(0, t - self.k) : t], tokens[t : t + self.k])

    def retrieve(self, context: Sequence[int], m: int) -> list[tuple]:
        """Algorithm 3: up to m distinct k-grams, longest matching suffix of the text first, the
        most recently filed first within one key."""
        out: list[tuple] = []
        self.found_under = []
        keys = [tuple(context[-length:]) for length in range(min(self.lookback, len(context)), 0, -1)]
        for key in keys:  # the longest suffix first
            for value in reversed(self.table.get(key, ())):
                if len(out) == m:
                    break
                if value not in out:
                    out.append(value)
                    self.found_under.append(key)
        if self.refresh == "use":
            self.touch(keys, out)
        return out

    def touch(self, keys: Sequence[tuple], values: Sequence[tuple]) -> None:
        """Appendix F's LRU, refresh="use": each retrieved k-gram becomes the most recent under
        every key of the text it is filed under; the first retrieved ends the most recent."""
        for value in reversed(values):
            for key in keys:
                bucket = self.table.get(key)
                if bucket is not None and value in bucket:
                    bucket.move_to_end(value)

# ---- 2. Fumble Around: the n guess streams (§4.2, Eq. 1) ---------------------------------------------------
#
#   y^i_{k+1} = argmax p( . | y^i_{1..k}, C(kv_{1..|x|}) )   for every stream i, all in one forward   (Eq. 1)
#
# After the forward each stream appends its new token and drops its oldest into its buffer; the new
# window goes to the pool. Streams are never reset (as Lookahead's): they share only the text's KV.

class Streams:
    def __init__(self, windows: list[list[int]], k: int):
        self.windows = windows  # n lists of k tokens: y^i_1 .. y^i_k
        self.buffers: list[list[int]] = [[] for _ in windows]  # each stream's last k dropped tokens
        self.k = k
        self.advances = 0  # forwards so far; after k, every window holds only the model's guesses

    @classmethod
    def from_prompt(cls, prompt_ids: Sequence[int], n: int, k: int, seed: int = 0) -> "Streams":
        """Lookahead's initialisation: random prompt tokens (a k-step warm-up, see advance)."""
        rng = random.Random(seed)
        return cls([[rng.choice(list(prompt_ids)) for _ in range(k)] for _ in range(n)], k)

    def advance(self, new_tokens: Sequence[int], pool: NgramPool) -> None:
        """Shift every stream by its new token; file the new windows in the pool once they are the
        model's. Warm-up, as Lookahead: the first k advances drop random prompt tokens, which make
        no keys, so the buffers stay empty and nothing is filed; from advance k + 1 on, the dropped
        token was the model's guess: it enters the buffer (the keys), and the window is filed. With
        k = 2: advances 1 and 2 file nothing, advance 3 files its window under a key of length 1,
        advance 4 under lengths 1 and 2."""
        dropped_is_guess = self.advances >= self.k  # the token to drop is the model's guess
        self.advances += 1
        for i, t in enumerate(new_tokens):
            dropped = self.windows[i][0]
            self.windows[i] = self.windows[i][1:] + [int(t)]
            if dropped_is_guess:
                self.buffers[i] = (self.buffers[i] + [dropped])[-self.k :]
            if self.buffers[i]:  # empty during the warm-up
                pool.add_guess(self.buffers[i], self.windows[i])

# ---- 3. The compression functions C (plug-ins) -------------------------------------------------------------
#
# A compressor answers one question per step: which cached (logical) positions may the guess rows
# see? The KV back-end turns them into a mask or the buffer's head; `budget` bounds the answer (flex
# allocates the head from it). The decode loop calls after_prefill() once and after_step() per step,
# which hand observe() the cache and (needs_query: Quest) the last verified row's queries; SnapKV
# votes once, with the prompt's last `window` rows (observe_prompt). To add one (H2O), subclass it.

class Compressor:
    # the base class is --compress none: guess rows see everything (Lookahead)
    name, budget = "none", None
    needs_query = False  # True -> observe() receives per-layer queries [L, H, D]
    window = 0  # > 0: the prefill keeps its hidden states for the prompt's last `window` rows (SnapKV)

    def observe(self, backend, queries: torch.Tensor | None) -> None:
        pass

    def observe_prompt(self, backend, queries: torch.Tensor, scale: float) -> None:
        pass

    def after_prefill(self, model, backend, hidden_states, prompt_len: int) -> None:
        """What the compressor learns from the prompt (Quest and SnapKV read queries: section 8)."""
        self.observe(backend, None)

    def after_step(self, model, backend, hidden_states, row: int, position: int) -> None:
        """What it learns from a verified step: the cache as it now is (and, Quest, the queries of
        input `row`, the one that produced the bonus token, at `position`)."""
        self.observe(backend, None)

    def select(self, length: int) -> list[int]:
        return list(range(length))

class StreamingLLM(Compressor):
    """Xiao et al. 2024: the first `sink` tokens (attention sinks) and the `recent` newest ones,
    e.g. length 12, sink 2, recent 4 -> [0, 1, 8, 9, 10, 11]."""

    name = "stream"

    def __init__(self, sink: int, recent: int):
        self.sink, self.recent = sink, recent
        self.budget = sink + recent

    def select(self, length: int) -> list[int]:
        head = list(range(min(self.sink, length)))
        return head + list(range(max(self.sink, length - self.recent), length))

FullKV = Compressor  # --compress none

def make_compressor(cfg: FafoConfig) -> Compressor:
    if cfg.compress == "stream":
        return StreamingLLM(cfg.sink, cfg.recent)
    if cfg.compress == "quest":  # section 8
        return Quest(cfg.page_size, cfg.top_pages)
    if cfg.compress == "snapkv":
        return SnapKV(cfg.window_size, cfg.max_capacity_prompt, cfg.kernel_size, cfg.recent)
    return FullKV()

# ---- 4. One step's input and its attention mask (Appendix E, Figure 4) -------------------------------------
#
# Rows of the step (q = 1 + n*k + m*k), e.g. n = 2 streams, k = 2, m = 1 candidate, last token at p:
#
#   row  token   position  sees (besides itself)
#   0    x       p         the whole cache                          <- verification: "last token"
#   1    y^1_1   p+1       C(kv), x                                 <- fumble, level 1 (column-wise:
#   2    y^2_1   p+2       C(kv), x                                    stream 1, stream 2, then level 2)
#   3    y^1_2   p+2       C(kv), x, y^1_1
#   4    y^2_2   p+3       C(kv), x, y^2_1
#   5    a_1     p+1       the whole cache, x                       <- find out: candidate a
#   6    a_2     p+2       the whole cache, x, a_1
#
# Column-wise (Lookahead's): a stream's k rows are n apart, so the streams' newest rows are the
# last n fumble rows. Layout and in-step mask depend only on (n, k, m): one BlockMask for flex.

@dataclass(frozen=True)  # hashable, so the masks below are built once per (n, k, m), not once per step
class StepLayout:
    n: int
    k: int
    m: int

    @property
    def rows(self) -> int:
        return 1 + self.n * self.k + self.m * self.k

    def fumble_row(self, i: int, j: int) -> int:
        return 1 + j * self.n + i  # stream i, level j (0-based)

    def cand_row(self, c: int, t: int) -> int:
        return 1 + self.n * self.k + c * self.k + t

    @functools.cache
    def read_rows(self) -> tuple[int, ...]:
        """The rows whose predictions the step reads: x, each stream's newest row (the last n fumble
        rows) and the candidates. The other (k-1)*n fumble rows are context: the head skips them.

        >>> StepLayout(n=2, k=2, m=1).read_rows()   # rows 1, 2 = level 1 of the streams: not read
        (0, 3, 4, 5, 6)
        """
        return (0,) + tuple(range(1 + (self.k - 1) * self.n, self.rows))

    @functools.cache
    def guess_rows(self) -> np.ndarray:
        """bool [q]: the rows restricted to C(kv). (Cached: treat as read-only.)"""
        g = np.zeros(self.rows, dtype=bool)
        g[1 : 1 + self.n * self.k] = True
        return g

    @functools.cache
    def inner_mask(self) -> np.ndarray:
        """bool [q, q]: which of the step's rows sees which. (Cached: treat as read-only.)"""
        allowed = np.eye(self.rows, dtype=bool)
        allowed[:, 0] = True  # everyone sees the last token
        for i in range(self.n):
            for j in range(self.k):
                for jj in range(j):
                    allowed[self.fumble_row(i, j), self.fumble_row(i, jj)] = True
        for c in range(self.m):
            for t in range(self.k):
                for tt in range(t):
                    allowed[self.cand_row(c, t), self.cand_row(c, tt)] = True
        return allowed

    def inputs(self, last: int, p: int, windows: list[list[int]], cands: list[Sequence[int]]):
        """(tokens [q], positions [q]) for this step; len(cands) must be m. Stream i's level-j token
        sits at p + 1 + i + j: Lookahead's staggering (its code's offsets; the paper only names the
        streams s_i), each stream one position further ahead than the last, so that their newest
        rows guess n different positions, p + k .. p + n + k - 1, and the pool gets k-grams starting
        at n different places of the text to come."""
        assert len(cands) == self.m and len(windows) == self.n
        tokens = [last] + [0] * (self.rows - 1)
        positions = [p] + [0] * (self.rows - 1)
        for i, w in enumerate(windows):
            for j, t in enumerate(w):
                r = self.fumble_row(i, j)
                tokens[r] = t
                positions[r] = p + 1 + i + j
        for c, cand in enumerate(cands):
            for t, tok in enumerate(cand):
                r = self.cand_row(c, t)
                tokens[r] = tok
                positions[r] = p + 1 + t
        return tokens, positions

def combined_mask(layout: StepLayout, cache_len: int, selected: Sequence[int]) -> np.ndarray:
    """Figure 4's readable spec, bool [q, cache_len + q]: verification rows see the full cache,
    fumble rows only `selected`; inside the step, StepLayout.inner_mask."""
    q = layout.rows
    allowed = np.zeros((q, cache_len + q), dtype=bool)
    guess = layout.guess_rows()
    allowed[~guess, :cache_len] = True
    sel = np.asarray(list(selected), dtype=np.int64)
    allowed[np.ix_(np.nonzero(guess)[0], sel)] = True
    allowed[:, cache_len:] = layout.inner_mask()
    return allowed

# ---- 5. Find Out verification (§4.3, Algorithm 4) ----------------------------------------------------------
#
# Each candidate is checked against the model's own choices; the longest run wins, plus the bonus
# token (the model's choice right after it). Ties go to the earlier candidate (= the longer key):
#   choice after x = ' sat';  candidate A = (' sat', ' on', ' a')    choices on A's rows: (' on', ' the', ...)
#                             candidate B = (' ran', ...)
#   A: ' sat' == ' sat' ok, ' on' == ' on' ok, ' a' != ' the'  -> 2 accepted, bonus ' the'
#   B: ' ran' != ' sat'                                        -> 0
#   => emit ' sat', ' on' (from A) + ' the' (bonus)

def find_out(cands: Sequence[Sequence[int]], first_choice: int,
             cand_choices: Sequence[Sequence[int]]):
    """Returns (winner index or -1, accepted count, bonus token). cand_choices[c][t] = the model's
    argmax on candidate c's row t (what comes after a_1..a_t)."""
    best = -1  # no candidate matched yet: accept nothing, the bonus is x's own choice
    best_len = 0
    bonus = first_choice
    for c, cand in enumerate(cands):
        matched = 0  # candidate c's tokens that equal the model's choices so far
        nxt = first_choice  # the model's choice after x and the matched tokens
        while matched < len(cand) and cand[matched] == nxt:
            nxt = cand_choices[c][matched]
            matched += 1
        if matched > best_len:  # the longest match wins; the first of equals
            best = c
            best_len = matched
            bonus = nxt
    return best, best_len, bonus

# ---- 6. The KV back-ends, and the dense one: the mask as a tensor (the spec) -------------------------------
#
# All three give the same logits (tested); the guess rows' attention reads: DenseKV the whole cache,
# then the mask zeroes most of it (Figure 4 as a tensor); SplitKV C(kv) gathered, in a second SDPA
# call (section 9); FlexKV the head blocks of a compacted buffer (§4.4, section 10). The decode loop
# drives them alike:
#   select(positions)                  C(kv) for the next forward (flex: swap them into the buffer's head)
#   forward(tokens, positions, rows)   -> logits [len(rows), V] of the rows asked for (+ hidden states)
#   keep(rows, positions)              after acceptance: keep the KV of these input rows only
#   keys(start, end)                   logical keys [L, H_kv, n, D] (Quest's page statistics)

class DenseKV:
    """The cache in logical order (verify.PreallocatedKVCache) + an additive float mask per step."""

    def __init__(self, model, cache, layout: StepLayout):
        self.model = model
        self.cache = cache
        self.layout = layout  # a full step's rows; a shorter step passes its own to forward()
        self.selected: list[int] = []  # C(kv): the positions the guess rows see

    @property
    def length(self) -> int:
        """The logical cache's length p (the KV of x_1 .. x_p)."""
        return verify.cache_len(self.cache)

    def select(self, positions: Sequence[int]) -> None:
        self.selected = list(positions)

    @torch.no_grad()
    def forward(self, tokens, positions, hidden: bool = False, layout: StepLayout | None = None,
                rows: Sequence[int] | None = None):
        """-> (logits [len(rows), V] of the input rows `rows` (None: all q), hidden states if
        asked). note: the LM head (hidden x vocab per row, a large share of a small model's work)
        runs on `rows` only, through `logits_to_keep` (a 1D tensor of positions)."""
        dev = self.model.device
        mask, attention = self.mask(layout or self.layout)
        only = {}  # logits of every row, unless rows are named
        if rows is not None:
            only = verify.last_logits_only(self.model, torch.tensor(rows, device=dev))
        ids = torch.tensor([tokens], device=dev)  # [1, q]
        position_ids = torch.tensor([positions], device=dev)  # [1, q]
        with attention:
            out = verify.model_forward(self.model, self.cache, input_ids=ids, attention_mask=mask,
                                       position_ids=position_ids, output_hidden_states=hidden, **only)
        logits = out.logits[0]  # [len(rows), V], or [q, V] from a model without logits_to_keep
        if rows is not None and len(logits) != len(rows):  # rows increase, so q rows = all
            logits = logits[list(rows)]  # such a model computed every row: we pick
        hidden_states = out.hidden_states if hidden else None
        return logits, hidden_states

    def mask(self, layout: StepLayout):
        """(the spec mask, additive [1, 1, q, p + q]; the attention function's context)."""
        allowed = combined_mask(layout, self.length, self.selected)  # [q, p + q]
        mask = verify.additive_mask(allowed, self.model.dtype, self.model.device)
        return mask, self.attention(allowed, layout)

    def attention(self, allowed: np.ndarray, layout: StepLayout):
        return contextlib.nullcontext()

    def keep(self, rows: Sequence[int], positions: Sequence[int]) -> None:
        # positions are consecutive (p, p + 1, ...): compact_kv needs only the first
        verify.compact_kv(self.cache, positions[0], rows)

    def keys(self, start: int, end: int) -> torch.Tensor:
        return torch.stack([layer.keys[0, :, start:end] for layer in self.cache.layers])

    def statistics(self, steps: int) -> dict:
        return {}

# ---- 7. The decode loop ------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
             cfg: FafoConfig, *, pool: NgramPool | None = None, step_times: dict[int, float] | None = None,
             sampling: verify.Sampling = verify.GREEDY, on_emit=None, on_step=None, stop=None) -> Generation:
    """FAFO decoding, greedy or sampled (guess rows stay greedy: they need only be plausible). A `pool`
    passed in (NgramPool.for_run) carries over between prompts. step_times: what a forward over n
    tokens takes here, {n: seconds} (verify.step_times: `prepare` reads it, else it is read now)."""
    cfg.check()
    n = cfg.n_guess  # guess streams (Lookahead's W)
    k = cfg.k  # tokens per stream, the n-gram length (Lookahead's N - 1)
    m = cfg.m  # candidates verified per step (Lookahead's G)
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step, stop=stop)
    compressor = make_compressor(cfg)
    pool = NgramPool.for_run(cfg, pool, prompt_ids)  # the caller's, or a new one
    streams = Streams.from_prompt(prompt_ids, n, k, cfg.stream_seed)  # random prompt tokens at first
    layout = StepLayout(n, k, m)  # the rows of a full step (Figure 4)
    cache, last_logits, hidden = prefill_prompt(model, prompt_ids, max_new_tokens, cfg, compressor,
                                                layout)
    # deviation: which guesses pay for their rows here (verify.py section 9; cost 'free': all m), the
    # lookahead rows a fixed cost (flex pads the guesses to m rows: a fixed cost there too)
    pays = verify.WhatPays.for_run(model, cfg.cost, step_times, layout.rows)
    flex = cfg.attn.startswith("flex")
    fixed = n * k + (m * k if flex else 0)
    guess_rows = 0 if flex else k
    pending = verify.first_token(last_logits, len(prompt_ids), sampling)
    if gen.finish_prefill(pending):
        return gen
    context = list(prompt_ids) + [pending]  # x_1 .. x_|x|; the last one is not in the KV cache yet
    # the attention back-end (section 6): it holds the KV cache and runs a step's forward
    backend = make_backend(model, cache, layout, cfg, compressor, len(prompt_ids) + max_new_tokens)
    compressor.after_prefill(model, backend, hidden, len(prompt_ids))
    gen.extra.update(compress=compressor.name, candidates=0)
    while True:
        started = time.perf_counter()
        p = backend.length  # the cached positions kv_1 .. kv_p (p = |x| - 1, not a probability)
        # -- Find Out, retrieve (Algorithm 3): up to m pool candidates keyed by the text's tail
        cands = pool.retrieve(context, m)
        cands = cands[: pays.guesses(pending, cands, context, fixed, guess_rows)]  # deviation: what pays
        real = len(cands)
        step = StepLayout(n, k, real)
        if cfg.attn.startswith("flex"):  # static shapes: exactly m, padded with never-accepted dummies
            cands = cands + [(pending,) * k] * (m - real)
            step = layout
        selected = compressor.select(p)  # -- compress (§4.1): C(kv_1..p), what guess rows see
        backend.select(selected)
        tokens, positions = step.inputs(pending, p, streams.windows, cands)
        draft_s = time.perf_counter() - started
        # -- one forward: x, the guess rows (Fumble Around), the candidates (Find Out)
        read = step.read_rows()  # the rows whose predictions we use
        logits, hidden = backend.forward(tokens, positions, compressor.needs_query, step, rows=read)
        choice = choices(logits, read, step, real, positions, sampling)  # input row -> model's token
        # -- Find Out, verify and accept (Algorithm 4), on the real candidates only
        cand_choices = [[choice[step.cand_row(c, t)] for t in range(k)] for c in range(real)]
        best, n_accepted, bonus = find_out(cands[:real], choice[0], cand_choices)
        accepted = list(cands[best][:n_accepted]) if n_accepted else []
        rows = [0] + [step.cand_row(best, t) for t in range(n_accepted)]  # verification rows kept
        # -- Fumble Around's result (Eq. 1): each stream's next token; its new k-gram -> pool (Alg. 2)
        streams.advance([choice[step.fumble_row(i, k - 1)] for i in range(n)], pool)
        backend.keep(rows, [p + j for j in range(len(rows))])  # -- keep x's, the accepted tokens' KV
        compressor.after_step(model, backend, hidden, rows[-1], positions[rows[-1]])
        tree, path = candidate_tree(pending, cands[:real], accepted)  # for Generation and --trace
        gen.extra["candidates"] += real
        context = context + accepted + [bonus]
        pending = bonus
        # an on_step hook is shown the KV lengths (kv_before: rows written, flex's padding too) and the step
        if gen.finish_step(tree, path, bonus, draft_s, kv_before=p + step.rows,
                           kv_after=backend.length, layout=step, tokens=tokens, choice=choice,
                           pool_keys=pool.found_under[:real], winner=best, selected=selected,
                           withheld=pays.withheld):
            return step_statistics(gen, pool, backend, layout, pays)

def choices(logits, read, step: StepLayout, real: int, positions,
            sampling: verify.Sampling) -> dict:
    """Input row -> the model's token after it: its argmax, or for the verification rows, sampled,
    the keyed sample at the position the row predicts. logits [len(read), V], in `read`'s order."""
    choice = dict(zip(read, logits.argmax(dim=-1).tolist()))
    if not sampling.greedy:
        check = [0] + [step.cand_row(c, t) for c in range(real) for t in range(step.k)]
        at = [read.index(r) for r in check]
        for r, tok in zip(check, sampling.choose(logits[at], [positions[r] + 1 for r in check])):
            choice[r] = tok
    return choice

def candidate_tree(pending: int, cands: Sequence[Sequence[int]], accepted: Sequence[int]):
    """(the step's candidates as a trie below the pending token, the accepted path's nodes): FAFO
    verifies candidates, not a tree, but in this form Generation counts the drafted tokens and the
    accepted ones as for every method, and --trace prints the step."""
    tree = Tree.from_branches(pending, [list(c) for c in cands])
    path = [0] + tree.add_branch(accepted)  # finds the accepted tokens' nodes (adds none)
    return tree, path

@torch.no_grad()
def prefill_prompt(model, prompt_ids: Sequence[int], max_new_tokens: int, cfg: FafoConfig,
                   compressor, layout: StepLayout):
    """The prompt through the model, into a cache for prompt + output + one whole step's rows.
    Unlike verify.prefill it returns (the cache, the last position's logits [V], the hidden states
    when the compressor reads queries, else None)."""
    check_reach(model, cfg, len(prompt_ids), max_new_tokens)
    cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + layout.rows)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    hidden = compressor.needs_query or compressor.window > 0
    out = verify.model_forward(model, cache, input_ids=ids, output_hidden_states=hidden,
                               **verify.last_logits_only(model))
    verify.check_filled(cache, len(prompt_ids))  # as verify.prefill: a recurrent model fills none
    return cache, out.logits[0, -1], out.hidden_states

def check_reach(model, cfg: FafoConfig, prompt_len: int, max_new_tokens: int) -> None:
    """subtle: guess rows run ahead of the text (up to position p + n + k - 1), so the context check
    counts them (a model with absolute positions fails past its table)."""
    if cfg.compress in ("quest", "snapkv"):
        check_llama_layout(model, cfg.compress)
    lead = cfg.n_guess + cfg.k
    reach = prompt_len + max_new_tokens + lead
    if reach > verify.context_length(model):
        raise UserError(f"prompt ({prompt_len}) + max new tokens ({max_new_tokens}) + the guess rows' "
                        f"lead (n + k = {lead}) exceeds the model's context of "
                        f"{verify.context_length(model)}")

def make_backend(model, cache, layout: StepLayout, cfg: FafoConfig, compressor, capacity: int):
    """The KV back-end cfg.attn names (section 6's interface), over the prefilled cache: DenseKV
    here, SplitKV and FlexKV below the banner (sections 9 and 10)."""
    if cfg.attn == "dense":
        return DenseKV(model, cache, layout)
    if cfg.attn == "split":
        return SplitKV(model, cache, layout)
    tail_slots = capacity + cfg.k + 1  # the last step may keep x and k accepted past the budget
    return FlexKV(model, cache, layout, compressor.budget, tail_slots, cfg.block_size,
                  compiled=cfg.attn == "flex-compiled")

def step_statistics(gen: Generation, pool, backend, layout: StepLayout, pays) -> Generation:
    """gen.extra's counts as per-step rates, and the pool's size, the back-end's own, the rule's."""
    gen.extra["pool_ngrams"] = len(pool)
    gen.extra["held_bytes"] = verify.tensor_bytes(backend.cache) + pool.held_bytes()
    gen.extra["guess_rows_per_step"] = float(layout.n * layout.k)  # each step: n streams x k tokens
    gen.extra["candidates_per_step"] = gen.extra.pop("candidates") / gen.steps
    gen.extra.update(backend.statistics(gen.steps))
    gen.extra["rule"] = pays.summary()
    return gen

# ---- Beyond the paper --------------------------------------------------------------------------------------

# ---- 8. The paper's other compressions, Quest (Table 2) and SnapKV (Table 8), here for their length ----

def quest_page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound on q.k over a page (Tang et al. 2024): per channel d, max(q_d M_d, q_d
    m_d), where M/m are the page's channel-wise max/min keys; summed over channels, max over heads.

    query [H, D]; kmin, kmax [P, H_kv, D] (H = G * H_kv query heads share each KV head) -> scores
    [P]. For one head, D = 2: q = (1, -1), page keys (0, 2) and (3, -1): M = (3, 2), m = (0, -1);
    bound = max(3, 0) + max(-2, 1) = 4, and indeed the best key (3, -1) scores 3 + 1 = 4."""
    H, D = query.shape
    h_kv = kmin.shape[1]
    q = query.view(h_kv, H // h_kv, D)  # [H_kv, G, D]
    hi = q[None] * kmax[:, :, None]  # [P, H_kv, G, D]
    lo = q[None] * kmin[:, :, None]
    return torch.maximum(hi, lo).sum(-1).amax(dim=(1, 2))  # [P]

class Quest(Compressor):
    """Query-aware page selection: pages of `page_size` positions keep their channel-wise min and
    max keys per layer; each step the `top_pages` pages with the highest `quest_page_scores` win.
    deviation: one selection for every layer and head (scores summed), from the last step's query."""

    name = "quest"
    needs_query = True

    def __init__(self, page_size: int, top_pages: int):
        self.page_size = page_size
        self.top_pages = top_pages
        self.budget = page_size * top_pages
        self.kmin = self.kmax = None  # [L, P, H_kv, D]: each page's channel-wise min / max key
        self.pages_done = 0  # pages whose min/max are final (complete pages)
        self.scores: torch.Tensor | None = None  # [P] of the last selection

    def observe(self, backend, queries: torch.Tensor | None) -> None:
        length = backend.length
        ps = self.page_size
        done = self.pages_done
        # only the pages that changed (the newest, partial ones): keys [L, H_kv, n, D] each
        new_pages = range(done, -(-length // ps))
        pages = [backend.keys(p * ps, min(length, (p + 1) * ps)) for p in new_pages]
        if pages:
            new_min = torch.stack([k.amin(dim=2) for k in pages], 1)  # [L, P', H_kv, D]
            new_max = torch.stack([k.amax(dim=2) for k in pages], 1)
            if self.kmin is None:
                self.kmin = new_min
                self.kmax = new_max
            else:  # the complete pages stay, the changed ones are replaced
                self.kmin = torch.cat([self.kmin[:, :done], new_min], 1)
                self.kmax = torch.cat([self.kmax[:, :done], new_max], 1)
        self.pages_done = length // ps
        self.queries = queries  # [L, H, D]

    def after_prefill(self, model, backend, hidden_states, prompt_len: int) -> None:
        last = [prompt_len - 1]
        self.observe(backend, layer_queries(model, hidden_states, last, last)[:, :, 0])  # [L, H, D]

    def after_step(self, model, backend, hidden_states, row: int, position: int) -> None:
        self.observe(backend, layer_queries(model, hidden_states, [row], [position])[:, :, 0])

    def select(self, length: int) -> list[int]:
        ps = self.page_size
        if -(-length // ps) <= self.top_pages:
            return list(range(length))
        q = self.queries.float()  # [L, H, D]
        lo = self.kmin.float()  # [L, P, H_kv, D]
        hi = self.kmax.float()
        self.scores = sum(quest_page_scores(q[i], lo[i], hi[i]) for i in range(len(lo)))  # [P], i: layer
        pages = sorted(torch.topk(self.scores, self.top_pages).indices.tolist())
        return [x for p in pages for x in range(p * ps, min(length, (p + 1) * ps))]

def snapkv_votes(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """SnapKV's vote (Li et al. 2024): the attention the window's queries [L, H, w, D]
    (RoPE applied) paid in the prefill to each position of keys [L, H_kv, P, D] before the window,
    summed -> [P - w] (tested)."""
    L, H, w, _ = queries.shape
    P = keys.shape[2]
    G = H // keys.shape[1]  # query heads per KV head (grouped-query attention)
    row_pos = torch.arange(P - w, P, device=keys.device)  # where the window's rows sit
    future = torch.arange(P, device=keys.device)[None, :] > row_pos[:, None]  # [w, P]: causal mask
    votes = torch.zeros(P - w, device=keys.device)
    for layer in range(L):  # one layer at a time: [H, w, P] stays small at long context
        k = keys[layer].float().repeat_interleave(G, dim=0)  # [H, P, D]
        logits = (queries[layer].float() @ k.transpose(-1, -2)) * scale  # [H, w, P]
        attn = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        votes += attn[:, :, : P - w].sum(dim=(0, 1))
    return votes

class SnapKV(Compressor):
    """Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
    arXiv:2404.14469 (FAFO's Table 8), made once after the prefill: the prompt's last `window_size`
    rows vote with their attention, the votes are average-pooled over `kernel_size` neighbours, and
    the top max_capacity_prompt - window_size positions are kept with the window, plus the `recent`
    newest positions. deviation: one selection for every layer and head (votes summed), like Quest.
    Prompt 12, window 2, capacity 5: votes over 0..9 -> top 3, say [1, 2, 7], + window [10, 11]."""

    name = "snapkv"

    def __init__(self, window_size: int, max_capacity_prompt: int, kernel_size: int, recent: int):
        self.window, self.capacity, self.kernel = window_size, max_capacity_prompt, kernel_size
        self.recent = recent
        self.budget = max_capacity_prompt + recent
        self.kept: list[int] = []  # the prompt positions SnapKV keeps

    def observe_prompt(self, backend, queries: torch.Tensor, scale: float) -> None:
        P = backend.length
        w = queries.shape[2]
        if P <= self.capacity:
            self.kept = list(range(P))
            return
        votes = snapkv_votes(queries, backend.keys(0, P), scale)  # [P - w]
        pooled = torch.nn.functional.avg_pool1d(votes[None, None], self.kernel, stride=1,
                                                padding=self.kernel // 2)[0, 0]  # [P - w] (odd kernel)
        top = torch.topk(pooled, self.capacity - w).indices
        self.kept = sorted(top.tolist()) + list(range(P - w, P))

    def after_prefill(self, model, backend, hidden_states, prompt_len: int) -> None:
        window = list(range(max(0, prompt_len - self.window), prompt_len))
        queries = layer_queries(model, hidden_states, window, window)  # [L, H, w, D]
        self.observe_prompt(backend, queries, attention_scale(model))

    def select(self, length: int) -> list[int]:
        return sorted(set(self.kept).union(range(max(0, length - self.recent), length)))

def check_llama_layout(model, compress: str = "quest") -> None:
    """Quest and SnapKV recompute each layer's queries (layer_queries): Llama-family layout only."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", [None])
    llama_like = all(hasattr(layer, "input_layernorm")
                     and hasattr(getattr(layer, "self_attn", None), "q_proj") for layer in layers)
    if not (hasattr(inner, "rotary_emb") and llama_like):
        raise UserError(f"--compress {compress} needs a Llama-style layout (input_layernorm, q_proj, "
                        f"rotary); {model.config.model_type} has another: use --compress stream or none")

def layer_queries(model, hidden_states, rows: Sequence[int],
                  positions: Sequence[int]) -> torch.Tensor:
    """The query vectors every layer computed for input rows `rows` at `positions`: [L, H, r, D],
    RoPE applied (as on the cached keys, so q.k times the layer's scaling is the attention logit).
    hidden_states[l] is layer l's input (transformers' output_hidden_states=True)."""
    inner = model.model
    cfg = model.config
    r = len(rows)
    H = cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    # [L, r, hid]
    hs = torch.stack([hidden_states[i][0, list(rows)] for i in range(cfg.num_hidden_layers)])
    pos = torch.tensor([list(positions)], device=hs.device)
    cos, sin = inner.rotary_emb(hs[:1], position_ids=pos)  # [1, r, D]
    qs = []
    for i, layer in enumerate(inner.layers):
        q = layer.self_attn.q_proj(layer.input_layernorm(hs[i])).view(r, H, D)  # [r, H, D]
        if hasattr(layer.self_attn, "q_norm"):  # QK-norm (Qwen3): per-head query norm, before RoPE
            q = layer.self_attn.q_norm(q)
        q = q.transpose(0, 1)  # [H, r, D]
        rot = torch.cat([-q[..., D // 2 :], q[..., : D // 2]], dim=-1)  # rotate_half
        qs.append(q * cos[0] + rot * sin[0])
    return torch.stack(qs)  # [L, H, r, D]

def attention_scale(model) -> float:
    """The factor on q.k in the model's attention: self_attn.scaling, else 1/sqrt(D)."""
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return float(getattr(model.model.layers[0].self_attn, "scaling", D ** -0.5))

# ---- 9. The split back-end (ours, the CPU default): the guess rows' attention in its own call --------------
#
#     row 0 and the candidates: the whole cache     ->   verification    all p + q keys (no gather)
#     the n*k guess rows: C(kv) + a few step columns ->  guess           |C(kv)| + 1 + n*k, gathered
#
# Every allowed (row, column) pair lies inside its group's block, so the two calls compute the dense
# spec's masked attention; the guess rows' work drops from O(p) to O(|C(kv)|), on any device, with
# no compile. note: SDPA's `enable_gqa=True` reads shared KV heads in place, where transformers'
# SDPA copies each G times whenever a mask is given: so split copies less than dense even with
# --compress none, and FAFO and Lookahead are compared on the same back-end.

def split_groups(allowed: np.ndarray, guess: np.ndarray, dtype, device="cpu") -> list[tuple]:
    """The dense spec mask `allowed` bool [q, n_keys] cut by rows: [(rows [r], cols [c] or None for
    every column, additive mask [1, 1, r, c])] for the verification rows (~guess) and the guess
    rows. A group seeing more than half of the columns reads them all (a gather would save little).

    >>> allowed = np.array([[1, 1, 1, 1, 1, 1, 1, 0],   # row 0: verification, sees all 6 cached columns
    ...                     [1, 0, 0, 0, 0, 1, 1, 1]],  # row 1: guess, sees cached 0 and 5, and the step
    ...                    dtype=bool)
    >>> groups = split_groups(allowed, np.array([False, True]), torch.float32)
    >>> [(r.tolist(), None if c is None else c.tolist()) for r, c, _ in groups]
    [([0], None), ([1], [0, 5, 6, 7])]
    """
    groups = []
    for rows in (np.nonzero(~guess)[0], np.nonzero(guess)[0]):
        if len(rows):
            cols = np.nonzero(allowed[rows].any(axis=0))[0]
            cols = None if len(cols) > allowed.shape[1] // 2 else cols
            vis = allowed[rows] if cols is None else allowed[rows][:, cols]
            groups.append((torch.as_tensor(rows, device=device),
                           None if cols is None else torch.as_tensor(cols, device=device),
                           verify.additive_mask(vis, dtype, device)))
    return groups

def _split_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, groups=(),
                   **kwargs):
    """A transformers attention function: query [B, H, q, D], key/value [B, H_kv, n_keys, D] (the
    updated cache). `attention_mask` (the dense spec) is unread: `groups` hold it, by rows."""
    import torch.nn.functional as F

    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)  # [B, H, q, D]
    for rows, cols, mask in groups:
        k = key if cols is None else key.index_select(2, cols)  # [B, H_kv, c, D]
        v = value if cols is None else value.index_select(2, cols)
        assert mask.shape[-1] == k.shape[-2], "split path: the mask was cut for another number of keys"
        out[:, :, rows] = F.scaled_dot_product_attention(query.index_select(2, rows), k, v,
                                                         scale=scaling,
                                                         attn_mask=mask.to(query.dtype), enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D], as transformers expects

SPLIT = "specdec_split"

class SplitKV(DenseKV):
    """DenseKV's cache and mask, but attention runs as two SDPA calls per layer (split_groups), same
    result. note: the model still gets the dense mask, so every model family prepares its inputs as
    on the dense path; only the attention function, which reads the groups, differs."""

    def attention(self, allowed: np.ndarray, layout: StepLayout):
        groups = split_groups(allowed, layout.guess_rows(), self.model.dtype, self.model.device)
        return verify.attention_function(self.model, SPLIT,
                                         functools.partial(_split_forward, groups=groups))

# ---- 10. The flex back-end: FlexAttention over verify.py's CompactedKVCache (§4.4) -------------------------

class FlexKV(DenseKV):
    """verify.CompactedKVCache + FlexAttention: C(kv) at the head, a BlockMask skips the rest."""

    def __init__(self, model, cache, layout: StepLayout, budget: int, tail_slots: int, block_size: int,
                 compiled: bool):
        compacted = verify.CompactedKVCache(model, head_slots=budget, input_rows=layout.rows,
                                            tail_slots=tail_slots, block_size=block_size)
        compacted.load(cache)  # everything to the tail; the first select() swaps C(kv) in
        super().__init__(model, compacted, layout)  # self.cache: the compacted buffer
        self.compiled = compiled
        # built ONCE: static shapes
        self.block_mask = compacted.block_mask(layout.inner_mask(), layout.guess_rows())

    @property
    def length(self) -> int:
        return self.cache.length

    def select(self, positions: Sequence[int]) -> None:
        self.cache.reselect(positions)

    def mask(self, layout: StepLayout):
        return self.block_mask, verify.flex_mode(self.model, self.compiled)

    def keep(self, rows: Sequence[int], positions: Sequence[int]) -> None:
        self.cache.commit(rows, positions)

    def keys(self, start: int, end: int) -> torch.Tensor:
        return self.cache.key_buffer[:, 0][:, :, self.cache.logical_slots(start, end)]

    def statistics(self, steps: int) -> dict:
        return {"slots_swapped_per_step": self.cache.moved / steps}

# ---- 11. FAFO's speed here, said in one line where it is below plain decoding (ours) ----------------------

def prepare(model, tok, cfg: FafoConfig, name: str = verify.DEFAULT_MODEL,
            step_times: dict[int, float] | None = None) -> tuple[FafoConfig, dict]:
    """The set-up before the first call (the script's, and custom_generate's through
    verify.prepare_once): the step times the rule reads (unless cost is free or they are given), and
    FAFO's speed over plain decoding here, measured once (verify.speed_over_plain): below 1, one
    line says so (TUTORIAL.md §5.6 says why FAFO then runs anyway)."""
    rows = StepLayout(cfg.n_guess, cfg.k, cfg.m).rows
    extra = {} if cfg.cost == "free" else {"step_times": step_times or verify.step_times(model, rows)}
    verify.say_if_slower(model, tok, functools.partial(generate, cfg=cfg, **extra), ("fafo", repr(cfg)),
                         "[fafo] on this machine FAFO runs at {:.2f}x plain decoding (" + f"{cfg.n_guess} x "
                         f"{cfg.k} lookahead rows and up to {cfg.m} guesses a step, measured once): its rows "
                         "cost more than its guesses bring here; a GPU, where rows are nearly free, would "
                         "help; it runs anyway")
    return cfg, extra

# ---- 12. From model.generate: the drop-in (verify.py section 13 reads the call) ----------------------------

def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                    fafo_config: FafoConfig | None = None, pool: NgramPool | None = None,
                    step_times: dict[int, float] | None = None, seed: int | None = None, **model_kwargs):
    """Run this file's generate() from transformers' own call, in place of its loop:

        out = model.generate(input_ids, custom_generate=fafo.custom_generate, max_new_tokens=128)

    Returns what model.generate returns (prompt + new tokens), honouring its GenerationConfig, its
    stopping criteria (per emitted token) and its streamer, and refusing in one line what it cannot
    reproduce (verify.check_generate_call).

    Keywords of this method, passed to model.generate beside its own:
        - fafo_config: a FafoConfig (default: FafoConfig.for_device(model.device), the script's
          default on that device)
        - pool: an NgramPool to carry over between calls (default: a fresh pool per call)
        - step_times: what a forward over n tokens takes here, {n: seconds} (default:
          verify.step_times, measured once on this machine and kept in
          ~/.cache/specdec-reference, or $SPECDEC_CACHE)
        - seed: the sampling noise's key under do_sample=True (default: drawn from torch's
          generator, so torch.manual_seed repeats a call)
    """
    call = verify.GenerateCall.read(model, input_ids, logits_processor, stopping_criteria,
                                    generation_config, model_kwargs, seed)
    cfg = FafoConfig.for_device(model.device) if fafo_config is None else fafo_config
    cfg.check()
    # the script's set-up (prepare), once per model: the step times, FAFO's speed here (its one line)
    cfg, extra = verify.prepare_once(model, prepare, cfg, step_times=step_times)
    gen = generate(model, call.prompt_ids, call.max_new_tokens, call.eos_ids, cfg, pool=pool,
                   sampling=call.sampling, **call.hooks(), **extra)
    return call.output(gen)

# ---- 13. CLI -----------------------------------------------------------------------------------------------

def make_parser():
    """The options: the common ones (verify.common_parser), then the paper's parameters
    (tools/replay.py takes them too)."""
    parser = verify.common_parser(__doc__.split("\n\n")[0].strip())
    default = functools.partial(verify.defaults_help, FafoConfig)  # ' (default: ...)' for a help line
    g = parser.add_argument_group("FAFO (the paper's names; CPU defaults are small: every row costs time)")
    add = g.add_argument
    add("--n-guess", type=int,
        help="n: guess streams in the fumble branch (§4.2)" + default("n_guess"))
    add("--k", type=int,
        help="k: tokens per stream = guessed n-gram length = longest pool key" + default("k"))
    add("--m", type=int, help="m: pool candidates verified per step (Algorithm 3)" + default("m"))
    add("--compress", choices=["stream", "quest", "snapkv", "none"],
        help="C: StreamingLLM, Quest pages, SnapKV's prompt selection + the recent positions, or "
        "none = full KV (Lookahead)" + default("compress"))
    add("--sink", type=int, help="StreamingLLM: attention-sink tokens kept" + default("sink"))
    add("--recent", type=int, help="StreamingLLM: most recent tokens kept" + default("recent"))
    add("--page-size", type=int, help="Quest: positions per page" + default("page_size"))
    add("--top-pages", type=int, help="Quest: pages selected per step" + default("top_pages"))
    add("--window-size", type=int,
        help="SnapKV: the prompt's last rows, which vote" + default("window_size"))
    add("--max-capacity-prompt", type=int, help="SnapKV: prompt positions kept, window included"
        + default("max_capacity_prompt"))
    add("--kernel-size", type=int,
        help="SnapKV: average-pooling width over the votes" + default("kernel_size"))
    add("--attn", choices=["dense", "split", "flex", "flex-compiled"],
        help="dense mask (the spec); split = guess rows over C(kv) in their own SDPA call; flex = "
        "compacted blocks (§4.4) with FlexAttention run eagerly (unfused: to check it, not for "
        "speed); flex-compiled = the same through torch.compile" + default("attn"))
    add("--pool-cap", type=int, help="pool: k-grams kept per key, LRU (Appendix F; default: n)")
    add("--pool-refresh", choices=["insert", "use"], help="pool: what refreshes a k-gram in the LRU: "
        "being filed again (Lookahead's code) or also being retrieved (Appendix F)"
        + default("pool_refresh"))
    add("--lookback", type=int,
        help="pool: longest key, §4.3's lookback window (default: k; 1 = Lookahead)")
    add("--prompt-pool", action="store_const", const=True,
        help="fill the pool with the prompt's k-grams too")
    add("--block-size", type=int, help="flex: KV block size, B_z in Algorithm 1" + default("block_size"))
    add("--cost", choices=verify.COSTS, help=verify.COST_HELP + default("cost"))
    return parser

def main(argv=None) -> int:
    return verify.run_cli(make_parser(), "fafo", generate, FafoConfig, prepare, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
