# SPDX-License-Identifier: MIT
"""tools/replay.py: a page per method from a real run of the default model, checked against oracles (HF
greedy through --compare, a fresh n-gram predictor, the KV cache's arithmetic, the candidate cache's own
tree), then opened in headless Chromium (skipped, with the reason, where none is installed)."""

import os

import pytest
from conftest import encode, run_main

import card
import ngram_predictor
from tools import replay
from tools.methods import METHODS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a Python function that checks whether a string is a palindrome."

# method -> its options on the replay's command line (small steps keep the run short)
RUNS = {
    "ngram": [],
    "cacheback": ["--ll", "1", "--frozen", "selfchat"],  # the shipped frozen table: frozen followers show
    "card-lockstep": ["--mode", "lockstep", "--K", "4", "--k", "4"],  # a cache wider than a chain
    # parallel, as the CPU default runs where CARD wins (it chooses by this machine's speed: card.py section 5b):
    # the draft in its own process, its cache sent through the pipe
    "card": ["--mode", "parallel", "--draft", "int8", "--ratio", "5"],
    "fafo": [],
}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """method -> (page path, its data), each from `python tools/replay.py METHOD ...`."""
    folder = tmp_path_factory.mktemp("replay")
    out = {}
    for name, options in RUNS.items():
        path = str(folder / f"{name}.html")
        # --compare (HF greedy beside the run, on the page) once: the other runs are checked against the oracle
        compare = ["--compare"] if name == "ngram" else []
        argv = [name.split("-")[0], "--prompt", PROMPT, "--max-new-tokens", "32", *compare, *options, "-o", path]
        status, stdout, stderr = run_main(replay, argv)
        assert status == 0, stderr
        assert stdout.startswith(f"wrote {path}: "), stdout
        out[name] = (path, replay.read_page(path))
    return out


def _emitted(step: dict) -> list[int]:
    """The tokens a step emits: its accepted branch, then the bonus token (cut where the run stopped)."""
    branch = [step["tokens"][i] for i in step["path"][1:]] + [step["bonus"]]
    return branch[: step["emitted"]]


@pytest.mark.parametrize("name", list(RUNS))
def test_a_page_holds_every_step_of_a_lossless_run(pages, real, oracle, name):
    """The steps rebuild the output token for token, and that output is HF greedy's (the oracle; with
    --compare the page says so too); the KV cache holds the prompt and the output but the pending token after
    each step, and held the whole step before."""
    _, data = pages[name]
    stats = data["stats"]
    ids, eos = encode(real, PROMPT)
    assert data["output"] == oracle(ids, 32, eos)
    if name == "ngram":  # the one run with --compare: the page's own verdict
        assert stats["identical"] is True
    assert len(data["steps"]) == stats["target_forwards"] - 1  # every forward but the prefill is a step
    rebuilt = data["output"][:1]
    for step in data["steps"]:
        assert step["n_before"] == len(rebuilt)
        rebuilt += _emitted(step)
        inputs = sum(len(row) for row in replay_rows(data, step))
        assert step["inputs"] == inputs
        assert step["kv_before"] == stats["prompt_tokens"] + step["n_before"] - 1 + inputs
        assert step["kv_after"] == stats["prompt_tokens"] + step["n_before"] + len(step["path"]) - 1
        accepted = len(step["path"]) - 1
        how = data["came_from"][step["n_before"] : step["n_before"] + step["emitted"]]
        assert how == (["draft"] * accepted + ["bonus"])[: step["emitted"]]  # the strip's colours
    assert rebuilt == data["output"]
    assert "".join(data["pieces"]) == real[1].decode(data["output"])  # the strip's text is the output's
    assert all(str(t) in data["vocab"] for s in data["steps"] for t in s["tokens"])


def replay_rows(data: dict, step: dict) -> list[list[int]]:
    """The step's verification inputs: the tree's nodes, or FAFO's rows (x, n x k guesses, m x k candidates)."""
    if data["method"] != "fafo":
        return [step["tokens"]]
    n, k, m = step["layout"]
    return [[step["tokens"][0]]] + [[0] * k] * n + [[0] * k] * m


