# SPDX-License-Identifier: MIT
"""card.py: cache construction (Eq. 1-9) on a hand-made draft distribution, the §2.3 mask against a
hand-written one, hit and miss correction (§2.4) against fresh recomputation, losslessness against the
target's HF greedy decoding in both modes, the offline drafts, the draft process (same tokens as lockstep, no
hang, no orphan) and the cost model."""

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch
import transformers

import card
import verify
from conftest import CARD_REAL, REAL_PROMPTS, ROOT, encode, make_tiny_llama, running

# ---------------------------------------------------------------------------------------------- the cache


def toy_cache():
    """The worked example of card.py §1: K = 2, k = 2."""
    c = card.CandidateCache(K=2, k=2)
    c.reset(10)  # root "The"
    root = c.nodes[c.root]
    root.slot, root.cands = 0, [(11, 0.6), (12, 0.3)]  # " cat" .6, " dog" .3
    layer1 = c.grow()
    cat, dog = layer1
    c.nodes[cat].slot, c.nodes[cat].cands = 1, [(13, 0.5), (14, 0.4)]  # " sat" .5, " ran" .4
    c.nodes[dog].slot, c.nodes[dog].cands = 2, [(14, 0.9), (13, 0.05)]  # " ran" .9, " sat" .05
    return c, cat, dog


def test_cache_construction_scores_topk_and_parents():
    c, cat, dog = toy_cache()
    assert [(c.nodes[i].token, c.nodes[i].sigma) for i in (cat, dog)] == [(11, 0.6), (12, 0.3)]
    # B^(1): every fed node's top-k children, w = p * sigma(parent)                         (Eq. 3, 5)
    b = sorted(c.secondary(1), key=lambda e: -e[1])
    assert [(t, round(w, 3), p) for t, w, p in b] == [(13, 0.3, cat), (14, 0.27, dog), (14, 0.24, cat), (13, 0.015, dog)]
    layer2 = c.grow()  # the global top-K = 2                                                   (Eq. 6-9)
    got = [(c.nodes[i].token, round(c.nodes[i].sigma, 3), c.nodes[i].parent) for i in layer2]
    assert got == [(13, 0.3, cat), (14, 0.27, dog)]
    assert c.depth == 2 and c.frontier() == layer2
    # QUERY: the best path of up to r tokens = the best sigma at depth min(r, depth), traced back
    assert [c.nodes[i].token for i in c.query(5)] == [11, 13]
    assert [c.nodes[i].token for i in c.query(1)] == [11]


def test_draft_mask_matches_the_hand_written_one():
    # card.py §2's example: prefix P P P, root at slot 3, layer 1 {cat, dog} at slots 4, 5; layer 2 fed next
    c, cat, dog = toy_cache()
    c.nodes[c.root].slot, c.nodes[cat].slot, c.nodes[dog].slot = 3, 4, 5
    front = c.grow()  # " sat" under cat, " ran" under dog
    want = np.array([
        # P  P  P  r  a  b | c  d
        [1, 1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1, 0, 1],
    ], dtype=bool)
    assert (card.draft_mask(c, front, dp=3, cache_len=6) == want).all()


# ---------------------------------------------------------------------------------------------- correction


def kv(cache, upto):
    return torch.cat([layer.keys[:, :, :upto] for layer in cache.layers])


def fresh_kv(model, ids):
    c = verify.new_cache(model)
    verify.prefill(model, c, ids)
    return kv(c, len(ids))


def grown_drafter(model, text, layers):
    d = card.Drafter(model, K=4, k=3)
    d.start(text)
    for _ in range(layers):
        d.step()
    return d


def test_hit_keeps_the_continuing_subtree_and_its_kv():
    model = make_tiny_llama(0)
    text = [1, 5, 6, 7, 8]
    d = grown_drafter(model, text, 4)
    tree = d.candidates
    a1 = tree.layers[1][0]  # accept the first layer-1 node, bonus = one of its children
    x = next(iter(tree.nodes[a1].children.values()))
    a1_tok, x_tok = tree.nodes[a1].token, tree.nodes[x].token
    below = {tree.nodes[i].token for i in tree.nodes[x].children.values()}
    assert d.correct([a1_tok], x_tok) is True
    assert d.text == text + [a1_tok, x_tok]
    assert d.candidates.root == x and d.candidates.nodes[x].depth == 0 and d.candidates.nodes[x].sigma == 1.0
    assert {d.candidates.nodes[i].token for i in d.candidates.nodes[x].children.values()} >= below
    # the verified prefix of the draft cache is exactly what a fresh prefill computes
    assert d.dp == len(d.text) - 1
    torch.testing.assert_close(kv(d.kv_cache, d.dp), fresh_kv(model, d.text[:-1]), atol=1e-5, rtol=1e-4)
    # x was fed inside the tree (tree mask, position by depth); a drafter started from scratch on the same
    # text feeds it as a plain causal root: both must see the same next-token distribution
    fresh = grown_drafter(model, d.text, 1)
    mine, theirs = d.candidates.nodes[x].cands, fresh.candidates.nodes[fresh.candidates.root].cands
    assert [t for t, _ in mine] == [t for t, _ in theirs]
    assert [p for _, p in mine] == pytest.approx([p for _, p in theirs], abs=1e-5)


