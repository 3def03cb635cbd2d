# SPDX-License-Identifier: MIT
"""bench/side_by_side.py's report, on hand-made rows: both speedup definitions, the acceptance rate and the drafting share;
which prompts it loads; and CARD's cost model (card.predicted_speedup, tested in test_card.py) beside a run."""

import types

import pytest
import torch

import prompts
from bench import side_by_side
import card
import verify
from conftest import make_tiny_llama


def row(method, qid, tokens, wall, forwards, **extra):
    return {"method": method, "question_id": qid, "category": "qa", "new_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "target_forwards": forwards, "identical": True, **extra}


def test_summary_gives_both_speedups_acceptance_and_drafting_share():
    rows = [row("hf-greedy", 1, 100, 10.0, 100), row("hf-greedy", 2, 100, 2.0, 100),
            row("ngram", 1, 100, 5.0, 50, accepted=50, drafted=100, draft_s=0.5),
            row("ngram", 2, 100, 2.0, 100, accepted=0, drafted=20, draft_s=0.2)]
    s = side_by_side.summarize(rows, ["hf-greedy", "ngram"])["overall"]["ngram"]
    # SpecBench: mean tokens/s (20 + 50) / 2 = 35 over hf-greedy's (10 + 50) / 2 = 30
    assert abs(s["speedup"] - 35 / 30) < 1e-9
    # total tokens over total time: 200 / 7 s over 200 / 12 s
    assert abs(s["speedup_total"] - 12 / 7) < 1e-9
    assert abs(s["mean_accepted"] - 200 / 150) < 1e-9
    assert abs(s["acceptance"] - 50 / 120) < 1e-9 and abs(s["draft_share"] - 0.7 / 7.0) < 1e-9
    assert side_by_side.summarize(rows, ["hf-greedy"])["overall"]["hf-greedy"]["acceptance"] is None
    table = side_by_side.markdown(side_by_side.summarize(rows, ["hf-greedy", "ngram"]), ["hf-greedy", "ngram"])
    # no decode rate, vanilla run or first-token time in these rows: shown as "-"
    assert "| ngram | 35.0 | 1.17x | 1.71x | - | - | - | 1.33 | 41.7% | 10.0% | 100% |" in table


def test_decode_speedup_leaves_the_time_to_first_token_out():
    # a long prompt: 8 s of prefill for both; then hf-greedy decodes 10 tokens in 2 s, ngram in 1 s
    rows = [row("hf-greedy", 1, 11, 10.0, 11, ttft_s=8.0, decode_tokens_per_s=10 / 2.0),
            row("ngram", 1, 11, 9.0, 6, ttft_s=8.0, decode_tokens_per_s=10 / 1.0, accepted=5, drafted=9, draft_s=0.0)]
    s = side_by_side.summarize(rows, ["hf-greedy", "ngram"])["overall"]["ngram"]
    assert abs(s["speedup"] - 10 / 9) < 1e-9  # end to end, the prefill hides most of it
    assert abs(s["decode_speedup"] - 2.0) < 1e-9 and s["ttft_s"] == 8.0


def test_speedup_over_vanilla_separates_the_cache_from_the_speculation():
    # our vanilla decodes 10 tokens in 1.6 s on the preallocated cache (HF greedy: 2 s), ngram in 1 s
    rows = [row("hf-greedy", 1, 11, 10.0, 11, ttft_s=8.0, decode_tokens_per_s=10 / 2.0),
            row("vanilla", 1, 11, 9.6, 11, ttft_s=8.0, decode_tokens_per_s=10 / 1.6),
            row("ngram", 1, 11, 9.0, 6, ttft_s=8.0, decode_tokens_per_s=10 / 1.0)]
    out = side_by_side.summarize(rows, ["hf-greedy", "vanilla", "ngram"])["overall"]
    assert abs(out["ngram"]["decode_speedup"] - 2.0) < 1e-9  # over HF greedy: cache and speculation together
    assert abs(out["ngram"]["decode_speedup_vanilla"] - 1.6) < 1e-9  # over vanilla: the speculation alone
    assert abs(out["ngram"]["speedup_vanilla"] - 9.6 / 9.0) < 1e-9
    assert abs(out["vanilla"]["decode_speedup"] - 1.25) < 1e-9 and out["vanilla"]["speedup_vanilla"] == 1.0
    table = side_by_side.markdown(side_by_side.summarize(rows, ["hf-greedy", "vanilla", "ngram"]), ["hf-greedy", "vanilla", "ngram"])
    assert "| 1.07x; 1.60x |" in table


def test_first_token_marks_the_first_emit_and_the_second_streamer_put():
    hook = side_by_side.FirstToken()
    hook([5], [False])
    t = hook.t
    hook([6], [True])
    assert hook.t == t is not None
    streamer = side_by_side.FirstToken()
    streamer.put("the prompt")
    assert streamer.t is None
    streamer.put("token 1")
    assert streamer.t is not None


def test_per_position_acceptance_counts_steps_that_reached_and_accepted_each_position():
    # three steps: drafts of depth 3, 1 and 2; accepted 2, 0 and 2 tokens
    counts = side_by_side.per_position([2, 0, 2], [3, 1, 2])
    assert counts[:4] == [[3, 2], [2, 2], [1, 0], [0, 0]]
    rates = side_by_side.position_rates([{"per_position": counts}, {"per_position": side_by_side.per_position([1], [1])}])
    assert rates[:4] == [3 / 4, 1.0, 0.0, None]
    rows = [row("hf-greedy", 1, 10, 1.0, 10),
            row("ngram", 1, 10, 1.0, 5, accepted=4, drafted=6, draft_s=0.0, per_position=counts)]
    table = side_by_side.markdown(side_by_side.summarize(rows, ["hf-greedy", "ngram"]), ["hf-greedy", "ngram"])
    assert "| ngram | 67% | 100% | 0% | - |" in table


def test_repeats_give_the_mean_and_std_over_passes():
    # two passes over two prompts; hf-greedy runs at 10 tokens/s throughout, ngram at 12 then 16 on prompt 1,
    # 20 both times on prompt 2 -> SpecBench speedups per pass: (12+20)/2/10 = 1.6 and (16+20)/2/10 = 1.8
    rows = []
    for rep, fast in ((0, 12.0), (1, 16.0)):
        for qid, t in ((1, fast), (2, 20.0)):
            rows.append({**row("hf-greedy", qid, 100, 10.0, 100), "repeat": rep})
            rows.append({**row("ngram", qid, 100, 100 / t, 50), "repeat": rep})
    s = side_by_side.summarize(rows, ["hf-greedy", "ngram"])["overall"]["ngram"]
    assert abs(s["speedup"] - 1.7) < 1e-9
    assert abs(s["speedup_std"] - 0.2 / 2 ** 0.5) < 1e-9  # sample std of (1.6, 1.8)
    assert s["passes"] == 2 and abs(s["mean_accepted"] - 2.0) < 1e-9  # counted over all four runs
    table = side_by_side.markdown(side_by_side.summarize(rows, ["hf-greedy", "ngram"]), ["hf-greedy", "ngram"])
    assert "mean ± std over 2 passes" in table and "| ngram | 1.70x ± 0.14 |" in table
    # a single pass prints no ± at all
    one = [r for r in rows if r["repeat"] == 0]
    assert "±" not in side_by_side.markdown(side_by_side.summarize(one, ["hf-greedy", "ngram"]), ["hf-greedy", "ngram"])


def test_prompts_are_filtered_by_split_and_category_and_the_long_set_has_its_halves():
    path = prompts.LONG
    rows = prompts.load_prompts(path, None, "report", ["4k"])
    assert [r["question_id"] for r in rows] == [10, 12, 18, 20, 22, 24]  # even ids, 4k only, in file order
    assert [r["question_id"] for r in prompts.load_prompts(path, 2, "tune", ["1k", "7k"])] == [1, 3, 13, 15]
    with pytest.raises(verify.UserError, match="no prompts of category 9k"):
        prompts.load_prompts(path, None, "all", ["9k"])

# ---------------------------------------- CARD's cost model (card.py) beside a run, with the run's acceptance


def test_card_predict_reads_a_run_and_card_costs_restores_the_threads():
    costs = dict(t_target=0.040, t_verify=0.060, t_draft=0.012)
    # 36 tokens in 10 target steps (mat 3.6), half of the queries hit and a hit emits c = 4 tokens:
    # a hit costs max(60, 4 * 12) = 60 ms, a miss 60 + r * 12 = 108 ms (wait None = r = 4) -> mean 84 ms
    gen = types.SimpleNamespace(tokens=[0] * 36, target_forwards=10, steps=10,
                                extra=dict(hits=5, hit_rate=0.5, hit_tokens=20))
    cfg = card.CardConfig(mode="parallel", ratio=4, K=1, k=1)
    assert side_by_side.card_predict(card, gen, costs, cfg).extra["predicted_speedup"] == pytest.approx(144 / 84)
    model, threads = make_tiny_llama(0), torch.get_num_threads()
    measured = side_by_side.card_costs(model, model, cfg)
    assert set(measured) == {"t_target", "t_verify", "t_draft"} and all(t > 0 for t in measured.values())
    assert torch.get_num_threads() == threads
