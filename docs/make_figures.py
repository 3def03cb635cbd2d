# SPDX-License-Identifier: MIT
"""Regenerates every figure of TUTORIAL.md into docs/figures/*.png (`make figures`), with matplotlib, and the
replay screenshots with tools/replay.py in headless Chromium (Debian: apt-get install chromium chromium-driver).

Each figure is drawn from the repository's own code: the masks from the functions that build them
(verify.tree_attention_mask, card.draft_mask, fafo.combined_mask), the tree from cacheback.grow_tree on the
default model, the compacted layout from a real verify.CompactedKVCache, the cost curve from a fresh
measurement (verify.measure_step_times), and the benchmark figures from the committed bench rows named in
BENCH_ROWS below (python bench/side_by_side.py ... --out <that file> regenerates them).

    python docs/make_figures.py                 # all figures
    python docs/make_figures.py mask_tree fafo  # only those whose name contains one of these words
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)
OUT = os.path.join(HERE, "figures")

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import verify  # noqa: E402

# The benchmark figures read these committed rows (the reporting half of the shipped prompts; see
# bench/side_by_side.py).
BENCH_ROWS = {
    "report": os.path.join(ROOT, "bench", "results", "figures-report-cpu.jsonl"),
    "long": os.path.join(ROOT, "bench", "results", "fafo-long-steps-cpu.jsonl"),
    "serve": os.path.join(ROOT, "bench", "results", "serve-together-one-process.jsonl"),
}
ALLOWED, DENIED = "#2b6cb0", "#f2f2f2"  # one colour pair for every mask figure


def save(fig, name: str) -> None:
    path = os.path.join(OUT, name + ".png")
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    from tqdm import tqdm

    tqdm.write(f"  wrote {os.path.relpath(path, ROOT)}", file=sys.stderr)  # above the progress bar


def draw_mask(ax, allowed: np.ndarray, rows: list[str], cols: list[str], title: str) -> None:
    """A bool [rows, cols] mask as a grid: filled = may attend."""
    cmap = matplotlib.colors.ListedColormap([DENIED, ALLOWED])
    ax.imshow(allowed.astype(int), cmap=cmap, vmin=0, vmax=1, aspect="equal")
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks(np.arange(-0.5, len(cols)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(rows)), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set_title(title, fontsize=10, pad=16)


# ----------------------------------------------------------------------------------------------------------
# §1.1 the cost curve
# ----------------------------------------------------------------------------------------------------------


def cost_curve(model) -> None:
    sizes = [1, 2, 4, 8, 16, 32, 64, 96]
    times = verify.measure_step_times(model, sizes, context=300, repeats=9)  # the machine is noisy: more than 5
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ratio = [times[n] / times[1] for n in sizes]
    ax.plot(sizes, ratio, "o-", color=ALLOWED, label=f"{model.device.type}, measured now")
    # beside it, the run RESULTS.md's table ("What a forward costs") gives: its 2-thread step times
    with open(os.path.join(ROOT, "bench", "results", "every-method-128-costs.json"), encoding="utf-8") as f:
        stored = [v for k, v in json.load(f).items() if json.loads(k)["what"][:1] == ["step times"]
                  and json.loads(k)["what"][3] is None][0]
    ax.plot([int(n) for n in stored], [t / stored["1"] for t in stored.values()], ".-", color="tab:orange", lw=0.8,
            label="the table's run (RESULTS.md)")
    ax.plot(sizes, [1] * len(sizes), "--", color="grey", lw=0.8, label="ideal: free extra rows")
    ax.plot(sizes, sizes, ":", color="grey", lw=0.8, label="n separate forwards")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_yticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_ylim(0.8, 16)
    ax.set_xlabel("tokens in one forward (n), after 300 cached")
    ax.set_ylabel("t(n) / t(1)")
    ax.set_title("§1.1 What verifying n tokens at once costs", fontsize=10)
    for n, r in zip(sizes, ratio):
        ax.annotate(f"{r:.1f}", (n, r), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.legend(fontsize=7, loc="upper left")
    save(fig, "cost_curve")


# ----------------------------------------------------------------------------------------------------------
# §1.4 the tree attention mask, §1.6 compaction
# ----------------------------------------------------------------------------------------------------------

# The draft tree of TUTORIAL §1.3 (prompt "What is the capital of France?"), node by node: (token, parent).
TREE_13 = [("Paris", -1), (",", 0), (" which", 1), (" is", 2), (".", 0), ("\\n", 4), ("\\n", 5), ("The", 6),
           (" capital", 7), (" answer", 7)]
ACCEPTED_13 = [0, 4, 5, 6, 7, 9]


def mask_tree() -> None:
    tokens = [t for t, _ in TREE_13]
    tree = verify.Tree.root_only(0)  # token ids do not matter for the mask: use the node index
    for i, (_, p) in enumerate(TREE_13[1:], start=1):
        assert tree.add(p, i) == i
    P = 5
    allowed = (verify.tree_attention_mask(tree.parents, P, torch.float32)[0, 0] == 0).numpy()  # [N, P + N]
    rows = [f'n{i} "{t}"' for i, t in enumerate(tokens)]
    cols = [f"p{j}" for j in range(P)] + [f"n{i}" for i in range(len(tokens))]
    pos = verify.tree_position_ids(tree.depths, P)[0].tolist()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    draw_mask(ax, allowed, [f"{r}  @{p}" for r, p in zip(rows, pos)], cols,
              "§1.4 Tree attention mask (rows: node, token @ position id)")
    ax.axvline(P - 0.5, color="black", lw=1.2)
    ax.text(P / 2 - 0.5, -0.8, "cached prompt", ha="center", fontsize=8)
    ax.text(P + len(tokens) / 2 - 0.5, -0.8, "this step's tree", ha="center", fontsize=8)
    save(fig, "mask_tree")


def compaction() -> None:
    """§1.6: the cache before and after compact_kv keeps the accepted path."""
    P, N = 5, len(TREE_13)
    before = [f"p{j}" for j in range(P)] + [f"n{i}" for i in range(N)]
    after = [f"p{j}" for j in range(P)] + [f"n{i}" for i in ACCEPTED_13]
    fig, ax = plt.subplots(figsize=(7.5, 1.9))
    for y, cells, label in ((1, before, "before: 15 entries"), (0, after, "after compact_kv: 11")):
        for x, c in enumerate(cells):
            kept = c.startswith("p") or int(c[1:]) in ACCEPTED_13
            colour = "#c6d8ee" if c.startswith("p") else ("#7fb27f" if kept else "#e8b4b4")
            ax.add_patch(plt.Rectangle((x, y), 0.95, 0.8, color=colour))
            ax.text(x + 0.47, y + 0.4, c, ha="center", va="center", fontsize=8)
        ax.text(-0.3, y + 0.4, label, ha="right", va="center", fontsize=8)
    ax.set_xlim(-6, N + P + 0.5)
    ax.set_ylim(-0.2, 2)
    ax.axis("off")
    ax.set_title("§1.6 Compaction: the accepted path's KV moves behind the prefix (green kept, red dropped)", fontsize=9)
    save(fig, "compaction")


# ----------------------------------------------------------------------------------------------------------
# §3.2 Cacheback's Figure 2 as a drawn tree
# ----------------------------------------------------------------------------------------------------------


def cacheback_tree(model, tok) -> None:
    """TUTORIAL §3.2's snippet, drawn: the tree grow_tree builds for "At dawn the fox", accepted path bold."""
    import cacheback as cb

    show = lambda t: tok.decode([t]).strip() or repr(tok.decode([t]))  # noqa: E731
    story = ("At dawn the fox ran fast across the field. At dawn the fox hid deep in the wood. "
             "At dawn the fox sat still by the river. At dawn the fox ran fast across the field. At dawn the fox")
    text = tok(story).input_ids
    dyn = cb.CacheTable(ll=2, fl=2, lc=1024, fc=8)
    cb.update_table(dyn, text, 0)
    cache = verify.new_cache(model)
    verify.prefill(model, cache, text[:-1])
    tree = cb.grow_tree(text[-1], text, dyn, None, tdl=12, crt=2)
    logits = verify.tree_forward(model, cache, tree)
    path, bonus = verify.accepted_path(tree, logits)

    # layout: x = depth, y = leaf order (a simple tidy-tree: each leaf gets its own row)
    children = [[] for _ in tree.tokens]
    for i, p in enumerate(tree.parents):
        if p >= 0:
            children[p].append(i)
    y, nxt = {}, [0]

    def place(i):
        if not children[i]:
            y[i] = nxt[0]
            nxt[0] += 1
        else:
            for c in children[i]:
                place(c)
            y[i] = sum(y[c] for c in children[i]) / len(children[i])

    place(0)
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    on_path = set(path)
    for i, p in enumerate(tree.parents):
        if p >= 0:
            bold = i in on_path and p in on_path
            ax.plot([tree.depths[p], tree.depths[i]], [y[p], y[i]], color="#2f7d32" if bold else "#999999",
                    lw=2.5 if bold else 1, zorder=1)
    for i, t in enumerate(tree.tokens):
        ax.text(tree.depths[i], y[i], f"{show(t)}\n#{i}", ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round", fc="#d9f0d9" if i in on_path else "white",
                          ec="#2f7d32" if i in on_path else "#999999"))
    last = path[-1]
    ax.annotate(f"bonus: {show(bonus)}", (tree.depths[last] + 0.35, y[last]), (tree.depths[last] + 1.0, y[last]),
                fontsize=8, va="center", arrowprops=dict(arrowstyle="<-", color="#2f7d32"), color="#2f7d32")
    ax.set_xlim(-0.5, max(tree.depths) + 1.8)
    ax.set_ylim(max(y.values()) + 0.7, -0.7)
    ax.set_xticks(range(max(tree.depths) + 1), [f"depth {d}" for d in range(max(tree.depths) + 1)], fontsize=8)
    ax.set_yticks([])
    for s in ("top", "right", "left"):
        ax.spines[s].set_visible(False)
    ax.set_title("§3.2 Cacheback's Figure 2 on the default model: the draft tree for \"At dawn the fox\"\n"
                 "(LL = 2, FL = 2, TDL = 12, CRT = 2); the accepted path in green", fontsize=9)
    save(fig, "cacheback_tree")


