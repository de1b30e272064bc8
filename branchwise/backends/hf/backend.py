"""The local backend: a HuggingFace causal LM driven by our own decode and layer loops.

Why own the loops: `generate()` costs time on every token (RKSC App. I.1), and every acceleration
in this project acts between layers or between tokens. The branch tree of KV segments (`tree.py`)
keeps a prefix shared by B branches once, not B times.

Sharing modes (baselines in the same code path):
- `share="exact"`: children of a node read its KV (token-exact prefix reuse).
- `share="none"`: the No-KV baseline; each child recomputes the full token path, batched,
  right-padded, with logits read at each row's last real token (not at a pad position).

`HFBackend` is a facade: it loads the model and builds the shared `Engine` (KV tree, runner, lock,
build cache); the operations run in a `Session` (`session.py`). `backend.session(share=..., accel=...)`
gives a run its own settings and statistics; the backend's own methods use a default session whose
settings are `backend.share` / `backend.accel` and whose statistics cover the whole tree.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from branchwise.backends.accel import Accel
from branchwise.backends.base import (
    SHARE_MODES,
    Admit,
    DecodeParams,
    Generation,
    KVStats,
    NodeId,
    ShareMode,
    StepListener,
    check_share,
)
from branchwise.backends.compute_thread import on_compute_thread
from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.arch import check_config, decoder_parts, kv_bytes_per_token
from branchwise.backends.hf.attention import ATTN_NAME, register
from branchwise.backends.hf.batch import Broadcast
from branchwise.backends.hf.embedded import EMBEDDED_MODEL, embedded_model_dir
from branchwise.backends.hf.engine import Engine, check_broadcast, special_ids
from branchwise.backends.hf.grammar import BudgetFit
from branchwise.backends.hf.hooks import Acceleration
from branchwise.backends.hf.own_kv import BLOCK, KVLayout, check_layout, default_layout
from branchwise.backends.hf.packaged import packaged_model_dir
from branchwise.backends.hf.plugins import EntropyTrace
from branchwise.backends.hf.pool import parse_budget, return_freed_memory
from branchwise.backends.hf.prepack import Prepacked
from branchwise.backends.hf.prepack import prepack as pack_weights
from branchwise.backends.hf.session import Session
from branchwise.backends.hf.step import WARMUP, StepMode
from branchwise.backends.hf.step_compiler import StepCompiler
from branchwise.constraints import Constraint

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Acceleration)

DEFAULT_CACHE_BYTES = 1 << 30
"""Default byte budget of the prefix cache across requests (1 GiB: ~23k tokens of the embedded
model's KV in fp32, a long conversation or a few-shot prompt many times over)."""

DEFAULT_PREFILL_CHUNK = 128
"""Tokens of a prompt computed per decode step of the rows running beside it (chunked prefill):
short enough that they wait little per step (`intake.py` has the measurement), long enough that
the prompt still prefills at a useful rate; alone, a prompt is computed in larger forwards."""

__all__ = ["SHARE_MODES", "HFBackend", "resolve_device", "resolve_dtype"]


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else must name a device this machine has.

    Checked before the weights load, so `device="cuda"` on a CPU-only machine fails at once with
    the reason instead of after minutes of loading, deep inside torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device={device!r}: this machine has no CUDA device (torch.cuda.is_available() is "
                f"false; torch {torch.__version__}); use 'cpu' or 'auto'"
            )
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={device!r}: CUDA device indices here are 0..{count - 1}")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = bf16 on CUDA, fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r} is not one of 'auto', {', '.join(map(repr, table))}")
    return table[dtype]


