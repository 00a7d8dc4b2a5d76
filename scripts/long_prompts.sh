#!/usr/bin/env bash
# Prompt processing on long prompts, ds4serve vs llama.cpp's llama-server, side by side (issue 12).
#
# The shared side-by-side script measures prompt speed at 960 tokens; this one measures it at longer
# prompts (default 4096 and 16384 tokens) on the same Flash-shaped checkpoint, GGUF and llama-server
# build (run ../shared/peers/side_by_side.sh once first: it builds them under $PEERS_DIR). Each round
# starts both servers in turn with a context that holds the longest prompt, sends REQUESTS prompts of
# each length one at a time (max_tokens 1) and keeps prompt tok/s = tokens / TTFT; medians over
# rounds, the two sides alternating so machine drift favours neither.
#     scripts/long_prompts.sh [ROUNDS] [LENGTH...]        e.g. scripts/long_prompts.sh 2 4096 16384
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
peers="$here/../../shared/peers"
rounds="${1:-2}"; shift || true
lengths="${*:-4096 16384}"
work="${PEERS_DIR:-$HOME/.cache/ds4-peers}"
py="${PYTHON:-.venv/bin/python}"; ds4="${DS4SERVE:-.venv/bin/ds4serve}"
requests="${REQUESTS:-2}"
ckpt="$work/bench-ckpt"
server="$("$peers/build_llama_server.sh" "$work/llama")"  # built once, then only located
if [ ! -x "$server" ] || [ ! -f "$work/bench.gguf" ]; then
  echo "run ../shared/peers/side_by_side.sh first (it builds llama-server and writes the checkpoint)" >&2; exit 1
fi
longest=0; for n in $lengths; do [ "$n" -gt "$longest" ] && longest=$n; done
ctx=$((longest + 256))
out="$work/runs/long-$(date +%s)"; mkdir -p "$out"
up() { for _ in $(seq 1 180); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done; echo "no server at $1" >&2; return 1; }
measure() {  # side url model round
  for n in $lengths; do
    "$py" "$peers/loadgen.py" --url "$2" --model "$3" --tokenizer "$ckpt/tokenizer.json" --concurrency 1 \
      --requests-per-client "$requests" --prompt-tokens "$n" --max-tokens 1 --warmup 0 --pause 0.5 \
      --request-timeout 600 --level-timeout 1800 --seed "$4" --label "$1" --out "$out/$1_${n}_$4.json" >/dev/null
  done
}
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null || true' EXIT  # never leave a server behind
stop() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; }
for r in $(seq 1 "$rounds"); do
  LD_LIBRARY_PATH="$(dirname "$server")" "$server" -m "$work/bench.gguf" --alias bench --host 127.0.0.1 \
    --port 18080 -c "$ctx" -np 1 -t "$(nproc)" -tb "$(nproc)" >"$out/llama.log" 2>&1 & pid=$!
  up http://127.0.0.1:18080 && measure llama http://127.0.0.1:18080 bench "$r"; stop
  # shellcheck disable=SC2086
  "$ds4" serve --model "$ckpt" --port 18090 --max-seqs 1 --max-model-len "$ctx" ${DS4_ARGS:-} >"$out/ds4serve.log" 2>&1 & pid=$!
  up http://127.0.0.1:18090 && measure ds4serve http://127.0.0.1:18090 bench-ckpt "$r"; stop
done
"$py" - "$out" $lengths <<'PY'
import glob, json, statistics, sys
out, lengths = sys.argv[1], [int(n) for n in sys.argv[2:]]
def rate(side, n):
    vals = [n / (json.load(open(f))["levels"][0]["ttft_ms"]["p50"] / 1000) for f in sorted(glob.glob(f"{out}/{side}_{n}_*.json"))]
    return statistics.median(vals) if vals else float("nan")
print("| prompt tokens | llama-server prompt tok/s | ds4serve prompt tok/s | ratio |")
print("|---|---|---|---|")
for n in lengths:
    lo, ds = rate("llama", n), rate("ds4serve", n)
    print(f"| {n} | {lo:.0f} | {ds:.0f} | {ds / lo:.2f}x |")
print(f"(raw runs in {out})")
PY
