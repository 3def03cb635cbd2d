# SPDX-License-Identifier: MIT
"""The CUDA tier: what a user of one GPU gets with the defaults, checked against the same oracles as on the CPU.

Every test here carries the `cuda` marker and is skipped where torch sees no GPU, so the CPU CI collects them
(`pytest --collect-only -m cuda` lists them) but runs none. On a GPU machine:

    pytest -m cuda tests          # this tier alone (a few minutes on an H100)
    pytest tests                  # the whole suite, this tier included

The oracles: HF `generate(do_sample=False)` for greedy, our plain sampler (verify.vanilla_generate) for seeded
sampling, and one method against itself across back-ends or modes. The model is the real default model in
float32, which `--dtype auto` now gives on CUDA too (TF32 off), with each method's CUDA defaults
(`XConfig.for_device("cuda")`, i.e. the papers' settings) and its `prepare()` exactly as the CLI runs them.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import card
import tools.methods
import verify
from conftest import REAL_PROMPTS

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the cuda tier)")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_NEW = 64  # new tokens per run: long enough for every method to draft and accept, short enough for the tier
PROMPTS = REAL_PROMPTS[:2]
METHODS = {name: tools.methods.module_of(name) for name in tools.methods.METHODS}
CONFIGS = {name: tools.methods.config_of(name) for name in tools.methods.METHODS}


@pytest.fixture(scope="module")
def gpu():
    """(model, tokenizer) of the default model as `--device auto --dtype auto` loads it on a GPU machine."""
    model, tok = verify.load_model(verify.DEFAULT_MODEL, device="cuda", dtype="auto")
    assert model.dtype == torch.float32 and model.device.type == "cuda"
    return model, tok


def run_with_defaults(name, model, tok, ids, n, eos, sampling=verify.GREEDY, **changes):
    """One method with its CUDA defaults (optionally some fields changed), prepared as the CLI prepares it."""
    module = METHODS[name]
    cfg = dataclasses.replace(CONFIGS[name].for_device(model.device), **changes)
    extra = {}
    if hasattr(module, "prepare"):
        cfg, extra = module.prepare(model, tok, cfg)
    try:
        return module.generate(model, ids, n, eos, cfg, sampling=sampling, **extra)
    finally:  # CARD's parallel mode: prepare() started a draft process, which this run owns
        for v in extra.values():
            if isinstance(v, card.DraftProcess):
                v.close()


def test_auto_dtype_is_float32_without_tf32(gpu):
    model, _ = gpu
    assert model.dtype == torch.float32
    assert torch.get_float32_matmul_precision() == "highest"  # TF32 off: float32 matmuls stay float32
    assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("name", list(METHODS))
def test_method_with_cuda_defaults_is_hf_greedy(gpu, name, prompt):
    model, tok = gpu
    ids = verify.encode_prompt(tok, prompt)
    eos = verify.eos_ids_of(model, tok)
    want = verify.hf_generate(model, ids, N_NEW, eos)
    gen = run_with_defaults(name, model, tok, ids, N_NEW, eos)
    assert gen.tokens == want, name
    assert gen.target_forwards <= len(gen.tokens)


def test_fafo_flex_compiled_equals_dense(gpu):
    """FAFO §4.4's compacted-block FlexAttention path, compiled (the fast path on a GPU), against the dense
    mask (the readable spec): the same tokens, and both HF greedy's."""
    model, tok = gpu
    ids = verify.encode_prompt(tok, PROMPTS[0])
    eos = verify.eos_ids_of(model, tok)
    dense = run_with_defaults("fafo", model, tok, ids, 48, eos, attn="dense")
    flex = run_with_defaults("fafo", model, tok, ids, 48, eos, attn="flex-compiled")
    # note: only the tokens are compared, not the forwards: a guess row's argmax may flip at a near-tie between
    # the two kernels, which changes the pool (never the output)
    assert flex.tokens == dense.tokens == verify.hf_generate(model, ids, 48, eos)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_card_parallel_equals_lockstep(gpu, prompt):
    """CARD's parallel mode (the draft in its own process, sharing the GPU) emits exactly lockstep's tokens,
    whatever the timing."""
    model, tok = gpu
    ids = verify.encode_prompt(tok, prompt)
    eos = verify.eos_ids_of(model, tok)
    lock = run_with_defaults("card", model, tok, ids, N_NEW, eos, mode="lockstep")
    par = run_with_defaults("card", model, tok, ids, N_NEW, eos, mode="parallel")
    assert par.tokens == lock.tokens == verify.hf_generate(model, ids, N_NEW, eos)
    s = verify.Sampling(0.8, top_p=0.95, seed=3)
    lock = run_with_defaults("card", model, tok, ids, 32, eos, sampling=s, mode="lockstep")
    par = run_with_defaults("card", model, tok, ids, 32, eos, sampling=s, mode="parallel")
    assert par.tokens == lock.tokens == verify.vanilla_generate(model, ids, 32, eos, s).tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_cacheback_sampled_is_the_plain_sampler(gpu, seed):
    """Seeded sampling on CUDA: the keyed Gumbel noise is drawn on the CPU in float64, so the same seed gives
    the plain sampler's tokens on any device."""
    model, tok = gpu
    ids = verify.encode_prompt(tok, PROMPTS[1])
    eos = verify.eos_ids_of(model, tok)
    s = verify.Sampling(0.7, top_p=0.9, seed=seed)
    want = verify.vanilla_generate(model, ids, 48, eos, s).tokens
    gen = run_with_defaults("cacheback", model, tok, ids, 48, eos, sampling=s)
    assert gen.tokens == want


def test_cli_default_on_cuda_is_float32_and_identical():
    """What a new user types: the README's demo with --compare, no --device or --dtype."""
    r = subprocess.run([sys.executable, "ngram_predictor.py", "--prompt", REAL_PROMPTS[4], "--max-new-tokens", "48",
                        "--json", "--compare"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["device"].startswith("cuda") and out["dtype"] == "float32"
    assert out["identical"] is True and out["identity_expected"] is True
