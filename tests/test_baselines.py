"""The vanilla loop against the oracle, HF generate(do_sample=False), on the real default model."""

import pytest

import verify
from conftest import REAL_PROMPTS


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:3])
def test_vanilla_is_token_identical_to_hf_generate(real, prompt):
    model, tok = real
    ids = verify.encode_prompt(tok, prompt)
    eos = verify.eos_ids_of(model, tok)
    want = verify.hf_generate(model, ids, 48, eos)
    gen = verify.vanilla_generate(model, ids, 48, eos)
    assert gen.tokens == want
    assert gen.target_forwards == len(want)  # one forward per token, prefill included


def test_forward_count_matches_model_calls(tiny):
    calls = []
    handle = tiny.register_forward_hook(lambda *a: calls.append(1))
    try:
        gen = verify.vanilla_generate(tiny, [1, 5, 6], 9, eos_ids=[95])
    finally:
        handle.remove()
    assert len(calls) == gen.target_forwards == 9


def test_default_model_is_the_smollm2_gguf(real):
    model, tok = real
    assert verify.default_gguf_path().endswith(".gguf")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.float32"
