#!/usr/bin/env bash
# Build a small wheelhouse of ds4serve's pure-Python (and small binary) dependencies for a machine
# with no network, e.g. a GPU box that already has a CUDA torch. Run it where pip can reach a
# registry; then bring the folder along and run scripts/gpu_check.sh there.
#
#   scripts/make_wheelhouse.sh [--python 3.12] [--out wheelhouse] [--no-transformers] [--full]
#                              [--exclude NAME,NAME,...]
#
# * The target is CPython 3.12 on manylinux x86_64 unless --python says otherwise (the wheels of
#   pydantic-core, pillow, numpy, ... are built per Python version: use the target's, e.g.
#   `--python 3.11` for this repository's CPU machine).
# * torch is never downloaded: the requirement list is read from pyproject.toml with torch removed,
#   and accelerate (whose requirements name torch) is fetched with --no-deps (its other needs are
#   listed explicitly); triton (CUDA torch brings its own) is left out too. Anything named torch /
#   nvidia-* / triton that still shows up is an error.
# * transformers==5.23.0 (the CUDA tests' reference checkpoints, bench engine's peer) is included
#   (~22 MB with its dependencies) unless --no-transformers. matplotlib (plots of bench serve only)
#   and schemathesis (the HTTP schema fuzz test only) are left out unless --full: together ~27 MB,
#   which would break the ~60 MB budget; gpu_check.sh installs without them when they are absent.
# * --exclude drops the wheels of packages the target machine already has (after resolving, so the
#   rest is still complete): the target's own versions are then used if they satisfy ds4serve.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
pyver="3.12"
out="$here/wheelhouse"
transformers=1
full=0
exclude=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) pyver="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --no-transformers) transformers=0; shift ;;
        --full) full=1; shift ;;
        --exclude) exclude="$2"; shift 2 ;;
        -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
PY="${PYTHON:-python3}"
abi="cp${pyver/./}"
mkdir -p "$out"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT

# the requirement list, from pyproject.toml (dependencies + the test extra), torch and accelerate out
"$PY" - "$here/pyproject.toml" "$transformers" "$full" >"$reqs" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
with_tf, full = sys.argv[2] == "1", sys.argv[3] == "1"
skip = {"torch", "accelerate", "triton"} | (set() if with_tf else {"transformers"}) \
    | (set() if full else {"matplotlib", "schemathesis"})
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0].lower()
    if name not in skip:
        print(req)
# needs of accelerate (fetched without its requirements, which name torch), small
print("psutil\npyyaml" + ("\nhuggingface-hub" if with_tf else ""))
# an editable install of ds4serve builds with setuptools (build isolation, no index)
print("setuptools>=68")
EOF

plat=(--only-binary=:all: --implementation cp --python-version "$pyver" --abi "$abi"
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
echo "== resolving for CPython $pyver manylinux x86_64 into $out:"
sed 's/^/   /' "$reqs"
quiet() { "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }  # a local index's noise
quiet "$PY" -m pip download -q -d "$out" "${plat[@]}" -r "$reqs"
if [ "$transformers" = 1 ] || [ "$full" = 1 ]; then
    quiet "$PY" -m pip download -q -d "$out" "${plat[@]}" --no-deps "accelerate>=1.0"
fi

for name in ${exclude//,/ }; do
    norm="$(echo "$name" | tr 'A-Z-.' 'a-z__')"
    for f in "$out"/*.whl; do
        base="$(basename "$f" | sed -E 's/-[0-9].*//' | tr 'A-Z-.' 'a-z__')"
        [ "$base" != "$norm" ] || rm -f "$f"
    done
done

bad="$(ls "$out" | grep -iE '^(torch|nvidia|triton)[-_]' || true)"
if [ -n "$bad" ]; then
    echo "ERROR: the wheelhouse holds torch or its CUDA stack (must never be brought along):" >&2
    echo "$bad" >&2
    exit 1
fi
# leftovers of another Python version make two candidates of one package: say so
dups="$(ls "$out" | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)"
[ -z "$dups" ] || echo "note: several versions of: $dups (an older run's files; delete the folder to start clean)"

n="$(ls "$out"/*.whl | wc -l)"
bytes="$(du -cb "$out"/*.whl | tail -1 | cut -f1)"
mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
echo "== wheelhouse: $out: $n wheels, $mib MiB (budget ~60 MB; CPython $pyver, manylinux x86_64)"
if [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
    echo "WARNING: over the ~60 MB budget (try --no-transformers, or leave out --full)" >&2
fi
