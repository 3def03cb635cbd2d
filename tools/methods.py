# SPDX-License-Identifier: MIT
"""The project's four methods, in the one table that bench.py, tools/replay.py, tools/offline.py,
tools/export_generate.py and the tests read: a method's name on their command lines, its file, its
configuration class, and what it is called where it is published (an exported folder's README)."""

from typing import NamedTuple


class Method(NamedTuple):
    module: str  # the method's file, without .py
    config: str  # its configuration class: for_device(device), check(), the paper's names
    title: str  # its name in an exported folder's README


METHODS = {
    "ngram": Method("ngram_predictor", "NgramConfig", "N-gram speculative decoding (akunu's frequency predictor)"),
    "cacheback": Method("cacheback", "CachebackConfig", "Cacheback speculative decoding"),
    "card": Method("card", "CardConfig", "CARD speculative decoding"),
    "fafo": Method("fafo", "FafoConfig", "FAFO decoding"),
}
