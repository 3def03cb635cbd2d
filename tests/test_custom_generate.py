# SPDX-License-Identifier: MIT
"""The drop-in: every method run by transformers' own `model.generate(..., custom_generate=...)`, in the
callable form (`METHOD.custom_generate`) and the exported folder form (tools/export_generate.py), checked
against `model.generate` itself: token-identical on tiny models of eight families and on the real default
model; EOS, max_new_tokens and a stop string that fall inside an accepted draft; return_dict_in_generate;
a TextStreamer; sampling; and each refusal."""

import copy
import inspect
import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
from transformers import (LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, StopStringCriteria,
                          TextStreamer, TopPLogitsWarper)

import cacheback
import card
import fafo
import ngram_predictor
import tools.methods
import verify
from conftest import CARD_REAL, REAL_PROMPTS, ROOT, encode
from test_architectures import ARCHS, EOS, NEW, PROMPT, _testable, tiny_model

METHODS = {name: tools.methods.module_of(name) for name in tools.methods.METHODS}

# each method's own keywords for a tiny model: small settings, so drafts are short (as in test_architectures);
# CARD in lockstep with a float32 copy of the target as its draft (tests/test_layout.py: one per method)
TINY_OPTIONS = {
    "ngram": lambda draft: dict(ngram_config=ngram_predictor.NgramConfig.paper()),
    "cacheback": lambda draft: dict(cacheback_config=cacheback.CachebackConfig(ll=1, tdl=16, crt=4)),
    "card": lambda draft: dict(card_config=card.CardConfig(mode="lockstep", K=4, k=2, ratio=3), draft_model=draft),
    "fafo": lambda draft: dict(fafo_config=fafo.FafoConfig(n_guess=3, k=3, m=2, sink=2, recent=8, prompt_pool=True)),
}


def tiny_options(name: str, draft) -> dict:
    return TINY_OPTIONS[name](draft)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """{method: the folder tools/export_generate.py wrote for it}."""
    from tools import export_generate

    out = tmp_path_factory.mktemp("exported")
    folders = {}
    for name in METHODS:
        folders[name] = str(out / name)
        export_generate.export(name, folders[name])
    return folders


@pytest.fixture(scope="module", params=ARCHS)
def family(request):
    """(arch, model, a float32 copy for CARD's draft): the first seed whose greedy text is worth testing."""
    for seed in range(40):
        model = tiny_model(request.param, seed)
        if _testable(verify.hf_generate(model, PROMPT, NEW, [EOS])):
            return request.param, model, copy.deepcopy(model)
    pytest.fail(f"{request.param}: no seed in 0..39 gives varied greedy text with repeats")


@pytest.fixture(scope="module")
def llama():
    """The tiny Llama of the family list, for the edge cases."""
    for seed in range(40):
        model = tiny_model("llama", seed)
        if _testable(verify.hf_generate(model, PROMPT, NEW, [EOS])):
            return model, copy.deepcopy(model)
    pytest.fail("no tiny llama seed gives varied greedy text")


IDS = torch.tensor([PROMPT])


@pytest.mark.compat
@pytest.mark.parametrize("name", list(METHODS))
def test_both_forms_are_token_identical_to_model_generate_on_tiny_families(family, exported, name):
    arch, model, draft = family
    want = model.generate(IDS, max_new_tokens=NEW, do_sample=False)
    options = tiny_options(name, draft)
    called = model.generate(IDS, custom_generate=METHODS[name].custom_generate, max_new_tokens=NEW, **options)
    assert torch.equal(called, want), f"{arch} / {name}: the callable form"
    loaded = model.generate(IDS, custom_generate=exported[name], trust_remote_code=True, max_new_tokens=NEW,
                            **options)
    assert torch.equal(loaded, want), f"{arch} / {name}: the folder form"


# ------------------------------------------------------------------------------------ the real default model

WANTED = {}


def plain(model, ids, n: int) -> torch.Tensor:
    """model.generate(ids, max_new_tokens=n, do_sample=False), once per prompt and length."""
    key = (tuple(ids[0].tolist()), n)
    if key not in WANTED:
        WANTED[key] = model.generate(ids, max_new_tokens=n, do_sample=False)
    return WANTED[key]


