"""The CPU kernels of our own, one C++ extension: decode attention over a paged KV pool read in
place (`paged_decode`), and a weight-only int8 product for a few rows (`int8_linear`).

Why `paged_decode`: a pool of fixed-size KV blocks (a block table per row, as vLLM and SGLang keep
KV) holds each row at its own length instead of the longest row's, but on a CPU it pays only if
attention reads each row's blocks where they lie: gathering them into a padded copy for SDPA first
cost 2-5x the attention itself (`benchmarks/paged_attention.py`). PyTorch has no such reader on the
CPU (FlexAttention's paged block mask compiles there, but ran at 0.5-0.9x the tails and cannot
return the log-sum-exp under compilation, which the cascade merges by), so `csrc/paged_decode.cpp`
is one: a `torch.library` op, `torch.ops.branchwise.paged_decode`, parallel over (row, KV head,
chunk of blocks) on torch's threads, an online softmax per tile of tokens in fp32, vectorized with
torch's own `at::vec` for the instruction set torch itself dispatches to on this CPU.
The shared segments a tree's rows read (their ancestors) go to the same call: each is read once
for all its rows, in the same softmax as each row's own blocks, where merging each segment's
attention by log-sum-exp in Python cost a dozen small operations per segment per layer (30 % of a
beam search's step on 2 cores). `paged_decode_mass` is the same op returning the attention mass
each own slot got too (RSBCM's: each slot's `exp(score - lse)`, summed over the heads): a tap that
scored the keys itself read every key twice and made the step read a gathered copy of the pages,
and one handed the scores exponentiated a grid of them in six operations per layer (0.985x the
plain step; 1.03x with the mass from the kernel).

Why `int8_linear` (`csrc/int8_linear.cpp`): River's quantized layers read a quarter of the bytes of
the float32 ones, but torch's CPU kernel for them takes bf16 activations and, without native bf16
(AVX2), streamed its weights at about half oneDNN's float32 speed; this one widens the codes to
float32 as it streams them (`river_quant.WeightOnlyLinear` uses it where it is built).

Why `pages_gather` / `pages_move` (`csrc/kv_pages.cpp`): a read of a row's slots out of every
layer of the pool, or an eviction's compaction of them, is one or four small torch operations per
layer, keys and values; one call does them all (`kv_pages.Pages.row` and `move` use them).

All are compiled on first use (`build`, 20-50 s on 2 cores; then loaded from
`$BRANCHWISE_CACHE_DIR/extensions`, well under a second) with torch's `cpp_extension`, and carry
fake kernels so they sit inside `torch.compile(fullgraph=True)` as opaque operations. Where no
compiler is found or the build fails, `build()` returns the reason instead of raising, so a caller
falls back and says why; `paged_decode` raises `PagedKernelUnavailable` with that reason.

`paged_decode_reference` is the same arithmetic in plain torch (gather, then an explicit softmax):
what the tests and the benchmark compare the kernel against, never a fallback on a hot path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from branchwise.backends.hf.embedded import branchwise_cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).resolve().parent / "csrc" / name
    for name in ("paged_decode.cpp", "int8_linear.cpp", "kv_pages.cpp")
)
"""The kernels' sources, shipped as package data (pyproject's `package-data`)."""

OP_NAME = "branchwise::paged_decode"


class PagedKernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


@dataclass(frozen=True)
class BuildInfo:
    """How the extension was obtained in this process: the library's path, the seconds `build()`
    took, and whether a previous build was found in the cache (`cached`) or compiled now."""

    path: Path
    seconds: float
    cached: bool


_lock = threading.Lock()
_info: BuildInfo | None = None
_reason: str | None = None
_tried = False
_done = False
_builder: threading.Thread | None = None
_builder_lock = threading.Lock()
BUILDING = "the paged decode kernel is being built in the background (once per machine, then cached)"
"""`ready_now`'s answer while a build runs: a step then reads a copy of its pages instead of waiting."""


