# SPDX-License-Identifier: MIT
"""serve/: two of the methods inside a serving engine: vLLM's proposers (vllm_proposers.py) and the batch
gate that decides what a batch can afford to verify (gate.py). Imports the method files and verify.py;
never bench/."""
