# kmirror: `make demo` runs the main job, `make test` the test suite; both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-ops test-compat lint format bench soak docs clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt kmirror/install_horovod.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test,notebooks,docs,ray,trackers]"
	$(PY) -m kmirror.install_horovod
	touch $(STAMP)

demo: install
	$(PY) examples/demo.py

# Tests grouped (tests/conftest.py): a test's time is mostly tracing, on one core. `make test` runs
# 3 test processes on 2 cores: while one waits (a job's processes starting, a launcher's timeout),
# the others use the cores (32:27 here, against 35:50 with 2, measured one after the other).
# `.ci/run` runs test-ops beside test-compat: 2 processes each.
PARALLEL := -n 2 --dist loadgroup --no-loadscope-reorder

test: install lint
	$(PY) -m pytest -n 3 --dist loadgroup --no-loadscope-reorder -m "not ops"

# Every function of keras.ops over the rows of a layer call, in fit, evaluate and predict, compiled
# and own steps, traced on 3 replicas and eager on 2 and 3 (tests/test_op_coverage.py; about 26 min).
test-ops: install
	$(PY) -m pytest $(PARALLEL) -m ops

# The core tests on the oldest supported Keras and TensorFlow (kmirror.versions), in their own venv.
# In 2 processes, grouped as `make test` groups them.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed
COMPAT_TESTS := tests/test_equivalence.py tests/test_keras_api.py tests/test_leaving.py \
	tests/test_bad_input.py tests/test_features.py tests/test_metric_states.py tests/test_backup.py \
	tests/test_in_place.py tests/test_layer_state.py

$(COMPAT_STAMP): pyproject.toml constraints-compat.txt
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q -c constraints-compat.txt -e ".[test]"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest $(PARALLEL) $(COMPAT_TESTS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: install
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_horovod.py
	$(PY) benchmarks/bench_ring.py
	$(PY) benchmarks/bench_allreduce.py
	$(PY) benchmarks/bench_fusion.py
	$(PY) benchmarks/bench_compression.py
	$(PY) benchmarks/bench_scaling.py
	$(PY) benchmarks/bench_accumulation.py
	$(PY) benchmarks/bench_large_output.py
	$(PY) benchmarks/bench_own_step.py
	$(PY) benchmarks/bench_input_sharding.py
	$(PY) benchmarks/bench_real_models.py
	$(PY) benchmarks/report.py

soak: install
	$(PY) scripts/soak.py

docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info .pytest_cache
