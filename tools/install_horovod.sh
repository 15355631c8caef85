#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (CPU, Gloo) into the Python environment given as $1
# (default: the `python` on PATH), against the TensorFlow already installed there.
#
# Horovod's last release has no wheel; pip builds it from the sdist. Against TensorFlow 2.21
# four things need handling (see the README, "Building Horovod"):
#   1. build isolation hides TensorFlow from Horovod's CMake -> --no-build-isolation;
#   2. cmake 4.x from PyPI refuses Gloo's old cmake_minimum_required -> CMAKE_POLICY_VERSION_MINIMUM;
#   3. xla_mpi_ops.cc includes a header TF 2.21 moved -> a one-line forwarding header;
#   4. TF's headers include highwayhash and farmhash, shipped under include/external.
# For GPU clusters set HOROVOD_GPU_OPERATIONS=NCCL (and drop HOROVOD_WITHOUT_MPI) before
# calling this script; that path is not tested on the CPU machines this project runs CI on.
set -euo pipefail
PY=${1:-python}

if "$PY" -c "import horovod.tensorflow" 2>/dev/null; then
    echo "horovod already installed: $("$PY" -c 'import horovod; print(horovod.__version__)')"
    exit 0
fi

"$PY" -m pip install cmake packaging psutil pyyaml cloudpickle

TF_INCLUDE=$("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())')
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/tensorflow/compiler/xla/client"
echo '#include "xla/hlo/builder/xla_builder.h"' > "$SHIM/tensorflow/compiler/xla/client/xla_builder.h"

export CMAKE_POLICY_VERSION_MINIMUM=3.5
export CXXFLAGS="${CXXFLAGS:-} -I$SHIM -I$TF_INCLUDE/external/highwayhash -I$TF_INCLUDE/external/farmhash_archive/src"
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1
export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ]; then export HOROVOD_WITHOUT_MPI=1; fi
export MAKEFLAGS=${MAKEFLAGS:--j2}
# The cmake wheel puts its binary next to the interpreter.
export PATH="$(dirname "$PY"):$PATH"

echo "building horovod 0.28.1 (takes about 5 minutes the first time; pip caches the wheel)"
LOG=${HOROVOD_BUILD_LOG:-$(dirname "$PY")/../horovod-build.log}
if ! "$PY" -m pip install --no-build-isolation -v horovod==0.28.1 > "$LOG" 2>&1; then
    grep -n -E "error:|\*\*\*" "$LOG" | head -n 30 >&2 || true
    echo "horovod build failed; full log: $LOG" >&2
    exit 1
fi
"$PY" -c "import horovod.tensorflow as hvd; print('horovod', hvd.__name__, 'ok')"
