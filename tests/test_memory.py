# SPDX-License-Identifier: MIT
"""What a run holds beyond the target's weights (FAFO's memory claim, Table 1 and §3.1): verify.tensor_bytes
counts tensors, each storage once; every method reports gen.extra["held_bytes"]. Oracles: the KV cache's size
from the model's config, an int8 model's size from its float original's shapes, and lockstep CARD against the
same draft in its own process."""

import pytest
import torch

import card
import fafo
import verify
from conftest import make_tiny_llama

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]


def test_a_kv_cache_counts_its_allocated_capacity(tiny):
    n = 10
    gen = verify.vanilla_generate(tiny, PROMPT, n, [95])
    capacity = len(PROMPT) + n + 1  # what vanilla_generate allocates
    assert gen.extra["held_bytes"] == verify.kv_cache_bytes(tiny.config, capacity, torch.float32)


def test_an_int8_model_counts_one_byte_a_weight():
    model = make_tiny_llama(seed=1)
    want = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # int8 weight, per-channel float64 scale + int64 zero point
            want += module.weight.numel() + 16 * module.out_features
            want += 0 if module.bias is None else 4 * module.bias.numel()
        else:
            want += sum(4 * p.numel() for p in module.parameters(recurse=False))
            want += sum(b.untyped_storage().nbytes() for b in module.buffers(recurse=False))
    assert verify.tensor_bytes(card.int8_draft(model)) == want


def test_fafo_holds_its_cache_and_its_pool(tiny):
    cfg = fafo.FafoConfig.cpu()
    pool = fafo.NgramPool(cfg.k, cfg.n_guess)
    gen = fafo.generate(tiny, PROMPT, 16, [95], cfg, pool=pool)
    capacity = len(PROMPT) + 16 + fafo.StepLayout(cfg.n_guess, cfg.k, cfg.m).rows
    ids = sum(len(key) + cfg.k * len(bucket) for key, bucket in pool.table.items())
    assert gen.extra["held_bytes"] == verify.kv_cache_bytes(tiny.config, capacity, torch.float32) + 4 * ids


@pytest.mark.skipif(not hasattr(torch.multiprocessing, "get_context"), reason="no multiprocessing")
def test_card_counts_the_draft_alike_in_either_process(tiny):
    cfg = card.CardConfig(K=2, k=2, ratio=3, mode="lockstep")
    lockstep = card.generate(tiny, PROMPT, 12, [95], cfg, draft_model=tiny)
    parallel = card.generate(tiny, PROMPT, 12, [95], card.CardConfig(K=2, k=2, ratio=3, mode="parallel"),
                             draft_model=tiny)
    assert lockstep.extra["draft_held_bytes"] == parallel.extra["draft_held_bytes"]
    assert lockstep.extra["draft_held_bytes"] > verify.tensor_bytes(tiny)  # the weights and a cache
    assert lockstep.extra["held_bytes"] > lockstep.extra["draft_held_bytes"]  # plus the target's cache
