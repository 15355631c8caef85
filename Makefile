# Two commands on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# oneDNN's CPU kernels: TensorFlow turns them on only on CPUs with AVX-512 VNNI, BF16 or
# AMX, yet its 3D convolutions are about 3x faster than the default ones on AVX2 CPUs too.
export TF_ENABLE_ONEDNN_OPTS ?= 1

HOROVODRUN := $(VENV)/bin/horovodrun --gloo -np 2 -H localhost:2

.PHONY: venv test test-fast demo demo-layers claim bench bench-halo bench-latency bench-interference validate-model profile clean

venv: $(STAMP)

$(STAMP): pyproject.toml tools/install_horovod.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,plot]'
	bash tools/install_horovod.sh $(PY)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not distributed"

# CosmoFlow end to end: synthetic universes, 2-rank spatial training, evaluation table.
demo: $(STAMP)
	$(PY) tools/demo_cosmoflow.py

# Exactness of the spatial layers: 2-rank forward+backward against plain Keras.
demo-layers: $(STAMP)
	$(HOROVODRUN) $(PY) tools/demo_layers.py

# docs/cosmoflow_claim.md: CosmoFlow on 32^3, 64^3 crops and whole 128^3 universes
# (seed 1, as published; about 110 minutes on an idle 2-core machine).
claim: $(STAMP)
	$(PY) tools/cosmoflow_volume_claim.py --seed 1

# docs/benchmarks.md: strong scaling (3 rounds) and memory, about 35 minutes (run on an
# otherwise idle machine).
bench: $(STAMP)
	$(PY) benchmarks/bench_scaling.py
	$(PY) benchmarks/bench_memory.py

# docs/benchmarks.md, profile section: per-rank breakdown of a step (TensorFlow profiler).
profile: $(STAMP)
	$(PY) benchmarks/profile_step.py

bench-halo: $(STAMP)
	$(HOROVODRUN) $(PY) benchmarks/bench_halo.py

# Latency of one small allreduce / alltoall in a tf.function chain, vs loopback TCP.
bench-latency: $(STAMP)
	$(HOROVODRUN) $(PY) benchmarks/bench_collective_latency.py

# What an idle Horovod job costs two training processes, per KERAS_SPATIAL_COMM_THREADS.
bench-interference: $(STAMP)
	$(PY) benchmarks/bench_comm_interference.py

# Calibrate the performance model here and compare it with measured steps, about 12 minutes.
validate-model: $(STAMP)
	$(PY) benchmarks/validate_cost_model.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
