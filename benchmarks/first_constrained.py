"""The first constrained call of a fresh process against its later ones: JSON mode, then a tool call.

Why: a process's first constrained call used to build its tokenizer's grammar tables (xgrammar's
vocabulary table, the closing walk's pieces, the longest token: `backends/hf/grammar_tables.py`)
and compile ``json_object`` on top of its own work. Now the tables are read from the cache folder
or built in the background from the model's load on, and ``json_object`` is compiled right after
them. This script measures that in two fresh processes sharing one empty cache folder (the model is
passed as a path, so nothing else of branchwise's cache is used):

* ``cold``: the first process builds the tables (and stores them);
* ``warm``: the second reads them.

Each process loads the model and at once (no idle time in between: the worst case) makes
`--calls` JSON-mode calls, then `--calls` tool calls (``tool_choice="required"``, one tool), each
a prefill and a decode of `--tokens` tokens, greedy, with the prefix cache off so that every call
computes the same work. Per kind: `first_s`, `later_s` (the median of the others) and `ratio`
(their quotient). `tables` says how the process came by its tables (`built`, `loaded`) and what
waited for them (`waits`, `wait_s`); `notes`, what the first call of each kind said.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BenchParser, emit, resolve_for_children
from structured import ADD_TOOL

QUICK = {"tokens": 16, "calls": 3}


def child(args: Any) -> dict[str, Any]:
    """One process's run (see the module docstring), as a dict."""
    import torch

    from branchwise.backends import DecodeParams
    from branchwise.backends.hf import HFBackend
    from branchwise.constraints import Constraint
    from branchwise.toolcalls import normalize_tools

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    backend = HFBackend(args.model, device=args.device, dtype=args.dtype, cache_bytes=0)
    load_s = time.perf_counter() - start
    tools = normalize_tools([ADD_TOOL])
    kinds = {
        "json_object": (Constraint.of_json_object(), None, "Describe a cat as a JSON object."),
        "tool_call": (Constraint.of_tools(tools, "required"), tools, "What is 12 plus 30?"),
    }
    rows = {}
    for kind, (constraint, shown, question) in kinds.items():
        prompt = backend.chat_prompt([{"role": "user", "content": question}], tools=shown)
        params = DecodeParams(max_tokens=args.tokens, temperature=0.0, constraint=constraint)
        times, notes = [], []
        for _ in range(args.calls):
            t = time.perf_counter()
            root = backend.prefill(prompt)
            (gen,) = backend.extend([root], params)
            times.append(time.perf_counter() - t)
            backend.release([root])
            notes.append(gen.notes)
        first, later = round(times[0], 3), round(statistics.median(times[1:]), 3)
        rows[kind] = {"first_s": first, "later_s": later, "ratio": round(first / later, 3), "notes": notes[0]}
    grammars = backend.engine.grammars
    return {
        "load_s": round(load_s, 2),
        "rows": rows,
        "tables": asdict(grammars.stats.tables) | {"wait_s": round(grammars.stats.tables.wait_s, 3)},
        "compiled": grammars.stats.compiled,
    }


def main() -> None:
    parser = BenchParser(__doc__, QUICK)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per call")
    parser.add_argument(
        "--calls", type=int, default=5, help="calls of each kind (the first and the later ones)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls < 2:
        parser.error(f"--calls={args.calls}: at least 2 (a first call and a later one)")
    if args.child:
        print(json.dumps(child(args)))
        return
    started = time.perf_counter()
    resolve_for_children(args)
    if args.model is None:
        from branchwise.backends.hf.embedded import embedded_model_dir

        args.model = str(embedded_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BRANCHWISE_CACHE_DIR": str(Path(tmp) / "cache")}
        command = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device,
                   "--dtype", args.dtype, "--tokens", str(args.tokens), "--calls", str(args.calls)]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        runs = {}
        for phase in ("cold", "warm"):
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"the {phase} process failed:\n{out.stderr[-3000:]}")
            runs[phase] = json.loads(out.stdout.strip().splitlines()[-1])
    config = {k: v for k, v in vars(args).items() if k not in ("model", "child")}
    emit("first_constrained", model=args.model, device=args.device, dtype=args.dtype, config=config,
         results=runs, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
