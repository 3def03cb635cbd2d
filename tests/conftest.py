"""Shared fixtures: a tiny random Llama for the mechanics (fast, deterministic) and the real default model
(SmolLM2-135M-Instruct, float32, CPU) for the oracle tests."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
sys.path.insert(0, ROOT)

import verify  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def make_tiny_llama(seed: int = 0, vocab: int = 96):
    """A 2-layer Llama with random weights: every mechanism of the real model (RoPE, GQA, sdpa, the
    DynamicCache) in a few milliseconds per forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float().eval()
    # Random weights give nearly flat distributions; scaling the output layer up makes the argmax decisive,
    # so tiny float differences cannot flip it and token-level comparisons are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="session")
def tiny():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the default model in float32 on CPU -- the configuration the lossless
    guarantee is stated for."""
    return verify.load_model(verify.DEFAULT_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def draft_bf16():
    """CARD's default draft: the default model's own weights in bfloat16."""
    return verify.load_model(verify.DEFAULT_MODEL, device="cpu", dtype="bfloat16")[0]


@pytest.fixture(scope="session")
def draft_int8(real):
    """CARD's CPU default draft: the default model with its linear layers in int8."""
    import card

    return card.int8_draft(real[0])


def running(pid: int) -> bool:
    """Whether a process runs (Linux, /proc): a zombie that nobody has reaped yet counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# A few real prompts, used by the lossless tests of every method.
REAL_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List the first five prime numbers and say what a prime number is.",
    "Translate into French: The cat is sleeping on the warm windowsill.",
    "Write a Python function that returns the factorial of n.",
]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compat: the lossless tests the CI compatibility job re-runs with the oldest transformers"
    )
    config.addinivalue_line(
        "markers", "cuda: the GPU tier (tests/test_cuda.py): skipped without CUDA; run it with pytest -m cuda"
    )
