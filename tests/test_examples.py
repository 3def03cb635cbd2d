# SPDX-License-Identifier: MIT
"""Every Python example in the opening docstring of verify.py and of each method file, and every Python block
of README.md, runs on the default model, a few tokens long (the examples' 128 become 8), with the names they
assume bound: model (and target), tok, prompt_ids, eos_ids, input_ids, attention_mask. What an example makes
is checked against HF greedy. serve/README.md's block starts a vLLM engine: tests/test_vllm.py runs it (make
serve-test)."""

import ast
import os
import re
import textwrap

import pytest
import torch

import cacheback
import card
import fafo
import ngram_predictor
import verify
from conftest import REAL_PROMPTS, encode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {"verify": verify, "ngram_predictor": ngram_predictor, "cacheback": cacheback, "card": card,
           "fafo": fafo}


def python_examples(docstring: str) -> list[str]:
    """A docstring's indented blocks that parse as Python and call something: its examples (shell lines and
    the maps from a paper's sections to the code do not parse)."""
    examples = []
    for block in re.split(r"\n[ \t]*\n", docstring):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or not all(line.startswith("    ") and not line.lstrip().startswith(">>>") for line in lines):
            continue
        code = textwrap.dedent("\n".join(lines))
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        if any(isinstance(node, ast.Call) for node in ast.walk(tree)):
            examples.append(code)
    return examples


def readme_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.M | re.S)


EXAMPLES = [(name, code) for name, module in MODULES.items() for code in python_examples(module.__doc__)]
EXAMPLES += [("README.md", code) for code in readme_blocks()]


def test_each_method_file_has_examples_and_the_finder_sees_them():
    found = {name for name, _ in EXAMPLES}
    assert {"ngram_predictor", "cacheback", "card", "fafo", "README.md"} <= found
    assert python_examples('''Title.

    python x.py --prompt "a"

    import x
    out = x.run(1)
''') == ["import x\nout = x.run(1)"]


@pytest.mark.parametrize("where,code", EXAMPLES, ids=[f"{w}-{i}" for i, (w, _) in enumerate(EXAMPLES)])
def test_the_example_runs(real, oracle, where, code):
    model, tok = real
    prompt_ids, eos_ids = encode(real, REAL_PROMPTS[0])
    input_ids = torch.tensor([prompt_ids])
    names = {"model": model, "target": model, "tok": tok, "prompt_ids": prompt_ids, "eos_ids": eos_ids,
             "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    exec(compile(code.replace("128", "8"), f"<{where}>", "exec"), names)
    want = oracle(prompt_ids, 8, eos_ids)
    if "gen" in names:
        assert names["gen"].tokens == want
    if "out" in names:
        assert names["out"][0, len(prompt_ids):].tolist() == want
    assert "gen" in names or "out" in names


def tutorial_scripts() -> list[tuple[str, str, str]]:
    """TUTORIAL.md's self-contained scripts (a Python block that opens with "# TUTORIAL.md §N.N") and the output
    the text shows for each (the plain block right after it): (section, code, output)."""
    with open(os.path.join(ROOT, "TUTORIAL.md"), encoding="utf-8") as f:
        text = f.read()
    found = re.findall(r"^```python\n(# TUTORIAL\.md (§[\d.]+).*?)^```\n\n```\n(.*?)^```", text, flags=re.M | re.S)
    return [(section, code, output) for code, section, output in found]


SCRIPTS = tutorial_scripts()
NUMBER = r"(-?\d+\.\d+)"


def same_but_rounding(printed: str, shown: str) -> bool:
    """The same lines, their decimals within 0.02 (another CPU's float kernels may move the last digit)."""
    if len(printed.splitlines()) != len(shown.splitlines()):
        return False
    for a, b in zip(printed.splitlines(), shown.splitlines()):
        parts_a, parts_b = re.split(NUMBER, a), re.split(NUMBER, b)
        if parts_a[::2] != parts_b[::2]:
            return False
        if any(abs(float(x) - float(y)) > 0.02 for x, y in zip(parts_a[1::2], parts_b[1::2])):
            return False
    return True


def test_the_tutorial_scripts_are_found_and_the_comparison_can_fail():
    assert {"§1.8", "§3.2", "§4.3", "§5.3"} <= {section for section, _, _ in SCRIPTS}
    assert same_but_rounding("p=0.49 'In'", "p=0.48 'In'") and not same_but_rounding("p=0.49 'In'", "p=0.49 'The'")
    assert not same_but_rounding("z=31.99", "z=32.99") and not same_but_rounding("a\nb", "a")


@pytest.mark.parametrize("section,code,shown", SCRIPTS, ids=[s for s, _, _ in SCRIPTS])
def test_the_tutorial_script_prints_what_the_tutorial_shows(real, monkeypatch, capsys, section, code, shown):
    """Each script prints the output shown beside it. CARD's (§4.3) runs a bfloat16 draft, whose kernels differ
    from CPU to CPU, so there its steps' form is checked: three queries, each a hit or a miss."""
    real_model = real
    load = verify.load_model
    monkeypatch.setattr(verify, "load_model", lambda *a, **k: real_model if not a and not k else load(*a, **k))
    exec(compile(code, f"<TUTORIAL.md {section}>", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    if section == "§4.3":
        assert printed.count("  query -> ") == 3
        assert printed.count("  HIT: ") + printed.count("  MISS: ") == 3
    else:
        assert same_but_rounding(printed, shown), printed
