# SPDX-License-Identifier: MIT
"""A proposer that fails on purpose, for the tests: tests/test_gate.py drives it with the stand-in batcher, and
tests/test_vllm.py has vLLM import it by name in its engine (with tests/ on PYTHONPATH)."""

from serve import vllm_proposers as proposers


class FaultyNgramProposer(proposers.NgramProposer):
    """The n-gram proposer, but every 5th call's drafting raises once the rows' states have been updated (what
    they were sent is not what vLLM gets), every 7th call's chains come back k + 3 tokens long, and every 11th
    with an id outside the vocabulary in second place."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.tries = 0

    def draft_batch(self, *args):
        self.tries += 1
        chains = super().draft_batch(*args)
        if self.tries % 5 == 0:
            raise RuntimeError(f"an injected fault (call {self.tries})")  # a message that varies: one kind
        if self.tries % 7 == 0:
            chains = [chain + [chain[-1]] * (self.k + 3) if chain else chain for chain in chains]
        if self.tries % 11 == 0:
            chains = [chain[:1] + [self.vocab_size + 5] + chain[1:] if chain else chain for chain in chains]
        return chains
