# SPDX-License-Identifier: MIT
"""The two choices serve/vllm_proposers.py makes, measured without a model (tools/offline.py's replay over the
default model's greedy streams): which branch of Cacheback's tree becomes vLLM's one chain, and whether a table
shared by every request (table = 'server') drafts better than one per request. Mean accepted tokens (MAT: new
tokens over target forwards) at k draft tokens per step; a shared table sees the streams one after another.

    .venv/bin/python bench/serve_offline.py --streams tune      # where the choices were made
    .venv/bin/python bench/serve_offline.py --streams report    # what RESULTS.md reports
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import cacheback  # noqa: E402
import ngram_predictor  # noqa: E402
import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402
from tools import offline  # noqa: E402
from verify import Tree  # noqa: E402


def deepest_branch(tree: Tree) -> list[int]:
    """The branch to the deepest node (the first such node in the tree's order)."""
    depths = tree.depths
    node = max(range(len(tree)), key=lambda i: (depths[i], -i))
    branch = []
    while node != 0:
        branch.append(tree.tokens[node])
        node = tree.parents[node]
    return branch[::-1]


def learn_emitted(request, new: list[int]) -> None:
    """A step's emitted tokens, learned as the proposer's catch_up learns them."""
    first_new = len(request.text)
    request.text += new
    request.learn(first_new)


def cacheback_chain(cfg, frozen, k: int, tdl: int, crt: int, pick, shared=None):
    """(start, propose, learn): Cacheback's drafting as the proposer does it, with the tree grown under tdl, crt
    and the chain picked by `pick`; `shared`: one dynamic table for every stream."""

    def start(prompt, first):
        return proposers.CachebackRequest(prompt + [first], cfg, shared, frozen)

    def propose(request, room):
        tree = cacheback.grow_tree(request.text[-1], request.text, request.dynamic, frozen, tdl, crt,
                                   cfg.frozen_order, cut=cfg.follower_fit == "cut")
        return Tree.chain(request.text[-1], pick(tree)[:k][: room - 1])

    return start, propose, learn_emitted


def ngram_chain(k: int, shared_tables=None):
    def start(prompt, first):
        return proposers.NgramRequest(prompt + [first], k, shared_tables)

    def propose(request, room):
        return Tree.chain(request.text[-1], request.draft(k).tokens[: room - 1])

    return start, propose, learn_emitted


def mat(streams, make) -> float:
    """MAT over all streams; make() is called once per stream (a shared table lives in its closure)."""
    total = offline.Replay()
    for s in streams:
        total.add(offline.replay(s["prompt"], s["output"], *make()))
    return total.row()["mat"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="tune", choices=["tune", "report"])
    p.add_argument("--ks", default="4,8", help="draft tokens per step (vLLM's num_speculative_tokens)")
    args = p.parse_args(argv)
    streams = offline.make_streams(args.streams)
    tok = verify.load_model(device="cpu")[1]
    presets = {"cpu": cacheback.CachebackConfig.cpu(), "paper": cacheback.CachebackConfig.paper()}
    frozen = cacheback.frozen_table_for(tok, presets["paper"])
    print(f"{len(streams)} streams ({args.streams}); MAT, every step counted\n")
    print("| drafter | k | chain | tree TDL / CRT | table | MAT |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in (int(x) for x in args.ks.split(",")):
        print(f"| ngram | {k} | - | - | request | {mat(streams, lambda: ngram_chain(k)):.3f} |")
        tables = ngram_predictor.NGramPredictor().tables
        print(f"| ngram | {k} | - | - | server | {mat(streams, lambda: ngram_chain(k, tables)):.3f} |")
        for name, cfg in presets.items():
            cfg.cost = "free"
            table_of = frozen if cfg.frozen != "none" else None
            for pick_name, pick in (("first", cacheback.first_branch), ("deepest", deepest_branch)):
                # a tree of k + 1 (one follower on level 1), the preset's own, the paper's
                for tdl, crt in dict.fromkeys([(k + 1, max(0, k - cfg.fl)), (cfg.tdl, cfg.crt), (96, 16)]):
                    value = mat(streams, lambda: cacheback_chain(cfg, table_of, k, tdl, crt, pick))
                    print(f"| cacheback-{name} | {k} | {pick_name} | {tdl} / {crt} | request | {value:.3f} |")
            shared = cacheback.CacheTable(cfg.ll, cfg.fl, cfg.lc, cfg.fc)
            value = mat(streams, lambda: cacheback_chain(cfg, table_of, k, cfg.tdl, cfg.crt, cacheback.first_branch,
                                                         shared))
            print(f"| cacheback-{name} | {k} | first | {cfg.tdl} / {cfg.crt} | server | {value:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
