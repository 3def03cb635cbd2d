"""
fafo.py -- FAFO: "Fumble Around and Find Out", lossless n-gram decoding whose guesses come from a
compressed KV cache. Paper: "FAFO: Lossy KV Cache Compression for Lossless Inference Acceleration via
Draftless Fumble Decoding", anonymous authors, ICLR 2026 submission, 2025,
https://openreview.net/forum?id=oSk9tP5Mgs. Built on Lookahead Decoding: Fu, Bailis, Stoica & Zhang, "Break
the Sequential Dependency of LLM Inference Using Lookahead Decoding", ICML 2024, arXiv:2402.02057.

Lookahead Decoding keeps n "guess streams" running beside normal decoding: each is a window of k tokens the
model extends by one token per step, throwing off plausible n-grams into a POOL; when the text ends with an
n-gram's key, the n-gram is a candidate and is verified. Guessing and verifying share ONE forward:

    one forward over  [ last token | fumble branch: n streams x k tokens | find-out branch: m candidates x k ]
                        full KV       sees only C(kv), a compressed cache    full KV, causal per candidate

FAFO's contribution (§4.2): guesses only need to be plausible, so the guess rows attend to a compressed
selection C(kv) of the cache (StreamingLLM; Quest and SnapKV beyond the paper's main path), which makes many
more guesses affordable; the verification rows see the full cache, so the output stays the target's greedy
output. §4.4's systems part, C(kv) kept contiguous at the head of a fixed buffer so FlexAttention skips the
other blocks, lives in verify.py (CompactedKVCache), used here by `--attn flex`.

The paper, in its order: 0 n, k, m and C, 1 the pool (Algorithms 2, 3), 2 the guess streams (Eq. 1), 3 the
compression C, 4 the step layout and its mask (Appendix E, Figure 4), 5 Find Out (Algorithm 4), 6 the dense
back-end (the mask as a tensor: the spec), 7 the decode loop. Beyond the paper: 8 Quest and SnapKV, 9 the
split back-end (the CPU default), 10 the flex back-end, 11 the CLI.

    python fafo.py --prompt "Write a limerick about a cat." --compare
    python fafo.py --prompt "..." --compress none --lookback 1   # Lookahead Decoding: full-KV guesses

    from fafo import FafoConfig, generate                    # as a library
    gen = generate(model, prompt_ids, 128, eos_ids, FafoConfig.cpu())

Deviations from the paper (each also in TUTORIAL.md chapter 5):
  * Stream i's tokens sit at positions p+1+i .. p+k+i (Lookahead's column offsets; the paper says "s_i").
  * Quest scores pages with the query of the LAST VERIFIED row (the new token's own query does not exist
    before the forward), and one page selection (summed scores) serves all layers and heads, so that one
    mask and one physical layout serve the model; SnapKV likewise, plus the `recent` newest positions.
  * The pool is not seeded from the prompt by default (as in the paper and Lookahead); `--prompt-pool` does.
  * Algorithm 3 as printed never shortens its suffix (an endless loop); we try suffix lengths k .. 1.
  * The head (hidden -> vocabulary) runs only on the rows whose prediction is read (StepLayout.read_rows).
  * `--attn split` (ours; the CPU default): the guess rows attend to C(kv) in their own SDPA call.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
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

    n_guess: int = 40  # n: guess streams in the fumble branch (§4.2; Tables 11, 12)
    k: int = 6  # k: tokens per stream = length of a guessed n-gram = longest pool key (§4.2, Algorithm 2)
    m: int = 8  # m: candidates retrieved and verified per step (Algorithm 3; not given in the paper: ours)
    compress: str = "stream"  # C: "stream" (StreamingLLM), "quest", "snapkv", or "none" (full KV: Lookahead)
    sink: int = 4  # StreamingLLM: attention-sink tokens kept from the start
    recent: int = 252  # StreamingLLM: most recent tokens kept (sink + recent = 256: one flex block pair)
    page_size: int = 16  # Quest: positions per page
    top_pages: int = 16  # Quest: pages selected per step
    window_size: int = 32  # SnapKV: the observation window, the prompt's last rows whose attention votes
    max_capacity_prompt: int = 256  # SnapKV: prompt positions kept, the window included
    kernel_size: int = 5  # SnapKV: width of the average pooling over the votes (keeps neighbours together)
    attn: str = "dense"  # "dense" mask (the spec), "split" (two SDPA calls), "flex"/"flex-compiled" (§4.4)
    pool_cap: int | None = None  # k-grams kept per pool key, LRU (Appendix F; None: n)
    lookback: int | None = None  # longest pool key, the "lookback window" of §4.3 (None: k; Lookahead: 1)
    prompt_pool: bool = False  # also seed the pool with the prompt's k-grams (not in the paper)
    block_size: int = 128  # flex: KV block size, B_z in Algorithm 1
    seed: int = 0  # the streams' random initial tokens

    @classmethod
    def paper(cls) -> "FafoConfig":
        """n and k from the ablation (Tables 11, 12); the Init+Local budget for short prompts is not given
        (Table 13's best is ~760 tokens): 256, one FlexAttention block pair. The back-end: dense, the fastest
        measured on an H100 (RESULTS.md, "FAFO on a GPU")."""
        return cls()

    @classmethod
    def cpu(cls) -> "FafoConfig":
        """Every row costs time on a CPU, so a small step (22 rows), the split back-end and the paper's budget
        of 256, chosen on the tuning halves of the shipped short and long prompts (RESULTS.md, "FAFO")."""
        return cls(n_guess=4, k=3, m=3, recent=252, top_pages=4, attn="split")

    @classmethod
    def for_device(cls, device) -> "FafoConfig":
        return cls.paper() if torch.device(device).type == "cuda" else cls.cpu()

    def check(self) -> None:
        """Raise verify.UserError (a ValueError) for an impossible value."""
        for name in ("n_guess", "k", "m", "recent", "page_size", "top_pages", "window_size", "kernel_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.sink < 0:
            raise UserError(f"--sink must be >= 0 (got {self.sink})")
        if self.lookback is not None and not 1 <= self.lookback <= self.k:
            raise UserError(f"--lookback must be between 1 and k = {self.k} (got {self.lookback})")
        if self.pool_cap is not None and self.pool_cap < 1:
            raise UserError(f"--pool-cap must be at least 1 (got {self.pool_cap})")
        if self.compress not in ("stream", "quest", "snapkv", "none"):
            raise UserError(f"--compress must be stream, quest, snapkv or none (got {self.compress!r})")
        if self.max_capacity_prompt <= self.window_size:
            raise UserError(f"--max-capacity-prompt ({self.max_capacity_prompt}) must exceed --window-size "
                            f"({self.window_size}): the window is part of what SnapKV keeps")
        if self.kernel_size % 2 == 0:
            raise UserError("--kernel-size must be odd, so pooling keeps the length "
                            f"(got {self.kernel_size})")
        if self.attn not in ("dense", "split", "flex", "flex-compiled"):
            raise UserError(f"--attn must be dense, split, flex or flex-compiled (got {self.attn!r})")
        if self.attn.startswith("flex") and self.compress == "none":
            raise UserError("--attn flex needs a fixed compression budget (--compress stream, quest, snapkv)")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise UserError(f"--block-size must be a power of two >= 16 (got {self.block_size})")

# ---- 1. The n-gram pool (Appendix F, Algorithms 2 and 3) ---------------------------------------------------
#
# Values are guessed k-grams; keys are the tokens that came right before them in their stream. Each stream
# remembers its last k discarded tokens (the "buffer"), and a new k-gram is filed under every suffix of that
# buffer -- the last discarded token, the last two, ... up to k (Algorithm 2). Lookahead keys by one token
# only; a longer key matches less often but, when it matches, the candidate shares more context with the
# text (Proposition F.1), so retrieval tries the LONGEST suffix of the decoded text first (Algorithm 3).
#
#   stream buffer ['The', ' cat'], new 3-gram (' sat', ' on', ' the')   k = 3
#   -> pool[(' cat',)]        gets (' sat', ' on', ' the')
#      pool[('The', ' cat')]  gets (' sat', ' on', ' the')
#   text "... The cat" -> retrieve: key ('The', ' cat') first, then (' cat',)
#
# note: key lengths. The paper's text says 1..k ("prefixes of increasing length up to k", §4.2; "1 <= m <= k",
# §4.3), but the printed pseudo-code disagrees: Algorithm 2's loop `for j = s+1 down to s-k` files under
# k+2 suffix lengths, and Algorithm 3 starts at `suffixSeqLen <- k+2`, although the buffer holds only k
# discarded tokens. We follow the text (1..k), which is also all a buffer of k tokens can provide.

class NgramPool:
    """key (tuple of 1..lookback tokens) -> at most `cap` k-grams, least recently used evicted first.
    lookback = k is FAFO's prefix caching (the default); lookback = 1 is Lookahead Decoding's pool, keyed by
    the one token before the n-gram ("conditioned solely on x_|x|", §4.3).

    >>> pool = NgramPool(k=2, cap=4, lookback=1)
    >>> pool.add_guess(['The', ' cat'], [' sat', ' on'])   # filed under (' cat',) only
    >>> pool.retrieve(['A', ' dog', 'The', ' cat'], m=2), pool.retrieve(['My', ' cat'], m=2)
    ([(' sat', ' on')], [(' sat', ' on')])
    """

    def __init__(self, k: int, cap: int, lookback: int | None = None):
        self.k, self.cap = k, cap
        self.lookback = k if lookback is None else lookback  # longest key: FAFO k, Lookahead 1
        self.table: dict[tuple, OrderedDict] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())

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
        """Algorithm 2 for one stream: file `ngram` under every suffix (length 1..lookback) of its buffer."""
        for length in range(1, min(self.lookback, len(discarded)) + 1):
            self.add(discarded[-length:], ngram)

    def seed(self, tokens: Sequence[int]) -> None:
        """Optional (--prompt-pool): file every k-gram of the prompt under its preceding 1..k tokens."""
        k = self.k
        for t in range(1, len(tokens) - k + 1):
            self.add_guess(tokens[max(0, t - k) : t], tokens[t : t + k])

    def retrieve(self, context: Sequence[int], m: int) -> list[tuple]:
        """Algorithm 3: up to m distinct k-grams, longest matching suffix of the text first, the most
        recently filed first within one key."""
        out: list[tuple] = []
        for length in range(min(self.lookback, len(context)), 0, -1):
            for value in reversed(self.table.get(tuple(context[-length:]), ())):
                if value not in out:
                    out.append(value)
                    if len(out) == m:
                        return out
        return out

# ---- 2. Fumble Around: the n guess streams (§4.2, Eq. 1) ---------------------------------------------------
#
#   y^i_{k+1} = argmax p( . | y^i_{1..k}, C(kv_{1..|x|}) )   for every stream i, all in one forward   (Eq. 1)
#
# After the forward each stream appends its new token and discards its oldest; the discarded token joins
# the stream's buffer and the window's new k tokens go to the pool. The streams are independent of the
# accepted text (like Lookahead's window, they are never reset): they only share its KV cache.

class Streams:
    def __init__(self, windows: list[list[int]], k: int):
        self.windows = windows  # n lists of k tokens: y^i_1 .. y^i_k
        self.buffers: list[list[int]] = [[] for _ in windows]  # the last k discarded tokens of each stream
        self.k = k
        self.advances = 0  # forwards so far; after k of them every window holds only the model's guesses

    @classmethod
    def from_prompt(cls, prompt_ids: Sequence[int], n: int, k: int, seed: int = 0) -> "Streams":
        """Lookahead's initialisation: random tokens of the prompt. The first k steps are a warm-up in
        which the streams replace these with the model's own guesses (and the pool is still empty)."""
        rng = random.Random(seed)
        return cls([[rng.choice(list(prompt_ids)) for _ in range(k)] for _ in range(n)], k)

    @property
    def n(self) -> int:
        return len(self.windows)

    def advance(self, new_tokens: Sequence[int], pool: NgramPool) -> None:
        """Shift every stream by its new token; file the new windows in the pool once they are the model's.

        Warm-up, as Lookahead: the initial windows are random prompt tokens, so for the first k advances a
        window still holds some of them, and a dropped token is one of them. Neither is the model's guess,
        so nothing is filed until the window is all guesses, and only guessed tokens enter the buffers
        (the keys). With k = 2: advances 1 and 2 file nothing, advance 3 files its window under a key of
        length 1, advance 4 under keys of length 1 and 2."""
        dropped_is_guess = self.advances >= self.k  # the token about to be dropped was guessed by the model
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
# A compressor answers one question per step: which cached positions may the guess rows see? It returns
# logical positions (0 .. length-1); the KV back-end turns them into a mask (dense) or into the head of the
# buffer (flex). `budget` bounds the answer's size (the flex head is allocated from it). To add another
# method (H2O: accumulate attention per position), subclass Compressor: `observe` sees every step's KV and
# the last verified row's queries (needs_query), `observe_prompt` the prompt's last rows' queries (window).

class Compressor:
    name = "base"
    needs_query = False  # True -> observe() receives per-layer queries [L, H, D]
    window = 0  # > 0 -> observe_prompt() receives the prompt's last `window` rows' queries, once

    def __init__(self):
        self.budget: int | None = None

    def observe(self, kv, queries: torch.Tensor | None) -> None:
        pass

    def observe_prompt(self, kv, queries: torch.Tensor, scale: float) -> None:
        pass

    def select(self, length: int) -> list[int]:
        raise NotImplementedError

class FullKV(Compressor):
    """--compress none: the guess rows see everything, as in Lookahead Decoding."""

    name = "none"

    def select(self, length: int) -> list[int]:
        return list(range(length))

class StreamingLLM(Compressor):
    """Xiao et al. 2024: the first `sink` tokens (attention sinks) and the `recent` newest ones.

        length 12, sink 2, recent 4  ->  [0, 1, 8, 9, 10, 11]
    """

    name = "stream"

    def __init__(self, sink: int, recent: int):
        super().__init__()
        self.sink, self.recent = sink, recent
        self.budget = sink + recent

    def select(self, length: int) -> list[int]:
        head = list(range(min(self.sink, length)))
        return head + list(range(max(self.sink, length - self.recent), length))

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
# Column-wise layout (Lookahead's): a stream's k rows are n apart, so a step's new tokens are simply the
# last n fumble rows. The layout and the mask inside the step depend only on (n, k, m), which is what lets
# the flex path build its BlockMask once.

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

    @cache
    def read_rows(self) -> tuple[int, ...]:
        """The rows whose next-token prediction the step reads: x, the newest row of every stream
        (column-wise, the last n fumble rows) and every candidate row. The other (k-1)*n fumble rows are there
        only as context for their stream's newest row, so the head (hidden -> vocab logits) skips them.
        (Cached.)

        >>> StepLayout(n=2, k=2, m=1).read_rows()   # rows 1, 2 = level 1 of the streams: not read
        (0, 3, 4, 5, 6)
        """
        return (0,) + tuple(range(1 + (self.k - 1) * self.n, self.rows))

    @cache
    def guess_rows(self) -> np.ndarray:
        """bool [q]: the rows restricted to C(kv). (Cached: treat as read-only.)"""
        g = np.zeros(self.rows, dtype=bool)
        g[1 : 1 + self.n * self.k] = True
        return g

    @cache
    def inner_mask(self) -> np.ndarray:
        """bool [q, q]: which row of the step sees which other row of it. (Cached: treat as read-only.)"""
        q = self.rows
        allowed = np.eye(q, dtype=bool)
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
        """(tokens [q], positions [q]) for this step; len(cands) must be m."""
        assert len(cands) == self.m and len(windows) == self.n
        tokens = [last] + [0] * (self.rows - 1)
        positions = [p] + [0] * (self.rows - 1)
        for i, w in enumerate(windows):
            for j, t in enumerate(w):
                r = self.fumble_row(i, j)
                tokens[r], positions[r] = t, p + 1 + i + j
        for c, cand in enumerate(cands):
            for t, tok in enumerate(cand):
                r = self.cand_row(c, t)
                tokens[r], positions[r] = tok, p + 1 + t
        return tokens, positions

def combined_mask(layout: StepLayout, cache_len: int, selected: Sequence[int]) -> np.ndarray:
    """The whole step's visibility, bool [q, cache_len + q]: the readable spec of Figure 4.
    Verification rows (last token, candidates) see the full cache; fumble rows see only `selected`."""
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
# Every candidate is checked against the model's own greedy choices; the longest run wins, plus the bonus
# token (the model's choice right after it). Ties go to the earlier candidate (= the longer key).
#
#   choice after x = ' sat';  candidate A = (' sat', ' on', ' a')    choices on A's rows: (' on', ' the', ...)
#                             candidate B = (' ran', ...)
#   A: ' sat' == ' sat' ok, ' on' == ' on' ok, ' a' != ' the'  -> 2 accepted, bonus ' the'
#   B: ' ran' != ' sat'                                        -> 0
#   => emit ' sat', ' on' (from A) + ' the' (bonus)

def find_out(cands: Sequence[Sequence[int]], first_choice: int, cand_choices: Sequence[Sequence[int]]):
    """Returns (winner index or -1, accepted count, bonus token). cand_choices[c][t] = the model's argmax
    on candidate c's row t (what comes after a_1..a_t)."""
    best, best_len, bonus = -1, 0, first_choice
    for c, cand in enumerate(cands):
        a, nxt = 0, first_choice
        while a < len(cand) and cand[a] == nxt:
            nxt = cand_choices[c][a]
            a += 1
        if a > best_len:
            best, best_len, bonus = c, a, nxt
    return best, best_len, bonus

# ---- 6. The KV back-ends, and the dense one: the mask as a tensor (the spec) -------------------------------
#
# All three give the same logits (tested); they differ in what the guess rows' attention reads:
#   DenseKV  the whole cache, then the mask zeroes most of it (what the paper's Figure 4 says, as a tensor)
#   SplitKV  C(kv) gathered + the step's own columns, in a second SDPA call (verify.py section 9b)
#   FlexKV   the head blocks of a compacted buffer, skipped block-wise by FlexAttention (§4.4, section 9)
# They expose the same four operations, so the decode loop below does not know which one it drives:
#   select(positions)       C(kv) for the next forward (flex: swap them into the head of the buffer)
#   forward(tokens, positions, ..., rows)
#                           -> logits [len(rows), V] of the rows asked for (+ hidden states if asked)
#   keep(rows, positions)   after acceptance: keep the KV of these input rows only
#   keys(start, end)        logical keys [L, H_kv, n, D] (Quest's page statistics)

def head_rows(model, rows: Sequence[int] | None) -> dict:
    """Ask the model for the logits of `rows` only: transformers' `logits_to_keep` takes a 1D tensor of
    positions (4.57 and 5.x). The head is a [hidden x vocab] matmul per row (49152 x 576 on the default
    model, a fifth of a row's multiply-adds), so the step's unread fumble rows are worth skipping. A model
    whose forward lacks the argument computes every row; rows_of() then picks the same rows."""
    return {} if rows is None else verify.last_logits_only(model, torch.tensor(rows, device=model.device))

def rows_of(logits: torch.Tensor, rows: Sequence[int] | None) -> torch.Tensor:
    """logits [q, V] (every row computed) or [len(rows), V] (just `rows`) -> [len(rows), V]. `rows` is
    increasing, so a length of q means every row, in order."""
    if rows is None or len(logits) == len(rows):
        return logits
    return logits[list(rows)]

class DenseKV:
    """The cache in logical order (verify.PreallocatedKVCache) + an additive float mask built every step."""

    def __init__(self, model, cache, layout: StepLayout):
        self.model, self.cache, self.layout = model, cache, layout
        self.selected: list[int] = []

    @property
    def length(self) -> int:
        return verify.cache_len(self.cache)

    def select(self, positions: Sequence[int]) -> None:
        self.selected = list(positions)

    @torch.no_grad()
    def forward(self, tokens, positions, hidden: bool = False, layout: StepLayout | None = None,
                rows: Sequence[int] | None = None):
        """-> (logits [len(rows), V] of the input rows `rows` (None: all q), hidden states if asked)."""
        layout = layout or self.layout
        p = self.length
        dev = self.model.device
        allowed = combined_mask(layout, p, self.selected)  # [q, p + q]
        mask = verify.additive_mask(allowed, self.model.dtype, dev)  # [1, 1, q, p + q], 0 / finfo.min
        with self.attention(allowed, layout):
            out = self.model(input_ids=torch.tensor([tokens], device=dev), attention_mask=mask,
                             position_ids=torch.tensor([positions], device=dev), past_key_values=self.cache,
                             use_cache=True, output_hidden_states=hidden, **head_rows(self.model, rows))
        return rows_of(out.logits[0], rows), (out.hidden_states if hidden else None)

    def attention(self, allowed: np.ndarray, layout: StepLayout):
        """Which attention function computes this forward: the model's own, with the mask above."""
        return contextlib.nullcontext()

    def keep(self, rows: Sequence[int], positions: Sequence[int]) -> None:
        verify.compact_kv(self.cache, positions[0], rows)  # rows are consecutive logical positions

    def keys(self, start: int, end: int) -> torch.Tensor:
        return torch.stack([layer.keys[0, :, start:end] for layer in self.cache.layers])  # [L, H_kv, n, D]

# ---- 7. The decode loop ------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], cfg: FafoConfig,
             *, pool: NgramPool | None = None, sampling: verify.Sampling = verify.GREEDY, on_emit=None,
             on_step=None) -> Generation:
    """FAFO decoding, greedy or sampled (the verification rows take verify.py's keyed sample; the guess rows
    stay greedy, they only need to be plausible). gen.extra gets the pool size and the rows per step. Pass
    your own `pool` (an NgramPool with the same k) to inspect it or carry it to the next prompt."""
    cfg.check()
    n, k, m = cfg.n_guess, cfg.k, cfg.m
    check_reach(model, cfg, len(prompt_ids), max_new_tokens)
    gen = Generation(max_new_tokens, eos_ids, on_emit=on_emit, on_step=on_step)
    compressor = make_compressor(cfg)
    pool = NgramPool(k, cfg.pool_cap or n, cfg.lookback) if pool is None else pool
    if pool.k != k:
        raise UserError(f"the pool given was built for k = {pool.k}, not k = {k}")
    streams = Streams.from_prompt(prompt_ids, n, k, cfg.seed)
    if cfg.prompt_pool:
        pool.seed(prompt_ids)
    # subtle: dense and split take as many candidates as the pool has (their mask is rebuilt anyway); flex
    # pads to exactly m (static shapes) with dummy candidates that can never be accepted.
    static = cfg.attn.startswith("flex")

    # -- prefill and the first token; the cache holds prompt + output + one whole step's rows
    layout = StepLayout(n, k, m)
    cache = verify.new_cache(model, len(prompt_ids) + max_new_tokens + layout.rows)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, **verify.last_logits_only(model),
                output_hidden_states=compressor.needs_query or compressor.window > 0)
    verify.check_filled(cache, len(prompt_ids))  # as verify.prefill does: a recurrent model fills no cache
    pending = verify.first_token(out.logits[0, -1], len(prompt_ids), sampling)
    if gen.finish_prefill(pending):
        return gen
    context = list(prompt_ids) + [pending]  # x_1 .. x_|x|; the last one is not in the KV cache yet
    kv = make_backend(model, cache, layout, cfg, compressor, len(prompt_ids) + max_new_tokens)
    observe_prompt(model, kv, compressor, out.hidden_states, len(prompt_ids))
    gen.extra.update(compress=compressor.name, guess_rows=0, candidates=0)

    while True:
        t0 = time.perf_counter()
        p = kv.length  # = len(context) - 1
        cands = pool.retrieve(context, m)  # Algorithm 3
        real = len(cands)
        cands = cands + [(pending,) * k] * (m - real) if static else cands
        step = layout if static else StepLayout(n, k, len(cands))
        kv.select(compressor.select(p))  # C(kv_1..p)
        tokens, positions = step.inputs(pending, p, streams.windows, cands)
        draft_s = time.perf_counter() - t0

        read = step.read_rows()  # x, the streams' newest rows, the candidates: the predictions we use
        logits, hidden = kv.forward(tokens, positions, hidden=compressor.needs_query, layout=step, rows=read)
        choice = choices(logits, read, step, real, positions, sampling)  # input row -> the model's token

        # Find Out (Algorithm 4) on the real candidates only
        cand_choices = [[choice[step.cand_row(c, t)] for t in range(k)] for c in range(real)]
        best, a, bonus = find_out(cands[:real], choice[0], cand_choices)
        accepted = list(cands[best][:a]) if a else []
        rows = [0] + [step.cand_row(best, t) for t in range(a)]

        # Fumble Around: every stream's newest row predicted its next token (Eq. 1) -> pool (Algorithm 2)
        streams.advance([choice[step.fumble_row(i, k - 1)] for i in range(n)], pool)

        # keep the KV of x and the accepted tokens -- from the VERIFICATION rows, never from guess rows
        kv.keep(rows, [p + j for j in range(len(rows))])
        last = rows[-1]  # the row that produced the bonus token (Quest reads its queries)
        compressor.observe(kv, layer_queries(model, hidden, [last], [positions[last]])[:, :, 0]
                           if compressor.needs_query else None)

        # the verified candidates as a draft tree (shared prefixes merged), for the common book-keeping
        tree = Tree.from_branches(pending, [list(c) for c in cands[:real]])
        path = [0]
        for t in accepted:
            path.append(tree.children[path[-1]][t])
        gen.extra["guess_rows"] += n * k
        gen.extra["candidates"] += real
        context += accepted + [bonus]
        pending = bonus
        if gen.finish_step(tree, path, bonus, draft_s):
            return finish_statistics(gen, pool, kv if static else None)

