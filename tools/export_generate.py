# SPDX-License-Identifier: MIT
"""Export one method as a folder that transformers' model.generate loads by name (its "custom generation
method" layout), to publish it on the Hub or keep it beside a project:

    python tools/export_generate.py cacheback OUT/

    model.generate(input_ids, custom_generate="OUT", trust_remote_code=True, max_new_tokens=128)

What it writes (transformers' load_custom_generate reads custom_generate/generate.py and checks
custom_generate/requirements.txt; the Hub lists a repository whose README carries the custom_generate tag):

    OUT/README.md                          front matter (library_name, license, tags: custom_generate), usage
    OUT/LICENSE                            the repository's licence (MIT), which the copied files carry
    OUT/custom_generate/generate.py        generate(model, **arguments): every argument model.generate got
    OUT/custom_generate/cacheback.py       the method file, and verify.py, as in this repository, but for
    OUT/custom_generate/verify.py          their `import verify` lines, made relative (see below)
    OUT/custom_generate/requirements.txt   torch, transformers, numpy

Why the import lines change: transformers copies generate.py and the files it imports relatively into its
module cache and imports them there as one package, so the method file's `import verify` (a script's
import) must read `from . import verify`. Nothing else in the two files differs; the test checks it.
"""

import argparse
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository's root on the path, as `python -m` has it
    sys.path.insert(0, ROOT)

import verify  # noqa: E402  (REFUSED: what a call refuses, the README's list)
from tools.methods import METHODS  # noqa: E402  (name -> the method's file, config class, title)

# a script's imports of the shared module, and what they become inside the exported package
IMPORT_REWRITES = [
    (re.compile(r"^import verify$", re.MULTILINE), "from . import verify"),
    (re.compile(r"^from verify import ", re.MULTILINE), "from .verify import "),
]
# one comparator per line: transformers' check_python_requirements reads no more
REQUIRED = ("torch", "transformers", "numpy")

GENERATE_PY = '''# SPDX-License-Identifier: MIT
"""{title} for model.generate: the custom generation method that tools/export_generate.py
exported from a reference implementation of training-free speculative decoding. {module}.py and verify.py
beside this file are the reference's own files (their `import verify` lines made relative: transformers
imports this folder as a package).

    model.generate(input_ids, custom_generate="THIS_FOLDER", trust_remote_code=True, max_new_tokens=128)
"""

import copy

from transformers import StoppingCriteriaList, StopStringCriteria

from .{module} import custom_generate as method_custom_generate
from .verify import UserError


def generate(model, **arguments):
    """transformers calls this with every argument model.generate was given (`model` for self) and
    prepares nothing. So the call goes back to model.generate with the method as a callable:
    transformers then prepares the GenerationConfig, the logits processors, the stopping criteria and
    the streamer exactly as it does for plain decoding, and verify.py's GenerateCall reads them.

    Two arguments a callable never receives are settled here first: `tokenizer`, which turns
    `stop_strings` into a StopStringCriteria, and `assistant_model`, transformers' own speculative
    decoding (refused: one or the other)."""
    tokenizer = arguments.pop("tokenizer", None)
    stop_strings = arguments.pop("stop_strings", None)
    config = arguments.get("generation_config") or model.generation_config
    if config.stop_strings is not None:  # configured rather than given: taken over the same way
        stop_strings = stop_strings or config.stop_strings
        config = copy.deepcopy(config)
        config.stop_strings = None
        arguments["generation_config"] = config
    if stop_strings:
        if tokenizer is None:
            raise UserError("stop_strings needs tokenizer=... (as model.generate does)")
        criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        arguments["stopping_criteria"] = criteria
    if arguments.get("assistant_model") is not None:
        raise UserError("assistant_model is transformers' own speculative decoding: use one or the other")
    return model.generate(custom_generate=method_custom_generate, **arguments)
'''

