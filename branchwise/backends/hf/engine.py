"""What every run of one local backend shares: the model, the KV tree and pool, the runner, the
lock and the build cache (`Engine`), and the broadcast modes a batch may read shared KV with.

Why apart from the session: a session is one run's settings and numbers, made per request and cheap;
the engine is made once per loaded model and outlives every session. The backend owns it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from branchwise.backends.hf.arch import DecoderParts, kv_bytes_per_token
from branchwise.backends.hf.batch import Broadcast
from branchwise.backends.hf.compile_worker import ModelSpec
from branchwise.backends.hf.embedded import branchwise_cache_dir
from branchwise.backends.hf.grammar import Grammars
from branchwise.backends.hf.hooks import Acceleration, Builds
from branchwise.backends.hf.own_kv import KVLayout
from branchwise.backends.hf.pace import PrefillPace
from branchwise.backends.hf.pool import KVPool
from branchwise.backends.hf.runner import Runner
from branchwise.backends.hf.step import Stepper
from branchwise.backends.hf.tree import KVTree
from branchwise.toolcalls import render_messages, template_has_tools

log = logging.getLogger(__name__)

COPY_TOKENS = 64
COPY_MIN_SEGMENTS = 8
"""In a batch reading more than `COPY_MIN_SEGMENTS` ancestors, those whose path holds at most
`COPY_TOKENS` tokens are read from copies in each row's tail instead of as shared segments (one
attention call per layer each). Measured on the 2-core CPU: 128 rows of 32 requests with ~50-token
prompts decode about 10 % faster copied. A batch of few segments keeps them shared (the copies would
only cost memory there), and a long prefix always stays shared."""


BROADCASTS: tuple[Broadcast, ...] = ("cascade", "copy")


def check_broadcast(broadcast: str, plugins: Sequence[Acceleration]) -> None:
    """Refuse a broadcast mode the run's accelerations cannot work with, naming both fields, when a
    session is built or the backend's mode changes (rather than at the first batch, mid-run)."""
    if broadcast not in BROADCASTS:
        raise ValueError(f"broadcast={broadcast!r} is not one of {BROADCASTS}")
    needs = [p.name for p in plugins if p.needs_cascade]
    if needs and broadcast != "cascade":
        fields = ", ".join(f"accel.{n}" for n in needs)
        raise ValueError(
            f"{fields} cannot run with broadcast={broadcast!r}: of the broadcast modes {BROADCASTS} it "
            "allows only 'cascade' (it reads attention per shared segment, which per-row copies do "
            f"not have); use broadcast='cascade' or turn {fields} off"
        )


def special_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[set[int], int]:
    """The ids that end a row (the generation config's and the tokenizer's end of sequence) and
    the id pads are fed as (the tokenizer's pad, else an end of sequence)."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)
    return eos_ids, pad_id


@dataclass
class Engine:
    """What every session of one backend shares: the model, the KV tree, the runner, the lock and
    the build cache."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    parts: DecoderParts
    device: torch.device
    dtype: torch.dtype
    eos_ids: set[int]
    pad_id: int
    prepacked: bool = False
    """Whether the model's linear layers were packed (`prepack.py`): the step compiler's worker
    packs its copy alike."""
    broadcast: Broadcast = "cascade"
    kv_layout: KVLayout = "tails"
    """How decode batches hold their rows' own KV (`own_kv.py`)."""
    tree: KVTree = field(default_factory=KVTree)
    lock: threading.RLock = field(default_factory=threading.RLock)
    builds: Builds = field(default_factory=Builds)
    runner: Runner = field(init=False)
    stepper: Stepper = field(init=False)
    """Decode steps at fixed shapes, captured as CUDA graphs on a GPU (`step.py`)."""
    grammars: Grammars = field(init=False)
    max_context: int | None = field(init=False)
    """The model's context window in tokens (None where its config does not say)."""
    pool: KVPool = field(init=False)
    """Every byte of KV and its budget (`pool.py`)."""
    pace: PrefillPace = field(default_factory=PrefillPace)
    """The size of each prefill chunk carried by a decode step, by time (`pace.py`)."""
    prefill_chunk: int = 128
    """Prompt tokens computed per decode step while other rows decode (0: whole prompts); alone,
    `intake.ALONE_CHUNK` per forward (`intake.py`)."""

    def _spec(self) -> ModelSpec | None:
        """What the step compiler's worker rebuilds the model from (None: a config it cannot read)."""
        try:
            return ModelSpec.of(self.model, self.prepacked)
        except Exception:  # a config that does not serialise: the step runs uncompiled, saying so
            log.warning("the model's config could not be read; decode steps will not compile", exc_info=True)
            return None

    def __post_init__(self) -> None:
        self.runner = Runner(self.parts, self.pad_id, self.device)
        self.stepper = Stepper(self.parts, self.pad_id, self.device, spec=self._spec())
        vocab = (
            int(cast(int, self.parts.head.out_features))
            if hasattr(self.parts.head, "out_features")
            else len(self.tokenizer)
        )
        self.grammars = Grammars(
            self.tokenizer, vocab, self.eos_ids, cache_dir=branchwise_cache_dir() / "grammar"
        )
        self.grammars.start()  # the tokenizer's tables, in the background: no first call waits for them
        # a dropped backend's grammar threads end with it, not a minute later
        weakref.finalize(self, self.grammars.close)
        self.pool = KVPool(self.tree, kv_bytes_per_token(self.parts, self.dtype), copy_tokens=COPY_TOKENS)
        config = self.model.config
        self.max_context = next(
            (
                int(v)
                for v in (getattr(config, k, None) for k in ("max_position_embeddings", "n_positions"))
                if isinstance(v, int) and v > 0
            ),
            None,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return cast(str, text)  # one sequence of ids decodes to one str

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        native = template_has_tools(template)
        rendered = render_messages(messages, tools, native=native)
        if not template:
            return self.encode("\n".join(m["content"] for m in rendered) + "\n")
        extra: dict[str, Any] = {"tools": list(tools)} if tools and native else {}
        text = self.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, tokenize=False, **extra
        )
        return self.encode(cast(str, text))  # tokenize=False: the rendered text

    def check_ids(self, ids: Sequence[int], name: str) -> list[int]:
        vocab = self.parts.embed.num_embeddings
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} holds ids outside [0, {vocab}): {bad[:5]}")
        return out
