# SPDX-License-Identifier: MIT
"""The documentation is code too: every `>>>` example in the method files and verify.py runs, and verify.py's
module docstring lists exactly the public names the file defines."""

import ast
import doctest
import inspect
import os
import re

import pytest

import prompts
import verify
from bench import side_by_side
from serve import gate, vllm_proposers
from tools import methods

# the files a reader studies: verify.py, every method of tools/methods.py, the serving code, the prompts' reader
READER_MODULES = [verify, *(methods.module_of(name) for name in methods.METHODS), vllm_proposers, gate, prompts]
MODULES = READER_MODULES + [side_by_side]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    # No option flags: the examples must pass exactly as a reader runs them (python -m doctest FILE).
    result = doctest.testmod(module)
    assert result.attempted > 0, f"{module.__name__} has no >>> example"
    assert result.failed == 0


def test_verify_docstring_lists_its_public_names():
    listed = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", verify.__doc__.split("The public names")[1].split("Greedy speculative")[0]))
    defined = {name for name, obj in vars(verify).items()
               if not name.startswith("_") and name != "main" and (inspect.isfunction(obj) or inspect.isclass(obj))
               and obj.__module__ == "verify"}
    assert defined <= listed, f"public but not listed: {sorted(defined - listed)}"
    described = {name for name in listed if name in vars(verify)}
    assert described >= defined and all(hasattr(verify, n) for n in described)


# one impossible value per method (tests/test_layout.py: every method of tools/methods.py has one)
BAD_CONFIGS = {"cacheback": dict(tdl=4, crt=4), "card": dict(ratio="fast"), "fafo": dict(k=0),
               "ngram": dict(max_order=1)}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_a_bad_configuration_is_an_ordinary_value_error(name):
    """Someone who copied one method file and verify.py gets normal exceptions, not a CLI-only type."""
    with pytest.raises(ValueError):
        methods.config_of(name)(**BAD_CONFIGS[name]).check()


def _figures_module():
    from docs import make_figures

    return make_figures


def test_every_tutorial_figure_is_made_by_make_figures_and_committed():
    import os

    figs = _figures_module()
    root = os.path.dirname(figs.HERE)
    text = "".join(open(os.path.join(root, f), encoding="utf-8").read() for f in ("TUTORIAL.md", "RESULTS.md"))
    embedded = set(re.findall(r"\]\(docs/figures/([a-z_]+)\.png\)", text))
    assert embedded == set(figs.FIGURES), "TUTORIAL.md and RESULTS.md embed exactly the figures make_figures draws"
    for name in embedded:
        assert os.path.getsize(os.path.join(figs.OUT, name + ".png")) > 5000, name


def test_mask_figures_draw_from_the_code(tmp_path, monkeypatch):
    """The figures that need no model, drawn into a scratch folder: they run and write a real PNG."""
    figs = _figures_module()
    monkeypatch.setattr(figs, "OUT", str(tmp_path))
    for name in ("mask_tree", "compaction", "card_mask", "fafo_mask"):
        getattr(figs, name)()
        with open(tmp_path / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


def named_in(text: str) -> dict[str, set]:
    """What a document names in backticks: code as `file.py:name` (or `file.py:Class.method`) and
    `module.name`; tests, `test_name` (or `tests/file.py::test_name`); files, `folder/path`."""
    code = set(re.findall(r"`(\w+\.py):([\w.]+)`", text))
    code |= {(module + ".py", name) for module, name in re.findall(
        r"`(verify|ngram_predictor|cacheback|card|fafo|gate|vllm_proposers)\.(?!py`)([A-Za-z_][\w.]*)`", text)}
    tests = set(re.findall(r"\b(test_[a-z0-9_]+[a-z0-9])\b(?!\.py|`\.py)", text))
    files = set(re.findall(r"`((?:bench|tools|tests|serve|docs|prompts|corpus)/[\w./-]+\.\w+)`", text))
    return {"code": code, "tests": tests, "files": files}


def test_every_name_a_document_gives_exists():
    """Each function, class, constant, test and file that README, TUTORIAL, RESULTS and serve/README name
    exists (a test by its function name or its file's)."""
    import os

    root = _root()
    modules = {os.path.basename(m.__file__): m for m in MODULES}  # serve/vllm_proposers.py, serve/gate.py too
    test_names = set()
    for name in os.listdir(os.path.join(root, "tests")):
        if name.endswith(".py"):
            test_names.add(name[:-3])
            test_names |= set(re.findall(r"^def (test_\w+)", _read("tests/" + name), flags=re.M))
    missing = []
    for document in DOCUMENTS:
        named = named_in(_read(document))
        assert document != "TUTORIAL.md" or len(named["code"]) > 40
        for file, name in sorted(named["code"]):
            obj = modules[file]
            for part in name.split("."):
                if not hasattr(obj, part):
                    missing.append(f"{document} names {file}:{name}")
                    break
                obj = getattr(obj, part)
        missing += [f"{document} names the test {t}" for t in sorted(named["tests"] - test_names)]
        missing += [f"{document} names {f}" for f in sorted(named["files"]) if not os.path.exists(os.path.join(root, f))]
    assert not missing, "\n".join(missing)


def test_the_names_check_sees_each_kind():
    named = named_in("`card.py:Drafter.advance`, `verify.step_times`, `fafo.py`, test_the_rule_works, `bench/none.py`")
    assert named == {"code": {("card.py", "Drafter.advance"), ("verify.py", "step_times")},
                     "tests": {"test_the_rule_works"}, "files": {"bench/none.py"}}


COMPUTING = (ast.Call, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.Subscript, ast.Compare, ast.BoolOp)


def packed_assignments(path: str) -> list[int]:
    """Lines that assign several names from a tuple of which an element computes something
    (`a, b = f(x), y[i] + 1`): one value a line reads better. Plain starts (`a, b = [], 0`) pass."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Tuple) and any(isinstance(e, COMPUTING) for e in node.value.elts)]


@pytest.mark.parametrize("module", READER_MODULES, ids=lambda m: m.__name__)
def test_one_computed_value_a_line(module):
    assert packed_assignments(module.__file__) == [], f"{module.__name__}: packed assignments"


def test_the_packed_assignment_check_sees_one(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("a, b = [], 0\nc, d = f(x), y[i] + 1\n")
    assert packed_assignments(str(path)) == [2]


def _root() -> str:
    import os

    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_tutorial_lists_exactly_what_verify_refuses():
    """verify.REFUSED is the one list of refusals; TUTORIAL §1.9's copy (between its markers) says the same."""
    import os

    with open(os.path.join(_root(), "TUTORIAL.md"), encoding="utf-8") as f:
        readme = f.read()
    block = readme.split("<!-- refused: verify.REFUSED -->")[1].split("<!-- /refused -->")[0]
    items = [" ".join(item.split()) for item in block.strip().removeprefix("- ").split("\n- ")]
    assert items == list(verify.REFUSED)


def test_every_python_file_carries_the_licence():
    import os
    import subprocess

    with open(os.path.join(_root(), "LICENSE"), encoding="utf-8") as f:
        assert f.readline().strip() == "MIT License"
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=_root(), capture_output=True, text=True).stdout.split()
    assert len(files) > 30
    for name in files:
        with open(os.path.join(_root(), name), encoding="utf-8") as f:
            assert f.readline() == "# SPDX-License-Identifier: MIT\n", name


# ---- the documents' links, and the results they cite ----------------------------------------------------------

DOCUMENTS = ("README.md", "serve/README.md", "TUTORIAL.md", "RESULTS.md")
# where a file of bench/results/ may be read by name: the scripts and the tests (not the results themselves)
READERS = ("bench/", "tools/", "tests/", "docs/", "Makefile")


def _tracked() -> list[str]:
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=_root(), capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def _read(path: str) -> str:
    import os

    with open(os.path.join(_root(), path), encoding="utf-8") as f:
        return f.read()


def _outside_code_blocks(text: str) -> list[str]:
    """A markdown file's lines outside fenced code blocks (where `# x` is no heading and `[a](b)` no link)."""
    lines = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: the text lowercased, every character but letters,
    digits, `_`, hyphens and spaces dropped, spaces made hyphens; a repeated heading gets -1, -2, ...

    >>> sorted(heading_anchors("## 1.9 Called by `model.generate`: what it does\\n## A b\\n## A b\\n"))
    ['19-called-by-modelgenerate-what-it-does', 'a-b', 'a-b-1']
    """
    anchors = set()
    seen = {}
    for line in _outside_code_blocks(text):
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def relative_links(text: str) -> list[tuple[str, str]]:
    """(text, target) of each markdown link `[text](target)` (an image's too) outside code, but web links."""
    links = []
    for line in _outside_code_blocks(text):
        line = re.sub(r"`[^`]*`", "", line)  # an inline code span holds no link
        for m in re.finditer(r"!?\[([^\]]*)\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(2)):  # http:, https:, mailto: ...
                links.append((m.group(1), m.group(2)))
    return links


def broken_links(document: str) -> list[str]:
    """What is wrong with each relative link of one document (a path from the repository's root)."""
    import os
    from urllib.parse import unquote

    root = _root()
    wrong = []
    for text, target in relative_links(_read(document)):
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(document), unquote(path))) if path else document
        where = f"{document}: [{text}]({target})"
        if file.startswith("..") or not os.path.exists(os.path.join(root, file)):
            wrong.append(f"{where} points at {file}, which does not exist")
        elif anchor and file.endswith(".md") and unquote(anchor) not in heading_anchors(_read(file)):
            wrong.append(f"{where}: {file} has no heading whose anchor is #{anchor}")
    return wrong


def test_every_link_between_the_documents_resolves():
    """Each relative link of README.md, serve/README.md, TUTORIAL.md and RESULTS.md names a file that exists,
    and its #anchor, into a markdown file, a heading of that file."""
    import os

    documents = [d for d in DOCUMENTS if os.path.exists(os.path.join(_root(), d))]
    assert "serve/README.md" in documents, "serve/README.md, the serving guide README.md links to, is missing"
    wrong = [problem for document in documents for problem in broken_links(document)]
    assert not wrong, "broken links:\n" + "\n".join(wrong)
    assert any(target.partition("#")[0] == "serve/README.md" for _, target in relative_links(_read("README.md"))), \
        "README.md links to serve/README.md"


def test_the_readmes_python_blocks_parse():
    """README.md's and serve/README.md's ```python blocks are Python a reader can paste."""
    for document in ("README.md", "serve/README.md"):
        blocks = re.findall(r"^```python\n(.*?)^```", _read(document), flags=re.M | re.S)
        for i, block in enumerate(blocks):
            try:
                ast.parse(block)
            except SyntaxError as e:
                raise AssertionError(f"{document}: python block {i + 1} does not parse: {e}") from None


def results_citations(text: str) -> set[str]:
    """The paths under bench/results/ a text names (`{a,b}` expanded; a placeholder such as NAME or <name>
    skipped), each without its trailing punctuation.

    >>> sorted(results_citations("see bench/results/serve-offline-{tune,report}.md. And bench/results/NAME.jsonl"))
    ['bench/results/serve-offline-report.md', 'bench/results/serve-offline-tune.md']
    """
    cited = set()
    for m in re.finditer(r"bench/results/([\w.{},*/-]*)([<$]?)", text):
        rest = m.group(1).rstrip(".,/")
        if not rest or m.group(2) or any(re.fullmatch(r"[A-Z]{2,}", part.partition(".")[0])
                                         for part in rest.split("/")):
            continue
        brace = re.search(r"\{([^{}]*)\}", rest)
        names = [rest[:brace.start()] + alt + rest[brace.end():] for alt in brace.group(1).split(",")] \
            if brace else [rest]
        cited.update("bench/results/" + name for name in names)
    return cited


def _stem(path: str) -> str:
    """A path without its extension: a benchmark's --out, whose rows (.jsonl), table (.md) and chart (.png)
    share it."""
    import os

    return os.path.splitext(path)[0]


def test_every_result_results_md_cites_exists():
    """A path RESULTS.md names under bench/results/ is a committed file, a folder of them, a pattern that
    matches some, or a benchmark's --out (its .jsonl, .md or .png committed)."""
    import fnmatch

    files = [f for f in _tracked() if f.startswith("bench/results/")]
    missing = []
    for path in sorted(results_citations(_read("RESULTS.md"))):
        if "*" in path:
            found = any(fnmatch.fnmatch(f, path) for f in files)
        else:
            found = any(f == path or f.startswith(path + "/") or _stem(f) == path for f in files)
        if not found:
            missing.append(path)
    assert not missing, "RESULTS.md cites what bench/results/ does not hold: " + ", ".join(missing)


def _names(path: str, text: str) -> bool:
    """Whether a text names a file of bench/results/: its name (`kv-long-after.md`), or one of its folders
    below bench/results/ (`second-read`), standing alone."""
    import os

    names = [os.path.basename(path), *os.path.dirname(path).split("/")[2:]]
    return any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) for name in names)


def test_every_committed_result_is_cited_or_read():
    """Each file in bench/results/ is cited by RESULTS.md (its path, its name, its folder, or a sibling of the
    same run: the rows and chart behind a cited table) or named by a script or a test that reads it."""
    import fnmatch

    tracked = _tracked()
    files = [f for f in tracked if f.startswith("bench/results/")]
    results = _read("RESULTS.md")
    cited = results_citations(results)
    readers = "\n".join(_read(f) for f in tracked if f.startswith(READERS) and not f.startswith("bench/results/")
                        and not f.endswith((".png", ".gz")))

    patterns = set(re.findall(r"(?<![\w/-])([\w.-]*\*[\w.*-]*\.(?:md|jsonl|png|txt))", results))  # `kv-*.md`

    def named(f: str) -> bool:
        parts = f.split("/")
        folders = {"/".join(parts[:i]) for i in range(3, len(parts))}  # bench/results/X/..., not bench/results
        return _stem(f) in {_stem(c) for c in cited} or bool(folders & cited) or _names(f, results) or \
            any(fnmatch.fnmatch(f, c) for c in cited) or any(fnmatch.fnmatch(parts[-1], p) for p in patterns)

    def is_cited(f: str) -> bool:  # the file, or another of its run (the same path but the extension)
        return any(named(g) for g in files if _stem(g) == _stem(f))

    def is_read(f: str) -> bool:
        return _names(f, readers) or re.search(rf"{re.escape(_stem(f))}(?![\w-])", readers) is not None

    orphans = [f for f in files if not is_cited(f) and not is_read(f)]
    assert not orphans, f"in bench/results/ but neither cited by RESULTS.md nor read by a script or test " \
                        f"({len(orphans)}): " + ", ".join(orphans)


def test_every_section_a_file_cites_is_a_heading_of_results_md():
    """A section the code or the documents cite (RESULTS.md, then its name in quotes; a comment may wrap it)
    is a heading of RESULTS.md, or its part before a colon ("Drafting quality offline" for the heading that
    goes on ": every drafter at budgets 4, 16 and 64")."""
    headings = [line.lstrip("#").strip() for line in _read("RESULTS.md").splitlines() if line.startswith("#")]
    cited = set()
    for f in _tracked():
        if f.endswith((".py", ".md", ".sh", ".toml", ".txt")) or f == "Makefile":
            text = re.sub(r"\n\s*#?\s*", " ", _read(f))  # a citation wrapped across comment lines
            cited.update(re.findall(r"RESULTS\.md[,:]? \(?\\?\"([^\"\\]+)\\?\"", text))
    assert len(cited) >= 10
    unknown = sorted(name for name in cited if not any(h == name or h.startswith(name + ":") for h in headings))
    assert not unknown, "RESULTS.md has no heading for: " + ", ".join(unknown)


def test_every_result_files_command_exists():
    """The command heading a committed result (its first line) names scripts and prompt files that exist today
    (a run made with a script since renamed says so on its next lines)."""
    import glob
    import os

    root = _root()
    missing = []
    for path in sorted(glob.glob(os.path.join(root, "bench", "results", "**", "*.md"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        named = re.findall(r"python3? ((?:[\w-]+/)*[\w-]+\.py)", first) + re.findall(r"(prompts/[\w.-]+\.jsonl)", first)
        named += re.findall(r"(bench/[\w.-]+\.jsonl)\b(?! --out)", first.split("--out")[0])
        missing += [f"{os.path.relpath(path, root)}: {name}" for name in named if not os.path.exists(os.path.join(root, name))]
    assert not missing, "\n".join(missing)


# ---- figures against their rows: each claim a phrase of RESULTS.md with {} where a figure recomputed from the
# rows it cites stands (a table's cells, or a sentence's number)

def _rows(name: str) -> list[dict]:
    import json

    with open(os.path.join(_root(), "bench", "results", name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def mean_accepted(rows: list[dict], method: str) -> float:
    """RESULTS.md's mean accepted: new tokens over target forwards, over all of a method's prompts together."""
    mine = [r for r in rows if r["method"] == method]
    return sum(r["new_tokens"] for r in mine) / sum(r["target_forwards"] for r in mine)


def specbench(rows: list[dict], method: str, baseline: str = "hf-greedy") -> float:
    """SpecBench's speedup: the mean of per-prompt tokens/s over the baseline's."""
    import statistics

    def mean(m):
        return statistics.mean(r["tokens_per_s"] for r in rows if r["method"] == m)
    return mean(method) / mean(baseline)


def total(rows: list[dict], method: str, baseline: str = "hf-greedy") -> float:
    """The total speedup: total tokens over total time, over the baseline's."""
    def speed(m):
        mine = [r for r in rows if r["method"] == m]
        return sum(r["new_tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
    return speed(method) / speed(baseline)


def withheld(rows: list[dict], method: str) -> str:
    """The draft tokens the rule did not verify, over all prompts ("1,099 of 2,368"), from each row's summary."""
    counts = [re.match(r"(\d+) of (\d+)", r["rule"]["withheld"]).groups() for r in rows if r["method"] == method]
    return f"{sum(int(w) for w, _ in counts):,} of {sum(int(d) for _, d in counts):,}"


def every_method_row(runs: list[list[dict]], method: str) -> tuple:
    """A row of "Every method at its CPU defaults": two threads, then one."""
    cells = []
    for rows in runs:
        cells += [specbench(rows, method), total(rows, method), mean_accepted(rows, method), withheld(rows, method)]
    return (method, *cells)


def before_after_row(runs: list[list[dict]], method: str) -> tuple:
    """A row of "The rule ..., before and after": per prompt, the speedup after over the speedup before
    (each over its own run's HF greedy), mean ± std and the mean's 95% interval (t, 13 degrees of freedom)."""
    import statistics

    before, after = runs

    def per_prompt(rows, m):
        return {r["question_id"]: r["tokens_per_s"] for r in rows if r["method"] == m}
    b, a = per_prompt(before, method), per_prompt(after, method)
    hb, ha = per_prompt(before, "hf-greedy"), per_prompt(after, "hf-greedy")
    ratios = [(a[q] / ha[q]) / (b[q] / hb[q]) for q in a]
    assert len(ratios) == 14
    mean, std = statistics.mean(ratios), statistics.stdev(ratios)
    half = 2.160 * std / len(ratios) ** 0.5
    return (specbench(before, method), mean_accepted(before, method), specbench(after, method),
            mean_accepted(after, method), mean, std, mean - half, mean + half)


def dropin_row(rows: list[dict], method: str) -> tuple:
    """A row of the drop-in's table, as speeds: greedy's time over the method's."""
    import statistics

    later = [r for r in rows if r["part"] == "later calls" and r["method"] == method]
    calls = [statistics.mean(col) for col in zip(*[[r["greedy_s"] / c for c in r["calls_s"]] for r in later])]

    def median(m, key):
        return statistics.median(r[key] for r in rows if r["part"] == "new process" and r["method"] == m)
    first, whole = median(method, "first_token_s"), median(method, "wall_s")
    return (*calls, first, median("greedy", "first_token_s") / first, whole, median("greedy", "wall_s") / whole)


EVERY = ["every-method-128.jsonl", "every-method-128-one-thread.jsonl"]
BEFORE_AFTER = ["every-method-128-before-the-rule.jsonl", "every-method-128.jsonl"]
CLAIMS = [
    ("| Lookahead | 10.5 | 0.64x | {:.2f} |", "fafo-4k-report.jsonl", lambda r: mean_accepted(r, "lookahead")),
    ("| FAFO, full KV | 10.6 | 0.65x | {:.2f} |", "fafo-4k-report.jsonl", lambda r: mean_accepted(r, "fafo-fullkv")),
    ("| FAFO | 12.3 | 0.76x | {:.2f} |", "fafo-4k-report.jsonl", lambda r: mean_accepted(r, "fafo")),
    ("All {} runs identical (and the", "kv-long-after.jsonl", lambda r: sum(x["identical"] for x in r)),
    ("(and the {} of `kv-long-before.md`)", "kv-long-before.jsonl", lambda r: sum(x["identical"] for x in r)),
    ("CARD 0.62x (T = 0.7) and {:.2f}x (T = 1.0)", "sampling-T1.0.jsonl",
     lambda r: specbench(r, "card-lockstep", "hf-sample")),
    ("run of that configuration (`bench/results/card-choice-avx512-walk.jsonl`, rows committed 2026-11-29 in\n"
     "b015f44) emitted {:.2f}", "card-choice-avx512-walk.jsonl", lambda r: mean_accepted(r, "card")),
    ("all {} runs identical to HF greedy", EVERY, lambda runs: sum(r["identical"] is True for rows in runs for r in rows)),
    *[("| {} | {:.2f}x / {:.2f}x, {:.2f} | {} | {:.2f}x / {:.2f}x, {:.2f} | {} |", EVERY,
       lambda runs, m=m: every_method_row(runs, m)) for m in ("ngram", "cacheback", "card", "fafo")],
    *[(f"| {name} | " + "{:.2f}x, {:.2f} | {:.2f}x, {:.2f} |", EVERY,
       lambda runs, m=m: (specbench(runs[0], m), mean_accepted(runs[0], m), specbench(runs[1], m),
                          mean_accepted(runs[1], m)))
      for name, m in (("n-gram predictor", "ngram"), ("Cacheback", "cacheback"),
                      ("CARD (int8 draft, chosen at set-up)", "card"), ("FAFO", "fafo"))],
    *[(f"| {m} | " + "{:.2f}x, {:.2f} | {:.2f}x, {:.2f} | {:.3f} ± {:.3f} | {:.2f} to {:.2f} |", BEFORE_AFTER,
       lambda runs, m=m: before_after_row(runs, m)) for m in ("ngram", "cacheback", "card", "fafo")],
    *[(f"| {m} | " + "{:.2f}x / {:.2f}x / {:.2f}x | {:.2f} s ({:.2f}x) | {:.2f} s ({:.2f}x) |", "dropin.jsonl",
       lambda r, m=m: dropin_row(r, m + "_predictor" if m == "ngram" else m)) for m in ("ngram", "cacheback", "card", "fafo")],
]


@pytest.mark.parametrize("phrase,rows,figure", CLAIMS, ids=[(c[1] if isinstance(c[1], str) else c[1][-1]) + ":" + c[0][:30] for c in CLAIMS])
def test_a_figure_matches_its_rows(phrase, rows, figure):
    """RESULTS.md states the figure its cited rows give (the phrase, with the figure in it, is in the text)."""
    text = " ".join(_read("RESULTS.md").split())
    figures = figure([_rows(name) for name in rows] if isinstance(rows, list) else _rows(rows))
    assert " ".join(phrase.format(*figures if isinstance(figures, tuple) else [figures]).split()) in text


def test_the_step_times_the_documents_give_are_the_measured_ones():
    """RESULTS.md's T(n) table and TUTORIAL.md's figures from it (§1.1, §2.3) are those of the costs file the
    table cites: the step times its 2-thread run measured."""
    import json

    import ngram_predictor

    with open(os.path.join(_root(), "bench", "results", "every-method-128-costs.json"), encoding="utf-8") as f:
        costs = {json.loads(key)["what"][3]: value for key, value in json.load(f).items()
                 if json.loads(key)["what"][0] == "step times"}
    t = {int(n): seconds for n, seconds in costs[None].items()}  # on every thread (None: as set, 2)
    results = " ".join(_read("RESULTS.md").split())
    sizes = (1, 2, 3, 4, 5, 8, 12, 16, 24, 32)
    assert "| 2 threads, ms | " + " | ".join(f"{t[n] * 1000:.1f}" for n in sizes) + " |" in results
    assert "| × one token | " + " | ".join(f"{t[n] / t[1]:.2f}" for n in sizes) + " |" in results
    tutorial = " ".join(_read("TUTORIAL.md").split())
    assert f"sixteen tokens cost about {t[16] / t[1]:.1f} single-token forwards" in tutorial
    assert f"a 32-token tree must be accepted {t[32] / t[1]:.1f} tokens deep" in tutorial
    ratio = t[5] / t[1]
    assert f"T(5)/T(1) = **{ratio:.2f}**" in tutorial
    speedups = [(1 + ngram_predictor.expected_accepted(alpha, 4)) / ratio for alpha in (0.5, 0.7, 0.9)]
    assert "predicts 1.94 / {:.2f} = {:.2f}x, α = 0.7 gives {:.2f}x, and α = 0.9 gives {:.2f}x".format(
        ratio, *speedups) in tutorial
