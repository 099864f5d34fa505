#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh needs on a GPU machine with no internet, in .gpu/
# (ignored by git; carried to the device with the working tree, under 64 MiB):
#   .gpu/llama-cpp-python-src.tar.gz  llama-cpp-python's sdist, trimmed to the Python
#                                      package and the llama.cpp sources a CUDA build needs
#   .gpu/wheels/                       pure or manylinux wheels of what the machine lacks
# Usage: bench/gpu/prepare.sh [--python-version 3.12]   (the device's python3 is 3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=3.12
[ "${1:-}" = "--python-version" ] && PYV=$2
VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
OUT=.gpu
PIP="${PYTHON:-python3} -m pip"
mkdir -p "$OUT/wheels"
grep -qx '.gpu/' .gitignore || echo '.gpu/' >> .gitignore

# 1. The sdist, trimmed: no prebuilt vocabularies, docs, web UI, tests, examples, or
#    backends a CUDA (or CPU) build does not compile.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PIP download --quiet --no-binary :all: --no-deps -d "$work" \
  "llama-cpp-python==$VERSION"
tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION"
lc="$src/vendor/llama.cpp"
rm -rf "$src"/{.git,docs,examples,tests,docker,scripts} "$lc"/{models,docs,media,examples,tests,\
gguf-py,.devops,.github,build,benches,.git} "$lc"/tools/server/public* "$lc"/tools/server/webui
for b in "$lc"/ggml/src/ggml-*/; do
  case "$(basename "$b")" in
    ggml-cpu|ggml-cuda|ggml-blas) ;;
    *) rm -rf "$b" ;;
  esac
done
# CMake adds a backend's directory only when it is enabled, but some list the
# examples and tests; keep their CMake entry points as empty stubs.
mkdir -p "$lc/examples" "$lc/tests"
: > "$lc/examples/CMakeLists.txt"
: > "$lc/tests/CMakeLists.txt"
tar -czf "$OUT/llama-cpp-python-src.tar.gz" -C "$work" "llama_cpp_python-$VERSION"

# 2. Wheels for what the device's image lacks (its list: the device tool's KINDS.md).
#    Pure-Python ones and manylinux builds for its Python; --no-deps, each named.
pure=(typer rich markdown-it-py mdurl pygments shellingham starlette uvicorn h11
      prometheus-client prompt-toolkit wcwidth platformdirs diskcache gguf tqdm
      hypothesis sortedcontainers pytest pluggy iniconfig pytest-timeout anyio sniffio
      click annotated-doc packaging
      typing-extensions idna pexpect ptyprocess jinja2)
binary=(httptools pyyaml markupsafe)
$PIP download --quiet --no-deps --only-binary=:all: -d "$OUT/wheels" --python-version "$PYV" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any "${pure[@]}" "${binary[@]}"
du -sh "$OUT" "$OUT"/*
