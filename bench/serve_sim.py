# SPDX-License-Identifier: MIT
"""The vLLM proposers' gate in a simulated engine: what an accepted token should count for
while nobody waits (serve/gate.py's IDLE_VALUE), chosen here on the tuning half without vLLM;
bench/serve_bench.py then measures the choice in vLLM on the reporting half.

The engine is a stand-in for vLLM's continuous batching: one forward a step over every running
request; a request takes a free slot when one opens, and its first step prefills its prompt. The
proposers are the real ones (serve/vllm_proposers.py), gate and all, fed each step what vLLM feeds
them. A step's time comes from a cost model, read by the gate through an injected clock as it
reads vLLM's steps:

    step = A + ROW · rows + TOKEN · (draft tokens sent + prompt tokens prefilled)

with the costs measured in vLLM on the AVX-512 EPYC at 14 rows (RESULTS.md, "Serving under load
on the AVX-512 EPYC": 83 ms a step with no drafts, about 2.3 ms a row, 3-5 ms a draft token). The
streams are the default model's greedy answers (tools/offline.py's, 128 tokens at most), so the
tokens accepted are those vLLM's greedy verification accepts.

Two loads, each against the same engine without drafts:
- closed: every request submitted at once into B slots (max_num_seqs), as serve_bench.py runs
  them; total time. At B = 16 the 14 requests never fill the slots: nobody ever waits.
- open: three passes over the streams arriving at random (exponential gaps) into 16 slots; the
  mean and 90th percentile of each request's time from its arrival to its last token.

    .venv/bin/python bench/serve_sim.py --split tune --idle-values 1,0.75,0.5,0.25
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402
from tools import offline  # noqa: E402

A = 0.051  # seconds: a step's fixed cost
ROW = 0.0023  # seconds a running request adds
TOKEN = 0.004  # seconds a draft token (or a prompt token) adds: 3-5 ms measured, flat here
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
             arrivals: list[float]) -> dict:
    """Serve streams[i] (prompt, greedy output), arriving at arrivals[i], through `proposer`
    (None: no drafts). Returns the total time and each request's time from arrival to last token."""
    clock = Clock()
    if proposer is not None:
        proposer.gate.clock = clock
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
        cost = A
        for row in range(live):
            request = rows[row]
            prompt, output = streams[request]
            if request in owing:  # the step that verifies its last chain: paid for, then it leaves
                cost += ROW + TOKEN * len(sent[request])
                sampled.append([])
                continue
            if emitted[request] == 0:  # its prefill: nothing sampled yet
                cost += TOKEN * len(prompt)
                token_ids[row, : len(prompt)] = prompt
                num_tokens[row] = len(prompt)
                emitted[request] = 1
                sampled.append([])
                continue
            cost += ROW + TOKEN * len(sent.get(request, []))
            text = prompt + output[: emitted[request]]
            token_ids[row, : len(text)] = text
            num_tokens[row] = len(text)
            sampled.append(output[before.get(request, 0): emitted[request]])
        clock.now += cost
        if proposer is None:
            chains = [[] for _ in sampled]
        else:
            chains = proposer.propose(sampled, num_tokens, token_ids)
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
            sent[request] = chain
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
    return {"seconds": clock.now, "latency": latency}


def proposer_for(name: str, slots: int, idle_value: float | None):
    """The proposer `name`, gated with this idle value (None: ungated)."""
    method = name.split("-")[0]
    options = dict(DRAFTERS[name], **({"gate": "off"} if idle_value is None else {}))
    make = getattr(proposers, proposers.PROPOSERS[method])
    proposer = make(engine_config(method, slots, **options))
    if idle_value is not None:
        proposer.gate.idle_value = idle_value
    return proposer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", default="tune", choices=["tune", "report"],
                   help="which half's streams (default: tune)")
    p.add_argument("--idle-values", default="1,0.75,0.5,0.25",
                   help="what an accepted token counts for while nobody waits (1: as when some wait)")
    p.add_argument("--gaps", default="4,2,1,0.5", help="open load: the mean seconds between arrivals")
    args = p.parse_args(argv)
    values = [float(v) for v in args.idle_values.split(",")]
    streams = [(s["prompt"], s["output"]) for s in offline.make_streams(args.split)]
    print(f"{len(streams)} streams ({args.split} half), step = {A * 1e3:.0f} ms + {ROW * 1e3:.1f} ms "
          f"a row + {TOKEN * 1e3:.0f} ms a draft or prompt token\n")
    print("closed: every request at once into B slots; no drafts' total time over each's "
          "(above 1: faster)\n")
    print("| drafter | B | ungated | " + " | ".join(f"idle value {v:g}" for v in values) + " |")
    print("| --- | --- |" + " --- |" * (len(values) + 1))
    at_once = [0.0] * len(streams)
    for batch in (1, 4, 8, 16):
        base = simulate(None, streams, batch, at_once)["seconds"]
        for name in DRAFTERS:
            cells = []
            for v in (None, *values):
                drafted = simulate(proposer_for(name, batch, v), streams, batch, at_once)
                cells.append(base / drafted["seconds"])
            print(f"| {name} | {batch} | " + " | ".join(f"{c:.3f}x" for c in cells) + " |", flush=True)
    print("\nopen: three passes over the streams arriving at random into 16 slots; each's mean / 90th "
          "percentile latency over no drafts' (below 1: faster)\n")
    print("| drafter | mean gap | " + " | ".join(f"idle value {v:g}" for v in values) + " |")
    print("| --- | --- |" + " --- |" * len(values))
    three = streams * 3
    for gap in (float(g) for g in args.gaps.split(",")):
        arrivals = list(np.cumsum(np.random.default_rng(0).exponential(gap, len(three))))
        base = simulate(None, three, 16, arrivals)["latency"]
        for name in DRAFTERS:
            cells = []
            for v in values:
                latency = simulate(proposer_for(name, 16, v), three, 16, arrivals)["latency"]
                cells.append(f"{np.mean(latency) / np.mean(base):.3f} / "
                             f"{np.percentile(latency, 90) / np.percentile(base, 90):.3f}")
            print(f"| {name} | {gap:g} s | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
