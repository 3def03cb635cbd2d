# SPDX-License-Identifier: MIT
"""docs/: TUTORIAL.md's figures (figures/) and the script that draws them from the code (make_figures.py)."""
