# SPDX-License-Identifier: MIT
"""ngram_predictor.py: hashing, the predictor's backoff and chaining, the corrected arithmetic, the
capacity guard, and losslessness against HF greedy on the real default model."""

import json
import subprocess
import sys

import numpy as np
import pytest

import ngram_predictor as ng
import verify
from conftest import REAL_PROMPTS, ROOT, encode, run_main

# ---------------------------------------------------------------------------------------------- hashing


def test_fnv1a_known_vectors():
    # Published 64-bit FNV-1a test vectors. Byte values are token ids < 256, for which XOR-ing a whole
    # 32-bit token (the chapter's code) equals XOR-ing one byte (textbook FNV-1a).
    assert ng.fnv1a_64(b"") == 0xCBF29CE484222325 == ng.FNV_OFFSET_BASIS
    assert ng.fnv1a_64(b"a") == 0xAF63DC4C8601EC8C
    assert ng.fnv1a_64(b"foobar") == 0x85944171F73967E8


def test_fnv1a_wraps_at_2_64_and_xors_whole_token_ids():
    h = ng.fnv1a_64([49151, 7])
    expected = ((((ng.FNV_OFFSET_BASIS ^ 49151) * ng.FNV_PRIME) % 2**64) ^ 7) * ng.FNV_PRIME % 2**64
    assert h == expected and 0 <= h < 2**64
    assert ng.fnv1a_64([1, 2]) != ng.fnv1a_64([2, 1])  # order matters


# ---------------------------------------------------------------------------------------------- predictor

WORDS = "the cat sat on mat . down and dog rug a".split()
ID = {w: i + 10 for i, w in enumerate(WORDS)}
W = {i: w for w, i in ID.items()}


def ids(text):
    return [ID[w] for w in text.split()]


def test_update_counts_every_order():
    p = ng.NGramPredictor()
    p.update_batch(ids("the cat sat on"))
    on = ID["on"]
    assert p.tables[0][ng.fnv1a_64(ids("sat"))] == {on: 1}  # bigram
    assert p.tables[1][ng.fnv1a_64(ids("cat sat"))] == {on: 1}  # trigram
    assert p.tables[2][ng.fnv1a_64(ids("the cat sat"))] == {on: 1}  # 4-gram
    assert list(p.history) == ids("the cat sat on")


def test_predict_chains_its_own_predictions():
    # The chapter's trace, steps 0-2: each prediction extends the tentative context of the next one.
    p = ng.NGramPredictor()
    p.update_batch(ids("a the cat sat on the mat . the cat sat"))
    assert [W[t] for t in p.predict()] == ["on", "the", "mat", "."]
    context, orders = list(p.history)[-3:], []
    for _ in range(4):
        tok, order = p.lookup(context)
        orders.append(order)
        context.append(tok)
    assert orders == [4, 4, 4, 4]


def test_backoff_order_longest_context_first():
    p = ng.NGramPredictor()
    # 4-gram "sat on the" -> mat; trigram "on the" -> rug (more often); bigram "the" -> dog (most often)
    p.update_batch(ids("sat on the mat a on the rug a on the rug a the dog a the dog a the dog a the dog"))
    assert p.lookup(ids("sat on the")) == (ID["mat"], 4)  # the 4-gram wins although rarer
    assert p.lookup(ids("cat on the")) == (ID["rug"], 3)  # unknown 4-gram -> trigram
    assert p.lookup(ids("cat sat the")) == (ID["dog"], 2)  # unknown 4-gram and trigram -> bigram
    assert p.lookup(ids("cat sat down")) is None  # nothing -> no draft for this position


def test_most_frequent_continuation_and_tie_rule():
    p = ng.NGramPredictor()
    p.update_batch(ids("cat sat on a cat sat down a cat sat down a cat sat and"))
    assert p.lookup(ids("the cat sat"))[0] == ID["down"]  # trigram "cat sat": down 2 > on 1 = and 1
    q = ng.NGramPredictor()
    q.update_batch(ids("sat on a sat down"))
    assert q.lookup(ids("sat"))[0] == ID["on"]  # tie 1:1 -> the continuation seen first


def test_prediction_stops_at_first_unknown_context_and_respects_draft_count():
    p = ng.NGramPredictor(draft_count=2)
    p.update_batch(ids("the cat sat on the mat the cat"))
    assert len(p.predict()) == 2
    q = ng.NGramPredictor()
    q.update_batch(ids("the cat sat"))  # "sat" was never followed by anything
    assert q.predict() == []


def test_history_window_bounds_context_not_tables():
    p = ng.NGramPredictor(max_history=4)
    p.update_batch(ids("the cat sat on the mat . dog"))
    assert list(p.history) == ids("the mat . dog")
    assert ng.fnv1a_64(ids("the cat sat")) in p.tables[2]  # counts outlive the window (not pruned)


# ---------------------------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_expected_accepted_matches_monte_carlo(alpha):
    rng = np.random.default_rng(0)
    d, trials = 4, 400_000
    ok = rng.random((trials, d)) < alpha
    accepted = np.where(ok.all(axis=1), d, ok.argmin(axis=1))  # leading successes, capped at D
    assert accepted.mean() == pytest.approx(ng.expected_accepted(alpha, d), abs=0.01)


def test_chapter_numbers_corrected():
    # The chapter prints 0.94, 2.05, 3.28. The first is right; the other two are too high.
    assert ng.expected_accepted(0.5, 4) == pytest.approx(0.9375)
    assert ng.expected_accepted(0.7, 4) == pytest.approx(1.7731, abs=1e-4)
    assert ng.expected_accepted(0.9, 4) == pytest.approx(3.0951, abs=1e-4)
    # its formula as written counts the all-accepted case twice:
    for a in (0.5, 0.7, 0.9):
        assert ng.expected_accepted_as_printed(a, 4) - ng.expected_accepted(a, 4) == pytest.approx(4 * a**4 * (1 - a))