# ----------------------------------------------------------------------------------------------------------
# §4.2 CARD's Figure 4, §5.2 FAFO's Figure 4
# ----------------------------------------------------------------------------------------------------------


def card_mask() -> None:
    """CARD §2.3: feeding layer 2 of a small candidate cache after a verified prefix of 3."""
    import card

    cache = card.CandidateCache(K=4, k=2)
    cache.reset(10)  # the root: the newest verified token, fed at slot 2 after a prefix of 2
    cache.nodes[cache.root].slot = 2
    # layer 1: two children of the root (fed, slots 3 and 4); layer 2: four grandchildren, being fed now
    a, b = cache._add(11, cache.root, 0.6), cache._add(12, cache.root, 0.3)
    cache.nodes[a].slot, cache.nodes[b].slot = 3, 4
    front = [cache._add(13, a, 0.4), cache._add(14, a, 0.1), cache._add(15, b, 0.2), cache._add(16, b, 0.05)]
    allowed = card.draft_mask(cache, front, dp=2, cache_len=5)  # [4, 5 + 4]
    labels = {0: "root", a: "a", b: "b", front[0]: "a.1", front[1]: "a.2", front[2]: "b.1", front[3]: "b.2"}
    cols = ["v0", "v1", "root"] + ["a", "b"] + [labels[i] for i in front]  # v: the verified prefix
    fig, ax = plt.subplots(figsize=(5.2, 2.6))
    draw_mask(ax, allowed, [labels[i] for i in front], cols,
              "§4.2 CARD Figure 4: feeding layer 2 (rows) of the candidate cache")
    ax.axvline(2.5, color="black", lw=1)
    ax.axvline(4.5, color="black", lw=1)
    ax.text(1, -0.75, "verified prefix", ha="center", fontsize=8)
    ax.text(3.5, -0.75, "layer 1 (fed)", ha="center", fontsize=8)
    ax.text(6.5, -0.75, "this step: itself only", ha="center", fontsize=8)
    save(fig, "card_mask")


