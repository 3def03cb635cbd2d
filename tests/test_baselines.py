# SPDX-License-Identifier: MIT
"""The vanilla loop against the oracle, HF generate(do_sample=False), on the real default model."""

import os
import subprocess
import sys

import pytest

import verify
from conftest import REAL_PROMPTS, ROOT, encode


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:3])
def test_vanilla_is_token_identical_to_hf_generate(real, oracle, prompt):
    ids, eos = encode(real, prompt)
    want = oracle(ids, 48, eos)
    gen = verify.vanilla_generate(real[0], ids, 48, eos)
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


def test_default_model_is_the_smollm2_gguf_converted_once(real):
    """The set-up step (tools/convert_gguf.py, which make install runs) wrote the checkpoint the default
    model name resolves to, and running it again keeps it."""
    model, tok = real
    assert verify.resolve_model(verify.DEFAULT_MODEL) == verify.converted_dir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_gguf.py")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"{verify.converted_dir()} (up to date)", r.stderr
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.float32"


def test_prefill_computes_only_the_last_logits_and_they_equal_the_full_forward(tiny):
    """verify.prefill asks for the last position's logits only (as HF generate does): same values as the last row
    of a full forward, and a model whose forward does not take logits_to_keep is simply asked for all of them."""
    import torch

    ids = list(range(3, 40))
    full = tiny(input_ids=torch.tensor([ids])).logits[0, -1]
    seen = []
    handle = tiny.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.shape[1]))
    cache = verify.new_cache(tiny)
    try:
        last = verify.prefill(tiny, cache, ids)
    finally:
        handle.remove()
    assert seen == [1]  # the head ran on one position, not 37
    assert not cache.layers[0].keys.requires_grad  # no autograd graph kept (prefill runs under no_grad)
    assert torch.allclose(full, last, atol=1e-5)

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    assert verify.last_logits_only(NoKeep()) == {} and verify.last_logits_only(tiny) == {"logits_to_keep": 1}


def test_step_times_are_measured_once_per_machine_and_again_when_their_key_changes(tiny, tmp_path, monkeypatch):
    """verify.step_times keeps what it measured on disk (a second process starts without the pause);
    a change of what the cost depends on (here the thread count) measures again, under its own key."""
    import json

    import torch

    monkeypatch.setenv("SPECDEC_COSTS", str(tmp_path / "measured-costs.json"))
    forwards = []
    hook = tiny.register_forward_hook(lambda *a: forwards.append(1))
    threads = torch.get_num_threads()
    try:
        first = verify.step_times(tiny)
        measured = len(forwards)
        assert measured > 0 and os.path.exists(verify.costs_path())
        assert verify.step_times(tiny) == first  # read back, int keys and all
        assert len(forwards) == measured, "measured again though nothing changed"
        torch.set_num_threads(1 if threads > 1 else 2)
        verify.step_times(tiny)
        assert len(forwards) == 2 * measured, "a changed thread count must measure again"
    finally:
        torch.set_num_threads(threads)
        hook.remove()
    with open(verify.costs_path(), encoding="utf-8") as f:
        keys = [json.loads(key) for key in json.load(f)]
    assert sorted(key["threads"] for key in keys) == sorted({threads, 1 if threads > 1 else 2})
    assert all(key["processor"] == verify.cpu_name() and key["torch"] == torch.__version__ for key in keys)