def test_miss_restarts_from_the_targets_token():
    model = make_tiny_llama(0)
    text = [1, 5, 6, 7, 8]
    d = grown_drafter(model, text, 3)
    a1 = d.candidates.layers[1][0]
    a1_tok = d.candidates.nodes[a1].token
    absent = next(t for t in range(3, 96) if t not in d.candidates.nodes[a1].children)
    assert d.correct([a1_tok], absent) is False
    assert d.candidates.depth == 0 and d.candidates.nodes[d.candidates.root].token == absent and d.candidates.nodes[d.candidates.root].slot is None
    assert d.dp == verify.cache_len(d.kv_cache) == len(text) + 1  # the old root and the accepted node are kept
    torch.testing.assert_close(kv(d.kv_cache, d.dp), fresh_kv(model, d.text[:-1]), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("mode", ["lockstep", "parallel"])
def test_lossless_on_a_tiny_pair_including_a_bad_draft(mode):
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6 + [11, 12]
    want = verify.hf_generate(target, prompt, 60, [95])
    # (draft, correct): a good draft (the target in bfloat16) and a bad one (other weights), with the cache
    # corrected (§2.4) or not (Table 2's ablation). Parallel mode: two of the four (each is a process start).
    good, bad = make_tiny_llama(0).to(torch.bfloat16), make_tiny_llama(1)
    pairs = [(good, True), (good, False), (bad, True), (bad, False)]
    for draft, correct in pairs if mode == "lockstep" else pairs[1:3]:
        cfg = card.CardConfig(K=6, k=3, ratio=4, mode=mode, correct=correct)
        assert card.generate(target, prompt, 60, [95], cfg, draft_model=draft).tokens == want, (correct, draft.dtype)


@pytest.mark.parametrize("prompt,mode", [(p, ("lockstep", "parallel")[i % 2]) for i, p in enumerate(REAL_PROMPTS)])
def test_lossless_on_real_prompts(real, oracle, draft_bf16, draft_process_bf16, prompt, mode):
    """Every prompt once, the two modes taking turns: the bf16 draft in this process, or in the shared draft
    process."""
    ids, eos = encode(real, prompt)
    draft = draft_bf16 if mode == "lockstep" else draft_process_bf16
    gen = card.generate(real[0], ids, 40, eos, card.CardConfig(ratio=4, mode=mode, **CARD_REAL), draft_model=draft)
    assert gen.tokens == oracle(ids, 40, eos)


def test_max_new_tokens_and_eos_boundaries():
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    for n in (1, 2, 5, 13):
        gen = card.generate(target, prompt, n, [95], card.CardConfig(K=4, k=2, ratio=4, mode="lockstep"), draft_model=target)
        assert gen.tokens == verify.hf_generate(target, prompt, n, [95])
    full = verify.hf_generate(target, prompt, 30, [95])
    eos = full[7]  # pretend the 8th token is EOS: generation must stop right there, inside an accepted chain
    gen = card.generate(target, prompt, 30, [eos], card.CardConfig(K=4, k=2, ratio=4, mode="lockstep"), draft_model=target)
    assert gen.tokens == verify.hf_generate(target, prompt, 30, [eos])


# ---------------------------------------------------------------------------------------------- the drafts


def test_int8_draft_is_close_to_the_target_and_card_with_it_is_lossless():
    target = make_tiny_llama(0)
    draft = card.int8_draft(target)
    assert type(draft.model.layers[0].mlp.up_proj).__name__ == "Linear" and draft.model.layers[0].mlp.up_proj.weight().is_quantized
    ids = torch.randint(3, 96, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = target(input_ids=ids).logits.argmax(-1)
        agree = (draft(input_ids=ids).logits.argmax(-1) == want).float().mean()
        unrelated = (make_tiny_llama(1)(input_ids=ids).logits.argmax(-1) == want).float().mean()
    # Close, not equal: int8 rounds the weights and the activations, by how much depends on the CPU's int8
    # kernels. So the reference is measured here: a model with other weights agrees with the target only by
    # chance (about 1 position in 96), a working int8 copy on most positions whatever its kernels.
    assert agree > unrelated + 0.5, (float(agree), float(unrelated))
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    gen = card.generate(target, prompt, 30, [95], card.CardConfig(K=2, k=2, ratio=3, mode="lockstep"), draft_model=draft)
    assert gen.tokens == verify.hf_generate(target, prompt, 30, [95])


# ---------------------------------------------------------------------------------------------- parallel mode


def test_parallel_equals_lockstep_on_the_real_model(real, oracle, draft_int8):
    """The CPU default draft in its own process: the same tokens as lockstep and as the plain decoders,
    greedy and sampled, whatever the timing. And the int8 draft is often right."""
    model, tok = real
    # the CPU default where it was tuned: K = k = 1 (the cache is one chain, the draft's own greedy continuation)
    cfg = card.CardConfig(K=1, k=1, ratio=5, mode="parallel", wait=3, draft="int8", cost="free")
    lockstep = dataclasses.replace(cfg, mode="lockstep")
    r, int8_accepted, self_accepted = cfg.ratio, 0, 0
    with card.DraftProcess(draft_int8, cfg) as proc:
        for prompt in REAL_PROMPTS[:1]:  # (more prompts in parallel mode: test_lossless_on_real_prompts)
            ids, eos = encode(real, prompt)
            lock = card.generate(model, ids, 32, eos, lockstep, draft_model=draft_int8)
            par = card.generate(model, ids, 32, eos, cfg, draft_model=proc)
            assert par.tokens == lock.tokens == oracle(ids, 32, eos)
            int8_accepted += sum(lock.accepted)
            # An exact reference: the float32 target as its own draft makes that chain the target's own, so
            # every step accepts all r tokens (the last one what max_new_tokens leaves). A cache that lost
            # its KV or a correction that kept the wrong nodes would accept less.
            own = card.generate(model, ids, 32, eos, lockstep, draft_model=model)
            assert own.tokens == lock.tokens and own.accepted[:-1] == [r] * (len(own.accepted) - 1)
            self_accepted += sum(own.accepted)
        s = verify.Sampling(0.8, top_p=0.95, seed=1)
        lock = card.generate(model, ids, 24, eos, lockstep, draft_model=draft_int8, sampling=s)
        par = card.generate(model, ids, 24, eos, dataclasses.replace(cfg, wait=0), draft_model=proc, sampling=s)
        assert par.tokens == lock.tokens == verify.vanilla_generate(model, ids, 24, eos, s).tokens
    assert draft_processes() == []
    # How often the int8 draft is right depends on the CPU: torch picks its int8 kernels by instruction set
    # (on AVX2 they saturate 16-bit sums), so the bound is stated against the self-draft on the same prompts.
    # Every int8 engine we measured kept well over half of its accepted tokens (RESULTS.md, "The test
    # suite"); a broken draft (wrong weights, a stale cache, a dead process) keeps next to none.
    assert int8_accepted >= self_accepted / 3, (int8_accepted, self_accepted)


def draft_processes():
    """The draft processes this test started (not the session's shared one, conftest.draft_process_bf16)."""
    return [p for p in multiprocessing.active_children() if p.name == "card-draft" and p.pid not in SHARED]


SHARED: set[int] = set()


@pytest.fixture(autouse=True)
def _shared_draft_processes():
    """Whatever draft processes run when a test starts belong to the session's fixtures."""
    SHARED.clear()
    SHARED.update(p.pid for p in multiprocessing.active_children() if p.name == "card-draft")


class ExplodingDraft(transformers.LlamaForCausalLM):
    """A draft whose forward fails, inside the draft process. (At module level: its class travels by pickle.)"""

    def forward(self, **kw):
        raise ValueError("draft exploded")


def test_no_draft_process_is_left_after_a_return_an_error_or_ctrl_c():
    target = make_tiny_llama(0)
    threads = torch.get_num_threads()
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    cfg = card.CardConfig(K=4, k=2, ratio=4, mode="parallel")
    card.generate(target, prompt, 20, [95], cfg, draft_model=target)  # a model: generate() owns its process
    assert draft_processes() == []

    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        def on_emit(tokens, flags, exc=exc):
            raise exc
        with pytest.raises(type(exc)):
            card.generate(target, prompt, 20, [95], cfg, draft_model=target, on_emit=on_emit)
        assert draft_processes() == []

    with pytest.raises(card.DraftProcessError, match="failed: ValueError: draft exploded"):
        card.generate(target, prompt, 20, [95], cfg, draft_model=ExplodingDraft(target.config))
    assert draft_processes() == []
    assert torch.get_num_threads() == threads  # the cores the draft process had are given back

    # a DraftProcess the caller passes is the caller's: it survives an error and serves the next call
    with card.DraftProcess(target, cfg) as proc:
        with pytest.raises(RuntimeError):
            card.generate(target, prompt, 20, [95], cfg, draft_model=proc, on_emit=lambda *a: (_ for _ in ()).throw(RuntimeError()))
        gen = card.generate(target, prompt, 20, [95], cfg, draft_model=proc)
        assert gen.tokens == verify.hf_generate(target, prompt, 20, [95])
    assert draft_processes() == []


def test_a_draft_with_hooks_crosses_to_its_process_as_parts():
    """A module pickles its hooks, and hooks are often local functions (transformers installs its own when
    hidden states are asked for): the draft crosses as class + config + tensors instead, sharing memory."""
    target, draft = make_tiny_llama(0), make_tiny_llama(0)
    calls = []
    draft.register_forward_hook(lambda *a: calls.append(1))  # a lambda: cannot be pickled
    draft(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    cls, config, tensors, buffers, _ = card.portable(draft)
    rebuilt = card.assemble(cls, config, tensors, buffers, draft.generation_config)
    assert rebuilt.lm_head.weight.data_ptr() == draft.lm_head.weight.data_ptr()  # the same tensors, no copy
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    cfg = card.CardConfig(K=2, k=2, ratio=3, mode="parallel")
    gen = card.generate(target, prompt, 20, [95], cfg, draft_model=draft)
    assert gen.tokens == verify.hf_generate(target, prompt, 20, [95])


def test_a_draft_process_not_waited_for_lets_the_first_steps_go_undrafted():
    """DraftProcess(block=False), as custom_generate starts one: the process is spawned only after the prompt's
    first token (beside the prefill it would take a core from it), generate() begins at once, its steps verify
    no draft while the process starts (corrections queue up for it), the tokens are HF greedy's, and once the
    process is up the next call drafts."""
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    cfg = card.CardConfig(K=4, k=2, ratio=3, mode="parallel")
    want = verify.hf_generate(target, prompt, 30, [95])
    with card.DraftProcess(target, cfg, block=False) as proc:
        assert proc.process.pid is None and proc.alive()  # not spawned yet, and not dead
        spawned = []  # at each emission: whether the process was spawned by then
        gen = card.generate(target, prompt, 30, [95], cfg, draft_model=proc,
                            on_emit=lambda *a: spawned.append(proc.process.pid is not None))
        assert spawned[0] is False and spawned[-1] is True  # the first token came before the spawn
        assert not proc.ready  # (a process start takes a second or more; these 30 tokens far less)
        assert gen.tokens == want and gen.drafted[0] == 0
        deadline = time.time() + 60
        while not proc.started() and time.time() < deadline:
            time.sleep(0.05)
        gen = card.generate(target, prompt, 30, [95], cfg, draft_model=proc)
        assert gen.tokens == want and sum(gen.accepted) > 0


def test_a_draft_process_never_spawned_closes_cleanly():
    cfg = card.CardConfig(K=4, k=2, ratio=3, mode="parallel")
    proc = card.DraftProcess(make_tiny_llama(0), cfg, block=False)
    proc.close()
    assert proc.process.pid is None and proc.conn.closed


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_kept_draft_process_stops_drafting_when_generate_returns():
    """Between two prompts the draft process must not take cores from whatever the caller runs next. The
    reference is the same process drafting freely (started, never told it is done) for as long: how many CPU
    ticks that takes depends on the machine and its load, an idle process takes next to none on any."""
    def cpu_ticks(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    def ticks_over(pid, seconds=1.0):
        before = cpu_ticks(pid)
        time.sleep(seconds)
        return cpu_ticks(pid) - before

    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    cfg = card.CardConfig(K=4, k=2, ratio=4, mode="parallel", max_lead=10**6)  # would draft forever
    with card.DraftProcess(target, cfg) as proc:
        card.generate(target, prompt, 20, [95], cfg, draft_model=proc)
        time.sleep(0.5)  # a layer already in flight when generate() returned may finish
        idle = ticks_over(proc.process.pid)
        proc.start(prompt, 256, cfg.max_lead)  # the reference: drafting, nobody says done
        busy = ticks_over(proc.process.pid)
        proc.done()
    assert idle * 4 < busy, (idle, busy)


def test_a_dead_draft_process_is_a_one_line_error_not_a_hang():
    target = make_tiny_llama(0)
    prompt = [1] + [5, 6, 7, 8, 9] * 6
    cfg = card.CardConfig(K=4, k=2, ratio=4, mode="parallel")
    proc = card.DraftProcess(target, cfg)

    def kill_it(gen, tree, path, bonus):
        os.kill(proc.process.pid, signal.SIGKILL)

    t0 = time.time()
    with pytest.raises(card.DraftProcessError, match=r"^the draft process died \(exit code -9\)$"):
        card.generate(target, prompt, 40, [95], cfg, draft_model=proc, on_step=kill_it)
    assert time.time() - t0 < 30
    assert draft_processes() == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_draft_process_exits_when_its_parent_dies(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]\n"
        "import card\n"
        "from conftest import make_tiny_llama\n"
        "if __name__ == '__main__':\n"
        "    proc = card.DraftProcess(make_tiny_llama(0), card.CardConfig(K=2, k=2, ratio=2))\n"
        "    print(proc.process.pid, flush=True)\n"
        "    os._exit(0)  # no clean-up at all, as if the parent were killed\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    pid = int(out.stdout.split()[-1])
    deadline = time.time() + 30
    while running(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not running(pid)


def test_refuses_a_draft_with_another_vocabulary(monkeypatch):
    target = make_tiny_llama(0)
    tok = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    other = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "c": 1})
    monkeypatch.setattr(verify, "load_model", lambda *a, **k: (target, other))
    cfg = card.CardConfig(draft="other-model")
    with pytest.raises(verify.UserError, match="do not share a vocabulary"):
        card.load_draft(target, tok, cfg, "target-model")


def test_ratio_auto_is_the_ceiling_of_the_step_time_ratio(monkeypatch):
    # §3.1: r = ceil(t_target / t_draft); here a 60 ms target step against a 25 ms draft layer -> 3
    times = {"target": 0.060, "draft": 0.025}
    monkeypatch.setattr(verify, "step_times", lambda model, largest=32, threads=None: {1: times[model], 8: times[model]})
    assert card.measure_ratio("target", "draft", K=4) == 3
    times["draft"] = 0.5  # a draft slower than the target still gets one layer per step
    assert card.measure_ratio("target", "draft", K=4) == 1


# ---- section 5b: the configuration chosen by its predicted speed --------------------------------------------

def test_cost_model_by_hand():
    costs = dict(t_target=0.040, t_verify=0.060, t_draft=0.012)
    # a hit consumes the 3.6 layers it emits, of a cache at most 8 layers ahead (no wait after a hit, d = 0)
    steps = dict(hit_len=3.6, max_lead=8)
    # lockstep: 4 draft layers then a 5-row verification: 4 * 12 + 60 = 108 ms for 3.6 tokens; greedy: 3.6 * 40
    assert card.predicted_speedup(costs, "lockstep", 4, 4, mat=3.6, hit_rate=0.5, **steps) == pytest.approx(144 / 108)
    # parallel, half hits: a hit costs max(60, 3.6 * 12) = 60 ms; a miss 60 + 4 * 12 = 108 ms -> mean 84 ms
    assert card.predicted_speedup(costs, "parallel", 4, 4, mat=3.6, hit_rate=0.5, **steps) == pytest.approx(144 / 84)
    # a draft too slow to keep up: a hit then costs the draft's 3.6 layers, not the verification
    slow = dict(costs, t_draft=0.030)
    assert card.predicted_speedup(slow, "parallel", 4, 0, mat=3.6, hit_rate=1.0, **steps) == pytest.approx(144 / 108)
    # ... and the layers a hit step consumes: 5 layers to replace -> 150 ms
    assert card.predicted_speedup(slow, "parallel", 4, 0, mat=3.6, hit_rate=1.0, hit_len=5,
                                  max_lead=8) == pytest.approx(144 / 150)
    # d: a fast draft stops max_lead = 6 layers ahead; a hit takes 5 of them and the query waits for 4,
    # so 3 more layers are drafted after each hit: max(60 + 3 * 12, 5 * 12) = 96 ms
    assert card.predicted_speedup(costs, "parallel", 4, 4, mat=3.6, hit_rate=1.0, hit_len=5,
                                  max_lead=6) == pytest.approx(144 / 96)
    # ... and none where the cache may lead by w + 5 = 9 layers
    assert card.predicted_speedup(costs, "parallel", 4, 4, mat=3.6, hit_rate=1.0, hit_len=5,
                                  max_lead=9) == pytest.approx(144 / 60)


def guesses(pattern: list[int], answers: int = 12) -> list[list[int]]:
    """A draft's agreement over `answers` calibration answers: per token, 1 where it guessed the target's."""
    return [list(pattern) * 4 for _ in range(answers)]


RIGHT_3_OF_4 = [1, 1, 1, 0]
RIGHT_7_OF_8 = [1] * 7 + [0]
RIGHT_15_OF_16 = [1] * 15 + [0]


def injected(draft_ms: float, pattern=RIGHT_3_OF_4, target_ms: float = 45.0) -> tuple:
    """measure_for_choice's result for a made-up 2-core machine: the target's plain step; its verification of
    n tokens, 3.6 ms a token more on both threads and 7.5 on the one that parallel leaves it; one int8 draft
    whose layer takes draft_ms on one thread, 15% less on two."""
    t_verify = {"all": {n: (target_ms + 3.6 * (n - 1)) / 1000 for n in range(1, 10)},
                "share": {n: (target_ms + 7.5 * (n - 1)) / 1000 for n in range(1, 10)}}
    draft = card.DraftMeasure(on_all=draft_ms * 0.85 / 1000, on_share=draft_ms / 1000, agreement=guesses(pattern))
    return target_ms / 1000, t_verify, draft


def chosen_on(monkeypatch, cfg, measured: tuple, can_split: bool):
    """choose_configuration on a made-up machine: what measure_for_choice would return, and whether a draft
    process can run there."""
    monkeypatch.setattr(card, "measure_for_choice", lambda *args: measured)
    monkeypatch.setattr(card, "parallel_possible", lambda model: can_split)
    return card.choose_configuration(None, None, cfg, "m")


@pytest.fixture
def fresh_warning_state(monkeypatch):
    monkeypatch.setattr(verify, "SAID_WILL_NOT_WIN", {})


LINEAR = {side: {n: 0.04 + 0.01 * n for n in range(1, 10)} for side in ("all", "share")}  # t_verify(n)
ALL_RIGHT = [[1] * 37] * 2  # every guess right: 1 + 4 * 9 tokens


def test_the_choice_by_hand_lockstep():
    """Lockstep, every guess right: r layers of 10 ms, then t_verify(r + 1) = 40 + 10·(r + 1) ms, for r + 1
    tokens (while the answer lasts) against plain steps of 50 ms. r = 8: 9 tokens for 80 + 130 ms, 2.14x; a
    smaller r pays the 50 ms fixed part of a verification more often (r = 1: 100 / 70 ms, 1.43x)."""
    cfg = dataclasses.replace(card.CardConfig.cpu(), mode="lockstep")
    draft = card.DraftMeasure(on_all=0.010, on_share=0.010, agreement=ALL_RIGHT)
    speedup, best = card.choose(cfg, 0.050, LINEAR, draft, can_split=False)
    assert (best.draft, best.mode, best.ratio) == ("int8", "lockstep", 8)
    assert speedup == pytest.approx(9 * 0.050 / (8 * 0.010 + 0.130))
    one, _ = card.choose(dataclasses.replace(cfg, ratio=1), 0.050, LINEAR, draft, can_split=False)
    assert one == pytest.approx(2 * 0.050 / (0.010 + 0.060))


def test_ratio_auto_with_the_mode_best_takes_the_papers_rule(fresh_warning_state, capsys, monkeypatch):
    """§3.1's rule: r = ceil(t_target / t_draft) = ceil(50 / 10) = 5, said on stderr; only the mode is chosen."""
    cfg = dataclasses.replace(card.CardConfig.cpu(), ratio="auto")
    draft = card.DraftMeasure(on_all=0.010, on_share=0.010, agreement=ALL_RIGHT)
    chosen = chosen_on(monkeypatch, cfg, (0.050, LINEAR, draft), can_split=False)
    assert (chosen.mode, chosen.ratio) == ("lockstep", 5)
    assert capsys.readouterr().err == "[card] --ratio auto: measured r = 5\n"
    # lockstep with r = 5, every guess right: 6 tokens for 5 draft layers and a 6-token verification
    assert card.choose(chosen, 0.050, LINEAR, draft, can_split=False)[0] == pytest.approx(6 * 0.050 / (5 * 0.010 + 0.100))


def test_the_draft_prefill_is_charged_once_a_call():
    """The draft prefills the prompt once a call: 0.5 s, against a typical call of 128 plain steps of 50 ms
    (6.4 s). Lockstep with r = 8 (the test above) runs 2.14x a step, a call 6.4 / 2.14 = 2.99 s; with the
    prefill 3.49 s, 1.84x. The same for every r, so the choice stays r = 8."""
    cfg = dataclasses.replace(card.CardConfig.cpu(), mode="lockstep")
    draft = card.DraftMeasure(on_all=0.010, on_share=0.010, agreement=ALL_RIGHT, prefill_all=0.5)
    speedup, best = card.choose(cfg, 0.050, LINEAR, draft, can_split=False)
    assert best.ratio == 8
    assert speedup == pytest.approx(6.4 / (6.4 / (9 * 0.050 / (8 * 0.010 + 0.130)) + 0.5))


def test_the_choice_by_hand_parallel():
    """Parallel, r = w = 3, every guess right: the draft's layer takes 15.9 ms on its one thread, so during a
    verification of 4 tokens (45 + 3·7.5 = 67.5 ms on the target's one thread) it drafts 4 layers and the
    chain is r = 3 long; every step a hit, 4 tokens. The cache stops max_lead = 6 layers ahead; a hit takes 4
    of them and the next query waits for 3: d = 1 layer more. t = max(67.5 + 15.9, 4·15.9) = 83.4 ms, against
    4 plain steps of 45 ms."""
    cfg = card.CardConfig(K=1, k=1, draft="int8", mode="parallel", ratio=3, wait=3)
    t_target, t_verify, draft = injected(15.9, [1])
    draft.agreement = [[1] * 17] * 3
    speedup, best = card.choose(cfg, t_target, t_verify, draft, can_split=True)
    assert speedup == pytest.approx(4 * 45 / 83.4)


def test_a_slow_draft_is_run_as_its_least_slow_configuration():
    """A draft step of 115 ms on one core (97.75 on two) beside a target step of 45 ms on two: nothing CARD can
    run here beats plain decoding. The least slow is lockstep with r = 1: with 3 of 4 guesses right, a chain
    of one token is accepted 3 times in 4 and a step emits 1.875 tokens (walk_chains), for one draft layer and
    a 2-token verification, 97.75 + 48.6 ms: 1.875·45 / 146.35 = 0.58x."""
    speedup, cfg = card.choose(card.CardConfig.cpu(), *injected(115.0), can_split=True)
    assert speedup == pytest.approx(0.58, abs=0.005)
    assert (cfg.draft, cfg.mode, cfg.ratio) == ("int8", "lockstep", 1)


@pytest.mark.parametrize("speedup,said", [(0.58, True), (0.999, True), (1.0, False), (1.4, False)])
def test_the_one_line_says_the_chosen_configurations_speed_below_one_and_only_then(fresh_warning_state, capsys,
                                                                                 monkeypatch, speedup, said):
    """The configuration chosen at set-up is timed against plain decoding (verify.speed_over_plain, here
    given); below 1, one line on stderr names that speed, the configuration and what would help, once a
    process; CARD still runs."""
    monkeypatch.setattr(verify, "speed_over_plain", lambda *a: speedup)
    cfg = card.CardConfig(K=1, k=1, draft="int8", mode="lockstep", ratio=1)
    for _ in range(2):
        card.say_if_slower(None, None, cfg, None, None)
    err = capsys.readouterr().err
    expected = (f"[card] on this machine CARD runs at {speedup:.2f}x plain decoding (int8 draft, lockstep, r = 1: "
                "the fastest its step times predict, measured once): its draft's steps cost too much of the "
                "target's here; another core, a smaller draft or a GPU would help; it runs anyway\n")
    assert err == (expected if said else "")


def test_the_one_line_obeys_the_warnings_filters(fresh_warning_state, capsys, monkeypatch):
    import warnings

    monkeypatch.setattr(verify, "speed_over_plain", lambda *a: 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as python -W ignore does
        card.say_if_slower(None, None, card.CardConfig(K=1, k=1, draft="int8", mode="lockstep", ratio=1), None, None)
    assert capsys.readouterr().err == ""


def test_a_fast_draft_chooses_parallel_and_says_nothing(fresh_warning_state, capsys, monkeypatch):
    """A draft that agrees often and whose three layers take about one verification: drafting while the target
    verifies hides them, and the parallel mode is predicted fastest."""
    cfg = chosen_on(monkeypatch, card.CardConfig.cpu(), injected(15.9, RIGHT_15_OF_16), can_split=True)
    assert (cfg.draft, cfg.mode) == ("int8", "parallel")
    assert capsys.readouterr().err == ""
    # where no draft process can run beside the target (one core, an unguarded script): lockstep
    single = chosen_on(monkeypatch, card.CardConfig.cpu(), injected(11.0, RIGHT_7_OF_8), can_split=False)
    assert single.mode == "lockstep"


@pytest.mark.parametrize("cfg", [card.CardConfig(draft="int8", mode="lockstep", ratio=4, K=1, k=1),
                                 card.CardConfig.paper(), card.CardConfig.gpu()], ids=["explicit", "paper", "gpu"])
def test_an_explicit_configuration_is_left_alone(fresh_warning_state, capsys, cfg):
    """Nothing 'best' in it: returned as it is, nothing measured (no model given to measure), nothing said."""
    assert card.choose_configuration(None, None, cfg, "m") is cfg
    assert capsys.readouterr().err == ""


def test_explicit_fields_are_kept_and_only_best_ones_chosen(fresh_warning_state, monkeypatch):
    cfg = dataclasses.replace(card.CardConfig.cpu(), mode="lockstep")  # --mode lockstep, the rest best
    chosen = chosen_on(monkeypatch, cfg, injected(11.0, RIGHT_7_OF_8), can_split=True)
    # a wrong guess every 8th token: chains of 7 (the longest that one wrong guess ends) emit the most a step
    assert (chosen.mode, chosen.draft, chosen.ratio) == ("lockstep", "int8", 7)
    fixed_r = dataclasses.replace(card.CardConfig.cpu(), ratio=12)  # beyond the measured sizes: extrapolated
    assert chosen_on(monkeypatch, fixed_r, injected(11.0, RIGHT_7_OF_8), can_split=True).ratio == 12


def test_walked_chains_by_hand():
    """walk_chains against steps worked by hand: where each chain starts, how much it accepts, hit or miss. Each
    answer's first token is the target's (its prefill), never drafted: the walk starts after it."""
    # q = 3: [1 1 1 1] at 1: 3 accepted + the bonus, guessed too (a hit) -> 4 tokens; at 5: [0] -> 1 token
    assert card.walk_chains([[1, 1, 1, 1, 1, 0]], 3, 3) == (2.5, 0.5)
    # a miss shortens the next chain: q_miss = 1 at 1 accepts 1, the guess after it wrong (a miss); at 3 a chain
    # of 1 accepts 1, the guess after it right (a hit); at 5 a chain of 4 accepts the last 2: 2, 2, 2 tokens
    assert card.walk_chains([[1, 1, 0, 1, 1, 1, 1]], 4, 1) == (2.0, 1 / 3)
    # every guess wrong: one token a step, never a hit; every guess right: q + 1 a step, every step a hit
    assert card.walk_chains([[1] + [0] * 6], 3, 3) == (1.0, 0.0)
    assert card.walk_chains([[1] * 13], 3, 3) == (4.0, 1.0)


def test_walked_chains_start_after_a_miss_where_the_average_does_not():
    """The mean over every start position gives each position inside a long run of right guesses a chain of
    its own; CARD's walk crosses such a run in one step per q + 1 tokens, and spends a step on each token of a
    cluster of wrong guesses, where the next chain starts. Clustered guesses: the walk is well below the
    average; wrong guesses spread evenly: the two agree to within a token."""
    clustered = [[1] + [1] * 10 + [0, 0, 0] + [1] * 10 + [0, 0, 0]] * 4

    def averaged(agreement, q):  # the mean over every start position, the estimate the walk replaced
        accepted = []
        for answer in agreement:
            for i in range(1, len(answer)):
                a = 0
                while a < q and i + a < len(answer) and answer[i + a]:
                    a += 1
                accepted.append(a)
        return 1 + sum(accepted) / len(accepted)

    assert card.walk_chains(clustered, 4, 4)[0] < averaged(clustered, 4) - 0.5  # 2.6 against 3.62
    spread = [[1] + [1, 1, 1, 1, 1, 1, 1, 0] * 4] * 4
    assert abs(card.walk_chains(spread, 4, 4)[0] - averaged(spread, 4)) < 1.0  # 4.0 against 3.75


def test_the_choice_is_measured_on_the_real_model_once_per_machine(real, monkeypatch, tmp_path):
    """measure_for_choice on the default model: positive step times, agreements of 0s and 1s (the int8 draft
    right more often than not), kept on disk: a second call measures nothing."""
    monkeypatch.setenv("SPECDEC_COSTS", str(tmp_path / "costs.json"))
    model, tok = real
    cfg = dataclasses.replace(card.CardConfig.cpu(), draft="int8")
    t_target, t_verify, draft = card.measure_for_choice(model, tok, cfg, verify.DEFAULT_MODEL)
    assert t_target == t_verify["all"][1] and all(t > 0 for side in t_verify.values() for t in side.values())
    assert draft.on_all > 0 and draft.on_share > 0

    def share(d):
        assert len(d.agreement) == len(verify.CALIBRATION)
        assert all(1 <= len(answer) <= verify.CALIBRATION_TOKENS for answer in d.agreement)  # EOS may end one
        flat = [x for answer in d.agreement for x in answer]
        assert set(flat) <= {0, 1}
        return sum(flat) / len(flat)

    assert 0.5 < share(draft) <= 1.0
    monkeypatch.setattr(verify, "measure_step_times", lambda *a, **k: pytest.fail("measured twice"))
    assert card.measure_for_choice(model, tok, cfg, verify.DEFAULT_MODEL)[2] == draft