def fafo_mask() -> None:
    import fafo

    lay = fafo.StepLayout(2, 3, 2)
    allowed = fafo.combined_mask(lay, 6, [0, 1, 5])  # [13, 6 + 13]
    rows = ["x"] + [None] * (lay.rows - 1)
    for i in range(lay.n):
        for j in range(lay.k):
            rows[lay.fumble_row(i, j)] = f"y{i + 1}_{j + 1}"
    for c in range(lay.m):
        for t in range(lay.k):
            rows[lay.cand_row(c, t)] = f"a{c + 1}_{t + 1}"
    cols = [f"c{j}" for j in range(6)] + rows
    fig, ax = plt.subplots(figsize=(7, 5))
    draw_mask(ax, allowed, rows, cols, "§5.2 FAFO Figure 4: one step, n = 2, k = 3, m = 2, C(kv) = {0, 1, 5}")
    ax.axvline(5.5, color="black", lw=1.2)
    for r in (0.5, 0.5 + lay.n * lay.k):
        ax.axhline(r, color="black", lw=1.2)
    for y0, y1, label in ((0, 0, "last token x:\nfull cache"), (1, lay.n * lay.k, "fumble (guess) rows:\nC(kv) only"),
                          (1 + lay.n * lay.k, lay.rows - 1, "find out (candidates):\nfull cache")):
        ax.text(len(cols) + 0.3, (y0 + y1) / 2, label, va="center", fontsize=8)
    save(fig, "fafo_mask")