def choices(logits, read, step: StepLayout, real: int, positions, sampling: verify.Sampling) -> dict:
    """Input row -> the model's token after it: its argmax, or for the verification rows, sampled, the keyed
    sample at the position the row predicts. logits [len(read), V], one row per input row in `read`."""
    choice = dict(zip(read, logits.argmax(dim=-1).tolist()))
    if not sampling.greedy:
        check = [0] + [step.cand_row(c, t) for c in range(real) for t in range(step.k)]
        at = [read.index(r) for r in check]
        for r, tok in zip(check, sampling.choose(logits[at], [positions[r] + 1 for r in check])):
            choice[r] = tok
    return choice

# ---- Beyond the paper --------------------------------------------------------------------------------------
def check_reach(model, cfg: FafoConfig, prompt_len: int, max_new_tokens: int) -> None:
    """subtle: guess rows run ahead of the text (stream i's level-j token at p + 1 + i + j, up to p + n + k
    - 1): a model with absolute positions fails past its table, so the context check must include them."""
    if cfg.compress in ("quest", "snapkv"):
        check_llama_layout(model, cfg.compress)
    reach, n, k = prompt_len + max_new_tokens + cfg.n_guess + cfg.k, cfg.n_guess, cfg.k
    if reach > verify.context_length(model):
        raise UserError(f"prompt ({prompt_len}) + max new tokens ({max_new_tokens}) + the guess rows' lead "
                        f"(n + k = {n + k}) exceeds the model's context of {verify.context_length(model)}")

