"""The documentation is code too: every `>>>` example in the method files and verify.py runs, and verify.py's
module docstring lists exactly the public names the file defines."""

import doctest
import inspect
import re

import pytest

import bench
import cacheback
import card
import fafo
import ngram_predictor
import verify

MODULES = [verify, ngram_predictor, cacheback, card, fafo, bench]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no >>> example"
    assert result.failed == 0


def test_verify_docstring_lists_its_public_names():
    listed = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", verify.__doc__.split("The public names")[1].split("Greedy speculative")[0]))
    defined = {name for name, obj in vars(verify).items()
               if not name.startswith("_") and name != "main" and (inspect.isfunction(obj) or inspect.isclass(obj))
               and obj.__module__ == "verify"}
    assert defined <= listed, f"public but not listed: {sorted(defined - listed)}"
    described = {name for name in listed if name in vars(verify)}
    assert described >= defined and all(hasattr(verify, n) for n in described)


@pytest.mark.parametrize("config,bad", [
    (cacheback.CachebackConfig, dict(tdl=4, crt=4)),
    (card.CardConfig, dict(ratio="fast")),
    (fafo.FafoConfig, dict(k=0)),
    (ngram_predictor.NgramConfig, dict(max_order=1)),
])
def test_a_bad_configuration_is_an_ordinary_value_error(config, bad):
    """Someone who copied one method file and verify.py gets normal exceptions, not a CLI-only type."""
    with pytest.raises(ValueError):
        config(**bad).check()