def _capability_flags() -> list[str]:
    """Compiler flags for the instruction set torch's own kernels use on this CPU (`at::vec` picks
    its implementation from the CPU_CAPABILITY macros, as torch's build does): the op is then as
    portable as torch's dispatch, with no guess about the machine beyond what torch detected."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return [
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
        ]
    if capability == "AVX2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]
    return ["-DCPU_CAPABILITY=DEFAULT"]  # at::vec's portable fallback (any CPU torch runs on)


def _cflags() -> list[str]:
    # at::parallel_for is inline over OpenMP in an OpenMP build of torch: without -fopenmp the
    # pragma is ignored and the kernel runs on one thread
    openmp = ["-fopenmp"] if torch._C.has_openmp else []
    return ["-O3", *openmp, *_capability_flags()]


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _extension_name(cflags: list[str]) -> str:
    """A name per source (its text and where it lies), flags, torch and machine: a cache shared by
    machines or torch versions never loads a library built for another, and two installs of the
    package (a checkout and a worktree) do not rebuild each other's (torch rebuilds a folder whose
    build file names another source path)."""
    key = "\n".join(
        [
            *(source.read_text(encoding="utf-8") for source in SOURCES),
            *map(str, SOURCES),
            *cflags,
            torch.__version__,
            platform.machine(),
            _compiler(),
        ]
    )
    return "branchwise_paged_decode_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_dir() -> Path:
    """Where built extensions are kept between processes."""
    return branchwise_cache_dir() / "extensions"


def build() -> str | None:
    """Build (or load the cached build of) the kernel once per process; None when it is ready,
    else why not (no compiler, no ninja, a build error), so the caller can fall back and say so."""
    global _info, _reason, _tried, _done
    with _lock:
        if _tried:
            return _reason
        _tried = True
        try:
            _info = _build()
        except Exception as exc:  # every failure is reported as the reason, never raised
            _reason = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("paged decode kernel unavailable: %s", _reason)
        _done = True
        return _reason


def build_ahead() -> None:
    """Start `build` on a thread of its own, unless one ran or runs: a backend that keeps its KV in
    pages starts it at load, so that no request waits for a compiler (20-50 s on 2 cores the first
    time on a machine). The thread is not a daemon: the interpreter waits for it at exit rather
    than cut a build short and leave the build folder locked."""
    global _builder
    with _builder_lock:
        if _tried or _builder is not None:
            return
        # daemon=False said outright: a thread inherits its starter's flag, and the starter is often
        # the (daemon) compute thread, whose builder was then cut off at exit every time, so that
        # on a fresh machine each short run built the kernel anew and read a copy meanwhile
        _builder = threading.Thread(target=build, name="branchwise-paged-build", daemon=False)
        _builder.start()
        # said before the interpreter waits for it (the hook runs before non-daemon threads are
        # joined): a process that ends mid-build otherwise sits silent for seconds at exit
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_say_exit_wait)


def _say_exit_wait() -> None:
    """At exit, while the build still runs: say that the process waits for it, and why."""
    if _builder is not None and _builder.is_alive():
        log.warning(
            "finishing the paged decode kernel's build before exiting (once per machine, then cached: "
            "the next process reads pages in place)"
        )


def ready_now() -> str | None:
    """`build()`'s answer without waiting for it: None when the kernel is ready, why not when it
    cannot be, `BUILDING` while a build runs (started here if none was)."""
    if _done:
        return _reason
    build_ahead()
    return BUILDING


def missing() -> str | None:
    """What this machine lacks to build the kernel (its source, a C++ compiler, ninja), without
    building it; None when nothing is missing (the build itself may still fail: `build`)."""
    if absent := [str(source) for source in SOURCES if not source.is_file()]:
        return f"the kernels' sources are not installed ({', '.join(absent)})"
    compiler = _compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (set CXX to one)"
    from torch.utils import cpp_extension

    _put_packaged_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return "torch builds extensions with ninja, which is not installed"
    return None


def _put_packaged_ninja_on_path() -> None:
    """Append the `ninja` package's binary folder to this process's PATH when no ninja is on it.

    Why: torch runs `ninja` from PATH, and the package (a dependency) installs it beside the
    environment's Python, which is not on PATH when a script is run by the environment's full path
    without activating it; without this such a machine would keep its KV in tails."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR:
        os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH", ""), ninja.BIN_DIR]))


