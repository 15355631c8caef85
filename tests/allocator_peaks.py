"""Peak rises of TensorFlow's CPU allocator, measured in a fresh process.

TensorFlow reports allocation peaks only with its BFC allocator on the CPU
(`TF_CPU_ALLOCATOR_USE_BFC=true`), which must be chosen before TensorFlow starts.
"""

import os
import subprocess
import sys
import textwrap

_HELPER = '''
import tensorflow as tf


def peak_rise_mib(run):
    """Call `run()` to warm up, then again: the allocator's peak rise during the second
    call over what was allocated before it, in MiB."""
    run()
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    run()
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20
'''


def allocator_peaks(script: str, onednn: bool | None = None) -> list[float]:
    """Run `script` (which may call `peak_rise_mib(run)`) in a new Python process with
    the BFC allocator; it prints one line "PEAKS v1 v2 ...". Returns those values.

    `onednn` chooses TensorFlow's CPU kernels (`TF_ENABLE_ONEDNN_OPTS`); None keeps
    TensorFlow's default, which depends on the CPU (oneDNN only where it has AVX-512 VNNI,
    BF16 or AMX). The kernels' scratch memory differs, and with it where the peak lies."""
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3"}
    if onednn is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = "1" if onednn else "0"
    source = _HELPER + textwrap.dedent(script)
    result = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [float(value) for value in result.stdout.split("PEAKS")[1].split()]
