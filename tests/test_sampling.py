# SPDX-License-Identifier: MIT
"""Sampling (verify.Sampling): Gumbel-max noise keyed by (seed, position).

Oracles: the exact filtered softmax (a chi-square test of the plain sampler, which must also FAIL for two
deliberately broken samplers), greedy decoding (top-k 1, a tiny top-p), and the plain sampler itself: every
method, sampled, must emit exactly its tokens for the same seed."""

import dataclasses
import math
import os

import pytest
import torch

import cacheback
import card
import fafo
import ngram_predictor
import verify
from conftest import REAL_PROMPTS, encode, make_tiny_llama, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------- the sampler


def test_filtering_keeps_top_k_then_the_top_p_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    z = verify.Sampling(temperature=1.0, top_p=0.7).filtered(logits)
    assert torch.isfinite(z).tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.5 + 0.3
    z = verify.Sampling(temperature=1.0, top_k=3, top_p=1.0).filtered(logits)
    assert torch.isfinite(z).tolist() == [[True, True, True, False]]
    z = verify.Sampling(temperature=1.0, top_p=1e-9).filtered(logits)
    assert torch.isfinite(z).tolist() == [[True, False, False, False]]  # the top token always stays


def test_the_token_depends_on_seed_and_position_only():
    s = verify.Sampling(temperature=1.0, seed=11)
    logits = torch.zeros(3, 50)  # uniform: the noise alone decides
    a = s.choose(logits, [7, 7, 8])
    assert a[0] == a[1] and s.choose(logits[:1], [7]) == a[:1]  # same position, same token, whatever the row
    assert len({tuple(verify.Sampling(1.0, seed=k).choose(logits[:1], [7])) for k in range(20)}) > 5


def first_two_logits(model, prompt):
    """The logits of the first new token [1, V], and {t1: the logits of the second after t1 [1, V]}."""
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1:]
        second = {t: model(torch.tensor([prompt + [t]])).logits[0, -1:] for t in range(first.shape[-1])}
    return first, second


def exact_first_two(first, second, sampling):
    """{(t1, t2): probability} under the filtered softmax."""
    p1 = torch.softmax(sampling.filtered(first), -1)[0]
    out = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = torch.softmax(sampling.filtered(second[t1]), -1)[0]
        for t2 in torch.nonzero(p2).flatten().tolist():
            out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


def sample_first_two(first, second, sampler, prompt_len):
    """What vanilla_generate emits first for this sampler, from precomputed logits (the test below checks the
    two agree): the token at position P, then the one at P + 1 given it."""
    t1 = sampler.choose(first, [prompt_len])[0]
    return t1, sampler.choose(second[t1], [prompt_len + 1])[0]


def chi_square(first, second, sampler, exact, n, prompt_len):
    """Pearson's statistic of n seeds' first two tokens against `exact`, cells with an expected count below 5
    pooled into one (unseen pairs included), and the 0.1% critical value for its degrees of freedom
    (Wilson-Hilferty's approximation of the chi-square quantile)."""
    counts = {}
    for seed in range(n):
        toks = sample_first_two(first, second, dataclasses.replace(sampler, seed=seed), prompt_len)
        counts[toks] = counts.get(toks, 0) + 1
    big = {c for c, p in exact.items() if p * n >= 5}
    cells = [(counts.get(c, 0), exact[c] * n) for c in big]
    cells.append((n - sum(o for o, _ in cells), n - sum(e for _, e in cells)))  # everything else, pooled
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    z = 3.090  # the 99.9% quantile of N(0, 1)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical, df


class ReusedNoise(verify.Sampling):
    """Broken on purpose: the same noise at every position (keyed by the seed alone)."""

    def noise(self, position, vocab):
        return super().noise(0, vocab)


class NoTopP(verify.Sampling):
    """Broken on purpose: top-p is ignored (the tail is sampled too)."""

    def filtered(self, logits):
        return verify.Sampling(self.temperature, self.top_k, 1.0, self.seed).filtered(logits)


