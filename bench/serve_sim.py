# SPDX-License-Identifier: MIT
"""The vLLM proposers' gate in a simulated engine: what an accepted token should count for
while nobody waits (serve/gate.py's IDLE_VALUE), chosen here on the tuning half without vLLM;
bench/serve_bench.py then measures the choice in vLLM on the reporting half.

The engine is a stand-in for vLLM's continuous batching: one forward a step over every running
request; a request takes a free slot when one opens, and its first step prefills its prompt. The
proposers are the real ones (serve/vllm_proposers.py), gate and all, fed each step what vLLM feeds
them. A step's time comes from a cost model, read by the gate through an injected clock as it
reads vLLM's steps:

    step = a + row · rows + token · (draft tokens sent + prompt tokens prefilled)

with the costs measured in vLLM on the AVX-512 EPYC (COSTS: vLLM's default set-up at 14 rows, or
vLLM in one process at four). The streams are the default model's greedy answers
(tools/offline.py's, 128 tokens at most), so the tokens accepted are those vLLM's greedy
verification accepts.

Two loads, each against the same engine without drafts:
- closed: every request submitted at once into B slots (max_num_seqs), as serve_bench.py runs
  them; total time. At B = 16 the 14 requests never fill the slots: nobody ever waits.
- open: three passes over the streams arriving at random (exponential gaps) into 16 slots; the
  mean and 90th percentile of each request's time from its arrival to its last token.

    .venv/bin/python bench/serve_sim.py --split tune --idle-values 1,0.75,0.5,0.25

--against-suffix: at each batch size, a closed batch as above, each drafter gated beside vLLM's
`suffix` (vLLM's own proposer, its calls replayed on the serve venv's arctic_inference, vLLM's
defaults, k = 4) and beside itself under a perfect gate (each row sent exactly the part of its draft
that will be accepted: at four rows in one process, the most a sharper acceptance signal could
bring). The proposers' own drafting time is added to each step, as the engine waits for it (so this
table moves by a few thousandths from run to run; the other is exact). --costs one-process: the step
costs of vLLM in one process at four rows.

    .venv-serve/bin/python bench/serve_sim.py --split tune --against-suffix --costs one-process

--where: at batch 8 and 16, where each gated drafter's few percent go: its own drafting time, and the
draft tokens it sent that were rejected (its speed had they cost nothing).

    .venv/bin/python bench/serve_sim.py --split report --where --costs one-process
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402
from serve.gate import IDLE_VALUE  # noqa: E402
from tools import offline  # noqa: E402


@dataclass
class Costs:
    """A step's seconds: a + row·rows + token·(draft tokens sent + prompt tokens prefilled)."""

    a: float  # a step's fixed cost
    row: float  # what a running request adds
    token: float  # what a draft token (or a prompt token) adds: flat here


COSTS = {
    # vLLM's default set-up (engine-core and worker processes) on the AVX-512 EPYC at 14 rows: 83 ms
    # a step without drafts, about 2.3 ms a row, 3-5 ms a draft token (RESULTS.md, "The gate when
    # nobody waits")
    "two-process": Costs(a=0.051, row=0.0023, token=0.004),
    # vLLM in one process (the uni executor) on the same CPU at four rows: the gate's own fits in the
    # server (31 ms + 1.8 ms a row + 1.5-1.7 ms a draft token), rounded; a draft token about 4% of a
    # four-row step, as serve_steps.py --one-process finds (RESULTS.md, "Batch 4 against suffix")
    "one-process": Costs(a=0.031, row=0.0019, token=0.0016),
}
DRAFTERS = {"ngram": {}, "cacheback": {}, "cacheback-paper": {"preset": "paper"}}


