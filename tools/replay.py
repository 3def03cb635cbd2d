# SPDX-License-Identifier: MIT
"""
tools/replay.py -- one run of a method, step by step, as one self-contained HTML page.

    python tools/replay.py ngram --prompt "List the planets of the solar system." -o run.html
    python tools/replay.py cacheback --prompt "..." --frozen selfchat --compare -o run.html
    python tools/replay.py card --prompt "..." --mode lockstep -o run.html
    python tools/replay.py fafo --prompt "..." --n-guess 6 -o run.html

Every option of the method's own script works here (`python card.py --help` lists them) but --trace
and --json, plus -o.
Open the page from disk in any browser: it needs no network (inline SVG and a little plain
JavaScript, no library). For each verification step it draws what the paper draws:

    the text so far, and the step's draft          n-gram: the chain, each token with the order whose
                                                   context matched; Cacheback: the tree, dynamic and
                                                   frozen followers marked; CARD: the queried chain,
                                                   hit or miss, and the candidate cache's layers;
                                                   FAFO: the guess streams, the pool keys that hit,
                                                   the verified candidates
    the tree-attention mask as a grid              rows: the step's inputs; columns: the cache, then them
    the accepted branch and the bonus token
    the KV cache's length before and after the rollback

The arrow keys (or the buttons) move between steps; #step=N in the address opens step N. Over it,
a strip colours every output token by how it came (accepted draft or bonus token) with each step's
count; a click on a token or a bar opens its step. The header gives the run's statistics, and with
--compare whether the output is identical to HF greedy's.

How: the method runs through verify.run_method with an on_step hook (Recorder) that keeps each
step's tree, accepted path and bonus token, and the facts the method hands Generation.finish_step
(kv_before, kv_after, the n-gram orders, CARD's cache, FAFO's rows). It keeps references and
decodes nothing, so the run's tokens/s is the method's own, but for CARD's: with a hook, its draft
side also copies the candidate cache every step (card.CandidateCache.as_ids, sent through the pipe
in parallel mode). The page is built after the run. --trace and --json do not apply here.
"""

from __future__ import annotations

import html
import importlib
import json
import os
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import cacheback  # noqa: E402
import verify  # noqa: E402

# name -> the method's file and config class (prepare() and report() are taken where the file has them)
from tools.methods import METHODS  # noqa: E402

# the methods whose drafts the page can draw (step_data's notes, the page script's DRAFT map): a method of
# tools/methods.py missing here is refused in one line, and tests/test_layout.py names the gap
DRAWN = ("ngram", "cacheback", "card", "fafo")


class RawStep(NamedTuple):
    n_before: int  # output tokens before this step (on_step runs before the step's are emitted)
    tree: verify.Tree  # the verified draft (Cacheback's a DraftTree: it has origins)
    path: list[int]  # the accepted nodes, root first
    bonus: int
    facts: dict  # Generation.step_facts: what the method showed of the step


class Recorder:
    """generate()'s on_step hook: what each step did, kept as references (trees, lists and dicts
    that the method builds anew every step), converted to plain values after the run."""

    def __init__(self):
        self.steps: list[RawStep] = []

    def __call__(self, gen, tree, path, bonus):
        self.steps.append(RawStep(len(gen.tokens), tree, list(path), int(bonus), gen.step_facts))


def run(method: str, argv: list[str]):
    """Parse the method's options (its make_parser) and -o, run it with a Recorder. Returns (args,
    result dict, Generation, tokenizer, Recorder)."""
    module_name, config_name, _ = METHODS[method]
    module = importlib.import_module(module_name)
    parser = module.make_parser()
    parser.prog = f"python tools/replay.py {method}"
    parser.add_argument("-o", "--output", default="replay.html",
                        help="the page to write (default: replay.html)")
    args = parser.parse_args(argv)
    if args.trace or args.json:
        raise verify.UserError("--trace and --json print a run; a replay writes it to the page instead")
    recorder = Recorder()
    r, gen, tok = verify.run_method(args, method, module.generate, getattr(module, config_name),
                                    getattr(module, "prepare", None), getattr(module, "report", None),
                                    hooks={"on_step": recorder})
    return args, r, gen, tok, recorder


# ---- the page's data: plain values, token ids with one text per id -------------------------------


