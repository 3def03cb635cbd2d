# SPDX-License-Identifier: MIT
"""The layout a newcomer reads: README's layout section names every folder, every top-level .py file and every
script, and nothing that is not there (and marks the files it names that read tools/methods.py); every module
has one name; imports only go down (the method files import verify.py alone, nothing below bench/ imports it, a
path insertion happens only in a script's entry point); and a method added to tools/methods.py reaches every
list made per method, or this file names where it is missing."""

import ast
import importlib
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from tools import methods

LAYOUT_START = "<!-- layout: tests/test_layout.py -->"
LAYOUT_END = "<!-- /layout -->"


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def layout_entries() -> dict[str, str]:
    """README's layout block: {path: its description} (continuation lines joined)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    block = readme.split(LAYOUT_START)[1].split(LAYOUT_END)[0].strip().strip("`").strip()
    entries = {}
    last = None
    for line in block.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            entries[last] += " " + line.strip()
            continue
        path, _, text = line.partition(" ")
        last = path
        entries[path] = text.strip()
    return entries


def entry_points(files: list[str]) -> list[str]:
    """The files a reader runs, outside tests/: a Python file with a `__main__` guard, or a shell script."""
    points = []
    for path in files:
        if path.startswith("tests/") or not path.endswith((".py", ".sh")):
            continue
        if path.endswith(".sh"):
            points.append(path)
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        if any(isinstance(node, ast.If) and is_main_guard(node.test) for node in tree.body):
            points.append(path)
    return points


def test_readme_layout_names_every_folder_and_entry_point():
    """One line per folder and entry point: every top-level folder, every top-level .py file and every script
    is named, and every path named is a tracked file, or a folder or pattern that holds some."""
    import fnmatch

    files = tracked()
    entries = layout_entries()
    wrong = []
    for path in entries:
        if "*" in path:
            found = any(fnmatch.fnmatch(f, path) for f in files)
        elif path.endswith("/"):
            found = any(f.startswith(path) for f in files)
        else:
            found = path in files
        if not found:
            wrong.append(f"README's layout names {path}, which is not in the repository")
    folders = sorted({f.split("/")[0] + "/" for f in files if "/" in f})
    for folder in folders:
        if not any(path == folder or path.startswith(folder) for path in entries):
            wrong.append(f"README's layout does not name the folder {folder}")
    for path in [f for f in files if "/" not in f and f.endswith(".py")] + entry_points(files):
        if path not in entries:
            wrong.append(f"README's layout does not name {path}" + ("" if "/" not in path else
                                                                       " (a script: it has a __main__ guard)"))
    assert not wrong, "\n".join(wrong)


def reads_the_methods_table(path: str) -> bool:
    """A file that takes its list of methods from tools/methods.py."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".sh"):
        return "-m tools.methods" in text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(a.name == "tools.methods" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module == "tools.methods" or
                                                 (node.module == "tools" and any(a.name == "methods" for a in node.names))):
            return True
    return False


def test_readme_layout_marks_the_files_that_read_the_methods_table():
    """Of the files the layout names, the ones that read tools/methods.py are marked, and only they."""
    entries = layout_entries()
    files = [f for f in tracked() if f in entries and f.endswith((".py", ".sh")) and f != "tools/methods.py"]
    readers = {f for f in files if reads_the_methods_table(f)}
    marked = {path for path, text in entries.items() if "(methods.py)" in text or "; methods.py)" in text}
    assert readers == marked, f"read tools/methods.py but not marked: {sorted(readers - marked)}; marked but do " \
                              f"not: {sorted(marked - readers)}"


# ---- imports ---------------------------------------------------------------------------------------------------

METHOD_MODULES = {m.module for m in methods.METHODS.values()}
# a layer -> the layers its files may import (tests may import anything; they are not listed)
MAY_IMPORT = {
    "verify": set(),
    "method": {"verify"},
    "prompts": {"verify"},
    "tools": {"verify", "method", "prompts", "tools"},
    "serve": {"verify", "method", "serve"},
    "corpus": {"verify", "method", "prompts", "tools"},
    "bench": {"verify", "method", "prompts", "tools", "serve", "bench"},
    "docs": {"verify", "method", "prompts", "tools", "serve", "bench", "docs"},
}
PACKAGES = ("prompts", "tools", "serve", "bench", "docs", "corpus")


def layer_of_file(path: str) -> str:
    if path == "verify.py":
        return "verify"
    if path.removesuffix(".py") in METHOD_MODULES:
        return "method"
    return path.split("/")[0]


def layer_of_import(name: str) -> str | None:
    """The layer a module name belongs to; None for the standard library and third-party packages."""
    top = name.split(".")[0]
    if top == "verify":
        return "verify"
    if top in METHOD_MODULES:
        return "method"
    if top in PACKAGES:
        return top
    return None


def project_sources() -> list[str]:
    return [f for f in tracked() if f.endswith(".py") and not f.startswith("tests/")]


