# SPDX-License-Identifier: MIT
"""The server, end to end: serve/vllm_proposers.py's launcher starts vLLM's OpenAI-compatible server with our
proposer on a free loopback port; a real client (the `openai` package, which vLLM installs) sends concurrent chat
requests, bounded in count and time; the answers are those of a server without speculation, /metrics shows drafts
and accepted tokens, and a SIGTERM stops the server with no process of it left. Run by `make serve-test`; skipped
where vLLM is not installed."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

vllm = pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

import verify  # noqa: E402
from conftest import ROOT  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402

SCRIPT = os.path.join(ROOT, "serve", "vllm_proposers.py")
QUESTIONS = ["Write a Python function that reverses a list.", "What is a hash map? Answer in two sentences.",
             "List three prime numbers and say why each is prime.", "Explain recursion to a child.",
             "Write a haiku about the sea.", "Give the SQL to count the rows of a table named users.",
             "What does HTTP stand for?", "Write a Python class Stack with push and pop."]
MAX_TOKENS = [48, 64, 40, 56, 24, 32, 16, 64]  # the requests end at different steps
START_S = 400  # a server's start (eager, two cores): about 30 s here; bounded well above
REQUEST_S = 240  # one request at most
# vLLM's own options, the same for both servers
VLLM_ARGS = ["--dtype", "float32", "--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "1024",
             "--max-num-seqs", "4", "--seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process in a session of its own (so that every process it starts can be found)."""

    def __init__(self, command: list[str], port: int, log_path: str, env: dict):
        self.port = port
        self.log = open(log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                        start_new_session=True)
        self.session = self.process.pid

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server stopped at start (rc {self.process.returncode}): {self.log.name}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"the server did not answer /health in {START_S} s: {self.log.name}")

    def left(self) -> list:
        """The processes still in the server's session."""
        found = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.session:
                    found.append(p)
            except (ProcessLookupError, psutil.Error, OSError):
                pass
        return found

    def stop(self) -> tuple[int | None, list[str]]:
        """SIGTERM, as a service manager stops it. Returns its return code (None: it had not stopped after 60 s)
        and the processes of its session still there 10 s after it stopped (then killed, so that nothing
        outlives the test)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.monotonic() + 10
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = self.left()
        names = [" ".join(p.cmdline()[:3]) for p in left]
        for p in left:
            p.kill()
        self.log.close()
        return code, names


def chat(server: Server, model: str) -> list[str]:
    """The questions, four at a time, greedy; each answer's text."""
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", timeout=REQUEST_S, max_retries=0)

    def ask(i):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[i]}],
                                               temperature=0, max_tokens=MAX_TOKENS[i], seed=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(ask, range(len(QUESTIONS))))


def metric(text: str, name: str) -> float:
    """The value of a Prometheus counter (its first sample) in /metrics' text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


@pytest.fixture(scope="module")
def model_path():
    path = verify.converted_dir()
    if not os.path.isdir(path):
        pytest.skip(f"the default model is not converted here ({path}): run make install first")
    return path


def test_the_server_answers_as_without_speculation_and_stops_cleanly(model_path, tmp_path):
    env = proposers.serve_environment()
    port = free_port()
    plain = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, *VLLM_ARGS,
                    "--port", str(port)], port, str(tmp_path / "plain.log"), env)
    try:
        plain.wait_ready()
        expected = chat(plain, model_path)
    finally:
        plain.stop()
    assert len(set(expected)) == len(QUESTIONS)

    port = free_port()
    ours = Server([sys.executable, SCRIPT, "--method", "ngram", "-k", "4", "--", model_path, *VLLM_ARGS,
                   "--port", str(port)], port, str(tmp_path / "ngram.log"), env)
    try:
        ours.wait_ready()
        answers = chat(ours, model_path)
        with urllib.request.urlopen(ours.url("/metrics"), timeout=30) as r:
            metrics = r.read().decode()
    finally:
        code, left = ours.stop()
    assert answers == expected
    assert metric(metrics, "vllm:spec_decode_num_draft_tokens_total") > 0
    assert metric(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert code is not None, "the server did not stop within 60 s of SIGTERM"
    assert left == [], f"processes left after the server stopped: {left}"
    with open(tmp_path / "ngram.log", encoding="utf-8") as f:
        log = f.read()
    assert "serve.vllm_proposers.NgramProposer" in log, f"the server did not load our proposer: {log[-2000:]}"
    ours = os.path.join(ROOT, "serve") + os.sep
    ours_raised = [block for block in tracebacks(log) if ours in block]
    assert not ours_raised, f"our proposer raised in the server:\n{ours_raised[0]}"


def tracebacks(log: str) -> list[str]:
    """Each Python traceback in a server's log, from its "Traceback" line to its exception's line, without
    vLLM's prefixes. Only one through our files is a failure: on SIGTERM vLLM kills its engine process at once
    (mode=abort) and may log its own output handler's EngineDeadError, with or without speculation."""
    blocks = []
    prefix = r"^(\(\w+ pid=\d+\) )?((DEBUG|INFO|WARNING|ERROR) \d\d-\d\d [\d:]+ \[[^\]]*\] )?"
    lines = [re.sub(prefix, "", line) for line in log.splitlines()]
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            end = i + 1
            while end < len(lines) and (lines[end].startswith((" ", "\t")) or lines[end].strip() == ""):
                end += 1
            blocks.append("\n".join(lines[i: end + 1]))
    return blocks