def real_options(name: str, draft) -> dict:
    """The script's defaults but for CARD, whose draft (bfloat16, the session's) is passed in."""
    if name == "card":
        return dict(card_config=card.CardConfig(mode="lockstep", ratio=3, **CARD_REAL), draft_model=draft)
    return {}


@pytest.mark.compat
@pytest.mark.parametrize("name", list(METHODS))
def test_both_forms_are_token_identical_on_the_real_default_model(real, draft_bf16, exported, name):
    """One prompt per method, two prompts taking turns (each method's own tests run all five)."""
    model, tok = real
    prompt = REAL_PROMPTS[list(METHODS).index(name) % 2]
    ids = torch.tensor([encode(real, prompt)[0]])
    want = plain(model, ids, 32)
    options = real_options(name, draft_bf16)
    called = model.generate(ids, custom_generate=METHODS[name].custom_generate, max_new_tokens=32, **options)
    assert torch.equal(called, want), f"{name}: the callable form"
    loaded = model.generate(ids, custom_generate=exported[name], trust_remote_code=True, max_new_tokens=32,
                            **options)
    assert torch.equal(loaded, want), f"{name}: the folder form"


def card_drafts() -> set[int]:
    """The pids of this process's live CARD draft processes."""
    return {p.pid for p in multiprocessing.active_children() if p.name == "card-draft"}


class FailAfter(StoppingCriteria):
    """A stopping criterion that raises at the n-th token it is asked about."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("a criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.compat
def test_card_with_no_options_keeps_one_draft_process_for_the_model(real, monkeypatch):
    """No keywords: CARD's CPU default (its mode and r predicted fastest: card.py section 5b) is set up at the
    model's first call and serves its later calls, a call that raises included, with the same tokens as
    model.generate; in parallel mode its draft process is kept, and ends when the model is let go. The machine's
    step times are injected (a fast int8 draft, for which the parallel mode is predicted fastest): test_card.py
    measures them on the real model."""
    import gc

    from test_card import RIGHT_15_OF_16, injected

    monkeypatch.setattr(card, "measure_for_choice", lambda *args: injected(15.9, RIGHT_15_OF_16))
    monkeypatch.setattr(card, "parallel_possible", lambda model: True)  # also under xdist's one thread a worker
    model = copy.deepcopy(real[0])  # a model of this test's own, to let go at the end
    ids = torch.tensor([encode(real, REAL_PROMPTS[2])[0]])
    chosen = card.choose_configuration(real[0], real[1], card.CardConfig.cpu(), verify.DEFAULT_MODEL)
    assert (chosen.draft, chosen.mode) == ("int8", "parallel")
    before = card_drafts()  # the session's own draft process lives on
    out = model.generate(ids, custom_generate=card.custom_generate, max_new_tokens=24)
    assert torch.equal(out, plain(real[0], ids, 24))
    kept = card_drafts() - before
    assert len(kept) == 1, "one draft process, kept for the model"
    with pytest.raises(RuntimeError, match="a criterion failed"):
        model.generate(ids, custom_generate=card.custom_generate, max_new_tokens=24,
                       stopping_criteria=StoppingCriteriaList([FailAfter(5)]))
    out = model.generate(ids, custom_generate=card.custom_generate, max_new_tokens=16)
    assert torch.equal(out, plain(real[0], ids, 24)[:, : ids.shape[1] + 16])
    assert card_drafts() - before == kept, "the same process served all three calls"
    del model, out
    gc.collect()
    assert card_drafts() == before, "let go with the model"


def test_card_starts_a_new_draft_process_where_the_kept_one_died(llama):
    """A kept draft process killed between two calls: the next call starts another, with the same tokens."""
    model, _ = llama
    config = card.CardConfig(K=2, k=2, ratio=3, draft="self", draft_dtype="float32")  # built by the method
    before = card_drafts()
    want = model.generate(IDS, max_new_tokens=NEW, do_sample=False)
    out = model.generate(IDS, custom_generate=card.custom_generate, max_new_tokens=NEW, card_config=config)
    assert torch.equal(out, want)
    (dead,) = card_drafts() - before
    os.kill(dead, signal.SIGKILL)
    deadline = time.time() + 10
    while dead in card_drafts() and time.time() < deadline:  # (until all its threads are gone)
        time.sleep(0.05)
    out = model.generate(IDS, custom_generate=card.custom_generate, max_new_tokens=NEW, card_config=config)
    assert torch.equal(out, want)
    assert len(card_drafts() - before) == 1


GUARDED_BY_NOTHING = """
import multiprocessing, os, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, os.path.join({root!r}, "tests"))
import card
from conftest import make_tiny_llama
print("top level", flush=True)
model = make_tiny_llama(0)
ids = torch.tensor([[1] + [5, 6, 7, 8, 9] * 6])
want = model.generate(ids, max_new_tokens=20, do_sample=False)
out = model.generate(ids, custom_generate=card.custom_generate, max_new_tokens=20, eos_token_id=95,
                     card_config=card.CardConfig(K=2, k=2, ratio=3, draft="self", draft_dtype="float32"))
drafts = [p.pid for p in multiprocessing.active_children() if p.name == "card-draft"]
print("identical", torch.equal(out, want), "drafts", drafts, flush=True)
if {interrupt}:
    os.kill(os.getpid(), __import__("signal").SIGINT)  # Ctrl-C, as a user presses it
"""


def run_script(how: str, tmp_path, interrupt: bool = False):
    """The script above run as a file, from stdin or with -c: (exit status, stdout, stderr)."""
    import subprocess

    code = GUARDED_BY_NOTHING.format(root=ROOT, interrupt=interrupt)
    path = tmp_path / "script.py"
    path.write_text(code)
    argv = {"file": [sys.executable, str(path)], "stdin": [sys.executable, "-"], "-c": [sys.executable, "-c", code]}
    # SIGINT's default disposition: a suite started in the background (`make test &`) ignores it, which its
    # children would inherit, and the Ctrl-C case would then be no interrupt at all
    run = subprocess.run(argv[how], input=code if how == "stdin" else None, capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return run.returncode, run.stdout, run.stderr


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_card_from_a_script_without_the_main_guard_runs_lockstep_and_says_so(tmp_path, how):
    """A spawned draft process would run the unguarded top level again (or, from stdin, find no file to
    import): CARD runs lockstep, the same tokens, and says why in one line; the top level runs once."""
    status, out, err = run_script(how, tmp_path)
    assert status == 0, err
    assert out.count("top level") == 1 and "identical True drafts []" in out, out
    assert err.count("\n") == 1 and err.startswith("[card] lockstep instead of parallel: "), err
    assert ('__name__ == "__main__"' if how == "file" else "<stdin>") in err


@pytest.mark.parametrize("interrupt", [False, True], ids=["exit", "ctrl-c"])
def test_card_from_python_c_runs_parallel_and_leaves_no_process_behind(tmp_path, interrupt):
    """Code from -c (a notebook's case too) has no main file to run again: the parallel mode, its draft
    process kept for the model, and gone once the program exits, normally or on Ctrl-C."""
    import re
    import time

    from conftest import running

    status, out, err = run_script("-c", tmp_path, interrupt)
    assert out.count("top level") == 1 and "identical True" in out, (out, err)
    pids = [int(pid) for pid in re.findall(r"\d+", out.split("drafts")[1])]
    assert len(pids) == 1, out
    if interrupt:
        assert status != 0 and "KeyboardInterrupt" in err
    else:
        assert status == 0 and err == "", err
    deadline = time.time() + 10
    while running(pids[0]) and time.time() < deadline:
        time.sleep(0.1)
    assert not running(pids[0]), "the draft process outlived its program"


def test_a_renamed_streamer_local_is_an_error_not_a_silent_hang(tmp_path):
    """generate_argument reads `streamer` from transformers' generate() frame; where a release no longer has
    it there, a TextIteratorStreamer's reader would wait forever: one line naming the version instead."""
    import importlib.util

    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "utils.py").write_text("import verify\n\ndef generate(streamed=None):\n"
                                     "    return verify.generate_argument('streamer')\n")
    # a module under transformers' name (not registered as it): a release whose generate() lacks the local
    spec = importlib.util.spec_from_file_location("transformers.generation.utils", folder / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match=r"transformers \S+'s generate\(\) has no argument 'streamer'") as e:
        module.generate()
    assert "\n" not in str(e.value)
    assert verify.generate_argument("streamer") is None  # no generate() frame at all: no streamer given


# ---------------------------------------------------------------------- where a stop falls inside a step


