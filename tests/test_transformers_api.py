# SPDX-License-Identifier: MIT
"""How we talk to transformers while it moves under us: the one place that hands a model its KV cache
(verify.model_forward, under the keyword the model's forward takes), and the suite's guard (conftest.py) that
fails any test in which our own code calls something transformers or torch has deprecated."""

import logging
import warnings

import pytest
import torch

import verify


class TakesCache(torch.nn.Module):  # transformers >= 5.24
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None):
        return cache


class TakesPastKeyValues(torch.nn.Module):  # transformers < 5.24
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
        return past_key_values


def test_the_cache_keyword_is_read_from_the_forward_signature():
    assert verify.cache_keyword(TakesCache()) == "cache"
    assert verify.cache_keyword(TakesPastKeyValues()) == "past_key_values"
    marker = object()
    assert verify.model_forward(TakesCache(), marker, input_ids=None) is marker
    assert verify.model_forward(TakesPastKeyValues(), marker, input_ids=None) is marker


@pytest.mark.compat
def test_model_forward_extends_the_cache_as_one_full_forward_would(tiny):
    """Oracle: one cacheless forward over the whole sequence. The cache reaches the model under whichever
    keyword the installed transformers takes (and, by the guard, without a deprecation notice)."""
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = verify.new_cache(tiny, 16)
    with torch.no_grad():
        full = tiny(input_ids=ids).logits[0]  # [12, V]
        first = verify.model_forward(tiny, cache, input_ids=ids[:, :8]).logits[0]  # [8, V]
        rest = verify.model_forward(tiny, cache, input_ids=ids[:, 8:]).logits[0]  # [4, V], reads 8 cached
    assert verify.cache_len(cache) == 12
    torch.testing.assert_close(torch.cat([first, rest]), full, atol=1e-5, rtol=0)


# ---- the guard (conftest.no_deprecation_from_our_calls) ----------------------------------------------------

def renamed_keyword(new=None, **old):
    """A stand-in for transformers' deprecate_kwarg: the old keyword still works, with a FutureWarning."""
    if old:
        warnings.warn("`old` is deprecated and will be removed in version 9.0. Use `new` instead.",
                      FutureWarning, stacklevel=2)
    return new


def renamed_attribute():
    """A stand-in for a transformers attribute that notifies through its logger (out.past_key_values does)."""
    logging.getLogger("transformers.some_model").warning("`past_key_values` is deprecated. Use `cache`.")


LIBRARY_FILE = "/usr/lib/python3/dist-packages/some_library/internal.py"  # not a file of this repository
LIBRARY_CODE = compile("def library_call(api):\n    return api(old=1)\n", LIBRARY_FILE, "exec")


def test_the_guard_catches_our_deprecated_call_and_spares_a_librarys_own(no_deprecation_from_our_calls):
    log = no_deprecation_from_our_calls
    renamed_keyword(old=1)  # our call
    assert len(log.ours) == 1 and log.ours[0].startswith("tests/test_transformers_api.py:")
    assert "`old` is deprecated" in log.ours[0]
    library = {}
    exec(LIBRARY_CODE, library)
    library["library_call"](renamed_keyword)  # the library's own call: not ours
    renamed_attribute()
    assert len(log.ours) == 2 and "transformers logger" in log.ours[1]  # its logger, from our call
    log.ours.clear()


def test_the_guard_sees_the_renamed_keyword_itself(tiny, no_deprecation_from_our_calls):
    """The case that broke a fresh install: `past_key_values=` on a transformers whose forward takes `cache`."""
    if verify.cache_keyword(tiny) != "cache":
        pytest.skip("this transformers takes past_key_values: nothing is deprecated")
    log = no_deprecation_from_our_calls
    with torch.no_grad():
        tiny(input_ids=torch.tensor([[1, 5, 6]]), past_key_values=verify.new_cache(tiny, 8), use_cache=True)
    assert any("past_key_values" in line and "test_transformers_api.py" in line for line in log.ours), log.ours
    log.ours.clear()
