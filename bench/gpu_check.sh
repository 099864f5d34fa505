#!/usr/bin/env bash
# The GPU check, in one call on a machine with an NVIDIA GPU and no internet:
#   1. builds llama.cpp with CUDA for this GPU's architecture only, from the trimmed
#      source that bench/gpu/prepare.sh put in .gpu/ (with llama-bench and llama-server),
#      and puts its libraries under llama-cpp-python's Python package;
#   2. installs the wheels in .gpu/wheels (what the machine's image lacks);
#   3. runs the tests marked `gpu` (they fail, not skip, without a CUDA executor);
#   4. prints our daemon vs `llama-bench -ngl 99` (one stream) and vs llama-server
#      (-ngl 99, 8 streams) on a random-weight model made there;
#   5. a draft model: ours with and without it, llama-server with and without -md, on a
#      random-weight pair sharing a vocabulary (the target the draft plus layers that
#      write nothing: every draft is accepted, so the host work per verified token shows).
# Prepare here:   bench/gpu/prepare.sh          (then carry .gpu with the working tree)
# Run there:      bash bench/gpu_check.sh 2>&1 | tee "$OUT/gpu_check.log"
# Dry run (CPU):  DRY_RUN=1 bench/gpu_check.sh  (everything but CUDA; bench/gpu/prepare.sh
#                 --python-version of this machine first)
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=${DRY_RUN:-0}
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-/tmp/gpu-check}
JOBS=$(nproc)
start=$(date +%s)
stamp() { echo "== $(( $(date +%s) - start ))s: $*"; }
mkdir -p "$WORK"
[ -f .gpu/llama-cpp-python-src.tar.gz ] || { echo "no .gpu/: run bench/gpu/prepare.sh first" >&2; exit 2; }

if [ "$DRY_RUN" = 1 ]; then
  CUDA=(-DGGML_CUDA=off)
  NGL=0
  MODEL_ARGS=(--layers 4 --embd 256 --ff 512)
else
  command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: not a GPU machine" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
  CUDA=(-DGGML_CUDA=on "-DCMAKE_CUDA_ARCHITECTURES=${ARCH}")
  NGL=99
  MODEL_ARGS=()
fi

stamp "wheels"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$WORK/site" .gpu/wheels/*.whl
export PYTHONPATH="$WORK/site:$PWD"

stamp "llama.cpp build (${CUDA[*]}, $JOBS jobs)"
rm -rf "$WORK/src"
mkdir -p "$WORK/src"
tar -xzf .gpu/llama-cpp-python-src.tar.gz -C "$WORK/src"
SRC=$(echo "$WORK"/src/llama_cpp_python-*)
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DGGML_NATIVE=ON "${CUDA[@]}" >"$WORK/cmake.log"
cmake --build "$WORK/build" -j "$JOBS" --target llama mtmd llama-bench llama-server \
  >"$WORK/build.log" || { tail -40 "$WORK/build.log"; exit 1; }
rm -rf "$WORK/site/llama_cpp"
cp -r "$SRC/llama_cpp" "$WORK/site/"
mkdir -p "$WORK/site/llama_cpp/lib"
cp -P "$WORK"/build/bin/lib*.so* "$WORK/site/llama_cpp/lib/"
$PY -c "import everycycle.hardware.executors as ex; [print(' ', e.name, e.vendor, len(e.devices), 'devices') for e in ex.discover()]"

stamp "tests marked gpu"
REQUIRE=1
[ "$DRY_RUN" = 1 ] && REQUIRE=0
EVERYCYCLE_REQUIRE_GPU=$REQUIRE $PY -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py

stamp "model"
$PY bench/gpu/make_model.py "$WORK/model.gguf" "${MODEL_ARGS[@]}"

stamp "single stream: everycycle vs llama-bench"
$PY bench/gpu/single.py --model "$WORK/model.gguf" --llama-bench "$WORK/build/bin/llama-bench" \
  --ngl "$NGL" -n 128 --rounds 3

stamp "8 streams: everycycle vs llama-server"
$PY bench/load.py -k 8 -n 128 --rounds 2 --ttft-samples 3 --model "$WORK/model.gguf" \
  --llama-server "$WORK/build/bin/llama-server" --ngl "$NGL"
stamp "draft model: everycycle vs llama-server -md"
DRAFT_ARGS=(--layers 2 --embd 2048 --ff 5632)
[ "$DRY_RUN" = 1 ] && DRAFT_ARGS=(--layers 2 --embd 256 --ff 512)
$PY bench/gpu/make_model.py "$WORK/draft.gguf" "${DRAFT_ARGS[@]}"
$PY bench/gpu/make_model.py "$WORK/target.gguf" "${DRAFT_ARGS[@]}" --inert 14
$PY bench/draft.py --target "$WORK/target.gguf" --draft "$WORK/draft.gguf" \
  --llama-server "$WORK/build/bin/llama-server" --ngl "$NGL" -n 128 --rounds 2 --draft-max 8
stamp "done"