# ----------------------------------------------------------------------------------------------------------
# §5.4 the compacted KV layout, before and after a swap
# ----------------------------------------------------------------------------------------------------------


def compacted_layout(model) -> None:
    """TUTORIAL §5.4's printout, drawn: a 20-token prefill, StreamingLLM sink 2 / recent 6, block size 8."""
    import fafo

    cache = verify.new_cache(model)
    verify.prefill(model, cache, list(range(100, 120)))
    comp = fafo.StreamingLLM(2, 6)
    kv = verify.CompactedKVCache(model, head_slots=8, input_rows=3, tail_slots=16, block_size=8)
    states = []
    kv.load(cache)
    kv.reselect(comp.select(20))
    states.append(("after prefill of 20", kv.slot_pos.copy(), set()))
    kv.key_buffer[:, :, :, kv.head_slots : kv.head_slots + 2] = 0  # stand-ins for two accepted rows' KV (the values do not matter here)
    kv.commit([0, 1], [20, 21])
    states.append(("after commit of 20, 21", kv.slot_pos.copy(), set()))
    before = kv.slot_pos.copy()
    kv.reselect(comp.select(22))
    moved = set(np.nonzero(kv.slot_pos != before)[0].tolist())
    states.append(("after reselect: 4 slots written", kv.slot_pos.copy(), moved))
    head = set(comp.select(22))
    fig, ax = plt.subplots(figsize=(9.5, 2.6))
    for y, (label, pos, mv) in enumerate(reversed(states)):
        for s, x in enumerate(pos):
            region = "head" if s < kv.head_slots else ("input" if s < kv.tail_start else "tail")
            colour = {"head": "#c6d8ee", "input": "#f5e3b3", "tail": "#e6e6e6"}[region]
            ax.add_patch(plt.Rectangle((s, y), 0.95, 0.8, color=colour,
                                       ec="#c0392b" if s in mv else colour, lw=2 if s in mv else 0))
            if x >= 0:
                bold = y == 0 and x in head
                ax.text(s + 0.47, y + 0.4, str(x), ha="center", va="center", fontsize=7,
                        fontweight="bold" if bold else "normal")
        ax.text(-0.4, y + 0.4, label, ha="right", va="center", fontsize=8)
    for x0, x1, name in ((0, kv.head_slots, "head: C(kv)"), (kv.head_slots, kv.tail_start, "input"), (kv.tail_start, kv.slots, "tail: the rest")):
        ax.text((x0 + x1) / 2, len(states) + 0.1, name, ha="center", fontsize=8)
    ax.set_xlim(-12, kv.slots + 0.5)
    ax.set_ylim(-0.3, len(states) + 0.6)
    ax.axis("off")
    ax.set_title("§5.4 The compacted KV buffer: logical positions by physical slot (red: written by the swap)",
                 fontsize=9)
    save(fig, "compacted_layout")


# ----------------------------------------------------------------------------------------------------------
# the benchmark figures (§1.7, §5.7)
# ----------------------------------------------------------------------------------------------------------


def _rows(kind: str):
    path = BENCH_ROWS[kind]
    if not os.path.isfile(path):
        from tqdm import tqdm

        tqdm.write(f"  skipped: {os.path.relpath(path, ROOT)} is missing (see its .md for the command)", file=sys.stderr)
        return None
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def speedup_bars() -> None:
    from bench import side_by_side

    rows = _rows("report")
    if rows is None:
        return
    methods = list(dict.fromkeys(r["method"] for r in rows))
    summary = side_by_side.summarize(rows, methods)
    cats = [c for c in summary if c != "overall"] + ["overall"]
    shown = [m for m in methods if m not in ("hf-greedy", "vanilla")]
    x = np.arange(len(cats))
    width = 0.8 / len(shown)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, m in enumerate(shown):
        vals = [summary[c][m]["speedup"] for c in cats]
        errs = [summary[c][m]["speedup_std"] for c in cats]
        ax.bar(x + (i - (len(shown) - 1) / 2) * width, vals, width, yerr=errs, capsize=2, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x, cats, rotation=15, fontsize=8)
    ax.set_ylabel("speedup vs hf-greedy (SpecBench)")
    passes = summary["overall"][shown[0]]["passes"]
    ax.set_title(f"§1.7 Speedup per category on the CPU: reporting prompts, mean ± std over {passes} passes",
                 fontsize=10)
    ax.legend(fontsize=7, ncol=len(shown))
    save(fig, "speedup_bars")


def per_position() -> None:
    from bench import side_by_side

    rows = _rows("report")
    if rows is None:
        return
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if all("per_position" in r for r in rows if r["method"] == m)]
    fig, ax = plt.subplots(figsize=(5.8, 3.4))
    js = np.arange(1, side_by_side.POSITIONS + 1)
    for m in methods:
        rates = side_by_side.position_rates([r for r in rows if r["method"] == m])
        ax.plot([j for j, r in zip(js, rates) if r is not None], [r for r in rates if r is not None], "o-", label=m)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("accepted / reached")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance (reporting prompts, CPU defaults)", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, "per_position")


