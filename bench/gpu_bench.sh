#!/usr/bin/env bash
# The one-command GPU run (README "On one GPU"): every method against its HF peers in float32 (the default
# dtype, TF32 off), on the reporting half of the short prompts, on the long prompts, and FAFO's step time
# per attention back-end; rows (.jsonl) and tables (.md, whose header names the GPU) land in
# bench/results/gpu-<gpu name>/.
#
#   make gpu-bench                       # all parts, one after the other
#   bash bench/gpu_bench.sh report card  # only some parts (each stays under 10 minutes on an H100)
#
# Parts:
#   report  ngram, cacheback, fafo, lookahead, vanilla against hf-greedy, hf-pld and hf-assisted (CARD's draft):
#           reporting half, 128 tokens
#   card    CARD parallel and lockstep against hf-greedy: reporting half, 128 tokens
#   long    the long prompts' reporting half (1k-7k tokens), FAFO and Lookahead on dense and split, 128 tokens
#   steps   one FAFO and one Lookahead step at 1k, 2k, 4k and 7k tokens on dense, split and flex-compiled
#   tier    the CUDA test tier (pytest -m cuda), its output in tier.txt
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
gpu=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")')
if [ -z "$gpu" ]; then
  echo "error: gpu_bench: torch sees no CUDA GPU (this run is for a GPU machine; bench/side_by_side.py runs on a CPU)" >&2
  exit 2
fi
slug=$(printf '%s' "$gpu" | tr 'A-Z' 'a-z' | sed -e 's/^nvidia //' -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//')
out=bench/results/gpu-$slug
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(report card long steps)
"$py" tools/convert_gguf.py  # the default model's one-time set-up (prints "(up to date)" when done)
# the methods, from tools/methods.py (CARD has a part of its own: its draft process)
ours=$("$py" -m tools.methods --without card)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "gpu_bench: $gpu, commit $commit, parts: ${parts[*]} -> $out"
for part in "${parts[@]}"; do
  start=$SECONDS
  case "$part" in
    report)
      "$py" bench/side_by_side.py --split report --max-new-tokens 128 --dtype float32 \
        --methods "hf-greedy,hf-pld,hf-assisted,vanilla,$ours,lookahead" --out "$out/report.jsonl" ;;
    card)
      "$py" bench/side_by_side.py --split report --max-new-tokens 128 --dtype float32 \
        --methods hf-greedy,card,card-lockstep --out "$out/card.jsonl" ;;
    long)
      # FAFO and Lookahead on two attention back-ends each; the other methods as they come
      "$py" bench/side_by_side.py --prompts prompts/long_prompts.jsonl --split report --max-new-tokens 128 --dtype float32 \
        --methods "hf-greedy,vanilla,$("$py" -m tools.methods --without card,fafo),fafo@attn=dense,lookahead@attn=dense,fafo@attn=split,lookahead@attn=split" \
        --out "$out/long.jsonl" ;;
    steps)
      "$py" bench/side_by_side.py --fafo-steps 1024,2048,4096,7168 --fafo-backends dense,split,flex-compiled --dtype float32 \
        --out "$out/steps.jsonl" ;;
    tier)
      "$py" -m pytest -q -m cuda tests 2>&1 | tee "$out/tier.txt" ;;
    *)
      echo "error: gpu_bench: unknown part '$part' (report, card, long, steps, tier)" >&2
      exit 2 ;;
  esac
  echo "gpu_bench: $part took $(( SECONDS - start )) s"
done