def test_ngram_orders_are_the_predictor_s_own(pages, real):
    """Each drafted token's order is the one a fresh predictor, fed the same text, reports (the sequential
    oracle); the step verifies a prefix of the chain, and shows how many tokens the rule withheld."""
    model, tok = real
    _, data = pages["ngram"]
    prompt_ids, _ = encode(real, PROMPT)
    cfg = ngram_predictor.NgramConfig.for_device("cpu")
    for step in data["steps"]:
        predictor = ngram_predictor.NGramPredictor(cfg.max_order, cfg.draft_count, cfg.max_history)
        predictor.update_batch(list(prompt_ids) + data["output"][: step["n_before"]])
        drafted = predictor.draft()[: len(data["output"]) - step["n_before"] - 1]
        verified = len(step["tokens"]) - 1
        assert step["tokens"][1:] == [t for t, _ in drafted[:verified]]
        assert step["notes"] == [f"{order}-gram" for _, order in drafted[:verified]]
        assert step["withheld"] == len(drafted) - verified


def test_cacheback_marks_dynamic_and_frozen_followers(pages):
    _, data = pages["cacheback"]
    marks = [flag for step in data["steps"] for flag in step["frozen"]]
    assert True in marks and False in marks  # both tables drafted in this run
    for step in data["steps"]:
        assert len(step["frozen"]) == len(step["notes"]) == len(step["tokens"]) - 1
        assert all(note.startswith("frozen" if f else "dynamic") for f, note in zip(step["frozen"], step["notes"]))


@pytest.mark.parametrize("name", ["card-lockstep", "card"])
def test_card_shows_the_queried_chain_inside_its_candidate_cache(pages, name):
    """The chain is a path of the cache the query saw (as token ids: through the pipe in parallel mode). In
    lockstep nothing drafts between the query and the correction, so a step hit exactly when the bonus token
    is a child of the last accepted node in that cache: the oracle for the hit/miss read from the counts."""
    _, data = pages[name]
    hits = []
    for step in data["steps"]:
        layers = step["layers"]
        assert layers and layers[0] == [[step["tokens"][0], -1, 1.0, True]]
        node = 0
        for depth, token in enumerate(step["tokens"][1:], start=1):
            node = next(i for i, nd in enumerate(layers[depth]) if nd[1] == node and nd[0] == token)
            if depth == len(step["path"]) - 1:
                last_accepted = node
        if len(step["path"]) == 1:
            last_accepted = 0
        below = layers[len(step["path"])] if len(step["path"]) < len(layers) else []
        in_cache = any(nd[1] == last_accepted and nd[0] == step["bonus"] for nd in below)
        if name == "card-lockstep" and step["hit"] is not None:
            assert step["hit"] == in_cache
        hits.append(step["hit"])
    assert hits[-1] is None and None not in hits[:-1]  # the last step is never corrected
    if name == "card":
        assert True in hits  # the draft process leads: some steps hit


def test_card_drafter_shows_nothing_unless_asked(real, draft_int8):
    """A normal run (no on_step hook) pays nothing: the Drafter shows nothing (shown() is empty)."""
    model, tok = real
    drafter = card.Drafter(draft_int8, K=1, k=1)
    drafter.start(list(encode(real, PROMPT)[0]), capacity=128)
    drafter.advance(3)
    assert drafter.shown() == {}
    drafter.start(list(encode(real, PROMPT)[0]), capacity=128, show=True)
    drafter.advance(3)
    facts = drafter.shown()
    assert len(facts["layers"]) == 4 and facts["hits"] == 0  # the root and three grown layers