README_MD = """---
library_name: transformers
license: mit
tags:
- custom_generate
---

# {title}

{summary}

Exported by `tools/export_generate.py {method}` from a minimal, commented reference implementation of
training-free speculative decoding: `custom_generate/{module}.py` is the method, read top to bottom beside
its paper; `custom_generate/verify.py` is the shared spine (tree attention, acceptance, KV rollback).

## Base model

None in particular: any decoder-only transformers model whose KV cache holds one key and value per
position (Llama, Qwen2/3, Mistral without a sliding window, Phi-3, Gemma, GPT-NeoX, GPT-2, ...). It was
tested on SmolLM2-135M-Instruct and on small random models of those families.

## Model compatibility

- Greedy output is token-identical to `model.generate(do_sample=False)` in float32. In bfloat16 or float16
  a many-token verification forward rounds differently from a one-token one, so near-ties can part.
- Sampled (`do_sample=True` with `temperature`, `top_k`, `top_p`), the output follows the same
  distribution as transformers' sampler but is a different random stream: the sampling noise is keyed by
  (seed, position), so a verified draft token is the one the plain sampler would have drawn.
- Refused, each with one line that names the cause (what would break losslessness):
{refused}

## Additional arguments

Passed to `model.generate` beside the usual ones, all optional:

{arguments}

## Output type changes

None: a LongTensor of prompt and new tokens, or with `return_dict_in_generate=True` a
`GenerateDecoderOnlyOutput` whose `sequences` is set (its `past_key_values` is None: the method's own,
rolled-back cache is not returned).

## Example usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

tok = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
text = tok.apply_chat_template([{{"role": "user", "content": "Explain a hash map."}}],
                              add_generation_prompt=True, tokenize=False)
ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
out = model.generate(ids, custom_generate="THIS_FOLDER_OR_REPO", trust_remote_code=True, max_new_tokens=128,
                     streamer=TextStreamer(tok, skip_prompt=True), stop_strings=["\\n\\n"], tokenizer=tok)
```

## License

MIT (`LICENSE`), as the reference it was exported from.
"""


def rewrite_imports(source: str, name: str) -> str:
    """The file with its `import verify` / `from verify import` lines relative; exactly one of each."""
    for pattern, replacement in IMPORT_REWRITES:
        source, count = pattern.subn(replacement, source)
        if count != 1:
            raise SystemExit(f"error: {name}: expected one line matching {pattern.pattern!r}, found {count}")
    return source


def requirements() -> str:
    """torch, transformers and numpy with the lower bounds of this repository's requirements.txt."""
    lines = ["# checked by transformers before it loads generate.py (one comparator per line)"]
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
        specs = [line.split("#")[0].strip() for line in f]
    for name in REQUIRED:
        spec = next(s for s in specs if re.match(rf"{name}\b", s))
        lines.append(spec.split(",")[0])  # "transformers>=4.57,<6" -> "transformers>=4.57"
    return "\n".join(lines) + "\n"


def export(method: str, out: str) -> list[str]:
    """Write the folder; returns the paths written."""
    import importlib

    module = METHODS[method].module
    title = METHODS[method].title
    folder = os.path.join(out, "custom_generate")
    os.makedirs(folder, exist_ok=True)
    written = []

    def write(path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(path)

    with open(os.path.join(ROOT, f"{module}.py"), encoding="utf-8") as f:
        write(os.path.join(folder, f"{module}.py"), rewrite_imports(f.read(), f"{module}.py"))
    with open(os.path.join(ROOT, "verify.py"), encoding="utf-8") as f:
        write(os.path.join(folder, "verify.py"), f.read())
    write(os.path.join(folder, "generate.py"), GENERATE_PY.format(title=title, module=module))
    write(os.path.join(folder, "requirements.txt"), requirements())
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        write(os.path.join(out, "LICENSE"), f.read())
    method_module = importlib.import_module(module)
    summary = method_module.__doc__.strip().split("\n\n")[0]
    arguments = "\n".join(keyword_list(inspect.getdoc(method_module.custom_generate)))
    refused = "\n".join("  - " + item for item in verify.REFUSED)
    write(os.path.join(out, "README.md"), README_MD.format(title=title, summary=summary, method=method,
                                                           module=module, arguments=arguments, refused=refused))
    return written


def keyword_list(doc: str) -> list[str]:
    r"""The custom_generate docstring's "Keywords of this method" list as Markdown items: each
    "- name: text" item on one line, the name as code.

    >>> keyword_list("Intro.\n\nKeywords of this method, ...:\n    - seed: the noise's\n      key\n")
    ["- `seed`: the noise's key"]
    """
    block = re.split(r"Keywords of this method[^\n]*:\n", doc)[1]
    items = []
    for line in block.splitlines():
        text = line.strip()
        if text.startswith("- "):
            name, _, rest = text[2:].partition(": ")
            items.append(f"- `{name}`: {rest}")
        elif text and items:
            items[-1] += " " + text
    return items


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=sorted(METHODS), help="the method to export")
    parser.add_argument("out", help="the folder to write (model.generate's custom_generate=OUT)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    args = parser.parse_args(argv)
    if os.path.isfile(args.out):
        print(f"error: {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.force:
        print(f"error: {args.out} is not empty (--force writes into it)", file=sys.stderr)
        return 2
    for path in export(args.method, args.out):
        print(f"wrote {os.path.relpath(path)}")
    print(f'use: model.generate(input_ids, custom_generate="{args.out}", trust_remote_code=True, '
          "max_new_tokens=128)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