def drafted_run(model, name: str, options: dict, ids, n: int, eos):
    """The method's own generate() with the same options: which emitted tokens came from accepted drafts."""
    config = next(value for key, value in options.items() if key.endswith("_config"))
    return METHODS[name].generate(model, ids[0].tolist(), n, list(eos), config)


# options that draft the same on every run (no timing-dependent gate or pruning), for the real model
STEADY = {
    "ngram": dict(ngram_config=ngram_predictor.NgramConfig.paper()),
    "cacheback": dict(cacheback_config=cacheback.CachebackConfig(ll=2, tdl=16, crt=4)),
    "fafo": dict(fafo_config=fafo.FafoConfig(n_guess=4, k=3, m=3, sink=2, recent=12, prompt_pool=True)),
}


@pytest.mark.compat
@pytest.mark.parametrize("name", list(STEADY))
def test_eos_inside_an_accepted_draft_stops_where_model_generate_stops(real, name):
    model, tok = real
    eos = verify.eos_ids_of(model, tok)
    for prompt in REAL_PROMPTS[::-1]:
        ids = torch.tensor([encode(real, prompt)[0]])
        gen = drafted_run(model, name, STEADY[name], ids, 48, eos)
        tokens, from_draft = gen.tokens, gen.from_draft
        # a drafted token, seen there first: as EOS, the rest of its step (at least the bonus) must go
        drafted_first = [i for i in range(len(tokens)) if from_draft[i] and tokens[i] not in tokens[:i]]
        if drafted_first:
            break
    assert drafted_first, "no drafted token to stop at: nothing tested"
    j = drafted_first[0]
    # the mask given: with an EOS that is not the pad token, transformers would infer padding wherever the
    # chat template's <|im_end|> (the pad token) is in the prompt
    mask = torch.ones_like(ids)
    for stop_at in (tokens[j], [*eos, tokens[j]]):  # one id, or a list
        want = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, eos_token_id=stop_at)
        assert want.shape[1] == ids.shape[1] + j + 1
        got = model.generate(ids, attention_mask=mask, custom_generate=METHODS[name].custom_generate,
                             max_new_tokens=48, eos_token_id=stop_at, **STEADY[name])
        assert torch.equal(got, want), (name, stop_at)


@pytest.mark.compat
@pytest.mark.parametrize("name", ["ngram", "cacheback"])
def test_max_new_tokens_inside_an_accepted_draft(llama, name):
    model, draft = llama
    from_draft = drafted_run(model, name, tiny_options(name, draft), IDS, NEW, [EOS]).from_draft
    inside = [n for n in range(1, NEW) if from_draft[n - 1]]  # token n - 1 drafted: its step went on past n
    assert inside, "no step was cut inside: nothing tested"
    for n in range(1, NEW):
        got = model.generate(IDS, custom_generate=METHODS[name].custom_generate, max_new_tokens=n,
                             **tiny_options(name, draft))
        assert torch.equal(got, model.generate(IDS, max_new_tokens=n, do_sample=False)), (name, n)
    got = model.generate(IDS, custom_generate=METHODS[name].custom_generate, max_length=len(PROMPT) + 7,
                         **tiny_options(name, draft))
    assert got.shape[1] == len(PROMPT) + 7  # max_length, the other way to say it


@pytest.mark.compat
def test_a_stop_string_inside_an_accepted_draft(real, exported):
    """A stop string completed by a drafted token: HF stops there, and so does each form (the callable through
    a StopStringCriteria, as transformers keeps `tokenizer` from a callable; the folder through stop_strings)."""
    model, tok = real
    config = cacheback.CachebackConfig(ll=2, tdl=16, crt=4)  # no pruning: the same drafts every run

    def candidates():  # (prompt ids, a drafted token's index, its text), prompt by prompt
        for prompt in REAL_PROMPTS:
            ids = torch.tensor([encode(real, prompt)[0]])
            gen = cacheback.generate(model, ids[0].tolist(), 48, verify.eos_ids_of(model, tok), config)
            for j, token in enumerate(gen.tokens):
                word = tok.decode([token]).strip()
                if gen.from_draft[j] and len(word) >= 2:
                    yield ids, j, word

    tested = 0
    for ids, j, word in candidates():
        want = model.generate(ids, max_new_tokens=48, stop_strings=[word], tokenizer=tok)
        if want.shape[1] != ids.shape[1] + j + 1:
            continue  # the string occurs earlier: not a stop inside this step
        criteria = StoppingCriteriaList([StopStringCriteria(tokenizer=tok, stop_strings=[word])])
        called = model.generate(ids, custom_generate=cacheback.custom_generate, max_new_tokens=48,
                                stopping_criteria=criteria, cacheback_config=config)
        assert torch.equal(called, want), word
        loaded = model.generate(ids, custom_generate=exported["cacheback"], trust_remote_code=True,
                                max_new_tokens=48, stop_strings=[word], tokenizer=tok, cacheback_config=config)
        assert torch.equal(loaded, want), word
        tested += 1
        break  # one stop inside a draft, in both forms
    assert tested, "no drafted word to stop at: nothing tested"
    # the callable form never sees the tokenizer: transformers itself says so
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, custom_generate=cacheback.custom_generate, max_new_tokens=8, stop_strings=["x"],
                       tokenizer=tok)