def test_fafo_shows_streams_keys_and_candidates(pages):
    """Every candidate's key is a suffix of the text the step saw; the winner's matched run is the accepted
    branch; the streams are n windows of k tokens."""
    _, data = pages["fafo"]
    n, k, _ = data["steps"][0]["layout"]
    for step in data["steps"]:
        assert len(step["streams"]) == n and all(len(s["window"]) == k for s in step["streams"])
        text = data["output"][: step["n_before"]]
        for cand in step["candidates"]:
            if cand["key"] is not None and len(cand["key"]) <= len(text):
                assert text[-len(cand["key"]):] == cand["key"]
        accepted = [step["tokens"][i] for i in step["path"][1:]]
        if step["winner"] >= 0:
            assert step["candidates"][step["winner"]]["tokens"][: len(accepted)] == accepted
        else:
            assert accepted == [] and step["bonus"] == step["first_choice"]


def test_the_page_needs_no_network(pages):
    for path, _ in pages.values():
        text = open(path, encoding="utf-8").read()
        for outside in ("<script src", "<link", "@import", "url(", "https://"):
            assert outside not in text, (path, outside)


def test_the_page_survives_text_that_looks_like_html(tmp_path):
    """A model's output may hold "</script>" or "<!--" (and a prompt the page's placeholders): the data stays
    data, and reads back unchanged."""
    data = {"method": "ngram", "prompt": "__DATA__ __TITLE__ </script><!-- <script>", "pieces": ["<!--", "<script>"]}
    path = str(tmp_path / "page.html")
    replay.write_page(data, path)
    text = open(path, encoding="utf-8").read()
    assert text.count("<script") == 2 and text.count("</script>") == 2  # the data block and the page's code
    assert replay.read_page(path) == data


@pytest.mark.parametrize("argv, message", [
    (["lookahead", "--prompt", "x"], f"error: unknown method 'lookahead': expected one of {', '.join(METHODS)}"),
    (["fafo", "--prompt", "x", "--k", "0"], "error: --k must be at least 1 (got 0)"),
    (["ngram", "--prompt", " "], "error: --prompt is empty"),
    (["card", "--prompt", "Hi.", "--trace"], "error: --trace and --json print a run; a replay writes it to the page "
                                             "instead"),
])
def test_bad_input_is_one_line_and_status_2(argv, message):
    status, stdout, stderr = run_main(replay, argv)
    assert (status, stdout, stderr.strip()) == (2, "", message)


def test_a_page_that_cannot_be_written_is_one_line(tmp_path):
    status, _, stderr = run_main(replay, ["ngram", "--prompt", "Hi.", "--max-new-tokens", "2",
                                          "-o", str(tmp_path / "no" / "such" / "dir.html")])
    assert status == 2 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1


# ---- in a real browser -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = replay.browser_missing()
    if missing and os.environ.get("CI") == "true":  # .ci/run installs it: a skip there would hide a failure
        pytest.fail(f"CI without a headless Chromium: {missing}")
    if missing:
        pytest.skip(f"no headless Chromium: {missing}")
    driver = replay.headless_chromium(profile=str(tmp_path_factory.mktemp("chromium-profile")))
    yield driver
    driver.quit()


@pytest.mark.parametrize("name", list(RUNS))
def test_the_page_steps_in_headless_chromium(pages, browser, name):
    """No console error; as many steps (and bars) as the run made; "next", the right arrow and a click on an
    output token each move to the step they should."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    path, data = pages[name]
    browser.get("file://" + path)
    browser.get_log("browser")  # (drops what an earlier page left)
    browser.refresh()
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
    steps = len(data["steps"])
    assert browser.find_element(By.ID, "step-count").text == str(steps)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#bar-chart g.bar")) == steps
    number = browser.find_element(By.ID, "step-number")
    assert number.text == "step 1"
    browser.find_element(By.ID, "next").click()
    assert number.text == "step 2"
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_RIGHT)
    assert number.text == "step 3"
    token = browser.find_elements(By.CSS_SELECTOR, "#strip span")[-1]  # the last token: the last step's
    token.click()
    assert number.text == f"step {data['step_of'][-1] + 1}"
    assert browser.find_elements(By.CSS_SELECTOR, "#mask svg path")  # the mask grid was drawn
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []
