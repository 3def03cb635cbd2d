# SPDX-License-Identifier: MIT
"""The documentation is code too: every `>>>` example in the method files and verify.py runs, and verify.py's
module docstring lists exactly the public names the file defines."""

import ast
import doctest
import inspect
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


def test_tutorial_code_references_name_real_functions():
    """TUTORIAL.md points at the code as `file.py:name` (or `file.py:Class.method`): each one exists."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "TUTORIAL.md"), encoding="utf-8").read()
    modules = {os.path.basename(m.__file__): m for m in MODULES}  # serve/vllm_proposers.py, serve/gate.py too
    refs = re.findall(r"`(\w+\.py):([\w.]+)`", text)
    assert len(refs) > 40
    for file, name in refs:
        obj = modules[file]
        for part in name.split("."):
            assert hasattr(obj, part), f"TUTORIAL.md names {file}:{name}, which does not exist"
            obj = getattr(obj, part)


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


def test_readme_lists_exactly_what_verify_refuses():
    """verify.REFUSED is the one list of refusals; README's copy (between its markers) says the same."""
    import os

    with open(os.path.join(_root(), "README.md"), encoding="utf-8") as f:
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
