# SPDX-License-Identifier: MIT
"""Measures CARD's offline draft candidates (card.py section 5) for RESULTS.md, "CARD on a CPU": for each --draft spec,

  t_draft     one draft step over a single token after 256 cached ones, with 2 threads and with 1 (the share a
              draft process gets on a 2-core machine in parallel mode); the fastest of 5 (verify.measure_step_times)
  r           t_target / t_draft at the same thread count: the paper's communication ratio (§3.1)
  accepted    CARD lockstep's mean accepted tokens per target step (K = 1, r = 4: at most 5), greedy, on the
              TUNING half of the shipped prompts: how often the draft agrees with the target

    python bench/card_drafts.py --drafts self,int8 --limit 1 --max-new-tokens 64
"""

import argparse
import os
import sys

if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import card  # noqa: E402
import prompts  # noqa: E402
import verify  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafts", default="self,int8",
                   help="comma list of card.py --draft specs")
    p.add_argument("--prompts", default=prompts.SHORT)
    p.add_argument("--limit", type=int, default=1, help="tuning prompts per category (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    try:
        model, tok = verify.load_model(device="cpu", dtype="float32")
        eos = verify.eos_ids_of(model, tok)
        encoded = [verify.encode_prompt(tok, q["prompt"]) for q in prompts.load_prompts(args.prompts, args.limit, "tune")]
        threads = torch.get_num_threads()
        t_target = {}
        for n in (threads, 1):
            torch.set_num_threads(n)
            t_target[n] = verify.measure_step_times(model, [1])[1]
        print(f"target: t(1) = {1000 * t_target[threads]:.1f} ms with {threads} threads, "
              f"{1000 * t_target[1]:.1f} ms with 1; {len(encoded)} tuning prompts, {args.max_new_tokens} tokens")
        print(f"\n| --draft | t_draft, {threads} threads | t_draft, 1 thread | r ({threads} threads) | r (1 thread) "
              "| mean accepted (lockstep, K = 1, r = 4) |\n|---|---|---|---|---|---|")
        for spec in args.drafts.split(","):
            draft = card.load_draft(model, tok, card.CardConfig(draft=spec))
            t = {}
            for n in (threads, 1):
                torch.set_num_threads(n)
                t[n] = verify.measure_step_times(draft, [1])[1]
            torch.set_num_threads(threads)
            cfg = card.CardConfig(K=1, k=1, ratio=4, mode="lockstep")
            tokens = forwards = 0
            for ids in encoded:
                gen = card.generate(model, ids, args.max_new_tokens, eos, cfg, draft_model=draft)
                tokens, forwards = tokens + len(gen.tokens), forwards + gen.target_forwards
            print(f"| {spec} | {1000 * t[threads]:.1f} ms | {1000 * t[1]:.1f} ms | {t_target[threads] / t[threads]:.2f} "
                  f"| {t_target[1] / t[1]:.2f} | {tokens / forwards:.2f} |", flush=True)
    except verify.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