def is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
    return sides == {"__name__", "'__main__'"}


def main_guarded(tree: ast.Module) -> set[int]:
    """ids of the nodes inside the body of `if __name__ == "__main__":` blocks."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_main_guard(node.test):
            for statement in node.body:
                inside.update(id(n) for n in ast.walk(statement))
    return inside


def changes_the_path(node: ast.AST) -> bool:
    """sys.path.insert/append/extend/..., sys.path[...] = or sys.path = ..., site.addsitedir."""
    if isinstance(node, ast.Call):
        func = ast.unparse(node.func)
        return func.startswith("sys.path.") or func in ("site.addsitedir", "addsitedir")
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(ast.unparse(t).startswith("sys.path") for t in targets)
    return False


def test_imports_go_down_and_path_insertions_stay_in_entry_points():
    bare_names = {os.path.basename(f).removesuffix(".py") for f in project_sources() if "/" in f} - {"__init__"}
    wrong = []
    for path in project_sources():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        layer = layer_of_file(path)
        guarded = main_guarded(tree)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if node.level == 0 else []
                if node.level:
                    wrong.append(f"{path}:{node.lineno} imports relatively (one way to import: by the package)")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module") \
                    and node.args and isinstance(node.args[0], ast.Constant):
                names = [node.args[0].value]  # a dynamic import of a name written out
            for name in names:
                if name.split(".")[0] in bare_names:
                    wrong.append(f"{path}:{node.lineno} imports {name} by a bare name (one module, two names)")
                target = layer_of_import(name)
                if target is not None and target not in MAY_IMPORT[layer]:
                    wrong.append(f"{path}:{node.lineno} ({layer}) imports {name} ({target}): imports go down only")
            if changes_the_path(node) and id(node) not in guarded:
                wrong.append(f"{path}:{node.lineno} changes sys.path outside a script's entry point")
    assert not wrong, "\n".join(wrong)


def test_every_module_has_one_name():
    """Import every module of the project by its dotted name: no file is loaded under two names."""
    for path in project_sources():
        name = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        importlib.import_module(name)
    names_of = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.realpath(file).startswith(os.path.realpath(ROOT) + os.sep) and ".venv" not in file:
            names_of.setdefault(os.path.realpath(file), []).append(name)
    twice = {os.path.relpath(f, ROOT): sorted(n) for f, n in names_of.items() if len(n) > 1}
    assert not twice, f"loaded under two names: {twice}"


# ---- the methods' table reaches every list made per method -----------------------------------------------

def test_every_method_reaches_every_list_made_per_method():
    """For each method of tools/methods.py, the places that need something written for it. A new method that
    lacks one fails here, naming it (the loops over tools.methods.METHODS reach it by themselves)."""
    # first the files themselves: the test modules imported below build tables from them at import
    unimportable = []
    for name, method in methods.METHODS.items():
        try:
            methods.module_of(name)
        except ImportError as e:
            unimportable.append(f"method {name!r} (tools/methods.py): its file {method.module}.py does not "
                                f"import ({e})")
    assert not unimportable, "\n".join(unimportable)
    import test_custom_generate
    import test_docs
    import test_replay
    from tools import replay

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(ROOT, "TUTORIAL.md"), encoding="utf-8") as f:
        tutorial = f.read()
    import verify

    # the header map: from its section list to its closing line, which names the methods only where they
    # use a section ("used by: ...")
    header_map = verify.__doc__.split("The public names")[1].split("Sections 11-12 serve")[0]
    page_draft = re.search(r"const DRAFT = \{([^}]*)\}", replay.PAGE).group(1)
    gaps = []
    for name, method in methods.METHODS.items():
        missing = []
        module = methods.module_of(name)
        for attr in (method.config, "generate", "custom_generate", "make_parser", "main"):  # prepare: optional
            if not hasattr(module, attr):
                missing.append(f"{method.module}.py's {attr}")
        if name not in replay.DRAWN:
            missing.append("tools/replay.py's DRAWN")
        if not re.search(rf"\b{name}\s*:", page_draft):
            missing.append("the replay page's DRAFT map (tools/replay.py)")
        for label, table in (("tests/test_custom_generate.py's TINY_OPTIONS", test_custom_generate.TINY_OPTIONS),
                             ("tests/test_docs.py's BAD_CONFIGS", test_docs.BAD_CONFIGS),
                             ("tests/test_replay.py's RUNS", test_replay.RUNS)):
            if name not in table:
                missing.append(label)
        for label, text in (("README.md", readme), ("TUTORIAL.md", tutorial), ("verify.py's header map",
                                                                               header_map)):
            if f"{method.module}.py" not in text:
                missing.append(label)
        if missing:
            gaps.append(f"method {name!r} (tools/methods.py) is missing from: {', '.join(missing)}")
    assert not gaps, "\n".join(gaps)