class HFBackend:
    """Local backend over a HuggingFace decoder-only causal LM (`arch.py` says which). See the module docstring.

    `HFBackend()` loads the embedded SmolLM2-135M-Instruct; `HFBackend("Qwen/Qwen2.5-1.5B-Instruct")`
    or a local path loads any supported model. Operations are serialised by a lock, so the backend
    can be shared by threads; give each caller its own `session(...)` so its settings and statistics
    stay its own.
    """

    name, admits_rows = "hf", True  # `SupportsAdmission`: rows join a running decode

    @on_compute_thread  # the weights load and are packed where every computation runs
    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        share: ShareMode = "exact",
        accel: Accel | None = None,
        broadcast: Broadcast = "cascade",
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        kv_budget: int | float | str | None = "auto",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prepack: bool = True,
        decode_step: StepMode = "auto",
        kv_layout: KVLayout | None = None,
    ) -> None:
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        name = EMBEDDED_MODEL if model is None else str(model)
        # the embedded model and packaged ones are addressed by name and load from the cache
        path: str | Path = (
            embedded_model_dir() if name == EMBEDDED_MODEL else (packaged_model_dir(name) or name)
        )
        if broadcast not in ("cascade", "copy"):
            raise ValueError(f"broadcast={broadcast!r} is not one of 'cascade', 'copy'")
        check_config(
            AutoConfig.from_pretrained(path)
        )  # what the backend cannot run fails before the weights load
        log.info("loading %s (%s, %s)", name, torch_dtype, dev)
        register()
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        # transformers' wrapped `to` types its first argument as the model, where `dev` goes
        on_device = loaded.to(dev)  # type: ignore[arg-type]
        self._setup(on_device, tokenizer, share=share, model_name=name, accel=accel, prepack=prepack)
        self.broadcast = broadcast
        self.cache_bytes = cache_bytes
        self.kv_layout = kv_layout  # first: the least budget depends on how rows are priced
        self.kv_budget = kv_budget  # the setter resolves it to bytes
        self.prefill_chunk = prefill_chunk
        self.decode_step = decode_step

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        share: ShareMode = "exact",
        accel: Accel | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        kv_budget: int | float | str | None = "auto",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prepack: bool = True,
        decode_step: StepMode = "auto",
        kv_layout: KVLayout | None = None,
    ) -> HFBackend:
        """Wrap an already loaded model (tests, notebooks) without reloading it. With `prepack`,
        its linear layers are packed in place (see `prepack.py`): the model is changed."""
        self = cls.__new__(cls)
        register()
        name = getattr(model.config, "_name_or_path", "model")
        self._setup(model, tokenizer, share=share, model_name=name, accel=accel, prepack=prepack)
        self.cache_bytes = cache_bytes
        self.kv_layout = kv_layout  # first: the least budget depends on how rows are priced
        self.kv_budget = kv_budget  # the setter resolves it to bytes
        self.prefill_chunk = prefill_chunk
        self.decode_step = decode_step
        return self

    @on_compute_thread
    def _setup(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        share: ShareMode,
        model_name: str,
        accel: Accel | None,
        prepack: bool,
    ) -> None:
        check_share(share)
        model.eval()
        check_config(model.config, type(model))
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:  # transformers keeps its own where it cannot
            raise ValueError(
                f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r}: "
                "its attention does not go through transformers' attention interface"
            )
        self.prepacked = (
            pack_weights(model, decoder_parts(model).layers) if prepack else Prepacked(reason="prepack=False")
        )
        """Whether the linear layers run on packed weights (`prepack.py`), and why not if not."""
        parts = decoder_parts(model)
        param = next(model.parameters())
        eos_ids, pad_id = special_ids(model, tokenizer)
        self.engine = Engine(
            model=model,
            tokenizer=tokenizer,
            model_name=model_name,
            parts=parts,
            device=param.device,
            dtype=param.dtype,
            eos_ids=eos_ids,
            pad_id=pad_id,
            prepacked=self.prepacked.active,
        )
        self.model, self.tokenizer, self.model_name, self.parts = model, tokenizer, model_name, parts
        self.device, self.dtype, self.eos_ids, self.pad_id = param.device, param.dtype, eos_ids, pad_id
        self.kv_token_bytes = kv_bytes_per_token(parts, param.dtype)
        self.tree = self.engine.tree
        self._default = Session(self.engine, share, accel or Accel(), ledger=self.tree.accounts.total)

    @property
    def max_context(self) -> int | None:
        """The model's context window in tokens (None if unknown); longer paths are refused first."""
        return self.engine.max_context

    # ------------------------------------------------------------------ settings
    def session(self, *, share: ShareMode | None = None, accel: Accel | None = None) -> Session:
        """A run's own view of this backend: `share` and `accel` (None = the backend's) and its own
        `kv_stats()`. Builds the accelerations it needs once per backend (cached across runs)."""
        default = self._default
        return Session(
            self.engine,
            default.share if share is None else share,
            default.accel if accel is None else accel,
        )

    @property
    def accel(self) -> Accel:
        """The accelerations the backend's own methods apply (a run passes its own via `session`)."""
        return self._default.accel

    @accel.setter
    @on_compute_thread
    def accel(self, value: Accel) -> None:
        with self.engine.lock:
            old = self._default
            self._default = Session(self.engine, old.share, value, ledger=old.ledger, stats=old.stats)

    @property
    def share(self) -> ShareMode:
        """The sharing mode of the backend's own methods (a fork's `share=` overrides it)."""
        return self._default.share

    @share.setter
    def share(self, value: ShareMode) -> None:
        self._default.share = check_share(value)

    @property
    def cache_bytes(self) -> int:
        """Byte budget of the prefix cache across requests (0 = off): finished requests' exact KV
        stays in the tree, and a `prefill` computes only what no cached path already holds."""
        return self.tree.prefix.budget

    @cache_bytes.setter
    @on_compute_thread
    def cache_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"cache_bytes={value} must be >= 0")
        with self.engine.lock:
            self.tree.prefix.budget = int(value)
            self.tree.trim()

    @property
    def kv_budget(self) -> int | None:
        """Bytes all KV together may hold (None: unbounded). Set it to bytes, a size string
        ("4GiB"), a fraction of free memory (0.5) or "auto" (`pool.AUTO_FRACTION` of free memory,
        the default); schedulers admit requests within it, the prefix cache yields to it and
        decodes that outgrow it preempt their youngest rows (`pool.py`, `intake.py`)."""
        return self.engine.pool.budget

    @kv_budget.setter
    @on_compute_thread
    def kv_budget(self, value: int | float | str | None) -> None:
        budget = parse_budget(value, self.device)
        with self.engine.lock:
            self.engine.pool.set_budget(budget)  # refuses one below a single row's need

    @property
    def grammar_timeout(self) -> float:
        """Seconds one grammar may take to compile (`Grammars.timeout_s`); past it the request is
        refused (`GrammarTimeout`) and the compile stopped where it can be (`grammar_workers`)."""
        return self.engine.grammars.timeout_s

    @grammar_timeout.setter
    def grammar_timeout(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"grammar_timeout={value!r} must be a number of seconds > 0")
        self.engine.grammars.timeout_s = float(value)

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens computed per decode step beside running rows (0: whole prompts, no
        interleaving); without a scheduler, `intake.ALONE_CHUNK` per forward."""
        return self.engine.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"prefill_chunk={value!r} must be an int >= 0 (0: whole prompts)")
        self.engine.prefill_chunk = value

    @property
    def decode_step(self) -> StepMode:
        """How decode steps run (`step.py`): ``auto`` (``compiled``, or `$BRANCHWISE_DECODE_STEP`:
        `step.auto_mode`), ``compiled`` (by a worker process while the same steps run eagerly;
        captured as CUDA graphs on CUDA), ``graphs`` (captured, uncompiled), ``eager``, or
        ``layers`` (every step through the layer loop: the baseline the fixed-shape step is
        measured against). On a CPU it calls oneDNN on the prepacked weights either way."""
        return self.engine.stepper.mode

    @decode_step.setter
    @on_compute_thread
    def decode_step(self, mode: StepMode) -> None:
        with self.engine.lock:
            self.engine.stepper.mode = mode

    @property
    def prefill_share(self) -> float:
        """How long a prefill chunk beside decoding rows may take, as a fraction of their decode
        step's time (`pace.py`; 0: every chunk is `prefill_chunk` tokens, whatever it costs)."""
        return self.engine.pace.share

    @prefill_share.setter
    def prefill_share(self, value: float) -> None:
        self.engine.pace.check_share(value)
        self.engine.pace.share = float(value)

    def kv_memory(self) -> dict[str, int | None]:
        """Budget, KV used (all of it), prefix cache and preemptions, read without the engine's lock
        (a monitor such as the server's `/health` must not wait for a running decode)."""
        return self.engine.pool.stats()

    @on_compute_thread
    def trim_memory(self) -> None:
        """Return memory freed by released KV to the system (`pool.return_freed_memory`); a
        scheduler calls it when its queue has drained."""
        with self.engine.lock:
            return_freed_memory(self.device)

    @property
    def kv_limit(self) -> int | None:
        return self._default.kv_limit

    def kv_room(self) -> int | None:
        return self._default.kv_room()

    def kv_cost(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        return self._default.kv_cost(prompt_tokens, n, max_tokens, share)

    def kv_floor(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        return self._default.kv_floor(prompt_tokens, n, max_tokens, share)

    def prepare_grammar(self, params: DecodeParams) -> Future[Any] | None:
        """The grammar rows decoding with `params` need, compiled off the caller's thread
        (`Grammars.prepare`; None without a constraint): a scheduler queues a constrained request
        only once this is done, so that no decode waits for its compile."""
        if params.constraint is None:
            return None
        return self.engine.grammars.prepare(params.constraint, params.max_tokens)

    def fit_constraint(self, constraint: Constraint, max_tokens: int) -> BudgetFit:
        """`constraint` fitted to `max_tokens` (`Grammars.fit`, which decoding under that budget
        then finds cached), with the tokens its shortest reply and each of its outputs take. A
        server reads those before queueing, to refuse a request no reply could complete instead of
        decoding one that is cut; nothing is logged here."""
        return self.engine.grammars.fit(constraint, max_tokens, warn=False)

    @property
    def broadcast(self) -> Broadcast:
        """How rows read shared ancestors: 'cascade' (one product per segment) or 'copy' (baseline)."""
        return self.engine.broadcast

    @broadcast.setter
    def broadcast(self, value: Broadcast) -> None:
        check_broadcast(value, self._default.plugins)  # e.g. RSBCM needs 'cascade'
        self.engine.broadcast = value

    @property
    def kv_layout(self) -> KVLayout:
        """How decode batches hold their rows' own KV (`own_kv.py`), and so how admission prices rows
        (`KVPool.row_slots`): ``tails`` (a rectangle per batch, rows padded to the longest; the worst
        case) or ``pages`` (16-token pages and a block table per row, read in place on a CPU; what
        rows hold, preempting those that outgrow the budget). None: the default (`default_layout`: pages on
        a CPU that can build their kernel, tails elsewhere)."""
        return self.engine.kv_layout

    @kv_layout.setter
    def kv_layout(self, value: KVLayout | None) -> None:
        layout = default_layout(self.device) if value is None else check_layout(value)
        with self.engine.lock:
            self.engine.pool.price_by(BLOCK if layout == "pages" else None)
            self.engine.kv_layout = layout
        if layout == "pages" and self.device.type == "cpu":
            cpu_kernels.build_ahead()  # from now on, in the background: no step waits for it

    def acceleration(self, kind: type[A]) -> A | None:
        """The default session's instance of an acceleration (its state, its build), or None."""
        return self._default.plugin(kind)

    # ------------------------------------------------------------------ Backend protocol (see `Session`)
    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.engine.decode(token_ids)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return self.engine.chat_prompt(messages, tools)

    def prefill(self, token_ids: Sequence[int]) -> NodeId:
        return self._default.prefill(token_ids)

    def fork(self, node: NodeId, n: int, share: ShareMode | None = None) -> list[NodeId]:
        return self._default.fork(node, n, share)

    def fork_prompts(
        self, node: NodeId, prompts: Sequence[Sequence[int]], share: ShareMode | None = None
    ) -> list[NodeId]:
        return self._default.fork_prompts(node, prompts, share)

    def append(self, nodes: Sequence[NodeId], token_ids: Sequence[Sequence[int]]) -> None:
        self._default.append(nodes, token_ids)

    def extend(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: StepListener | None = None,
        admit: Admit | None = None,
        constraints: Sequence[Constraint | None] | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]:
        return self._default.extend(nodes, params, on_step, admit, constraints, row_params)

    def score_next(
        self,
        nodes: Sequence[NodeId],
        suffix: Sequence[int],
        candidates: Sequence[int],
        trace: list[EntropyTrace] | None = None,
    ) -> list[list[float]]:
        return self._default.score_next(nodes, suffix, candidates, trace)

    def embed_nodes(self, nodes: Sequence[NodeId], probe: Sequence[int]) -> torch.Tensor:
        return self._default.embed_nodes(nodes, probe)

    def set_scores(self, nodes: Sequence[NodeId], scores: Sequence[float]) -> None:
        self._default.set_scores(nodes, scores)

    def skip_verify(self, confidences: Sequence[float]) -> bool:
        return self._default.skip_verify(confidences)

    def release(self, nodes: Sequence[NodeId]) -> None:
        self._default.release(nodes)

    def tokens(self, node: NodeId) -> list[int]:
        return self._default.tokens(node)

    def kv_stats(self) -> KVStats:
        """Bytes and nodes of the whole tree; counters of the backend's own (default-session) calls."""
        return self._default.kv_stats()

    def reset_stats(self) -> None:
        self._default.reset_stats()

    @property
    def decode_compile(self) -> dict[str, Any] | None:
        """Where compiling the decode step stands (`StepCompiler.status`); None where it does not."""
        return None if (compiler := self.engine.stepper.compiler) is None else compiler.status()

    @on_compute_thread
    def preload_steps(self) -> int:
        """`StepCompiler.preload` on the compute thread: loading runs each step once, and from a
        script's main thread every later step of the process ran 1.3x slower, eager or compiled."""
        return 0 if (compiler := self.engine.stepper.compiler) is None else compiler.preload()

    def warm_up(self, wait: float | None = 0.0) -> dict[str, Any]:
        """Start compiling the decode step for the kinds of batch a server meets first (one row,
        several, several over a shared prompt, over a prompt under a cached lead-in) by decoding a
        few tokens of each, run eagerly while the kinds compile in the background
        (`step_compiler.py`); kinds an earlier process compiled are loaded first. `wait` seconds
        (None: until done; 0: not at all) to block for them. Returns the compiler's `status`."""
        compiler = self.engine.stepper.compiler
        if compiler is None:
            return StepCompiler.idle_status()
        self.preload_steps()  # kinds an earlier process compiled: loaded before any request needs them
        session = self.session(share="exact")  # its own statistics: the default session's stay clean
        params = DecodeParams(max_tokens=WARMUP + 3, min_tokens=WARMUP + 3)  # past the eager warm-up step
        roots = [session.prefill(self.encode(text)) for text in ("Hello", "Good morning")]
        made: list[NodeId] = []
        try:
            session.extend(roots[:1], params)
            session.extend(roots, params)
            made += session.fork(roots[0], 2)  # prompts under a lead-in: one token (a repeated one), more
            session.append(made[:1], [self.encode(" there")[-1:]])
            session.append(made[1:2], [self.encode(" there and everywhere")])
            for parent in (roots[1], made[0], made[1]):
                made += session.fork(parent, 2)
                session.extend(made[-2:], params)
        finally:
            session.release([*roots, *made])
        if wait is None or wait > 0:
            compiler.wait(wait)
        return compiler.status()

    # ------------------------------------------------------------------ baseline
    @on_compute_thread
    def hf_generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        exact_length: bool = False,
        return_cache_bytes: bool = False,
        cache_implementation: str | None = None,
        compile_config: Any = None,
    ) -> list[list[int]] | tuple[list[list[int]], int]:
        """What users do today: `model.generate` (greedy) on a left-padded batch. A baseline only.

        With `return_cache_bytes`, also returns the bytes of the KV cache `generate` ended with.
        `cache_implementation="static"` (and a transformers `CompileConfig`) is the baseline a user
        picks for speed: transformers compiles that forward and replays it as CUDA graphs, which
        inference mode's tensors would defeat, so it runs under `generate`'s own no-grad only.
        """
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(list(p))
            mask[i, width - len(p) :] = 1
        # a causal LM: `generate` is GenerationMixin's, which PreTrainedModel's type does not include
        model: Any = self.model
        static = {"cache_implementation": cache_implementation} if cache_implementation else {}
        if compile_config is not None:
            static["compile_config"] = compile_config
        with torch.inference_mode(not static):
            out = model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if exact_length else None,
                pad_token_id=self.pad_id,
                temperature=None,
                top_p=None,
                top_k=None,
                return_dict_in_generate=return_cache_bytes,
                **static,
            )
        sequences = out.sequences if return_cache_bytes else out
        tokens = [row[width:].tolist() for row in sequences.cpu()]
        if not return_cache_bytes:
            return tokens
        cache = out.past_key_values
        nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return tokens, nbytes
