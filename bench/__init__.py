# SPDX-License-Identifier: MIT
"""bench/: the measurements: the side-by-side harness of the methods (side_by_side.py), the studies built on it
and on vLLM, and their committed rows (results/). It may import everything below it (the methods, verify.py,
prompts/, tools/, serve/); nothing of the project imports it but the tests and docs/make_figures.py."""