def test_alpha_estimate_recovers_alpha_from_simulated_steps():
    rng = np.random.default_rng(1)
    drafted = rng.integers(0, 5, size=50_000)
    ok = rng.random((50_000, 4)) < 0.6
    lead = np.where(ok.all(axis=1), 4, ok.argmin(axis=1))
    accepted = np.minimum(lead, drafted)
    assert ng.estimate_alpha(accepted.tolist(), drafted.tolist()) == pytest.approx(0.6, abs=0.01)
    assert ng.estimate_alpha([0, 0], [0, 0]) is None


# ---------------------------------------------------------------------------------------------- decode loop


def test_capacity_guard_limits_every_verification_batch(tiny):
    prompt = [1] + [5, 6, 7, 8, 9] * 6  # repetitive: long drafts
    sizes = []
    gen = ng.generate(tiny, prompt, 30, [95], ng.NgramConfig(draft_count=10, max_batch=3, cost="free"),
                      on_step=lambda g, tree, path, bonus: sizes.append(len(tree)))
    assert max(sizes) == 3  # [known, d0, d1]: the guard cut longer drafts
    assert gen.tokens == verify.hf_generate(tiny, prompt, 30, [95])


def test_draft_never_runs_past_max_new_tokens(tiny):
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    sizes = []
    gen = ng.generate(tiny, prompt, 3, [95], ng.NgramConfig.paper(), on_step=lambda g, tree, path, bonus: sizes.append(len(tree)))
    assert len(gen.tokens) == 3 and max(sizes) <= 2


@pytest.mark.parametrize("prompt", REAL_PROMPTS)
def test_lossless_on_real_prompts(real, oracle, prompt):
    # the chapter's: every draft is verified (the most acceptance decisions to get right)
    ids_, eos = encode(real, prompt)
    gen = ng.generate(real[0], ids_, 48, eos, ng.NgramConfig.paper())
    assert gen.tokens == oracle(ids_, 48, eos)
    assert sum(gen.drafted) > 0  # the predictor did draft on these prompts


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:2])
def test_lossless_with_the_rule_cutting_chains(real, oracle, prompt):
    # a forward over 1 + n tokens costs 1 + n/4 of a plain one: the rule cuts most chains short
    ids_, eos = encode(real, prompt)
    steep = {n: 0.04 * (1 + (n - 1) / 4) for n in (1, 2, 3, 4, 5)}
    gen = ng.generate(real[0], ids_, 48, eos, ng.NgramConfig(cost="pinned"), step_times=steep)
    assert gen.tokens == oracle(ids_, 48, eos)
    assert "withheld" in gen.extra["rule"] and not gen.extra["rule"]["withheld"].startswith("0 of")


def test_lossless_when_no_draft_is_ever_produced(real, oracle):
    # Raw text, no chat template, and a short generation of tokens that never repeat: the predictor never
    # finds a context, so every step is the no-draft fallback.
    ids_, eos = encode(real, "Once upon a time", chat=False)
    want = oracle(ids_, 8, eos)
    gen = ng.generate(real[0], ids_, 8, eos, ng.NgramConfig.paper())
    assert gen.tokens == want and sum(gen.drafted) == 0 and gen.target_forwards == len(want)


def test_lossless_when_eos_falls_inside_an_accepted_draft(real, oracle):
    # The answer repeats the prompt's sentence, and in the prompt "." is followed by <|im_end|>: the
    # predictor drafts the EOS and the model accepts it inside the draft.
    ids_, eos = encode(real, "Repeat exactly: The cat sat on the mat.")
    gen = ng.generate(real[0], ids_, 64, eos, ng.NgramConfig.paper())
    assert gen.tokens == oracle(ids_, 64, eos)
    assert gen.tokens[-1] in eos and gen.from_draft[-1]  # EOS came from an accepted draft


def test_cli_json_has_the_chapter_estimate():
    r = subprocess.run([sys.executable, "ngram_predictor.py", "--prompt", "Repeat exactly: one two three four.",
                        "--max-new-tokens", "16", "--json", "--compare"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["method"] == "ngram" and out["identical"] is True
    assert {"alpha", "cost_ratio", "predicted_speedup"} <= set(out) and out["cost_ratio"] > 0


@pytest.mark.parametrize("flag,value,message", [("--max-order", "1", "--max-order"), ("--draft-count", "-1", "--draft-count"),
                                                ("--max-batch", "0", "--max-batch")])
def test_cli_rejects_bad_parameters(flag, value, message):
    status, _, err = run_main(ng, ["--prompt", "hi", flag, value])
    assert status == 2 and err.startswith("error: ") and message in err and err.strip().count("\n") == 0


def test_max_history_bounds_only_the_deque():
    """The chapter's sliding window: drafts read the last MAX_ORDER - 1 tokens, so any window of at least
    that many tokens drafts the same (oracle: the default 512-token window)."""
    import random

    rng = random.Random(3)
    text = [rng.randrange(5, 40) for _ in range(700)]  # longer than the 512-token window
    drafts = []
    for window in (3, 64, ng.MAX_HISTORY):
        p = ng.NGramPredictor(max_history=window)
        seen = []
        for t in text:
            p.update(t)
            seen.append(p.draft())
        drafts.append(seen)
    assert drafts[0] == drafts[1] == drafts[2]