def make_backend(model, cache, layout: StepLayout, cfg: FafoConfig, compressor, capacity: int):
    """The KV back-end cfg.attn names (section 6's interface), over the prefilled cache."""
    if cfg.attn.startswith("flex"):
        return FlexKV(model, cache, layout, compressor.budget, capacity + cfg.k + 1, cfg.block_size,
                      compiled=cfg.attn == "flex-compiled")
    return (SplitKV if cfg.attn == "split" else DenseKV)(model, cache, layout)

def observe_prompt(model, kv, compressor, hidden_states, prompt_len: int) -> None:
    """What a compressor learns from the prefill: SnapKV's observation window votes once (rows = positions
    in the prompt); Quest reads the prompt's last row's queries."""
    final = prompt_len - 1
    if compressor.window:
        window = list(range(max(0, prompt_len - compressor.window), prompt_len))
        queries = layer_queries(model, hidden_states, window, window)
        compressor.observe_prompt(kv, queries, attention_scale(model))
    queries = layer_queries(model, hidden_states, [final], [final])[:, :, 0] if compressor.needs_query else \
        None
    compressor.observe(kv, queries)

def finish_statistics(gen: Generation, pool, flex) -> Generation:
    rows, cands = gen.extra.pop("guess_rows"), gen.extra.pop("candidates")
    gen.extra.update(pool_ngrams=len(pool), guess_rows_per_step=rows / gen.steps,
                     candidates_per_step=cands / gen.steps)
    if flex is not None:
        gen.extra["slots_swapped_per_step"] = flex.kv.moved / gen.steps
    return gen