def _build() -> BuildInfo:
    if (lacking := missing()) is not None:
        raise PagedKernelUnavailable(lacking)
    from torch.utils import cpp_extension

    cflags = _cflags()
    name = _extension_name(cflags)
    directory = build_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    started = time.perf_counter()
    with _only_builder(directory):
        cached = library.is_file()
        cpp_extension.load(
            name=name,
            sources=list(map(str, SOURCES)),
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    _register_fake()
    seconds = time.perf_counter() - started
    log.info("paged decode kernel %s in %.1f s (%s)", "loaded" if cached else "built", seconds, library)
    return BuildInfo(library, seconds, cached)


@contextmanager
def _only_builder(directory: Path) -> Iterator[None]:
    """Hold `directory` against every other process that builds or loads the kernel, with a lock
    the OS lets go of when its holder dies; a lock file torch's own guard left behind then is stale.

    Why: torch guards a build folder with a plain file (`FileBaton`) that only its holder removes. A
    process killed while it built (a server stopped during its first start, a test's subprocess)
    left it, and every later process on the machine waited on it forever: a test fixture hung, and a
    server's background build never ended, so its pages were read as a copy from then on."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own guard alone
        yield
        return
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removed the build lock a process left when it died while building (%s)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _register_fake() -> None:
    """The op's shapes without running it, so `torch.compile` treats it as one opaque call."""

    @torch.library.register_fake(OP_NAME)
    def _(
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        lens: torch.Tensor,
        seg_keys: list[torch.Tensor],
        seg_values: list[torch.Tensor],
        seg_rows: list[torch.Tensor],
        scale: float,
        chunk_blocks: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(q.dim() == 3, lambda: "paged_decode: q must be [B, Hq, D]")
        out = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
        return out, lse

    @torch.library.register_fake("branchwise::paged_decode_mass")
    def _(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`paged_decode`'s shapes (the same arguments), and the mass `[B, M * BS]`."""
        q, k_pool, block_table = args[0], args[1], args[3]
        out, lse = torch.ops.branchwise.paged_decode(*args)
        slots = block_table.shape[1] * k_pool.shape[2]
        return out, lse, q.new_empty((q.shape[0], slots), dtype=torch.float32)

    @torch.library.register_fake("branchwise::int8_linear")
    def _(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[0])


def build_info() -> BuildInfo | None:
    """How this process got the kernel (None before a successful `build()`)."""
    return _info


def unavailable_reason() -> str | None:
    """`build()`'s answer: None when the kernel is ready, else why it is not."""
    return build()


@dataclass(frozen=True)
class Segments:
    """Shared segments the kernel reads beside each row's own blocks: per segment its keys and
    values `[H_kv, T, D]` (one layer's, the pool's dtype, head dim contiguous) and the rows that
    read it (`rows`, int32 `[r]`; a negative entry names no row: padding, as a segment no row reads
    is, which a compiled step uses to keep to a few counts of segments and readers)."""

    keys: Sequence[torch.Tensor] = ()
    values: Sequence[torch.Tensor] = ()
    rows: Sequence[torch.Tensor] = ()


NO_SEGMENTS = Segments()


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    chunk_blocks: int = 0,
    segments: Segments = NO_SEGMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row attending to its KV in a paged pool, read in place, and to the
    shared segments it reads.

    `q` `[B, Hq, D]`; `k_pool`, `v_pool` `[N_blocks, H_kv, BS, D]` (head dim contiguous), Hq a
    multiple of H_kv; `block_table` `[B, M]` int32 (row b's i-th block); `lens` `[B]` int32 (row
    b's tokens: its first ceil(len / BS) blocks); `segments`: a tree's ancestors, each read once
    for all its rows, in the same softmax as their own blocks (no merge left to the caller).
    float32 or bfloat16, accumulated in float32. Returns (out `[B, Hq, D]` in q's dtype, lse
    `[B, Hq]` float32: the natural log of each query's softmax denominator over `scale * q.k`, all
    it read); a row that reads nothing gives zeros and -inf, which a log-sum-exp merge ignores.
    `chunk_blocks` > 0 fixes how many blocks one thread reads before a merge (0: chosen from the
    rows and threads). Raises `PagedKernelUnavailable` when the kernel cannot be built here
    (`unavailable_reason()` says why beforehand). Inside `torch.compile` the op is traced through
    its fake kernel: build it before compiling."""
    _ensure_built()
    s = segments
    out, lse = torch.ops.branchwise.paged_decode(
        q, k_pool, v_pool, block_table, lens, list(s.keys), list(s.values), list(s.rows), scale, chunk_blocks
    )
    return out, lse


def paged_decode_mass(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    chunk_blocks: int = 0,
    segments: Segments = NO_SEGMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`paged_decode`, and the attention mass each of a row's own slots got: `[B, M * BS]` float32,
    `exp(score - lse)` summed over the query heads, against the log-sum-exp of all the query read
    (its segments' included), 0 past the row's length. What an attention-mass tap adds up, with the
    exponentials taken inside the kernel rather than over a `[B, Hq, M * BS]` grid of scores in
    every layer (valid only where nothing is merged into the output after the kernel: a masked
    pool of blocks would change the log-sum-exp; `step_attention.pages_copied`)."""
    _ensure_built()
    s = segments
    out, lse, mass = torch.ops.branchwise.paged_decode_mass(
        q, k_pool, v_pool, block_table, lens, list(s.keys), list(s.values), list(s.rows), scale, chunk_blocks
    )
    return out, lse, mass


def _ensure_built() -> None:
    """Build the extension on a call outside compilation (`PagedKernelUnavailable` if it cannot)."""
    if not torch.compiler.is_compiling() and (not _done or _reason is not None):
        reason = build()
        if reason is not None:
            raise PagedKernelUnavailable(reason)


def int8_linear_ready() -> bool:
    """Whether `int8_linear` runs here now, vectorized: the extension is built (never waited for)
    and torch dispatches to AVX2 or AVX-512 on this CPU (elsewhere the op is a scalar loop, slower
    than torch's own kernel for the same layer)."""
    return VECTORIZED and ready_now() is None


def int8_linear_pending() -> str | None:
    """Why `int8_linear_ready` may still change its answer in this process (the extension still
    building, or it could not be built); None where it never will. A compiled step traced where it
    was ready calls the op, one traced where it was not calls torch's kernel instead, so a step
    with int8 layers compiles only once the answer is final (`step_compiler.not_compiled`)."""
    return ready_now() if VECTORIZED else None


VECTORIZED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
"""Whether torch dispatches to AVX2 or AVX-512 here: asked once, as a constant (a compiled step is
traced through `int8_linear_ready`, and torch's question returns a string a trace cannot hold)."""


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ (w * scale[:, None]).T` for float32 `x` `[M, K]`, int8 `w` `[N, K]` (contiguous) and
    float32 `scale` `[N]`, accumulated in float32, streaming `w` once for all rows. Only where
    `int8_linear_ready()` says so (its caller keeps another kernel meanwhile)."""
    return torch.ops.branchwise.int8_linear(x, w, scale)


def pages_ready() -> bool:
    """Whether `pages_gather`/`pages_move` run here now (the extension built; never waited for)."""
    return ready_now() is None


def pages_gather(pools: Sequence[torch.Tensor], page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Slots (`page`, `off`: int64 `[S]`) of every pool (`[N, H, BS, D]`, one per layer) as one
    `[L, H, S, D]` tensor of its own. Only where `pages_ready()` says so."""
    return torch.ops.branchwise.pages_gather(list(pools), page, off)


def pages_move(
    pools: Sequence[torch.Tensor],
    page: torch.Tensor,
    off: torch.Tensor,
    index: torch.Tensor,
    dst_page: torch.Tensor,
    dst_off: torch.Tensor,
) -> None:
    """In every pool, in place: the slots `index` (`[K]`, or `[L, H, K]` per layer and head;
    positions into `page`/`off` `[S]`) go to `dst_page`/`dst_off` `[K]`, all read before any is
    written. Only where `pages_ready()` says so."""
    torch.ops.branchwise.pages_move(list(pools), page, off, index, dst_page, dst_off)


def paged_decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    segments: Segments = NO_SEGMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_decode` in plain torch, row by row: gather the row's blocks and the segments it reads,
    an explicit softmax in float32 (float64 inputs stay float64). What the kernel is checked
    against; slow by design."""
    b, hq, d = q.shape
    h, bs = k_pool.shape[1], k_pool.shape[2]
    g = hq // h
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=work, device=q.device)
    readers = [set(rows.tolist()) for rows in segments.rows]
    for row in range(b):
        n = int(lens[row])
        blocks = block_table[row, : -(-n // bs)].long()
        ks = [k_pool[blocks].to(work).transpose(0, 1).reshape(h, -1, d)[:, :n]]  # [H, n, D]
        vs = [v_pool[blocks].to(work).transpose(0, 1).reshape(h, -1, d)[:, :n]]
        for keys, values, rows in zip(segments.keys, segments.values, readers, strict=True):
            if row in rows:
                ks.append(keys.to(work))
                vs.append(values.to(work))
        k, v = torch.cat(ks, 1), torch.cat(vs, 1)
        if k.shape[1] == 0:
            continue
        scores = q[row].to(work).view(h, g, d) @ k.transpose(1, 2) * scale  # [H, G, n]
        lse[row] = torch.logsumexp(scores, -1).reshape(hq)
        out[row] = (torch.softmax(scores, -1) @ v).reshape(hq, d).to(q.dtype)
    return out, lse.float() if work == torch.float32 else lse
