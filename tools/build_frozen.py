# SPDX-License-Identifier: MIT
"""
tools/build_frozen.py -- build a frozen Cacheback table offline (Cacheback §3.3 and §4).

§4: "The building procedure first picks the most frequent LC n-grams of length LL as the leaders in the table.
Then, for each leader, it selects the most frequent FC n-grams of length FL that appear after the leader." The
paper samples 1% of OpenWebText. Nothing like that is available offline here, so there are two corpora:

  stdlib    the source every Python install carries: the standard library (English docstrings and comments,
            the reference-manual text in pydoc_data/topics.py, and code), files sampled in a seeded order until
            --max-tokens, so a build is deterministic
  selfchat  the target model's OWN greedy answers to corpus/instructions.jsonl (247 instructions written for
            this project, disjoint from the benchmark prompts). Still training-free: nothing is learned, the
            table caches the model's habitual phrasing ("Here are some tips for", "In summary,", the chat
            template's tokens), which Python source cannot. The default model's answers are shipped
            (corpus/selfchat-<model>.jsonl); for another model they are generated once and cached.

The default model's tables for §4's LL, FL, LC, FC are shipped in corpus/; cacheback.py --frozen stdlib|selfchat
reads those, or what this tool wrote to the cache folder (the default --out), and names this command otherwise.

    python tools/build_frozen.py --corpus stdlib --ll 2            # ~25 s; then: cacheback.py --frozen stdlib --ll 2
    python tools/build_frozen.py --corpus selfchat --model DIR --out table.json.gz  # then --frozen table.json.gz
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import sysconfig
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import cacheback as cb  # noqa: E402
import verify  # noqa: E402

INSTRUCTIONS = os.path.join(cb.CORPUS_DIR, "instructions.jsonl")
SELFCHAT_TOKENS = 192  # answer length: most answers of the default model end before it


def stdlib_corpus(seed: int) -> list[str]:
    """The standard library's .py files (tests and site-packages excluded), in a seeded random order."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if not any(part in f for part in ("site-packages", os.sep + "test", "idlelib")))
    random.Random(seed).shuffle(files)
    return files


