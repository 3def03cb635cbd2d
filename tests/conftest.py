# SPDX-License-Identifier: MIT
"""Shared fixtures: a tiny random Llama for the mechanics (fast, deterministic) and the real default model
(SmolLM2-135M-Instruct, float32, CPU) for the oracle tests, with the oracle itself (HF greedy) run once per
prompt for the whole session.

    pytest -n 2 --dist loadfile tests              # the whole suite as make test runs it (two workers)
    pytest tests                                   # the same in one process
    pytest tests --quantized-engine qnnpack        # the int8 draft on another of torch's int8 back-ends
"""

import copy
import json
import logging
import os
import re
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
sys.path.insert(0, ROOT)

import verify  # noqa: E402

# The suite's measured costs (verify.measured_costs) in a file of their own, kept between runs: measured under
# the suite's load, they must not become the costs a user's own runs and bench/side_by_side.py read. Subprocesses inherit it.
os.environ.setdefault("SPECDEC_COSTS", os.path.join(verify.cache_root(), "measured-costs-tests.json"))

# At most 2 threads (CI's machines have 2 cores), fewer where this process may use fewer: torch's default
# already honours OMP_NUM_THREADS and the CPU affinity (taskset), so the suite runs under either as asked.
# Under pytest-xdist (make test runs two workers) each worker takes its share of them.
# The scripts that tests start in a subprocess take the same share (OpenMP threads that outnumber the cores
# spin against each other: a run slows down severalfold).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // WORKERS))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


def make_tiny_llama(seed: int = 0, vocab: int = 96):
    """A 2-layer Llama with random weights: every mechanism of the real model (RoPE, GQA, sdpa, the
    DynamicCache) in a few milliseconds per forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float().eval()
    # Random weights give nearly flat distributions; scaling the output layer up makes the argmax decisive,
    # so tiny float differences cannot flip it and token-level comparisons are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="session")
def tiny():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the default model in float32 on CPU -- the configuration the lossless
    guarantee is stated for."""
    return verify.load_model(verify.DEFAULT_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def draft_bf16(real):
    """CARD's CUDA default draft: the default model's own weights in bfloat16 (what load_model(dtype=
    "bfloat16") gives: the same float32 checkpoint, rounded)."""
    return copy.deepcopy(real[0]).to(torch.bfloat16)


@pytest.fixture(scope="session")
def draft_int8(real):
    """CARD's CPU default draft: the default model with its linear layers in int8."""
    import card

    return card.int8_draft(real[0])


# The CARD cache of the real-model tests: a DraftProcess drafts with one K, k, so they share one.
CARD_REAL = dict(K=4, k=2)


@pytest.fixture(scope="session")
def draft_process_bf16(draft_bf16):
    """One draft process (parallel mode) for every real-model CARD test with CARD_REAL: starting one costs
    a Python start-up and the imports."""
    import card

    with card.DraftProcess(draft_bf16, card.CardConfig(mode="parallel", **CARD_REAL)) as proc:
        yield proc


class Oracle:
    """HF greedy generate on one model, run once per (prompt, EOS set) for the whole session.

    Greedy decoding is prefix-closed: a run of n new tokens is the first n tokens of a run of N >= n (HF
    makes the same forwards in the same order and stops at the same EOS), so the longest run asked for so
    far serves every shorter request. A request for more tokens than that runs HF again."""

    def __init__(self, model):
        self.model, self.runs = model, {}

    def __call__(self, prompt_ids, max_new_tokens: int, eos_ids) -> list[int]:
        key = (tuple(prompt_ids), tuple(eos_ids))
        asked, tokens = self.runs.get(key, (0, []))
        if max_new_tokens > asked and len(tokens) == asked:  # longer than any run so far, none ended at EOS
            asked = max(max_new_tokens, 64)
            tokens = verify.hf_generate(self.model, prompt_ids, asked, eos_ids)
            self.runs[key] = (asked, tokens)
        return tokens[:max_new_tokens]


@pytest.fixture(scope="session")
def oracle(real):
    """oracle(ids, n, eos) -> HF greedy's n new tokens on the real default model (memoized, see Oracle)."""
    return Oracle(real[0])


def encode(real, prompt: str, chat: bool = True):
    """(prompt ids, EOS ids) of a prompt for the real default model."""
    model, tok = real
    return verify.encode_prompt(tok, prompt, chat=chat), verify.eos_ids_of(model, tok)


def running(pid: int) -> bool:
    """Whether a process runs (Linux, /proc): a zombie that nobody has reaped yet counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run_main(module, argv) -> tuple[int, str, str]:
    """A method's CLI in this process, as `python <module>.py ARGS` runs it: (exit status, stdout, stderr).
    Cheaper than a subprocess (no second start-up and import); the subprocess tests in test_cli.py check
    the scripts themselves. argparse's own exits (--help, a bad choice) become their status."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = module.main(list(argv))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return status, out.getvalue(), err.getvalue()


# A few real prompts, used by the lossless tests of every method.
REAL_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List the first five prime numbers and say what a prime number is.",
    "Translate into French: The cat is sleeping on the warm windowsill.",
    "Write a Python function that returns the factorial of n.",
]