# ------------------------------------------------------------------------------------ outputs and streaming


class Never(StoppingCriteria):
    """A caller's criterion that answers a plain bool, as StoppingCriteriaList allows."""

    def __call__(self, input_ids, scores, **kwargs):
        return False


@pytest.mark.compat
def test_return_dict_in_generate(llama):
    model, draft = llama
    want = model.generate(IDS, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    got = model.generate(IDS, custom_generate=cacheback.custom_generate, max_new_tokens=NEW,
                         return_dict_in_generate=True, stopping_criteria=StoppingCriteriaList([Never()]),
                         **tiny_options("cacheback", draft))
    assert type(got) is type(want)
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.compat
@pytest.mark.parametrize("name", ["ngram", "cacheback"])
def test_a_text_streamer_prints_what_model_generate_prints(real, exported, capsys, name):
    model, tok = real
    ids = torch.tensor([encode(real, REAL_PROMPTS[1])[0]])
    model.generate(ids, max_new_tokens=24, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
    want = capsys.readouterr().out
    assert len(want) > 24
    model.generate(ids, custom_generate=METHODS[name].custom_generate, max_new_tokens=24,
                   streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == want, "the callable form"
    model.generate(ids, custom_generate=exported[name], trust_remote_code=True, max_new_tokens=24,
                   streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == want, "the folder form"


@pytest.mark.compat
@pytest.mark.parametrize("name", list(METHODS))
def test_sampling_is_the_plain_samplers_for_the_seed(llama, name):
    """do_sample with temperature, top_k, top_p: exactly our plain sampler's tokens for that seed (a different
    random stream from HF's sampler, the same distribution); without seed=, torch.manual_seed repeats a call;
    HF's default top_k of 50 is read from its logits processors."""
    model, draft = llama
    options = tiny_options(name, draft)
    method = METHODS[name].custom_generate
    got = model.generate(IDS, custom_generate=method, max_new_tokens=NEW, do_sample=True, temperature=0.7,
                         top_k=20, top_p=0.95, seed=3, **options)
    want = verify.vanilla_generate(model, PROMPT, NEW, [EOS], verify.Sampling(0.7, 20, 0.95, 3)).tokens
    assert got[0, len(PROMPT):].tolist() == want
    got = model.generate(IDS, custom_generate=method, max_new_tokens=NEW, do_sample=True, seed=4, **options)
    assert got[0, len(PROMPT):].tolist() == verify.vanilla_generate(model, PROMPT, NEW, [EOS],
                                                                    verify.Sampling(1.0, 50, 1.0, 4)).tokens
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(model.generate(IDS, custom_generate=method, max_new_tokens=NEW, do_sample=True, **options))
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------------------------------------- refusals


def _refusals(model, draft):
    sliding = tiny_sliding_window()
    yield "batch size 2", model, dict(inputs=torch.tensor([PROMPT, PROMPT]))
    yield "num_return_sequences", model, dict(do_sample=True, num_return_sequences=2)
    yield "padded attention_mask", model, dict(attention_mask=torch.tensor([[0] + [1] * (len(PROMPT) - 1)]))
    yield "RepetitionPenaltyLogitsProcessor", model, dict(repetition_penalty=1.3)
    yield "Min(NewTokens)?LengthLogitsProcessor", model, dict(min_new_tokens=5)
    yield "NoBadWordsLogitsProcessor", model, dict(bad_words_ids=[[7]])
    yield "beam search", model, dict(num_beams=2)
    yield "contrastive search", model, dict(penalty_alpha=0.6, top_k=4)
    yield "dola generation", model, dict(dola_layers="low")
    yield "output_scores", model, dict(return_dict_in_generate=True, output_scores=True)
    yield "assisted generation", model, dict(assistant_model=draft)
    yield "assisted generation", model, dict(prompt_lookup_num_tokens=3)
    yield "TemperatureLogitsWarper after TopPLogitsWarper", model, dict(
        do_sample=True, temperature=0.7, logits_processor=LogitsProcessorList([TopPLogitsWarper(0.9)]))
    yield "position_ids", model, dict(position_ids=torch.arange(len(PROMPT))[None] + 3)
    yield "cache_implementation", model, dict(cache_implementation="static")
    yield "sliding-window", sliding, {}


def tiny_sliding_window():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, sliding_window=16, eos_token_id=EOS,
                              pad_token_id=EOS)
    return tf.MistralForCausalLM(config).eval()


@pytest.mark.parametrize("name", list(METHODS))
def test_what_would_break_losslessness_is_refused_in_one_line(llama, name):
    model, draft = llama
    for reason, target, arguments in _refusals(model, draft):
        arguments = {"inputs": IDS, **arguments}
        options = tiny_options(name, copy.deepcopy(target) if name == "card" else None)
        with pytest.raises(ValueError, match=reason) as refused:
            target.generate(custom_generate=METHODS[name].custom_generate, max_new_tokens=8, **arguments,
                            **options)
        assert "\n" not in str(refused.value), (name, reason)
    # a method's keyword misspelt: transformers itself refuses a keyword that nothing takes
    with pytest.raises(ValueError, match="cacheback_cfg"):
        model.generate(IDS, custom_generate=cacheback.custom_generate, max_new_tokens=8, cacheback_cfg=cacheback.CachebackConfig())


def test_the_exported_folder_holds_the_method_and_verify_as_in_the_repository(exported):
    """Exactly the files transformers reads, and the method file and verify.py as they are here but for the
    two import lines (relative, as transformers imports the folder as a package)."""
    for name, folder in exported.items():
        module = METHODS[name].__name__
        files = sorted(os.listdir(os.path.join(folder, "custom_generate")))
        assert files == sorted(["generate.py", "requirements.txt", "verify.py", f"{module}.py"]), files
        assert sorted(os.listdir(folder)) == ["LICENSE", "README.md", "custom_generate"]
        with open(os.path.join(folder, "LICENSE"), encoding="utf-8") as f, open(os.path.join(ROOT, "LICENSE")) as g:
            assert f.read() == g.read()
        with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        assert readme.startswith("---\nlibrary_name: transformers\nlicense: mit\ntags:\n- custom_generate\n---\n")
        assert all(item in readme for item in verify.REFUSED)
        # the method's keywords, one item each, as its custom_generate's signature has them
        keywords = [k for k in inspect.signature(METHODS[name].custom_generate).parameters
                    if k not in ("model", "input_ids", "logits_processor", "stopping_criteria", "generation_config",
                                 "model_kwargs")]
        arguments = readme.split("## Additional arguments")[1].split("##")[0]
        assert [line.split("`")[1] for line in arguments.splitlines() if line.startswith("- `")] == keywords
        assert "prepare()" not in arguments and "frozen_table_for" not in arguments  # no internal names
        for source in (f"{module}.py", "verify.py"):
            with open(os.path.join(ROOT, source), encoding="utf-8") as f:
                ours = f.read().splitlines()
            with open(os.path.join(folder, "custom_generate", source), encoding="utf-8") as f:
                theirs = f.read().splitlines()
            changed = [(a, b) for a, b in zip(ours, theirs) if a != b]
            assert len(ours) == len(theirs)
            expected = [] if source == "verify.py" else [("import verify", "from . import verify"),
                                                         ("from verify import", "from .verify import")]
            assert len(changed) == len(expected), (source, changed)
            for (a, b), (old, new) in zip(changed, expected):
                assert a.startswith(old) and b.startswith(new), (a, b)


def test_export_refuses_a_folder_that_is_not_empty(tmp_path):
    import subprocess

    (tmp_path / "x").write_text("keep me")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "export_generate.py"), "ngram",
                          str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "not empty" in run.stderr, run.stderr
