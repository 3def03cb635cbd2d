"""bench.py's report, on hand-made rows: both speedup definitions, the acceptance rate and the drafting share."""

import bench


def row(method, qid, tokens, wall, forwards, **extra):
    return {"method": method, "question_id": qid, "category": "qa", "new_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "target_forwards": forwards, "identical": True, **extra}


def test_summary_gives_both_speedups_acceptance_and_drafting_share():
    rows = [row("hf-greedy", 1, 100, 10.0, 100), row("hf-greedy", 2, 100, 2.0, 100),
            row("ngram", 1, 100, 5.0, 50, accepted=50, drafted=100, draft_s=0.5),
            row("ngram", 2, 100, 2.0, 100, accepted=0, drafted=20, draft_s=0.2)]
    s = bench.summarize(rows, ["hf-greedy", "ngram"])["overall"]["ngram"]
    # SpecBench: mean tokens/s (20 + 50) / 2 = 35 over hf-greedy's (10 + 50) / 2 = 30
    assert abs(s["speedup"] - 35 / 30) < 1e-9
    # total tokens over total time: 200 / 7 s over 200 / 12 s
    assert abs(s["speedup_total"] - 12 / 7) < 1e-9
    assert abs(s["mean_accepted"] - 200 / 150) < 1e-9
    assert abs(s["acceptance"] - 50 / 120) < 1e-9 and abs(s["draft_share"] - 0.7 / 7.0) < 1e-9
    assert bench.summarize(rows, ["hf-greedy"])["overall"]["hf-greedy"]["acceptance"] is None
    table = bench.markdown(bench.summarize(rows, ["hf-greedy", "ngram"]), ["hf-greedy", "ngram"])
    assert "| ngram | 35.0 | 1.17x | 1.71x | 1.33 | 41.7% | 10.0% | 100% |" in table


def test_per_position_acceptance_counts_steps_that_reached_and_accepted_each_position():
    # three steps: drafts of depth 3, 1 and 2; accepted 2, 0 and 2 tokens
    counts = bench.per_position([2, 0, 2], [3, 1, 2])
    assert counts[:4] == [[3, 2], [2, 2], [1, 0], [0, 0]]
    rates = bench.position_rates([{"per_position": counts}, {"per_position": bench.per_position([1], [1])}])
    assert rates[:4] == [3 / 4, 1.0, 0.0, None]
    rows = [row("hf-greedy", 1, 10, 1.0, 10),
            row("ngram", 1, 10, 1.0, 5, accepted=4, drafted=6, draft_s=0.0, per_position=counts)]
    table = bench.markdown(bench.summarize(rows, ["hf-greedy", "ngram"]), ["hf-greedy", "ngram"])
    assert "| ngram | 67% | 100% | 0% | - |" in table