def test_plain_sampler_matches_the_exact_distribution_and_the_test_catches_broken_ones():
    model = make_tiny_llama(3)
    prompt = [1, 5, 9, 14]
    right = verify.Sampling(temperature=1.0, top_p=0.9)
    first, second = first_two_logits(model, prompt)
    for seed in range(30):  # the fast path below is what vanilla_generate does
        s = dataclasses.replace(right, seed=seed)
        assert tuple(verify.vanilla_generate(model, prompt, 2, [], s).tokens) == sample_first_two(first, second, s, 4)
    exact = exact_first_two(first, second, right)
    stat, critical, df = chi_square(first, second, right, exact, 2000, len(prompt))
    print(f"\nchi-square, plain sampler: {stat:.1f} (df {df}, 0.1% critical {critical:.1f})")
    assert df >= 10 and stat < critical
    for broken in (ReusedNoise(1.0, 0, 0.9), NoTopP(1.0, 0, 0.9)):
        bad, critical, df = chi_square(first, second, broken, exact, 2000, len(prompt))
        print(f"chi-square, {type(broken).__name__}: {bad:.1f} (df {df}, 0.1% critical {critical:.1f})")
        assert bad > critical


def test_top_k_one_and_a_tiny_top_p_are_greedy(tiny):
    prompt = [1, 5, 6, 7, 8]
    want = verify.hf_generate(tiny, prompt, 20, [95])
    for s in (verify.Sampling(1.0, top_k=1, seed=4), verify.Sampling(0.7, top_p=1e-6, seed=9)):
        assert verify.vanilla_generate(tiny, prompt, 20, [95], s).tokens == want


# ---------------------------------------------------------------------------------------------- every method


def methods(draft):
    cost = {1: 1.0, 2: 1.65, 4: 1.8, 8: 2.0, 16: 2.2}
    return {
        "ngram": lambda m, ids, n, eos, s: ngram_predictor.generate(m, ids, n, eos, ngram_predictor.NgramConfig.paper(), sampling=s),
        "cacheback": lambda m, ids, n, eos, s: cacheback.generate(m, ids, n, eos, cacheback.CachebackConfig.cpu(), step_times=cost, sampling=s),
        "card": lambda m, ids, n, eos, s: card.generate(m, ids, n, eos, card.CardConfig(K=2, k=2, ratio=3, mode="lockstep"),
                                                         draft_model=draft, sampling=s),
        "fafo": lambda m, ids, n, eos, s: fafo.generate(m, ids, n, eos, dataclasses.replace(fafo.FafoConfig.cpu(), prompt_pool=True),
                                                         sampling=s),
    }


@pytest.mark.parametrize("prompt,temperature,seed", [(REAL_PROMPTS[0], 0.7, 0), (REAL_PROMPTS[1], 1.0, 1)])
def test_every_method_sampled_is_the_plain_sampler(real, draft_bf16, prompt, temperature, seed):
    model, tok = real
    ids, eos = encode(real, prompt)
    s = verify.Sampling(temperature, top_p=0.9, seed=seed)
    want = verify.vanilla_generate(model, ids, 24, eos, s).tokens
    accepted = 0
    for name, run in methods(draft_bf16).items():
        gen = run(model, ids, 24, eos, s)
        assert gen.tokens == want, name
        accepted += sum(gen.accepted)
    assert accepted > 0  # drafts were accepted, so the sampled acceptance rule was exercised


@pytest.mark.compat
def test_tiny_model_every_method_and_mode_sampled(tiny):
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    parallel = card.CardConfig(K=4, k=2, ratio=3, mode="parallel")
    with card.DraftProcess(tiny, parallel) as proc:  # one draft process for every seed
        for seed in range(2):
            s = verify.Sampling(0.8, top_k=20, top_p=0.95, seed=seed)
            want = verify.vanilla_generate(tiny, prompt, 30, [95], s).tokens
            for name, run in methods(tiny).items():
                assert run(tiny, prompt, 30, [95], s).tokens == want, (name, seed)
            assert card.generate(tiny, prompt, 30, [95], parallel, draft_model=proc, sampling=s).tokens == want
            gen = fafo.generate(tiny, prompt, 30, [95], dataclasses.replace(fafo.FafoConfig.cpu(), attn="flex", block_size=16), sampling=s)
            assert gen.tokens == want


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--temperature", "1", "--top-k", "-2"], "--top-k must be >= 0"),
])
def test_bad_sampling_input_is_a_one_line_error(args, message):
    status, _, err = run_main(cacheback, ["--prompt", "hi", *args])
    assert status == 2 and err.strip().count("\n") == 0 and message in err


def test_cli_compare_sampled_checks_the_plain_sampler():
    import json

    status, out, err = run_main(ngram_predictor, ["--prompt", "Name three colors.", "--max-new-tokens", "12",
                                                  "--temperature", "0.9", "--top-p", "0.9", "--seed", "5", "--json",
                                                  "--compare"])
    assert status == 0, err
    out = json.loads(out.strip().splitlines()[-1])
    assert out["identical"] is True and out["sampling"] == {"temperature": 0.9, "top_k": 0, "top_p": 0.9, "seed": 5}
