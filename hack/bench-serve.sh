#!/usr/bin/env bash
# `make bench-serve`: an off-the-shelf benchmark tool (guidellm, from hack/bench-tool.sh) against the
# local ensemble. Starts `consort up -f examples/local` (engines + router as local processes on
# 127.0.0.1), waits until the router is ready, runs a bounded guidellm benchmark against the router's
# OpenAI endpoint, then stops everything (also on Ctrl-C or failure). Reports land in $BENCH_OUT.
#
# Knobs (environment): BENCH_STREAMS (concurrency levels, default 1,4,16), BENCH_SECONDS (per level,
# default 15), BENCH_PROMPT_TOKENS / BENCH_OUTPUT_TOKENS (synthetic prompts, default 64 / 32),
# BENCH_FORMAT (/v1/chat/completions or /v1/completions), BENCH_MANIFESTS, BENCH_PORT, BENCH_OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CACHE:-$HOME/.cache/consort}
PY=${PY:-.venv/bin/python}
MANIFESTS=${BENCH_MANIFESTS:-examples/local}
STREAMS=${BENCH_STREAMS:-1,4,16}
SECONDS_EACH=${BENCH_SECONDS:-15}
PROMPT_TOKENS=${BENCH_PROMPT_TOKENS:-64}
OUTPUT_TOKENS=${BENCH_OUTPUT_TOKENS:-32}
FORMAT=${BENCH_FORMAT:-/v1/chat/completions}
OUT=${BENCH_OUT:-$CACHE/bench-serve/$(date +%Y%m%d-%H%M%S)}
READY_TIMEOUT=${BENCH_READY_TIMEOUT:-300}

say() { echo "bench-serve: $*" >&2; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=${BENCH_PORT:-$(free_port)}
URL=http://127.0.0.1:$PORT

GUIDELLM=$(hack/bench-tool.sh)
mkdir -p "$OUT"
say "consort up -f $MANIFESTS on $URL (log: $OUT/up.log)"
# Its own session (process group): the trap stops consort up, which stops its engines and router.
setsid "$PY" -m consort_common.cli up -f "$MANIFESTS" --port "$PORT" --engine-base-port 0 \
  --run-dir "$OUT/up" >"$OUT/up.log" 2>&1 &
UP_PID=$!
stop_up() {
  kill -TERM "$UP_PID" 2>/dev/null || return 0
  say "stopping consort up (pid $UP_PID)"
  for _ in $(seq 60); do kill -0 "$UP_PID" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- "-$UP_PID" 2>/dev/null || true
}
trap stop_up EXIT
trap 'exit 130' INT TERM

# Wait for the router, echoing consort up's own progress lines.
shown=0
deadline=$(( $(date +%s) + READY_TIMEOUT ))
until grep -q '] ready: ' "$OUT/up.log" 2>/dev/null; do
  lines=$(wc -l <"$OUT/up.log")
  [ "$lines" -gt "$shown" ] && sed -n "$((shown + 1)),${lines}p" "$OUT/up.log" >&2 && shown=$lines
  kill -0 "$UP_PID" 2>/dev/null || { say "consort up exited:"; tail -25 "$OUT/up.log" >&2; exit 1; }
  [ "$(date +%s)" -lt "$deadline" ] || { say "not ready after ${READY_TIMEOUT} s"; exit 1; }
  sleep 1
done
grep '] ready: ' "$OUT/up.log" >&2

# The tokenizer guidellm counts tokens with: the checkpoint an engine serves (its model card's
# `root`), read from the first engine `consort up` started; no model hub is involved.
ENGINE_URL=$(grep -o 'engine [^:]*: pid [0-9]*, http://[0-9.:]*' "$OUT/up.log" | head -1 | grep -o 'http://.*')
TOKENIZER=${BENCH_TOKENIZER:-$(python3 -c 'import json, sys, urllib.request as u
print(json.load(u.urlopen(sys.argv[1] + "/v1/models", timeout=10))["data"][0]["root"])' "$ENGINE_URL")}
say "tokenizer: $TOKENIZER (root of $ENGINE_URL/v1/models)"

progress=(--disable-progress)
[ -t 1 ] && progress=()
say "guidellm: $FORMAT, synthetic ${PROMPT_TOKENS}-token prompts / ${OUTPUT_TOKENS}-token outputs," \
    "concurrency $STREAMS, ${SECONDS_EACH} s each (log: $OUT/guidellm.log)"
set +e
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout 1200 "$GUIDELLM" run \
  --backend "kind=openai_http,target=$URL,request_format=$FORMAT" \
  --tokenizer "kind=hf_auto,model=$TOKENIZER" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --profile kind=concurrent --override profile.streams "$STREAMS" \
  --constraint "kind=max_duration,seconds=$SECONDS_EACH" \
  --output "kind=json,path=$OUT/benchmarks.json" --output "kind=csv,path=$OUT/benchmarks.csv" \
  "${progress[@]}" 2>&1 | tee "$OUT/guidellm.log"
rc=${PIPESTATUS[0]}
set -e
# What the engines saw, by vLLM's metric names (the same counters vLLM's dashboards read).
grep -o 'engine [^:]*: pid [0-9]*, http://[0-9.:]*' "$OUT/up.log" | while read -r _ name _ _ url; do
  curl -s "$url/metrics" | grep -E '^vllm:(request_success_total|generation_tokens_total|prompt_tokens_total)' \
    | sed "s/^/  ${name%:} /" >&2 || true
done
if grep -q 'Traceback' "$OUT"/up/logs/*.log; then
  say "WARNING: a server logged a traceback during the run (see $OUT/up/logs)"
fi
say "reports: $OUT/benchmarks.json, $OUT/benchmarks.csv, $OUT/guidellm.log (exit $rc)"
exit "$rc"
