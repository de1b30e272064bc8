#!/usr/bin/env bash
# Start or stop one vLLM OpenAI server on loopback, for the vLLM stage of .ci/run (and by hand).
#
#   .ci/vllm_server.sh start PYTHON MODEL_DIR PORT LOG [CPUS] [KV_GIB]   # waits for /health
#   .ci/vllm_server.sh stop LOG                                         # stops what `start` began
#
# Why a script: the server starts in its own process group (setsid) so `stop` ends vLLM and its
# engine-core child together, by that group's id only; a server that does not answer /health within
# VLLM_START_TIMEOUT seconds (600: the first start compiles for minutes) fails loudly with its log
# tail, instead of letting the tests skip or hang.
set -euo pipefail

cmd=${1:?usage: $0 start PYTHON MODEL_DIR PORT LOG [CPUS] [KV_GIB] | stop LOG}
case "$cmd" in
  start)
    python=${2:?PYTHON}; model=${3:?MODEL_DIR}; port=${4:?PORT}; log=${5:?LOG}
    cpus=${6:-0-1}; kv=${7:-2}
    timeout=${VLLM_START_TIMEOUT:-600}
    VLLM_CPU_KVCACHE_SPACE=$kv VLLM_CPU_OMP_THREADS_BIND=$cpus setsid "$python" -m vllm.entrypoints.openai.api_server \
      --model "$model" --dtype float32 --max-model-len 4096 --enable-prefix-caching \
      --host 127.0.0.1 --port "$port" >"$log" 2>&1 </dev/null &
    echo $! >"$log.pid"
    start=$SECONDS
    until curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
      if ! kill -0 "$(cat "$log.pid")" 2>/dev/null; then
        echo "vLLM on port $port exited during start; the last lines of $log:" >&2
        tail -n 60 "$log" >&2
        exit 1
      fi
      if ((SECONDS - start > timeout)); then
        echo "vLLM on port $port did not answer /health within $timeout s; the last lines of $log:" >&2
        tail -n 60 "$log" >&2
        "$0" stop "$log" || true
        exit 1
      fi
      sleep 3
    done
    echo "vLLM up on http://127.0.0.1:$port after $((SECONDS - start)) s (pid $(cat "$log.pid"), log $log)"
    ;;
  stop)
    log=${2:?LOG}
    [[ -f "$log.pid" ]] || exit 0
    pid=$(cat "$log.pid")
    # the group setsid made (its id is the server's pid): the API server and its engine core
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$log.pid"
    ;;
  *)
    echo "unknown command $cmd (start or stop)" >&2
    exit 2
    ;;
esac