def step_data(method: str, raw: RawStep) -> dict:
    """One step as the page draws it (inputs: the rows of its verification forward)."""
    tree, facts = raw.tree, raw.facts
    step = {"n_before": raw.n_before, "tokens": [int(t) for t in tree.tokens], "parents": list(tree.parents),
            "path": raw.path, "bonus": raw.bonus, "inputs": len(tree), "kv_before": facts.get("kv_before"),
            "kv_after": facts.get("kv_after"), "withheld": facts.get("withheld", 0)}
    if method == "ngram":
        step["notes"] = [f"{order}-gram" for order in facts["orders"]]  # one per verified draft token
    elif method == "cacheback":
        origins = tree.origins[1:]  # (source, rank, pos, fanout) per drafted node; source 1 = frozen
        step["frozen"] = [origin[0] == 1 for origin in origins]
        # rank MAX_RANK stands for that rank and every later one (cacheback.DraftTree says why)
        ranks = [f"r{o[1]}+" if o[1] == cacheback.MAX_RANK else f"r{o[1]}" for o in origins]
        step["notes"] = [("frozen " if o[0] else "dynamic ") + rank for o, rank in zip(origins, ranks)]
        step["grown"] = facts["grown"]
    elif method == "card":
        # per layer, per node: (token, its parent's index in the layer above, sigma, fed?): as_ids
        step["layers"] = facts.get("layers")  # None where the draft side showed nothing
        step["hits"] = facts.get("hits")  # corrections so far that hit: card_hits reads them
    elif method == "fafo":
        step.update(fafo_rows(facts))
    return step


def fafo_rows(facts: dict) -> dict:
    """FAFO's step in Figure 4's terms: the n guess streams (their k tokens and the model's next
    one), the m candidate rows (each with the key it was found under, and the model's choice after
    each of its tokens), the winner, and how much of the cache the guess rows saw."""
    layout = facts["layout"]  # fafo.StepLayout: which input row is which
    tokens = facts["tokens"]  # the forward's input, one token per row
    choice = facts["choice"]  # input row -> the model's token after it (the rows it read)
    keys = facts["pool_keys"]  # the pool key of each real candidate, in order
    streams = []
    for i in range(layout.n):
        window = [tokens[layout.fumble_row(i, j)] for j in range(layout.k)]
        streams.append({"window": window, "next": choice[layout.fumble_row(i, layout.k - 1)]})
    candidates = []
    for c in range(layout.m):
        rows = [layout.cand_row(c, t) for t in range(layout.k)]
        # the flex path pads the real candidates (the first len(keys)) to m with dummies, never accepted
        real = c < len(keys)
        candidates.append({"tokens": [tokens[r] for r in rows], "key": list(keys[c]) if real else None,
                           "choices": [choice[r] for r in rows] if real else None})
    return {"streams": streams, "candidates": candidates, "winner": facts["winner"],
            "first_choice": choice[0], "layout": [layout.n, layout.k, layout.m], "inputs": layout.rows,
            "guess_sees": len(facts["selected"])}


def fafo_masks(steps: list[dict]) -> dict:
    """Each distinct step layout's in-step mask (StepLayout.inner_mask), rows as '0'/'1' strings:
    the layout is the same every step but on the dense and split paths' shorter steps."""
    import fafo

    masks = {}
    for step in steps:
        n, k, m = step["layout"]
        inner = fafo.StepLayout(n, k, m).inner_mask()
        masks[f"{n},{k},{m}"] = ["".join("1" if a else "0" for a in row) for row in inner.tolist()]
    return masks


def card_hits(steps: list[dict]) -> None:
    """A CARD step's correction is counted before the next query, so step s hit when the count grew
    by step s + 1 (the last step is never corrected: the run ended)."""
    counts = [step.pop("hits") for step in steps] + [None]  # hits before each step's correction
    for step, now, later in zip(steps, counts, counts[1:]):
        step["hit"] = None if now is None or later is None else later > now


def token_ids(data: dict) -> set[int]:
    """Every token id the page shows."""
    ids = set(data["output"])
    for step in data["steps"]:
        ids.update(step["tokens"])
        ids.add(step["bonus"])
        for layer in step.get("layers") or []:
            ids.update(node[0] for node in layer)
        for stream in step.get("streams", []):
            ids.update(stream["window"] + [stream["next"]])
        for cand in step.get("candidates", []):
            ids.update(cand["tokens"] + (cand["key"] or []) + (cand["choices"] or []))
        ids.add(step.get("first_choice", step["bonus"]))
    return ids


def output_pieces(tok, ids: list[int]) -> list[str]:
    """The output's text, token by token, as verify.Printer streams it: each piece is what decoding
    one more token adds (a token alone can lose its leading space, or half a character)."""
    pieces, shown = [], ""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        pieces.append(text[len(shown) :])
        shown = text
    return pieces


def page_data(method: str, r: dict, gen, tok, recorder: Recorder, prompt: str) -> dict:
    """Everything the page draws, as JSON-ready values."""
    steps = [step_data(method, raw) for raw in recorder.steps]
    if method == "card":
        card_hits(steps)
    came_from = ["prefill"] + ["draft" if d else "bonus" for d in gen.from_draft[1:]]  # per output token
    step_of = [-1] * len(gen.tokens)  # output token -> the step that emitted it (-1: the prefill)
    for s, step in enumerate(steps):
        end = steps[s + 1]["n_before"] if s + 1 < len(steps) else len(gen.tokens)
        step["emitted"] = end - step["n_before"]  # fewer than accepted + 1 where the run stopped inside
        for i in range(step["n_before"], end):
            step_of[i] = s
    stats = {key: r.get(key) for key in ("new_tokens", "target_forwards", "mean_accepted", "tokens_per_s",
                                         "decode_tokens_per_s", "ttft_s", "identical", "speedup",
                                         "baseline_tokens_per_s", "device", "dtype", "prompt_tokens",
                                         "identity_expected", "first_difference", "top2_margin")}
    data = {"method": method, "model": r["model"], "prompt": prompt, "stats": stats, "config": r.get("config"),
            "sampling": r["sampling"], "output": gen.tokens, "pieces": output_pieces(tok, gen.tokens),
            "came_from": came_from, "step_of": step_of, "steps": steps,
            "masks": fafo_masks(steps) if method == "fafo" else {}}
    data["vocab"] = {str(i): tok.decode([i]) for i in sorted(token_ids(data))}
    return data


def write_page(data: dict, path: str) -> None:
    # subtle: text inside <script> must not hold "</script" or "<!--" (a model's output may): JSON
    # writes "<" as \u003c, and < occurs only inside its strings
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    title = html.escape(f"{data['method']} replay: {data['prompt'][:60]}")
    head, tail = PAGE.split("__DATA__")  # (not str.replace: a prompt may contain the placeholders)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head.replace("__TITLE__", title) + blob + tail)


def read_page(path: str) -> dict:
    """The data a page was written with (the tests and docs/make_figures.py read it back)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index('<script id="run-data" type="application/json">')
    blob = text[text.index(">", start) + 1 : text.index("</script>", start)]
    return json.loads(blob)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\nusage: python tools/replay.py {{{','.join(METHODS)}}} [the method's options] -o PAGE.html")
        return 0
    method = argv[0]
    if method not in METHODS:
        print(f"error: unknown method {method!r}: expected one of {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if method not in DRAWN:
        print(f"error: the page cannot draw {method}'s drafts yet (tools/replay.py: DRAWN)", file=sys.stderr)
        return 2
    try:
        args, r, gen, tok, recorder = run(method, argv[1:])
        data = page_data(method, r, gen, tok, recorder, args.prompt)
        write_page(data, args.output)
    except (verify.UserError, OSError) as e:  # bad input, or the page cannot be written there
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    same = "" if r.get("identical") is None else f", identical to the baseline: {'yes' if r['identical'] else 'NO'}"
    print(f"wrote {args.output}: {len(data['steps'])} steps, {len(gen.tokens)} tokens, mean accepted "
          f"{r['mean_accepted']:.2f}, {r['tokens_per_s']:.1f} tokens/s{same}")
    return 0


# ---- a headless browser, for the tests and the tutorial's screenshots (docs/make_figures.py) --------

CHROMIUM = "/usr/bin/chromium"  # Debian's packages chromium and chromium-driver
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    """Why no headless Chromium can be driven here (None: it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return f"{path} is not installed (Debian: apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements.txt)"
    return None


def headless_chromium(width: int = 1280, height: int = 1000, profile: str | None = None):
    """A selenium driver for Debian's Chromium, headless, with its console log kept. The flags keep it
    off the network (it opens pages from disk) and out of a sandbox it cannot have as root; `profile`:
    a new, empty folder for its user data."""
    import tempfile

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={width},{height}",
                 f"--user-data-dir={profile or tempfile.mkdtemp(prefix='replay-chromium-')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; max-width: 1400px; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 14px 0 6px; }
.muted { color: #666; } .stats { display: flex; flex-wrap: wrap; column-gap: 16px; } .stats span { white-space: nowrap; }
#strip { line-height: 1.9; font-family: ui-monospace, monospace; font-size: 13px; white-space: pre-wrap;
  border: 1px solid #ddd; padding: 6px; max-height: 180px; overflow: auto; }
#strip span { cursor: pointer; border-radius: 2px; }
.t-prefill { background: #e2e2e2; } .t-draft { background: #c6efce; } .t-bonus { background: #ffd8a8; }
#strip span.here { outline: 2px solid #1c4e9c; } #bars { overflow-x: auto; }
nav { margin: 10px 0; display: flex; gap: 8px; align-items: center; position: sticky; top: 0; background: #fff;
  padding: 6px 0; border-bottom: 1px solid #ddd; z-index: 1; }
nav button { font-size: 14px; padding: 3px 10px; }
#text { font-family: ui-monospace, monospace; font-size: 13px; white-space: pre-wrap; border: 1px solid #ddd;
  padding: 6px; max-height: 160px; overflow: auto; }
.panels { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
.left { flex: 1 1 560px; min-width: 0; overflow-x: auto; } #mask { flex: 0 1 auto; max-width: 480px; }
#extra { overflow-x: auto; }
figure { margin: 0; } figcaption { font-size: 12px; color: #555; margin-top: 4px; max-width: 640px; }
svg text { font-family: ui-monospace, monospace; font-size: 11px; }
table.grid { border-collapse: collapse; font-family: ui-monospace, monospace; font-size: 12px; }
table.grid td, table.grid th { border: 1px solid #ccc; padding: 1px 6px; }
td.ok { background: #c6efce; } td.no { background: #f4c7c3; } td.win { font-weight: bold; } td.pad { color: #aaa; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 3px;
  border: 1px solid #888; }
</style></head>
<body>
<script id="run-data" type="application/json">__DATA__</script>
<header><h1 id="title"></h1><div id="prompt" class="muted"></div><div id="stats" class="stats"></div>
<details><summary class="muted">configuration</summary><div id="config" class="muted"></div></details></header>
<h2>The output <span class="legend"><span><i class="swatch t-prefill"></i>the prefill's token</span>
<span><i class="swatch t-draft"></i>accepted draft</span><span><i class="swatch t-bonus"></i>bonus token</span>
<span class="muted">click a token or a bar for its step</span></span></h2>
<div id="strip"></div><div id="bars"></div>
<nav><button id="first" title="Home">&laquo; first</button><button id="prev" title="left arrow">&#x25C0; prev</button>
<span id="where"><b id="step-number"></b> of <b id="step-count"></b></span>
<button id="next" title="right arrow">next &#x25B6;</button><button id="last" title="End">last &raquo;</button>
<input id="slider" type="range" min="1" value="1" style="flex: 1"></nav>
<main id="step">
<h2>The text so far, and what this step added</h2><div id="text"></div>
<div id="summary"></div>
<div class="panels"><div class="left"><figure id="draft"></figure></div><figure id="mask"></figure></div>
<div id="extra"></div>
</main>
<script>
"use strict";
const RUN = JSON.parse(document.getElementById("run-data").textContent);
const STEPS = RUN.steps;
const SVG = "http://www.w3.org/2000/svg";
let current = 0;

function $(id) { return document.getElementById(id); }
function el(tag, attrs, parent, text) {
  const node = tag === "svg" || SVG_TAGS.has(tag) ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}
const SVG_TAGS = new Set(["rect", "line", "text", "path", "g", "title", "polyline"]);
function piece(id) { return RUN.vocab[String(id)] ?? "?"; }
// a token as a label: spaces and line breaks made visible
function label(id, max) {
  let s = piece(id).replace(/ /g, "\u2423").replace(/\n/g, "\u23CE").replace(/\t/g, "\u21E5");
  if (max && s.length > max) s = s.slice(0, max - 1) + "\u2026";
  return s || "\u2205";
}
function fmt(x, digits) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }

// ---- the header and the strip: the whole run at a glance
function header() {
  const s = RUN.stats;
  $("title").textContent = `${RUN.method} on ${RUN.model} (${s.device}, ${s.dtype})`;
  $("prompt").textContent = "prompt: " + RUN.prompt;
  const items = [`${s.new_tokens} new tokens`, `${STEPS.length} steps (+ the prefill)`,
    `mean accepted ${fmt(s.mean_accepted, 2)} tokens per target forward`, `${fmt(s.tokens_per_s, 1)} tokens/s`,
    `first token ${fmt(s.ttft_s, 2)} s`];
  if (s.identical !== null && s.identical !== undefined) {
    const base = RUN.sampling.temperature > 0 ? "the plain sampler" : "HF greedy";
    let same = s.identical ? "yes" : `NO, from output token ${s.first_difference} (top-2 logit margin there ${fmt(s.top2_margin, 4)})`;
    if (!s.identical && !s.identity_expected) same += `: expected in ${s.dtype}, where a many-row forward rounds differently`;
    items.push(`identical to ${base}: ${same}`);
    items.push(`speedup ${fmt(s.speedup, 2)}x (${fmt(s.baseline_tokens_per_s, 1)} tokens/s)`);
  }
  for (const item of items) el("span", {}, $("stats"), item);
  $("config").textContent = Object.entries(RUN.config || {}).map(([k, v]) => `${k}=${v}`).join("  ");
}

function strip() {
  RUN.output.forEach((id, i) => {
    const s = RUN.step_of[i];
    const how = RUN.came_from[i];
    const span = el("span", {class: "t-" + how, "data-step": s}, $("strip"), RUN.pieces[i]);
    span.title = s < 0 ? "the prefill's token" : `step ${s + 1}: ${how === "draft" ? "accepted draft" : "bonus token"}`;
    if (s >= 0) span.addEventListener("click", () => show(s));
  });
  // one bar per step: the accepted draft tokens it emitted (green) and its bonus token (orange)
  const w = Math.max(3, Math.min(14, Math.floor(1100 / Math.max(STEPS.length, 1))));
  const most = Math.max(1, ...STEPS.map(st => st.emitted));
  const unit = 56 / most, base = 72;
  const svg = el("svg", {width: w * STEPS.length + 2, height: base + 4, id: "bar-chart"}, $("bars"));
  STEPS.forEach((st, s) => {
    const g = el("g", {class: "bar", "data-step": s, cursor: "pointer"}, svg);
    const acc = Math.min(st.path.length - 1, st.emitted);  // the run may stop inside a draft
    const bonus = st.emitted - acc;
    el("rect", {x: s * w, y: 0, width: w, height: base, fill: "transparent"}, g);
    if (bonus) el("rect", {x: s * w + 0.5, y: base - unit * (acc + 1), width: w - 1, height: unit, fill: "#f0a860"}, g);
    if (acc) el("rect", {x: s * w + 0.5, y: base - unit * acc, width: w - 1, height: unit * acc, fill: "#5cb85c"}, g);
    if (w >= 9 && acc) el("text", {x: s * w + w / 2, y: base - unit * st.emitted - 3, "text-anchor": "middle", fill: "#2e7d32"}, g, String(acc));
    el("title", {}, g, `step ${s + 1}: ${acc} accepted of ${st.tokens.length - 1} drafted` + (bonus ? ", + the bonus token" : ""));
    g.addEventListener("click", () => show(s));
  });
  el("rect", {id: "bar-here", x: 0, y: 0, width: w, height: base + 2, fill: "none", stroke: "#1c4e9c", "stroke-width": 2}, svg);
  el("div", {class: "muted"}, $("bars"), "per step: the accepted draft tokens (green, counted) and the bonus token (orange)");
}

// ---- a draft tree (a chain is a tree): nodes by depth left to right, branches top to bottom
function drawTree(st, notes, frozen) {
  const n = st.tokens.length;
  const children = Array.from({length: n}, () => []);
  for (let i = 1; i < n; i++) children[st.parents[i]].push(i);
  const depth = new Array(n).fill(0);
  for (let i = 1; i < n; i++) depth[i] = depth[st.parents[i]] + 1;
  const row = new Array(n).fill(0);
  let next = 0;
  (function place(i) {  // leaves take rows in depth-first order; a parent sits on its first child's row
    if (!children[i].length) { row[i] = next++; return; }
    children[i].forEach(place);
    row[i] = row[children[i][0]];
  })(0);
  const onPath = new Set(st.path);
  const longest = Math.max(...st.tokens.concat([st.bonus]).map(t => label(t, 12).length));
  const W = Math.max(44, 7 * longest + 12), H = 22, GX = 18, GY = notes ? 22 : 10;
  const last = st.path[st.path.length - 1];
  const bonusRow = children[last].length ? next : row[last];  // beside the last accepted node, or below all
  const rows = Math.max(next, bonusRow + 1);
  const cols = Math.max(...depth) + 2;  // + the bonus token
  const svg = el("svg", {width: cols * (W + GX) + 10, height: rows * (H + GY) + 10});
  const at = i => [5 + depth[i] * (W + GX), 5 + row[i] * (H + GY)];
  for (let i = 1; i < n; i++) {
    const [x, y] = at(i), [px, py] = at(st.parents[i]);
    el("line", {x1: px + W, y1: py + H / 2, x2: x, y2: y + H / 2, stroke: onPath.has(i) ? "#2e7d32" : "#bbb"}, svg);
  }
  const box = (x, y, fill, stroke, dashed, text, title) => {
    const g = el("g", {}, svg);
    el("rect", {x, y, width: W, height: H, rx: 4, fill, stroke, "stroke-width": 1.5,
                "stroke-dasharray": dashed ? "4 3" : "none"}, g);
    el("text", {x: x + 5, y: y + 15}, g, text);
    el("title", {}, g, title);
  };
  for (let i = 0; i < n; i++) {
    const [x, y] = at(i);
    const fill = i === 0 ? "#dbe8fb" : onPath.has(i) ? "#c6efce" : "#f5f5f5";
    const isFrozen = frozen && i > 0 && frozen[i - 1];
    const how = i === 0 ? "the pending token (the root: emitted, not yet in the KV cache)"
      : onPath.has(i) ? "accepted" : "rejected";
    box(x, y, fill, isFrozen ? "#8e44ad" : "#555", isFrozen, label(st.tokens[i], 12),
        `node ${i}: ${JSON.stringify(piece(st.tokens[i]))}, ${how}` + (notes && i > 0 ? `, ${notes[i - 1]}` : ""));
    if (notes && i > 0) el("text", {x: x + 2, y: y + H + 12, fill: "#666"}, svg, notes[i - 1]);
  }
  const [bx, by] = at(last);
  const y = 5 + bonusRow * (H + GY);
  el("line", {x1: bx + W, y1: by + H / 2, x2: bx + W + GX, y2: y + H / 2, stroke: "#e67e22", "stroke-dasharray": "3 2"}, svg);
  box(bx + W + GX, y, "#ffd8a8", "#e67e22", false, label(st.bonus, 12), "the bonus token: the target's own choice after the accepted branch");
  return svg;
}

// ---- the attention mask as a grid: rows = this step's inputs, columns = the cache, then the inputs
function drawMask(parent, rowLabels, allowed, cacheSees, caption) {
  const n = rowLabels.length;
  const c = Math.max(4, Math.min(14, Math.floor(440 / Math.max(n, 1))));
  const labelW = c >= 10 ? 112 : 0;
  const cacheW = 3 * c;
  const svg = el("svg", {width: Math.max(labelW + cacheW + n * c + 8, labelW + 190), height: 30 + n * c + 4}, parent);
  el("text", {x: labelW, y: 12, fill: "#555"}, svg, "cache");
  el("text", {x: labelW + cacheW + 4, y: 22, fill: "#555"}, svg, "\u2193 this step's inputs");
  let cells = "", partial = "";
  for (let i = 0; i < n; i++) {
    const y = 26 + i * c;
    if (labelW) el("text", {x: 2, y: y + c - 2}, svg, rowLabels[i]);
    if (cacheSees[i] === "all") cells += `M${labelW},${y}h${cacheW - 2}v${c - 1}h${-(cacheW - 2)}z`;
    else partial += `M${labelW},${y}h${cacheW - 2}v${c - 1}h${-(cacheW - 2)}z`;
    for (let j = 0; j < n; j++) if (allowed(i, j)) cells += `M${labelW + cacheW + j * c},${y}h${c - 1}v${c - 1}h${-(c - 1)}z`;
  }
  el("rect", {x: labelW + cacheW, y: 26, width: n * c, height: n * c, fill: "#f2f2f2"}, svg);
  el("path", {d: cells, fill: "#2b6cb0"}, svg);
  if (partial) el("path", {d: partial, fill: "#9cc3ea"}, svg);
  el("figcaption", {}, parent, caption);
}

function treeMask(st) {
  const ancestors = st.parents.map((_, i) => {  // node i, its parent, ..., the root
    const seen = new Set();
    for (let j = i; j >= 0; j = st.parents[j]) seen.add(j);
    return seen;
  });
  const labels = st.tokens.map((t, i) => `${i} ${label(t, 10)}`);
  const cached = st.kv_before - st.inputs;
  drawMask($("mask"), labels, (i, j) => ancestors[i].has(j), labels.map(() => "all"),
    `Tree attention: node i sees the ${cached} cached positions and its own ancestors (dark = may attend). ` +
    "Positions follow depth, so every branch reads as its own sequence.");
}

// ---- each method's own figures
function ngramDraft(st) {
  $("draft").append(drawTree(st, st.notes, null));
  let cap = `The n-gram chain: each drafted token with the order (2-${RUN.config.max_order}) whose context matched, the longest tried first.`;
  if (st.withheld) cap += ` The rule of verify.py section 9 (ours) withheld the chain's last ${st.withheld} token(s): not worth their time here.`;
  else if (st.tokens.length === 1) cap += " No context of the last tokens was in the tables: no draft, a plain one-token step.";
  el("figcaption", {}, $("draft"), cap);
}

function cachebackDraft(st) {
  $("draft").append(drawTree(st, st.notes, st.frozen));
  const frozen = st.frozen.filter(Boolean).length;
  el("figcaption", {}, $("draft"),
    `The draft tree: followers of the leader (the last LL tokens) hung below the pending token, level by level. ` +
    `Solid: from the dynamic table (${st.frozen.length - frozen}); dashed purple: from the frozen table (${frozen}); ` +
    `r = the follower's rank (0 = most recent). ` + (RUN.config.cost === "free" ? `Grown and verified ${st.grown} token(s) (cost free: every draft verified).`
      : `Grown ${st.grown} token(s), ${st.tokens.length - 1} verified (cut to the tokens left to generate, then to what pays here: the rule of verify.py section 9).`));
}

function cardDraft(st) {
  $("draft").append(drawTree(st, null, null));
  const hit = st.hit === null ? "none, the run ended"
    : st.hit ? "HIT: when the correction came, the cache held the bonus token below the accepted tokens; that subtree is kept" +
               (RUN.config.mode === "parallel" ? " (in parallel mode the draft kept drafting after the query)" : "")
    : "MISS: the bonus token was not in the cache below the accepted tokens; it restarts from the bonus token";
  el("figcaption", {}, $("draft"), `The chain the query returned (the best path of up to r tokens), verified in one forward. Correction: ${hit}.`);
  if (!st.layers) {
    el("p", {class: "muted"}, $("extra"), "The candidate cache lives in the draft process, which showed nothing this step.");
    return;
  }
  // the candidate cache, layer by layer: the queried chain in green, the top nodes of each layer
  const box = el("figure", {}, $("extra"));
  const chain = st.tokens.slice(1);
  const W = 100, H = 18, GX = 24, TOP = 12;
  let onChain = [0];  // per layer: the index of the chain's node
  for (let l = 1; l < st.layers.length; l++) {
    const k = st.layers[l].findIndex(nd => nd[1] === onChain[l - 1] && nd[0] === chain[l - 1]);
    if (k < 0 || l > chain.length) break;
    onChain.push(k);
  }
  const shown = st.layers.map((layer, l) => {
    const order = layer.map((nd, i) => i).sort((a, b) => layer[b][2] - layer[a][2]);
    const keep = order.slice(0, TOP);
    if (onChain[l] !== undefined && !keep.includes(onChain[l])) keep.push(onChain[l]);
    return keep;
  });
  const rows = Math.max(...shown.map(k => k.length));
  const svg = el("svg", {width: st.layers.length * (W + GX) + 10, height: rows * (H + 6) + 30}, box);
  const pos = shown.map(keep => new Map(keep.map((i, r) => [i, r])));
  st.layers.forEach((layer, l) => {
    el("text", {x: 5 + l * (W + GX), y: 11, fill: "#555"}, svg, l === 0 ? "root" : `layer ${l} (${layer.length})`);
    shown[l].forEach((i, r) => {
      const [tok, parentIdx, sigma, fed] = layer[i];
      const x = 5 + l * (W + GX), y = 18 + r * (H + 6);
      if (l > 0 && pos[l - 1].has(parentIdx)) {
        const py = 18 + pos[l - 1].get(parentIdx) * (H + 6);
        el("line", {x1: x - GX, y1: py + H / 2, x2: x, y2: y + H / 2, stroke: "#ccc"}, svg);
      }
      const inChain = onChain[l] === i;
      const accepted = inChain && l > 0 && l < st.path.length;
      el("rect", {x, y, width: W, height: H, rx: 3, fill: accepted ? "#c6efce" : inChain ? "#e8f5e9" : "#fafafa",
                  stroke: inChain ? "#2e7d32" : "#999", "stroke-dasharray": fed ? "none" : "3 2"}, svg);
      el("text", {x: x + 3, y: y + 13}, svg, `${label(tok, 8)} ${sigma.toFixed(2)}`);
    });
  });
  el("figcaption", {}, box, `The candidate cache as the query saw it (§2.2), below the verified text: each layer's nodes ` +
    `with sigma, the draft's probability of the path to them (top ${TOP} per layer shown; dashed: grown, not yet fed ` +
    `to the draft). Green border: the queried chain; filled: accepted.`);
}

// a table whose header is: first, then k columns letter1 .. letterk, then last
function table(parent, id, first, letter, k, last) {
  const t = el("table", {class: "grid", id}, parent);
  const head = el("tr", {}, t);
  el("th", {}, head, first);
  for (let j = 0; j < k; j++) el("th", {}, head, `${letter}${j + 1}`);
  el("th", {}, head, last);
  return t;
}

function fafoDraft(st) {
  $("draft").append(drawTree(st, null, null));
  el("figcaption", {}, $("draft"), st.tokens.length > 1
    ? "Find Out: the verified candidates (the pool's k-grams filed under a key that ends the text) as a trie, the accepted run in green."
    : "Find Out: no k-gram in the pool under a key that ends the text, so nothing to verify: a plain step (the guess rows still run).");
  const [n, k] = st.layout;
  const cached = st.kv_before - st.inputs;
  const sec = $("extra");
  el("h2", {}, sec, `Fumble Around: ${n} guess streams of k = ${k} tokens (they see C(kv): ${st.guess_sees} of the ${cached} cached positions)`);
  const t1 = table(sec, "streams", "stream", "y", k, "the model's next guess (a new k-gram for the pool)");
  st.streams.forEach((s, i) => {
    const tr = el("tr", {}, t1);
    el("td", {}, tr, String(i));
    s.window.forEach(t => el("td", {}, tr, label(t, 12)));
    el("td", {}, tr, label(s.next, 12));
  });
  el("h2", {}, sec, `Find Out: ${st.candidates.filter(c => c.key).length} candidate(s) from the pool (at most m = ${RUN.config.m})`);
  const t2 = table(sec, "candidates", "pool key that hit", "a", k, "matched");
  st.candidates.forEach((c, ci) => {
    const tr = el("tr", {}, t2);
    if (!c.key) {
      el("td", {class: "pad"}, tr, "(padding: flex's fixed m)");
      c.tokens.forEach(t => el("td", {class: "pad"}, tr, label(t, 12)));
      el("td", {class: "pad"}, tr, "-");
      return;
    }
    el("td", {}, tr, c.key.map(t => label(t, 10)).join(" "));
    // Algorithm 4 on this row: a token is accepted while it equals the model's choice after the ones before
    let want = st.first_choice, matched = 0, alive = true;
    c.tokens.forEach((t, j) => {
      const ok = alive && t === want;
      const why = ok ? "equals the model's choice" : alive ? `the model chose ${JSON.stringify(piece(want))}` : "not checked: after a mismatch";
      if (ok) { matched++; want = c.choices[j]; } else alive = false;
      el("td", {class: ok ? "ok" : "no"}, tr, label(t, 12)).title = why;
    });
    el("td", {class: ci === st.winner ? "win" : ""}, tr, ci === st.winner ? `${matched}, the winner` : String(matched));
  });
  // the mask: Figure 4's rows; guess rows see only C(kv) of the cache
  const rows = st.inputs;
  const inner = RUN.masks[st.layout.join(",")];
  const labels = [];
  const sees = [];
  for (let r = 0; r < rows; r++) {
    if (r === 0) { labels.push("x " + label(st.tokens[0], 8)); sees.push("all"); }
    else if (r <= n * k) { const j = Math.floor((r - 1) / n), i = (r - 1) % n; labels.push(`s${i}.y${j + 1}`); sees.push("some"); }
    else { const c = Math.floor((r - 1 - n * k) / k), t = (r - 1 - n * k) % k; labels.push(`c${c}.a${t + 1}`); sees.push("all"); }
  }
  drawMask($("mask"), labels, (i, j) => inner[i][j] === "1", sees,
    `Figure 4's mask, one forward: x (the pending token), the n x k guess rows (s) and the m x k candidate rows (c). ` +
    `The cache column: dark = the full ${cached} positions, light = only C(kv), ` +
    (st.guess_sees < cached ? `${st.guess_sees} of them.` : "here all of them (the text is shorter than the compression's budget)."));
}

const DRAFT = {ngram: ngramDraft, cacheback: cachebackDraft, card: cardDraft, fafo: fafoDraft};

// ---- one step
function show(s) {
  if (!STEPS.length) return;
  current = Math.max(0, Math.min(STEPS.length - 1, s));
  const st = STEPS[current];
  $("step-number").textContent = `step ${current + 1}`;
  $("slider").value = current + 1;
  try { history.replaceState(null, "", "#step=" + (current + 1)); } catch (e) { /* a browser that refuses it for file:// */ }
  for (const id of ["draft", "mask", "extra", "summary", "text"]) $(id).replaceChildren();
  el("span", {class: "muted"}, $("text"), RUN.pieces.slice(0, st.n_before).join(""));
  for (let i = st.n_before; i < st.n_before + st.emitted; i++)
    el("span", {class: "t-" + RUN.came_from[i]}, $("text"), RUN.pieces[i]);
  $("text").scrollTop = $("text").scrollHeight;  // the step's tokens are at the end
  const accepted = st.path.length - 1;
  const kept = st.kv_after - (st.kv_before - st.inputs);  // the cache's growth over the step
  const dropped = st.emitted < accepted + 1 ? ` (the run stopped inside it: ${st.emitted} emitted)` : "";
  el("p", {}, $("summary"),
    `Drafted ${st.tokens.length - 1} token(s); accepted ${accepted} + the bonus token ${JSON.stringify(piece(st.bonus))}${dropped}. ` +
    `KV cache: ${st.kv_before} positions after the verification forward, ${st.kv_after} after the rollback ` +
    `(${kept} of this step's inputs kept: the pending token and the accepted drafts).`);
  DRAFT[RUN.method](st);
  if (RUN.method !== "fafo") treeMask(st);
  document.querySelectorAll("#strip span.here").forEach(x => x.classList.remove("here"));
  const here = document.querySelectorAll(`#strip span[data-step="${current}"]`);
  here.forEach(x => x.classList.add("here"));
  if (here.length) {  // scroll the strip (only the strip, not the page) to the step's tokens
    const box = $("strip");
    const top = here[0].offsetTop - box.offsetTop;
    if (top < box.scrollTop || top > box.scrollTop + box.clientHeight - 30) box.scrollTop = top - 30;
  }
  const bar = $("bar-here");
  if (bar) bar.setAttribute("x", current * Number(bar.getAttribute("width")));
}

header();
strip();
$("step-count").textContent = STEPS.length;
$("slider").max = STEPS.length;
$("first").onclick = () => show(0);
$("prev").onclick = () => show(current - 1);
$("next").onclick = () => show(current + 1);
$("last").onclick = () => show(STEPS.length - 1);
$("slider").oninput = e => show(Number(e.target.value) - 1);
document.addEventListener("keydown", e => {
  if (e.target.tagName === "INPUT") return;
  if (e.key === "ArrowRight") show(current + 1);
  else if (e.key === "ArrowLeft") show(current - 1);
  else if (e.key === "Home") show(0);
  else if (e.key === "End") show(STEPS.length - 1);
  else return;
  e.preventDefault();
});
function fromAddress() {  // #step=N opens step N
  const asked = /step=(\d+)/.exec(location.hash);
  if (asked && Number(asked[1]) - 1 !== current) show(Number(asked[1]) - 1);
}
window.addEventListener("hashchange", fromAddress);
if (STEPS.length) {
  show(0);
  fromAddress();
} else {
  $("summary").textContent = "The run ended at the prefill's token: there was no verification step.";
}
</script></body></html>
"""

if __name__ == "__main__":
    sys.exit(main())
