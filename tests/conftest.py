import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# The same CPU kernels on every machine (TensorFlow's default depends on the CPU), and the
# fast ones: oneDNN's 3D convolutions are about 3x faster than Eigen's on AVX2-only CPUs.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