class Clock:
    """The time the gate reads: the simulated engine moves it by each step's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine_config(method: str, slots: int, **options):
    """The parts of a VllmConfig that the proposers read."""
    model = verify.converted_dir()
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4,
                                           num_speculative_tokens_per_batch_size=None),
        additional_config={"specdec": options},
        model_config=SimpleNamespace(max_model_len=4096, tokenizer=model, model=model,
                                     get_vocab_size=lambda: 49152),
        scheduler_config=SimpleNamespace(max_num_seqs=slots))


def simulate(proposer, streams: list[tuple[list[int], list[int]]], slots: int,
             arrivals: list[float], costs: Costs = COSTS["two-process"],
             charge_drafting: bool = False, perfect: bool = False) -> dict:
    """Serve streams[i] (prompt, greedy output), arriving at arrivals[i], through `proposer`
    (None: no drafts). Returns the total time, each request's time from arrival to last token and
    the draft tokens sent. charge_drafting: each step also takes the proposer's own time in
    propose() (the engine waits for it). perfect: each chain is cut to the part of it that will be
    accepted (the perfect gate: give it an ungated proposer)."""
    clock = Clock()
    if getattr(proposer, "gate", None) is not None:  # the gate reads the simulated time (suffix: none)
        proposer.gate.clock = clock
    draft_tokens = 0  # sent, all steps
    drafting = 0.0  # seconds in propose(), all steps
    width = max(len(p) + len(o) for p, o in streams) + 8
    token_ids = np.zeros((slots, width), dtype=np.int32)  # [slots, width]: each row's tokens
    num_tokens = np.zeros(slots, dtype=np.int32)  # [slots]
    rows: list[int | None] = [None] * slots  # the request in each row
    arrived = 0
    waiting: list[int] = []
    emitted = {}  # request -> output tokens it has (0: its prefill is next)
    before = {}  # request -> output tokens it had before its last step
    sent = {}  # request -> the chain it was last sent
    owing = set()  # requests whose last tokens came from a chain not yet paid for: one more step
    finished = {}
    while len(finished) < len(streams):
        while arrived < len(streams) and arrivals[arrived] <= clock.now:
            waiting.append(arrived)
            arrived += 1
        if not waiting and all(r is None for r in rows):  # idle until the next request
            clock.now = arrivals[arrived]
            continue
        while waiting and None in rows:
            request = waiting.pop(0)
            emitted[request] = 0
            rows[rows.index(None)] = request
        live = max(i + 1 for i, r in enumerate(rows) if r is not None)
        sampled = []  # what each row emitted last step, as vLLM's sampled_token_ids ([]: a prefill)
        cost = costs.a
        for row in range(live):
            request = rows[row]
            prompt, output = streams[request]
            if request in owing:  # the step that verifies its last chain: paid for, then it leaves
                cost += costs.row + costs.token * len(sent[request])
                sampled.append([])
                continue
            if emitted[request] == 0:  # its prefill: nothing sampled yet
                cost += costs.token * len(prompt)
                token_ids[row, : len(prompt)] = prompt
                num_tokens[row] = len(prompt)
                emitted[request] = 1
                sampled.append([])
                continue
            cost += costs.row + costs.token * len(sent.get(request, []))
            text = prompt + output[: emitted[request]]
            token_ids[row, : len(text)] = text
            num_tokens[row] = len(text)
            sampled.append(output[before.get(request, 0): emitted[request]])
        clock.now += cost
        if proposer is None:
            chains = [[] for _ in sampled]
        else:
            started = time.perf_counter()
            chains = proposer.propose(sampled, num_tokens, token_ids)
            drafting += time.perf_counter() - started
            if charge_drafting:
                clock.now += time.perf_counter() - started
        for row in range(live):
            if not sampled[row]:
                continue
            request = rows[row]
            output = streams[request][1]
            # subtle: a chain's tokens are counted here, when it is drafted; the engine emits them
            # in the next step, charged at the top of the loop: a request ending on them owes it
            done = emitted[request]
            chain = chains[row]
            # greedy verification: the longest prefix of the chain that the output continues with
            accepted = 0
            while accepted < min(len(chain), len(output) - done):
                if chain[accepted] != output[done + accepted]:
                    break
                accepted += 1
            if perfect:
                chain = chain[:accepted]  # what a gate that knew each token's fate would have sent
            sent[request] = chain
            draft_tokens += len(chain)
            before[request] = done
            emitted[request] = min(len(output), done + accepted + 1)
            if emitted[request] >= len(output) and accepted:
                owing.add(request)
        for row in range(live):
            request = rows[row]
            if request is None or emitted[request] < len(streams[request][1]):
                continue
            if request in owing and sampled[row]:  # it ends after the step that pays for its chain
                continue
            owing.discard(request)
            finished[request] = clock.now
            rows[row] = None
        # vLLM condenses the batch: the last row moves into the lowest hole
        while None in rows[: sum(r is not None for r in rows)]:
            last = max(i for i, r in enumerate(rows) if r is not None)
            hole = rows.index(None)
            rows[hole], rows[last] = rows[last], None
            token_ids[hole] = token_ids[last]
            num_tokens[hole] = num_tokens[last]
    latency = [finished[i] - arrivals[i] for i in range(len(streams))]
    return {"seconds": clock.now, "latency": latency, "draft_tokens": draft_tokens, "drafting": drafting}


def proposer_for(name: str, slots: int, idle_value: float | None):
    """The proposer `name`, gated with this idle value (None: ungated)."""
    method = name.split("-")[0]
    options = dict(DRAFTERS[name], **({"gate": "off"} if idle_value is None else {}))
    make = getattr(proposers, proposers.PROPOSERS[method])
    proposer = make(engine_config(method, slots, **options))
    if idle_value is not None:
        proposer.gate.idle_value = idle_value
    return proposer


SUFFIX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth: the trees' depth, the pattern matched


class SuffixRequest(proposers.RequestState):
    """A request as SuffixStandIn tells it apart (by its tokens, serve/vllm_proposers.py's Rows): a
    name for arctic_inference's cache. learn() does nothing: the cache learns the tokens itself
    (add_active_response)."""

    made = 0  # names given so far, all stand-ins

    def __init__(self, tokens):
        super().__init__(tokens)
        SuffixRequest.made += 1
        self.name = SuffixRequest.made

    def learn(self, first_new: int) -> None:
        pass


class SuffixStandIn:
    """vLLM's `suffix` proposer (vllm/v1/spec_decode/suffix_decoding.py, 0.32) in the simulated
    engine: its calls on arctic_inference's SuffixDecodingCache with vLLM's defaults (trees 24
    tokens deep, 10,000 requests' answers kept, a draft at most as long as its match, tokens of
    probability 0.1 or more) and k draft tokens at most, as serve_bench.py starts it. Two
    differences: vLLM knows each row's request id, the stand-in tells requests apart by their tokens,
    as our proposers do (about 10 µs a row, charged to it); and the simulated engine does not call
    the proposer after a request's last step, so the last tokens of each answer never reach the
    cache (in vLLM they do)."""

    def __init__(self, k: int, slots: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # vLLM's: the serve venv

        self.k = k
        self.cache = SuffixDecodingCache(max_tree_depth=SUFFIX_DEPTH, max_cached_requests=10000)
        self.rows = proposers.Rows(SuffixRequest, keep=2 * slots)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        texts = {row: token_ids_cpu[row, : int(num_tokens_no_spec[row])]
                 for row, sampled in enumerate(sampled_token_ids) if sampled}
        states = self.rows.states_for(texts)
        chains = [[] for _ in sampled_token_ids]
        # in row order, as vLLM: each row's tokens join the cache before the next row drafts
        for row in sorted(states):
            state = states[row]
            text = texts[row]  # [n]
            if state.name not in self.cache.active_requests:  # its first step: its prompt's tree
                prompt = text[: len(text) - len(sampled_token_ids[row])]  # [n - sampled]
                self.cache.start_request(state.name, prompt)
            self.cache.add_active_response(state.name, list(sampled_token_ids[row]))
            state.text = text.tolist()  # what Rows recognizes it by next step
            draft = self.cache.speculate(state.name, text[-SUFFIX_DEPTH:], max_spec_tokens=self.k,
                                         max_spec_factor=1.0, min_token_prob=0.1)
            chains[row] = list(draft.token_ids)
        for name in self.cache.active_requests - {state.name for state in states.values()}:
            self.cache.stop_request(name)  # it left the batch: its prompt's tree goes, its answer stays
        return chains


def against_suffix(streams, costs: Costs) -> None:
    """The --against-suffix table: a closed batch at each batch size, each drafter's speed over no
    drafts'.

    The perfect gate: the drafter ungated, each chain cut to what will be accepted. Where every
    accepted token pays (requests wait, and a draft token costs less than a row's share of the step:
    four rows in one process), that is the most a sharper acceptance signal could bring to the
    drafter's drafts; it still drafts every step, which the real gate skips where nothing can pay."""
    names = ["vllm-suffix", *DRAFTERS, *(f"{name}, perfect gate" for name in DRAFTERS)]
    print("closed: every request at once into B slots; no drafts' total time over each's (above 1: "
          "faster), and the draft tokens sent; each proposer's drafting time counts\n")
    print("| B | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    at_once = [0.0] * len(streams)
    for batch in (1, 4, 8, 16):
        base = simulate(None, streams, batch, at_once, costs)["seconds"]
        cells = []
        for name in names:
            perfect = name.endswith("perfect gate")
            if name == "vllm-suffix":
                proposer = SuffixStandIn(4, batch)
            elif perfect:
                proposer = proposer_for(name.split(",")[0], batch, None)
            else:
                proposer = proposer_for(name, batch, IDLE_VALUE)
            drafted = simulate(proposer, streams, batch, at_once, costs, charge_drafting=True,
                               perfect=perfect)
            cells.append(f"{base / drafted['seconds']:.3f}x ({drafted['draft_tokens']})")
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


def where_it_goes(streams, costs: Costs) -> None:
    """The --where table: at batch 8 and 16, a closed batch, each gated drafter's speed over no drafts
    with its drafting time charged, the share of the run's time its propose() took, and its speed had
    the draft tokens it sent and saw rejected cost nothing (each chain cut to what was accepted)."""
    print("closed: every request at once into B slots, each gated drafter's drafting time charged\n")
    print("| drafter | B | over no drafts | propose()'s share of the time | rejected draft tokens free |")
    print("| --- | --- | --- | --- | --- |")
    at_once = [0.0] * len(streams)
    for batch in (8, 16):
        base = simulate(None, streams, batch, at_once, costs)["seconds"]
        for name in DRAFTERS:
            real = simulate(proposer_for(name, batch, IDLE_VALUE), streams, batch, at_once, costs,
                            charge_drafting=True)
            free = simulate(proposer_for(name, batch, IDLE_VALUE), streams, batch, at_once, costs,
                            charge_drafting=True, perfect=True)
            print(f"| {name} | {batch} | {base / real['seconds']:.3f}x | {real['drafting'] / real['seconds']:.1%} | "
                  f"{base / free['seconds']:.3f}x |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", default="tune", choices=["tune", "report"],
                   help="which half's streams (default: tune)")
    p.add_argument("--idle-values", default="1,0.75,0.5,0.25",
                   help="what an accepted token counts for while nobody waits (1: as when some wait)")
    p.add_argument("--gaps", default="4,2,1,0.5", help="open load: the mean seconds between arrivals")
    p.add_argument("--costs", default="two-process", choices=list(COSTS),
                   help="the step costs: vLLM's default set-up at 14 rows (default), or vLLM in one "
                        "process at four")
    p.add_argument("--where", action="store_true",
                   help="instead: where a gated drafter's time goes at batch 8 and 16 (its drafting, its "
                        "rejected draft tokens)")
    p.add_argument("--against-suffix", action="store_true",
                   help="instead: each drafter gated, beside vLLM's suffix and beside itself under a "
                        "perfect gate (needs the serve venv's arctic_inference)")
    args = p.parse_args(argv)
    values = [float(v) for v in args.idle_values.split(",")]
    costs = COSTS[args.costs]
    streams = [(s["prompt"], s["output"]) for s in offline.make_streams(args.split)]
    print(f"{len(streams)} streams ({args.split} half), step = {costs.a * 1e3:.0f} ms + "
          f"{costs.row * 1e3:.1f} ms a row + {costs.token * 1e3:.1f} ms a draft or prompt token "
          f"({args.costs})\n")
    if args.against_suffix:
        against_suffix(streams, costs)
        return 0
    if args.where:
        where_it_goes(streams, costs)
        return 0
    print("closed: every request at once into B slots; no drafts' total time over each's "
          "(above 1: faster)\n")
    print("| drafter | B | ungated | " + " | ".join(f"idle value {v:g}" for v in values) + " |")
    print("| --- | --- |" + " --- |" * (len(values) + 1))
    at_once = [0.0] * len(streams)
    for batch in (1, 4, 8, 16):
        base = simulate(None, streams, batch, at_once, costs)["seconds"]
        for name in DRAFTERS:
            cells = []
            for v in (None, *values):
                drafted = simulate(proposer_for(name, batch, v), streams, batch, at_once, costs)
                cells.append(base / drafted["seconds"])
            print(f"| {name} | {batch} | " + " | ".join(f"{c:.3f}x" for c in cells) + " |", flush=True)
    print("\nopen: three passes over the streams arriving at random into 16 slots; each's mean / 90th "
          "percentile latency over no drafts' (below 1: faster)\n")
    print("| drafter | mean gap | " + " | ".join(f"idle value {v:g}" for v in values) + " |")
    print("| --- | --- |" + " --- |" * len(values))
    three = streams * 3
    for gap in (float(g) for g in args.gaps.split(",")):
        arrivals = list(np.cumsum(np.random.default_rng(0).exponential(gap, len(three))))
        base = simulate(None, three, 16, arrivals, costs)["latency"]
        for name in DRAFTERS:
            cells = []
            for v in values:
                latency = simulate(proposer_for(name, 16, v), three, 16, arrivals, costs)["latency"]
                cells.append(f"{np.mean(latency) / np.mean(base):.3f} / "
                             f"{np.percentile(latency, 90) / np.percentile(base, 90):.3f}")
            print(f"| {name} | {gap:g} s | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
