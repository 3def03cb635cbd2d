# SPDX-License-Identifier: MIT
"""tools/: what works on the methods without being one: the methods' table (methods.py), a run as a page
(replay.py), a method as a folder for model.generate (export_generate.py), drafters replayed without a model
(offline.py), set-up steps (convert_gguf.py, build_frozen.py), and bench rows side by side (compare_runs.py).
Imports the method files, verify.py and prompts/; never bench/."""