def pytest_addoption(parser):
    parser.addoption("--quantized-engine", default=None,
                     help="torch.backends.quantized.engine for the int8 draft: one of "
                          "torch.backends.quantized.supported_engines (default: torch's choice for this CPU)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compat: the lossless tests the CI compatibility job re-runs with the oldest transformers"
    )
    config.addinivalue_line(
        "markers", "cuda: the GPU tier (tests/test_cuda.py): skipped without CUDA; run it with pytest -m cuda"
    )
    # torch's own notice at the first import of its compiler (no_deprecation_from_our_calls says more); this
    # line covers what runs outside that fixture, such as a module's fixtures
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    engine = config.getoption("--quantized-engine")
    if engine:
        if engine not in torch.backends.quantized.supported_engines:
            raise pytest.UsageError(f"--quantized-engine {engine}: this torch supports "
                                    f"{', '.join(torch.backends.quantized.supported_engines)}")
        torch.backends.quantized.engine = engine


def pytest_report_header(config):
    return (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
            f"quantized engine {torch.backends.quantized.engine}")


# ---------------------------------------------------------------------------------------------- no deprecation of ours
#
# transformers renames things under us (5.24: forward's `past_key_values` became `cache`). Its keyword
# deprecations arrive as a FutureWarning that `stacklevel` attributes to torch's nn.Module code, and some
# arrive through its logger instead, so neither the module a warning names nor pytest's own filters can tell
# our calls from the library's. This guard looks at the stack when the notice is raised:
# - the deprecated API is the innermost frame outside the notifying machinery (warnings, logging);
# - its caller, past torch's module dispatch and the decorators around a forward, is either a file of this
#   repository (ours: the test fails) or library code warning about its own internals (ignored: a user could
#   not act on it either).

DEPRECATION_TEXT = re.compile(r"deprecat|will be removed|no longer supported", re.IGNORECASE)
DEPRECATION_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
NOTIFYING = (os.sep + "logging" + os.sep, os.sep + "warnings.py",
             os.path.join("transformers", "utils", "logging.py"))
DISPATCH = (os.path.join("torch", "nn", "modules"), os.path.join("torch", "utils", "_contextlib.py"),
            os.path.join("transformers", "utils", "generic.py"),  # can_return_tuple and kin wrap forwards
            os.sep + "accelerate" + os.sep, os.sep + "functools.py", os.sep + "contextlib.py")


def is_ours(filename: str) -> bool:
    """A file of this repository (its tests included), not a package installed into its venvs."""
    path = os.path.abspath(filename)
    return path.startswith(ROOT + os.sep) and "site-packages" not in path


def deprecation_caller(frame):
    """The file and line that called the deprecated API whose notice is being raised in `frame`'s stack."""
    while frame is not None and (frame.f_code.co_filename.endswith("conftest.py")
                                 or any(part in frame.f_code.co_filename for part in NOTIFYING)):
        frame = frame.f_back  # this guard, then warnings/logging: the notifier
    if frame is not None:
        frame = frame.f_back  # skip the deprecated API itself (a decorator's wrapper, a property, a function)
    while frame is not None and any(part in frame.f_code.co_filename for part in DISPATCH):
        frame = frame.f_back  # torch's module call, no_grad's wrapper: not a caller
    if frame is None:
        return "?", 0
    return frame.f_code.co_filename, frame.f_lineno


class DeprecationLog(logging.Handler):
    """Collects the deprecations our own calls raise, from `warnings` and from transformers' logger."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.ours: list[str] = []

    def note(self, text: str) -> None:
        filename, line = deprecation_caller(sys._getframe(1))
        if is_ours(filename):
            self.ours.append(f"{os.path.relpath(filename, ROOT)}:{line}: {text.splitlines()[0]}")

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DEPRECATION_CATEGORIES) or DEPRECATION_TEXT.search(str(message)):
            self.note(f"{category.__name__}: {message}")
        self.forward(message, category, filename, lineno, file, line)  # pytest still records it

    def emit(self, record: logging.LogRecord) -> None:
        if DEPRECATION_TEXT.search(record.getMessage()):
            self.note(f"transformers logger: {record.getMessage()}")


@pytest.fixture(autouse=True)
def no_deprecation_from_our_calls():
    log = DeprecationLog()
    library_logger = logging.getLogger("transformers")
    level = library_logger.level
    once = getattr(logging.Logger, "warning_once", None)  # transformers' once-per-process warnings
    if hasattr(once, "cache_clear"):
        once.cache_clear()  # so a notice already given in an earlier test is given again here
    with warnings.catch_warnings():
        warnings.simplefilter("always", FutureWarning)  # every occurrence, not once per place
        warnings.simplefilter("always", DeprecationWarning)
        # torch's own, at the first import of its compiler (FAFO's FlexAttention path, vLLM): a TorchScript
        # class in torch/utils/mkldnn.py. Not from a call of ours, and nothing we can change.
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        log.forward = warnings.showwarning
        warnings.showwarning = log.showwarning
        library_logger.addHandler(log)
        library_logger.setLevel(min(level or logging.WARNING, logging.WARNING))  # load_model sets ERROR
        try:
            yield log  # a test of the guard itself reads log.ours, then empties it
        finally:
            library_logger.removeHandler(log)
            library_logger.setLevel(level)
    if log.ours:
        pytest.fail("a deprecation from our own call:\n" + "\n".join(sorted(set(log.ours))), pytrace=False)


@pytest.fixture(scope="session")
def byte_streams():
    """Eight of the default model's own answers (corpus/), as byte streams: token ids < 256 with the repeats of
    real text, of different lengths. The first 40 bytes are the prompt."""
    with open(os.path.join(ROOT, "corpus", "selfchat-SmolLM2-135M-Instruct.jsonl"), encoding="utf-8") as f:
        answers = [json.loads(line)["answer"].encode() for line in f][:8]
    return [(list(a[:40]), list(a[40:40 + 120 + 37 * i])) for i, a in enumerate(answers)]
