#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (TensorFlow + Gloo) into a virtualenv, against the TensorFlow already there.
#
# Usage: scripts/install_horovod.sh [VENV]        (VENV defaults to .venv)
#
# Horovod 0.28.1 ships only as an sdist, and as published it does not compile against TensorFlow >= 2.18:
# horovod/tensorflow/xla_mpi_ops.cc includes XLA headers that TensorFlow's wheel no longer ships. Those ops
# only serve XLA-compiled GPU graphs, so the build leaves that one file out. The built wheel is cached in
# $KMIRROR_CACHE/horovod/ (default ~/.cache/kmirror; keyed by the TensorFlow version and build flags),
# so a second run takes seconds.
#
# GPU machines: export HOROVOD_GPU_OPERATIONS=NCCL (and, if needed, HOROVOD_NCCL_HOME / HOROVOD_CUDA_HOME)
# before running; the flags become part of the cache key.
set -euo pipefail

VENV=${1:-.venv}
PY="$VENV/bin/python"
VERSION=0.28.1

if "$PY" -c "import horovod.tensorflow as h; assert h.gloo_built()" 2>/dev/null; then
    echo "horovod $VERSION already installed in $VENV"
    exit 0
fi

export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
TF_VERSION=$("$PY" -c "import tensorflow as tf; print(tf.__version__)")
KEY="tf${TF_VERSION}-$(uname -m)-gpu${HOROVOD_GPU_OPERATIONS:-none}"
CACHE="${KMIRROR_CACHE:-$HOME/.cache/kmirror}/horovod/$KEY"
mkdir -p "$CACHE"

WHEEL=$(ls "$CACHE"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$WHEEL" ]; then
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    echo "building horovod $VERSION against tensorflow $TF_VERSION (a few minutes) ..."
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$VERSION"
    tar -xzf "$BUILD"/horovod-$VERSION.tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$VERSION"
    # Leave out the XLA ops: their headers are not in TensorFlow's wheel.
    sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
    # cmake and the compiler must see the venv's TensorFlow, and the build runs without isolation for that.
    "$PY" -m pip install -q "cmake<4" setuptools wheel
    PATH="$VENV/bin:$PATH" MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$CACHE" "$SRC" > "$BUILD/build.log" 2>&1 \
        || { tail -n 40 "$BUILD/build.log"; exit 1; }
    WHEEL=$(ls "$CACHE"/horovod-*.whl | head -n 1)
fi
"$PY" -m pip install -q --no-deps "$WHEEL"
# Horovod's runtime needs these (it was installed without dependency resolution to keep TF untouched).
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
"$PY" -c "import horovod.tensorflow as h; assert h.gloo_built(), 'horovod was built without gloo'"
echo "horovod $VERSION installed from $WHEEL"
