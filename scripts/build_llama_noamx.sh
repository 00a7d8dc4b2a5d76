#!/usr/bin/env bash
# llama.cpp's llama-server for an Intel Xeon with AMX, built without its AMX backend, for the peer
# comparisons (../shared/peers/*side_by_side.sh). Why: the native build (GGML_NATIVE=ON, which turns
# AMX on) aborts at start-up on the wide DS4-Flash GGUF (make_wide_ckpt.py, q8_0):
# "ggml-backend.cpp:1294: GGML_ASSERT(*cur_backend_id != -1) failed" in ggml_backend_sched_split_graph
# (seen 2026-12-06, llama.cpp vendored in llama-cpp-python 0.3.36). This build keeps every other
# instruction set the native one would use (AVX-512 with VBMI, VNNI and BF16, AVX-VNNI) and llama.cpp's
# weight repacking, so it is llama.cpp's fastest build that runs that model here.
# Uses the source tree build_llama_server.sh unpacked (run that first); prints the binary's path last.
#     scripts/build_llama_noamx.sh [PEERS_DIR/llama]
set -euo pipefail
src="${1:-${PEERS_DIR:-$HOME/.cache/ds4-peers}/llama}/src/vendor/llama.cpp"
bin="$src/build-noamx/bin/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
[ -d "$src" ] || { echo "no llama.cpp source at $src: run ../shared/peers/build_llama_server.sh first" >&2; exit 1; }
mkdir -p "$src/build-noamx" && cd "$src/build-noamx"
cmake .. -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
cmake --build . --target llama-server -j"$(nproc)" >/dev/null
echo "$bin"
