#!/usr/bin/env bash
# GPU check: on a machine with one CUDA GPU, a CUDA torch and no network, in under 8 minutes:
#   install ds4serve from this checkout out of a wheelhouse (never touching the machine's torch),
#   check that torch sees the GPU, then, each step under its own time limit:
#   (1) the CUDA tests, (2) ds4serve bench engine --device cuda, (3) a served smoke test with an
#   image on models/ds4v-tiny, (4) tensor parallel: 2 CPU processes over gloo answer as one,
#   (5) the mixed-traffic pause measurement (images bench),
#   and print ONE markdown summary table at the end, whatever failed.
#
#   scripts/gpu_check.sh [--wheelhouse DIR] [--out DIR] [--quick] [--no-install] [--plan]
#
#   --wheelhouse DIR  wheels made beforehand by scripts/make_wheelhouse.sh (default: ./wheelhouse)
#   --out DIR         logs, results.json, summary.md (default: ./gpu-check-out)
#   --quick           small sizes (a CPU run of the same steps: GPU_CHECK_DEVICE=cpu ... --quick)
#   --no-install      use the packages already installed (skip pip)
#   --plan            print what would run, run nothing
# Environment: GPU_CHECK_DEVICE (cuda, or cpu to try the script without a GPU), PYTHON (the python
# that holds torch; default python3), GPU_CHECK_BUDGET (seconds for the steps after the install;
# default 465 minus the install's seconds, at most 400).
# Exit status 0 only if every step passed.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
device="${GPU_CHECK_DEVICE:-cuda}"
PY="${PYTHON:-python3}"
wh="$root/wheelhouse"
out="$root/gpu-check-out"
quick=""
install=1
planonly=0
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) wh="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --quick) quick="--quick"; shift ;;
        --no-install) install=0; shift ;;
        --plan|--dry-run) planonly=1; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"

if [ "$planonly" = 1 ]; then
    echo "install (<= 180 s): $PY -m pip install --no-index --find-links $wh -c <torch==installed> -e .[test]"
    exec "$PY" scripts/gpu_check.py --device "$device" $quick --out "$out" --plan
fi

t0=$(date +%s)
status="pass"; figs=""
if [ "$install" = 0 ]; then
    status="skipped"; figs="--no-install: packages already installed"
elif ! torch_ver="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
    status="FAIL"; figs="$PY cannot import torch (bring a CUDA torch; the wheelhouse never holds one)"
elif [ ! -d "$wh" ]; then
    status="FAIL"; figs="no wheelhouse at $wh (scripts/make_wheelhouse.sh, where a registry is reachable)"
else
    # pin the machine's torch (and its triton): pip may never replace them, only fail
    cons="$out/constraints.txt"
    "$PY" - >"$cons" <<'EOF'
import importlib.metadata as m
for name in ("torch", "triton", "pytorch-triton"):
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        pass
EOF
    pipi=("$PY" -m pip install --no-index --find-links "$wh" -c "$cons" --disable-pip-version-check --no-input --no-compile)
    log="$out/install.log"
    : >"$log"
    if timeout 60 "${pipi[@]}" -e ".[test]" >>"$log" 2>&1; then
        figs="pip install -e .[test] from $(ls "$wh"/*.whl | wc -l) wheels"
    else
        # the wheelhouse leaves out what the check does not need (matplotlib, schemathesis): install
        # every wheel it holds, then ds4serve itself without its requirement list
        echo "== -e .[test] could not be satisfied from the wheelhouse: installing its wheels, then ds4serve --no-deps" >>"$log"
        names="$(ls "$wh" | grep '\.whl$' | sed -E 's/-[0-9][^-]*-.*//' | sort -u)"
        if timeout 75 "${pipi[@]}" $names >>"$log" 2>&1 && timeout 45 "${pipi[@]}" --no-deps -e . >>"$log" 2>&1; then
            missing="$("$PY" - <<'EOF'
import importlib.metadata as m, re
req = m.requires("ds4serve") or []
names = {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0] for r in req}
miss = []
for n in sorted(names):
    try:
        m.version(n)
    except m.PackageNotFoundError:
        miss.append(n)
print(", ".join(miss))
EOF
)"
            figs="wheelhouse + ds4serve --no-deps; not installed: ${missing:-nothing}"
        else
            status="FAIL"; figs="pip failed: $(grep -E 'ERROR' "$log" | tail -1 | cut -c1-200)"
        fi
    fi
    after="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    if [ "$status" = pass ] && [ "$after" != "$torch_ver" ]; then
        status="FAIL"; figs="$figs; torch CHANGED from $torch_ver to $after"
    elif [ "$status" = pass ] && ! "$PY" -c 'import ds4serve.cli, fastapi, uvicorn, PIL, pytest' >>"$log" 2>&1; then
        status="FAIL"; figs="$figs; ds4serve or a needed package does not import (see $log)"
    else
        figs="$figs; torch $torch_ver untouched"
    fi
fi
secs=$(( $(date +%s) - t0 ))
echo "== install: $status in ${secs} s: $figs"
# the steps get what is left of 8 minutes (less 15 s of slack), at most 400 s
budget="${GPU_CHECK_BUDGET:-$(( 465 - secs < 400 ? 465 - secs : 400 ))}"
[ "$budget" -ge 120 ] || budget=120

# the steps; the outer timeout is a backstop only (the helper keeps its own limits), and if it
# ever fires the table is rendered from what the helper saved after each finished step
timeout -k 10 $((budget + 40)) "$PY" scripts/gpu_check.py --device "$device" $quick --out "$out" \
    --budget "$budget" --install "$status|$secs|$figs"
rc=$?
if [ $rc = 124 ] || [ $rc = 137 ]; then
    echo "== the steps ran past the backstop ($((budget + 40)) s); what they saved:"
    "$PY" scripts/gpu_check.py --render "$out/results.json" || true
fi
if [ "$status" = FAIL ] && [ $rc = 0 ]; then rc=1; fi
exit $rc