def fafo_steps() -> None:
    rows = _rows("long")
    if rows is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, label, style in (("lookahead_dense_ms", "Lookahead (C = none), dense", "s--"),
                               ("lookahead_split_ms", "Lookahead (C = none), split", "s-"),
                               ("dense_ms", "FAFO, dense", "o--"), ("split_ms", "FAFO, split", "o-"),
                               ("flex_ms", "FAFO, flex (eager)", "^:")):
        pts = [(r["context"], r[name]) for r in rows if name in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set_xlabel("cached context (tokens)")
    ax.set_ylabel("ms per step")
    r0 = rows[0]
    ax.set_title(f"§5.7 One step ({r0['rows']} rows) against context length, {r0.get('device', 'cpu')}", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, "fafo_steps")


# ----------------------------------------------------------------------------------------------------------
# §2.4, §3.3, §4.3, §5.2 one step of a real run, as tools/replay.py's page shows it (headless Chromium)
# ----------------------------------------------------------------------------------------------------------

REPLAY_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def replay_figure(name: str, method: str, options: list[str], pick, height: int = 1450) -> None:
    """Run `python tools/replay.py METHOD --prompt REPLAY_PROMPT OPTIONS`, open the page in headless Chromium
    at the step pick(steps) chooses, and save the window. The options keep each run free of timing (no
    cost gate or pruning, CARD in lockstep), so the same step comes out every time."""
    import importlib.util
    import tempfile
    import time

    spec = importlib.util.spec_from_file_location("replay", os.path.join(ROOT, "tools", "replay.py"))
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    missing = replay.browser_missing()
    if missing:
        raise SystemExit(f"make figures: the replay screenshots need a headless Chromium: {missing}")
    page = os.path.join(tempfile.mkdtemp(prefix="replay-"), f"{method}.html")
    argv = [method, "--prompt", REPLAY_PROMPT, "--max-new-tokens", "64", *options, "-o", page]
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            status = replay.main(argv)
        finally:
            sys.stdout = stdout
    assert status == 0, f"tools/replay.py {' '.join(argv)} failed"
    steps = replay.read_page(page)["steps"]
    step = pick(steps) + 1
    driver = replay.headless_chromium(1200, height)
    try:
        driver.get(f"file://{page}#step={step}")
        time.sleep(0.3)  # layout settles
        driver.save_screenshot(os.path.join(OUT, name + ".png"))
    finally:
        driver.quit()
    from tqdm import tqdm

    tqdm.write(f"  wrote docs/figures/{name}.png (step {step} of {len(steps)})", file=sys.stderr)


def most_accepted(steps, also=lambda step: True) -> int:
    """The step that accepted the most drafted tokens (the first of equals), among those `also` admits."""
    candidates = [i for i, step in enumerate(steps) if also(step)] or list(range(len(steps)))
    return max(candidates, key=lambda i: (len(steps[i]["path"]), len(steps[i]["tokens"]), -i))


def replay_ngram() -> None:
    replay_figure("replay_ngram", "ngram", ["--cost", "free"], most_accepted)


def replay_cacheback() -> None:
    # the shipped frozen table is keyed by one token (LL = 1); the paper's whole trees, no pruning
    replay_figure("replay_cacheback", "cacheback", ["--ll", "1", "--frozen", "selfchat", "--cost", "free"],
                  lambda steps: most_accepted(steps, lambda s: any(s["frozen"])))


def replay_card() -> None:
    replay_figure("replay_card", "card", ["--mode", "lockstep", "--ratio", "5", "--K", "4", "--k", "4", "--cost", "free"],
                  lambda steps: most_accepted(steps, lambda s: len(s["layers"]) > 2))


def replay_fafo() -> None:
    replay_figure("replay_fafo", "fafo", ["--cost", "free"], lambda steps: most_accepted(steps, lambda s: s["winner"] >= 0),
                  height=1700)  # the streams' and the candidates' tables below


def serve_batches() -> None:
    """RESULTS.md, "Serving under load in one process": each drafter's speedup over vLLM without
    speculation against the batch size (total tokens over total time; every drafter between the same
    runs of no speculation, their order rotated each round; bench/serve_bench.py --together --one-process)."""
    from bench import serve_bench

    rows = _rows("serve")
    if rows is None:
        return
    summary = serve_bench.summary(rows)
    drafters = list(dict.fromkeys(e["config"] for e in summary if e["config"] != "none"))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name in drafters:
        points = sorted((e["batch"], e["over_none"]) for e in summary if e["config"] == name)
        style = "--" if name.endswith("ungated") else ("-" if not name.startswith("vllm") else ":")
        ax.plot([b for b, _ in points], [x for _, x in points], style, marker="o", label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.97, color="grey", lw=0.6, ls=":")
    batches = sorted({e["batch"] for e in summary})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (max_num_seqs; all prompts submitted)")
    ax.set_ylabel("tokens/s over no speculation")
    ax.set_title("§7.5 vLLM in one process on two AVX-512 CPU cores: speedup over no speculation by batch size "
                 "(reporting half)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save(fig, "serve_batches")


FIGURES = ["cost_curve", "mask_tree", "compaction", "cacheback_tree", "card_mask", "fafo_mask", "compacted_layout",
           "speedup_bars", "per_position", "fafo_steps", "replay_ngram", "replay_cacheback", "replay_card",
           "replay_fafo", "serve_batches"]


def main(argv=None) -> int:
    from tqdm import tqdm

    wanted = sys.argv[1:] if argv is None else argv
    names = [n for n in FIGURES if not wanted or any(w in n for w in wanted)]
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    model = tok = None
    for name in tqdm(names, desc="figures", unit="fig", file=sys.stderr):
        fn = globals()[name]
        needs = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        if needs and model is None:
            model, tok = verify.load_model()
        with torch.no_grad():
            fn(*[{"model": model, "tok": tok}[a] for a in needs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