# ---- 8. Two more compressions: Quest (pages) and SnapKV (the prompt's votes) -------------------------------

def quest_page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound on q.k over a page (Tang et al. 2024): per channel d, max(q_d M_d, q_d m_d),
    where M/m are the page's channel-wise max/min keys; summed over channels, max over heads.

    query [H, D]; kmin, kmax [P, H_kv, D] (H = G * H_kv query heads share each KV head) -> scores [P].
    Worked example, one head, D = 2: q = (1, -1), page keys (0, 2) and (3, -1): M = (3, 2), m = (0, -1);
    bound = max(3, 0) + max(-2, 1) = 4, and indeed the best key (3, -1) scores 3 + 1 = 4."""
    H, D = query.shape
    h_kv = kmin.shape[1]
    q = query.view(h_kv, H // h_kv, D)  # [H_kv, G, D]
    hi = q[None] * kmax[:, :, None]  # [P, H_kv, G, D]
    lo = q[None] * kmin[:, :, None]
    return torch.maximum(hi, lo).sum(-1).amax(dim=(1, 2))  # [P]

class Quest(Compressor):
    """Query-aware page selection: the cache is cut into pages of `page_size` positions; each page keeps
    its channel-wise min and max key per layer; each step the `top_pages` pages with the highest
    `quest_page_scores` (summed over layers) are selected."""

    name = "quest"
    needs_query = True

    def __init__(self, page_size: int, top_pages: int):
        super().__init__()
        self.page_size, self.top_pages = page_size, top_pages
        self.budget = page_size * top_pages
        self.kmin: torch.Tensor | None = None  # [L, P, H_kv, D]
        self.kmax: torch.Tensor | None = None
        self.pages_done = 0  # pages whose min/max are final (complete pages)
        self.scores: torch.Tensor | None = None  # [P] of the last selection (shown by --trace)

    def observe(self, kv, queries: torch.Tensor | None) -> None:
        length, ps = kv.length, self.page_size
        n_pages = -(-length // ps)
        mins, maxs = [], []
        for p in range(self.pages_done, n_pages):  # only pages that changed: the newest, partial ones
            keys = kv.keys(p * ps, min(length, (p + 1) * ps))  # [L, H_kv, n, D]
            mins.append(keys.amin(dim=2))
            maxs.append(keys.amax(dim=2))
        if mins:
            new_min, new_max = torch.stack(mins, 1), torch.stack(maxs, 1)  # [L, P', H_kv, D]
            keep = self.pages_done
            self.kmin = new_min if self.kmin is None else torch.cat([self.kmin[:, :keep], new_min], 1)
            self.kmax = new_max if self.kmax is None else torch.cat([self.kmax[:, :keep], new_max], 1)
        self.pages_done = length // ps
        self.queries = queries  # [L, H, D]

    def select(self, length: int) -> list[int]:
        n_pages = -(-length // self.page_size)
        if n_pages <= self.top_pages:
            return list(range(length))
        scores = sum(quest_page_scores(self.queries[l].float(), self.kmin[l].float(), self.kmax[l].float())
                     for l in range(self.kmin.shape[0]))  # [P]
        self.scores = scores
        pages = sorted(torch.topk(scores, self.top_pages).indices.tolist())
        ps = self.page_size
        return [x for p in pages for x in range(p * ps, min(length, (p + 1) * ps))]

def snapkv_votes(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """SnapKV's vote (Li et al. 2024): the attention that the observation window's queries pay to each
    position before the window, summed over the window's rows, the heads and the layers.

    queries [L, H, w, D] (the prompt's last w rows, RoPE applied), keys [L, H_kv, P, D] (the cache after the
    prefill) -> votes [P - w]. These are the attention weights the model itself computed in the prefill:
    the rows' softmax over every position they could see (causal inside the window), then cut to the
    positions before the window (tested against the model's own attention weights)."""
    L, H, w, _ = queries.shape
    P = keys.shape[2]
    G = H // keys.shape[1]  # query heads per KV head (grouped-query attention)
    row_pos = torch.arange(P - w, P, device=keys.device)  # where the window's rows sit
    future = torch.arange(P, device=keys.device)[None, :] > row_pos[:, None]  # [w, P]: causal mask
    votes = torch.zeros(P - w, device=keys.device)
    for l in range(L):  # one layer at a time: [H, w, P] stays small at long context
        k = keys[l].float().repeat_interleave(G, dim=0)  # [H, P, D]
        logits = (queries[l].float() @ k.transpose(-1, -2)) * scale  # [H, w, P]
        attn = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        votes += attn[:, :, : P - w].sum(dim=(0, 1))
    return votes

class SnapKV(Compressor):
    """Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
    arXiv:2404.14469: a static selection, made once after the prefill. The prompt's last `window_size` rows
    (the observation window) vote with their attention; the votes are average-pooled over `kernel_size`
    neighbours (so a selected token keeps its context) and the top max_capacity_prompt - window_size positions
    are kept, with the window. FAFO names it as its third compression method (Appendix, Table 8). The guess
    rows then see that selection plus the `recent` newest positions (the tokens generated since the prompt).

        prompt 12, window 2, capacity 5: votes over positions 0..9 -> top 3, say [1, 2, 7], + window [10, 11]
        -> C(kv) = [1, 2, 7, 10, 11] + the most recent positions

    deviation (as for Quest): one selection for every layer and head (the votes are summed), so that one
    mask and one physical layout serve the whole model. SnapKV proper selects per head."""

    name = "snapkv"

    def __init__(self, window_size: int, max_capacity_prompt: int, kernel_size: int, recent: int):
        super().__init__()
        self.window, self.capacity = window_size, max_capacity_prompt
        self.kernel, self.recent = kernel_size, recent
        self.budget = max_capacity_prompt + recent
        self.kept: list[int] = []  # the prompt positions SnapKV keeps

    def observe_prompt(self, kv, queries: torch.Tensor, scale: float) -> None:
        P, w = kv.length, queries.shape[2]
        if P <= self.capacity:
            self.kept = list(range(P))
            return
        votes = snapkv_votes(queries, kv.keys(0, P), scale)  # [P - w]
        pooled = torch.nn.functional.avg_pool1d(votes[None, None], self.kernel, stride=1,
                                                padding=self.kernel // 2)[0, 0]  # [P - w] (odd kernel)
        top = torch.topk(pooled, self.capacity - w).indices
        self.kept = sorted(top.tolist()) + list(range(P - w, P))

    def select(self, length: int) -> list[int]:
        return sorted(set(self.kept).union(range(max(0, length - self.recent), length)))

def check_llama_layout(model, compress: str = "quest") -> None:
    """Quest and SnapKV recompute each layer's queries from its input (layer_queries below), which needs the
    Llama-family module layout. Other families (GPT-2, GPT-NeoX, Phi3's fused qkv) are refused clearly."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    ok = layers is not None and hasattr(inner, "rotary_emb") and all(
        hasattr(l, "input_layernorm") and hasattr(getattr(l, "self_attn", None), "q_proj")
        for l in layers
    )
    if not ok:
        raise UserError(f"--compress {compress} needs a Llama-style layout (input_layernorm, q_proj, "
                        "rotary); "
                        f"{model.config.model_type} has another: use --compress stream or none")

def layer_queries(model, hidden_states, rows: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """The query vectors every layer computed for input rows `rows` at `positions`: [L, H, r, D], RoPE
    applied (cached keys carry RoPE too, so q.k times the layer's scaling is exactly the attention logit).

    note: Llama-family layout (input_layernorm -> q_proj, rotary_emb); hidden_states[l] is layer l's input,
    as transformers returns it with output_hidden_states=True."""
    inner = model.model
    cfg = model.config
    H = cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    r = len(rows)
    hs = torch.stack([hidden_states[l][0, list(rows)] for l in range(cfg.num_hidden_layers)])  # [L, r, hid]
    pos = torch.tensor([list(positions)], device=hs.device)
    cos, sin = inner.rotary_emb(hs[:1], position_ids=pos)  # [1, r, D]
    qs = []
    for l, layer in enumerate(inner.layers):
        q = layer.self_attn.q_proj(layer.input_layernorm(hs[l])).view(r, H, D)  # [r, H, D]
        if hasattr(layer.self_attn, "q_norm"):  # QK-norm (Qwen3): each head's query is normalised before RoPE
            q = layer.self_attn.q_norm(q)
        q = q.transpose(0, 1)  # [H, r, D]
        rot = torch.cat([-q[..., D // 2 :], q[..., : D // 2]], dim=-1)  # rotate_half
        qs.append(q * cos[0] + rot * sin[0])
    return torch.stack(qs)  # [L, H, r, D]

def attention_scale(model) -> float:
    """The factor on q.k in the model's attention (transformers keeps it as self_attn.scaling; 1/sqrt(D)
    otherwise)."""
    attn = model.model.layers[0].self_attn
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return float(getattr(attn, "scaling", D ** -0.5))

# ---- 9. The split back-end (ours, the CPU default): the guess rows' attention in its own call --------------

#
#
#     allowed [q rows, p cached + q step columns]        group           keys it reads
#     row 0 and the candidates: the whole cache     ->   verification    all p + q  (no gather)
#     the n*k guess rows: C(kv) + a few step columns ->  guess           |C(kv)| + 1 + n*k, gathered
#
# Every allowed (row, column) pair lies inside its group's block, so the two calls compute exactly the
# masked attention of the dense spec (up to float rounding: a softmax over fewer, all-masked-out-anyway
# columns). The guess rows' work drops from O(p) to O(|C(kv)|) per layer, on any device, with no compile.
#
# note: grouped-query attention. transformers' own SDPA function copies each KV head G times (repeat_kv)
# whenever a mask is given; SDPA's `enable_gqa=True` (torch >= 2.5) reads the shared heads in place. At a
# long context that copy is a large part of a masked step's cost on a CPU, so this path is faster than the
# dense one even where it skips nothing (--compress none). Compare the methods on the same back-end.

@dataclass
class SplitGroup:
    rows: torch.Tensor  # [r] query rows of the step in this group
    cols: torch.Tensor | None  # [c] key columns they may see (None: all of them, no gather)
    mask: torch.Tensor  # [1, 1, r, c] additive float: 0 where allowed, finfo.min elsewhere

@dataclass
class SplitPlan:
    groups: list[SplitGroup]
    n_keys: int  # cached + step columns the forward's attention sees: checks that the plan fits the call

    @classmethod
    def from_mask(cls, allowed: np.ndarray, row_groups: Sequence[Sequence[int]], dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> "SplitPlan":
        """allowed: bool [q, n_keys], the dense spec mask; row_groups: a partition of its rows. Each group
        reads the union of its rows' visible columns, gathered, or all columns if that union is more than
        half of them (a gather that skips little costs more than it saves). Groups that read all columns
        are merged into one call.

        >>> allowed = np.array([[1, 1, 1, 1, 1, 1, 1, 0],   # row 0: verification, sees all 6 cached columns
        ...                     [1, 0, 0, 0, 0, 1, 1, 1]],  # row 1: guess, sees cached 0 and 5, and the step
        ...                    dtype=bool)
        >>> plan = SplitPlan.from_mask(allowed, [[0], [1]], torch.float32)
        >>> [(g.rows.tolist(), None if g.cols is None else g.cols.tolist()) for g in plan.groups]
        [([0], None), ([1], [0, 5, 6, 7])]
        >>> len(SplitPlan.from_mask(np.ones((2, 8), bool), [[0], [1]], torch.float32).groups)  # no skip
        1
        """
        q, n_keys = allowed.shape
        assert sorted(r for g in row_groups for r in g) == list(range(q)), "row_groups: not a partition"
        groups, full = [], []  # full: rows of the groups that read every column
        for rows in row_groups:
            rows = np.asarray(rows, dtype=np.int64)
            if len(rows) == 0:
                continue
            vis = allowed[rows]  # [r, n_keys]
            cols = np.nonzero(vis.any(axis=0))[0]
            if len(cols) > n_keys // 2:  # not worth a gather: read every column, mask as the spec does
                full.extend(rows.tolist())
            else:
                groups.append(SplitGroup(torch.as_tensor(rows, device=device),
                                         torch.as_tensor(cols, device=device),
                                         verify.additive_mask(vis[:, cols], dtype, device)))
        if full:
            full.sort()
            groups.insert(0, SplitGroup(torch.as_tensor(full, device=device), None,
                                        verify.additive_mask(allowed[full], dtype, device)))
        return cls(groups, n_keys)

def _split_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   plan: SplitPlan = None, **kwargs):
    """A transformers attention function: query [B, H, q, D], key/value [B, H_kv, n_keys, D] (the cache
    after this step's update). `attention_mask` (the dense spec, as the model passed it on) is not read:
    `plan` holds the same mask cut into row groups."""
    import torch.nn.functional as F

    assert key.shape[-2] == plan.n_keys, f"split path: a plan for {plan.n_keys} keys, not {key.shape[-2]}"
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)  # [B, H, q, D]
    for g in plan.groups:
        k = key if g.cols is None else key.index_select(2, g.cols)  # [B, H_kv, c, D]
        v = value if g.cols is None else value.index_select(2, g.cols)
        out[:, :, g.rows] = F.scaled_dot_product_attention(query.index_select(2, g.rows), k, v,
                                                           attn_mask=g.mask.to(query.dtype), scale=scaling,
                                                           enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D], as every transformers attention returns

SPLIT = "specdec_split"

def split_mode(model, plan: SplitPlan):
    """`with split_mode(model, plan):` -- the model's attention goes through `_split_forward` with `plan`."""
    return verify.attention_function(model, SPLIT, functools.partial(_split_forward, plan=plan))

class SplitKV(DenseKV):
    """The dense back-end's cache and mask, but attention runs as two SDPA calls per layer (verify.py section
    9b): the verification rows over the whole cache, the guess rows over C(kv) gathered plus their step
    columns. Same result as DenseKV; the guess rows' attention costs O(|C(kv)|) instead of O(p)."""

    def attention(self, allowed: np.ndarray, layout: StepLayout):
        """The same spec mask `allowed` [q, p + q], cut into two row groups: verification rows, guess rows.
        note: the model still gets the dense mask (DenseKV.forward), so every model family prepares its
        inputs exactly as on the dense path; only the attention function, which reads the plan, differs."""
        guess = layout.guess_rows()
        plan = SplitPlan.from_mask(allowed, [np.nonzero(~guess)[0], np.nonzero(guess)[0]],
                                          self.model.dtype, self.model.device)
        return split_mode(self.model, plan)

# ---- 10. The flex back-end: FlexAttention over verify.py's CompactedKVCache (§4.4) -------------------------

class FlexKV:
    """verify.CompactedKVCache + FlexAttention: C(kv) is kept at the head of a fixed buffer and one static
    BlockMask lets the guess rows skip every other block."""

    def __init__(self, model, cache, layout: StepLayout, budget: int, max_len: int, block_size: int,
                 compiled: bool):
        self.model, self.layout = model, layout
        self.kv = verify.CompactedKVCache(model, head_slots=budget, input_rows=layout.rows,
                                          tail_slots=max_len, block_size=block_size)
        self.kv.load(cache)  # everything to the tail; the first select() swaps C(kv) in
        self.block_mask = self.kv.block_mask(layout.inner_mask(), layout.guess_rows())  # built ONCE
        self.compiled = compiled

    @property
    def length(self) -> int:
        return self.kv.length

    def select(self, positions: Sequence[int]) -> None:
        self.kv.reselect(positions)

    @torch.no_grad()
    def forward(self, tokens, positions, hidden: bool = False, layout=None, rows=None):
        dev = self.model.device
        with verify.flex_mode(self.model, self.compiled):
            out = self.model(input_ids=torch.tensor([tokens], device=dev), attention_mask=self.block_mask,
                             position_ids=torch.tensor([positions], device=dev), past_key_values=self.kv,
                             use_cache=True, output_hidden_states=hidden, **head_rows(self.model, rows))
        return rows_of(out.logits[0], rows), (out.hidden_states if hidden else None)

    def keep(self, rows: Sequence[int], positions: Sequence[int]) -> None:
        self.kv.commit(rows, positions)

    def keys(self, start: int, end: int) -> torch.Tensor:
        s = self.kv.logical_slots(start, end)
        return self.kv.K[:, 0][:, :, s]  # [L, H_kv, n, D]

# ---- 11. CLI -----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = verify.common_parser(
        "FAFO: n guess streams attend to a compressed KV cache (fumble around) while the pool's candidates\n"
        "are verified against the full cache (find out), in one forward per step. Lossless: the output\n"
        "equals greedy decoding (or, with --temperature, the plain sampler's). --trace shows each step's\n"
        "candidates."
    )
    def default(name):
        return verify.defaults_help(FafoConfig, name)

    g = parser.add_argument_group("FAFO (the paper's names; CPU defaults are small: every row costs time "
                                  "there)")
    g.add_argument("--n-guess", type=int, help="n: guess streams in the fumble branch (§4.2)"
                   + default("n_guess"))
    g.add_argument("--k", type=int,
                   help="k: tokens per stream = guessed n-gram length = longest pool key (§4.2)"
                        + default("k"))
    g.add_argument("--m", type=int, help="m: pool candidates verified per step (Algorithm 3)" + default("m"))
    g.add_argument("--compress", choices=["stream", "quest", "snapkv", "none"],
                   help="C: stream = StreamingLLM, quest = Quest pages, snapkv = SnapKV's prompt "
                        "selection + the recent positions, none = full KV (Lookahead) (default: stream)")
    g.add_argument("--sink", type=int, help="StreamingLLM: attention-sink tokens kept" + default("sink"))
    g.add_argument("--recent", type=int, help="StreamingLLM: most recent tokens kept" + default("recent"))
    g.add_argument("--page-size", type=int, help="Quest: positions per page" + default("page_size"))
    g.add_argument("--top-pages", type=int, help="Quest: pages selected per step" + default("top_pages"))
    g.add_argument("--window-size", type=int,
                   help="SnapKV: observation window, the prompt's last rows whose attention votes"
                        + default("window_size"))
    g.add_argument("--max-capacity-prompt", type=int,
                   help="SnapKV: prompt positions kept, the window included" + default("max_capacity_prompt"))
    g.add_argument("--kernel-size", type=int,
                   help="SnapKV: average-pooling width over the votes" + default("kernel_size"))
    g.add_argument("--attn", choices=["dense", "split", "flex", "flex-compiled"],
                   help="dense mask (the spec); split = two SDPA calls per layer, guess rows over C(kv) "
                        "only; flex = compacted blocks (eager: checks the layout), flex-compiled"
                        + default("attn"))
    g.add_argument("--pool-cap", type=int, help="pool: k-grams kept per key, LRU (Appendix F; default: n)")
    g.add_argument("--lookback", type=int,
                   help="pool: longest key, in tokens before the n-gram (§4.3's lookback window; "
                        "default: k). 1 = Lookahead Decoding's pool, keyed by the last token only")
    g.add_argument("--prompt-pool", action="store_const", const=True,
                   help="also seed the pool with the prompt's k-grams (not in the paper)")
    g.add_argument("--block-size", type=int, help="flex: KV block size, B_z in Algorithm 1 (default: 128)")
    config = lambda args, device: verify.config_from_args(FafoConfig.for_device(device), args)
    return verify.run_cli(parser, "fafo", generate, config, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