def build_frozen(tok, ll: int, fl: int, lc: int, fc: int, max_tokens: int = 2_000_000, seed: int = 0,
                 progress: bool = True, sequences=None, corpus: str = "python-stdlib") -> tuple[cb.CacheTable, dict]:
    """Count leaders and their followers over the corpus; keep the top LC leaders and their top FC followers.
    The corpus is `sequences` (token-id lists; `selfchat_sequences`) or, by default, the Python standard
    library's source, tokenized with `tok`, up to max_tokens tokens. Ties are broken by token ids."""
    leader_counts: Counter = Counter()
    follower_counts: dict[tuple, Counter] = defaultdict(Counter)
    used = 0
    if sequences is None:
        def read(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return tok(f.read(), add_special_tokens=False).input_ids

        sequences = (read(path) for path in stdlib_corpus(seed))
    bar = tqdm(total=max_tokens, desc="frozen table: counting n-grams", unit="tok", disable=not progress,
               file=sys.stderr)
    for ids in sequences:
        ids = list(ids)[: max_tokens - used]
        for leader, follower in cb.windows(ids, ll, fl):
            leader_counts[leader] += 1
            follower_counts[leader][follower] += 1
        used += len(ids)
        bar.update(len(ids))
        if used >= max_tokens:
            break
    bar.close()
    table = cb.CacheTable(ll, fl, lc, fc)
    # the top-LC leaders, least frequent inserted first (so the most frequent ends most recent)
    top = sorted(leader_counts, key=lambda leader: (-leader_counts[leader], leader))[:lc]
    for leader in reversed(top):
        best = sorted(follower_counts[leader].items(), key=lambda kv: (-kv[1], kv[0]))[:fc]
        for follower, _ in reversed(best):
            table.insert(leader, follower)
    table.read_only = True
    return table, {"corpus": corpus, "seed": seed, "tokens": used}


def selfchat_answers(model, tok, model_name: str, progress: bool = True, batch: int = 16) -> list[dict]:
    """[{id, instruction, answer}]: the model's greedy answers, from the shipped file if it is this model's,
    else generated now (batched greedy, minutes on a CPU) and cached. Deterministic: fixed batches, fixed order."""
    safe = os.path.basename(str(model_name).rstrip("/")).replace(os.sep, "_")
    shipped = os.path.join(cb.CORPUS_DIR, f"selfchat-{safe}.jsonl")
    cached = os.path.join(os.path.dirname(verify.converted_dir()), f"selfchat-{safe}.jsonl")
    for path in (shipped, cached):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f]
    if model is None:
        model, tok = verify.load_model(model_name)
    with open(INSTRUCTIONS, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    eos = verify.eos_ids_of(model, tok)
    side, tok.padding_side = tok.padding_side, "left"  # batched decoding pads on the left
    out = []
    try:
        for i in tqdm(range(0, len(rows), batch), desc="selfchat: the model answers", unit="batch",
                      disable=not progress, file=sys.stderr):
            texts = [tok.apply_chat_template([{"role": "user", "content": r["instruction"]}],
                                             add_generation_prompt=True, tokenize=False) for r in rows[i : i + batch]]
            enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(model.device)
            with torch.no_grad():
                ids = model.generate(**enc, do_sample=False, max_new_tokens=SELFCHAT_TOKENS, eos_token_id=eos,
                                     pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
            for r, row in zip(rows[i : i + batch], ids[:, enc.input_ids.shape[1] :].tolist()):
                out.append({**r, "answer": tok.decode(row, skip_special_tokens=True)})
    finally:
        tok.padding_side = side
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with open(cached, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in out)
    return out


def selfchat_sequences(tok, answers: list[dict]) -> list[list[int]]:
    """Each instruction in the chat template followed by the model's answer: token ids as the model sees them."""
    return [verify.encode_prompt(tok, r["instruction"]) + tok(r["answer"], add_special_tokens=False).input_ids
            for r in answers]


def build_corpus_table(tok, corpus: str, ll: int, fl: int, lc: int, fc: int, model=None,
                       model_name: str = verify.DEFAULT_MODEL, max_tokens: int = 2_000_000, seed: int = 0):
    """build_frozen over one of cacheback.FROZEN_CORPORA: (table, meta)."""
    if corpus == "selfchat":
        seqs = selfchat_sequences(tok, selfchat_answers(model, tok, model_name))
        return build_frozen(tok, ll, fl, lc, fc, max_tokens=max_tokens, sequences=seqs, corpus="selfchat")
    return build_frozen(tok, ll, fl, lc, fc, max_tokens=max_tokens, seed=seed)


def ensure_table(tok, cfg: cb.CachebackConfig, model=None, model_name: str = verify.DEFAULT_MODEL) -> str:
    """The path of the table `cfg.frozen` names (a corpus), built into the cache folder if neither shipped
    nor built before (bench/side_by_side.py calls this before cacheback.prepare)."""
    path = cb.frozen_path(tok, cfg, model_name)
    if path is None:
        table, meta = build_corpus_table(tok, cfg.frozen, cfg.ll, cfg.fl, cfg.lc, cfg.fc, model, model_name)
        path = cb.frozen_path(tok, cfg, model_name, built=True)
        save_atomically(table, path, tok, meta)
    return path


def save_atomically(table: cb.CacheTable, path: str, tok, meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    cb.save_frozen(table, tmp, tok, meta)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--corpus", default="stdlib", choices=list(cb.FROZEN_CORPORA),
                   help="stdlib = Python source; selfchat = the model's answers (default: stdlib)")
    p.add_argument("--model", default=verify.DEFAULT_MODEL, help="whose tokenizer (selfchat: answers) to use")
    p.add_argument("--out", help="output file (.json.gz); default: the cache folder cacheback.py reads")
    d = cb.CachebackConfig.paper()
    p.add_argument("--ll", type=int, default=d.ll, help=f"LL, leader length (default: {d.ll})")
    p.add_argument("--fl", type=int, default=d.fl, help=f"FL, follower length (default: {d.fl})")
    p.add_argument("--lc", type=int, default=d.lc, help=f"LC: the LC most frequent leaders (default: {d.lc})")
    p.add_argument("--fc", type=int, default=d.fc, help=f"FC: each leader's FC most frequent followers "
                   f"(default: {d.fc})")
    p.add_argument("--max-tokens", type=int, default=2_000_000, help="corpus size in tokens (default: 2,000,000)")
    p.add_argument("--seed", type=int, default=0, help="stdlib: the order corpus files are read in (default: 0)")
    args = p.parse_args(argv)
    try:
        if min(args.ll, args.fl, args.lc, args.fc, args.max_tokens) < 1:
            raise verify.UserError("--ll, --fl, --lc, --fc and --max-tokens must be positive")
        t0 = time.perf_counter()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(verify.resolve_model(args.model))
        table, meta = build_corpus_table(tok, args.corpus, args.ll, args.fl, args.lc, args.fc,
                                         model_name=args.model, max_tokens=args.max_tokens, seed=args.seed)
        cfg = cb.CachebackConfig(ll=args.ll, fl=args.fl, lc=args.lc, fc=args.fc, frozen=args.corpus)
        out = args.out or cb.frozen_path(tok, cfg, args.model, built=True)
        save_atomically(table, out, tok, meta)
    except verify.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    n = sum(len(f) for f in table.leaders.values())
    print(f"wrote {out}: {len(table)} leaders, {n} followers from {meta['tokens']} tokens ({meta['corpus']}) in "
          f"{time.perf_counter() - t0:.1f} s, {os.path.getsize(out) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
