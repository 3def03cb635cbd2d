# SPDX-License-Identifier: MIT
"""The project's four methods, in the one table that every list of methods is made from: a method's
name on the command lines, its file, its configuration class, and what it is called where it is
published (an exported folder's README). Read by bench/side_by_side.py, bench/dropin.py,
bench/gpu_bench.sh (through the command line below), tools/replay.py, tools/export_generate.py and
the tests; tests/test_layout.py fails, naming the gap, where a method added here does not reach one.

    python -m tools.methods                     # ngram,cacheback,card,fafo
    python -m tools.methods --without card      # the others, for a command line
"""

import argparse
import importlib
import sys
from typing import NamedTuple


class Method(NamedTuple):
    module: str  # the method's file, without .py
    config: str  # its configuration class: for_device(device), check(), the paper's names
    title: str  # its name in an exported folder's README


METHODS = {
    "ngram": Method("ngram_predictor", "NgramConfig",
                    "N-gram speculative decoding (akunu's frequency predictor)"),
    "cacheback": Method("cacheback", "CachebackConfig", "Cacheback speculative decoding"),
    "card": Method("card", "CardConfig", "CARD speculative decoding"),
    "fafo": Method("fafo", "FafoConfig", "FAFO decoding"),
}


def module_of(name: str):
    """The method's file, imported: module_of("cacheback") is the cacheback module."""
    return importlib.import_module(METHODS[name].module)


def config_of(name: str):
    """The method's configuration class."""
    return getattr(module_of(name), METHODS[name].config)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Print the methods' names, comma-separated.")
    p.add_argument("--without", default="", help="comma list of names to leave out")
    args = p.parse_args(argv)
    left_out = set(filter(None, args.without.split(",")))
    unknown = left_out - set(METHODS)
    if unknown:
        known = ", ".join(METHODS)
        print(f"error: unknown method {sorted(unknown)[0]!r} (known: {known})", file=sys.stderr)
        return 2
    print(",".join(name for name in METHODS if name not in left_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
