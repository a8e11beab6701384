# The README's commands: `make demo` and `make test`. Everything runs from .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test typecheck test-faults demo bench soak venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'   # test: the suite; bench: plots of make demo / make bench
	touch $(STAMP)

test: typecheck
	$(PY) -m pytest -q

# mypy --strict on the pure packages (pyproject.toml [tool.mypy]). mypy does not follow the
# editable install's import hook that maps laswrr.schemas to schemas/ and so on, so it reads a
# tree of links with the installed layout (build/mypy/laswrr/schemas -> ../../../schemas, ...):
# the files checked are the checkout's own, reported under laswrr/.
MYPY_TREE := build/mypy
TYPED := schemas scheduler
typecheck: $(STAMP)
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/laswrr
	ln -s ../../../laswrr/__init__.py $(MYPY_TREE)/laswrr/__init__.py
	for dir in $(TYPED); do ln -s ../../../$$dir $(MYPY_TREE)/laswrr/$$dir; done
	cd $(MYPY_TREE) && ../../$(PY) -m mypy --config-file ../../pyproject.toml $(foreach dir,$(TYPED),-p laswrr.$(dir))

# The fault suite alone (also part of `make test`): real processes killed by their own pid,
# poison pills, decoder fuzzing. Each fault prints a "FAULT ..." line of figures.
test-faults: $(STAMP)
	$(PY) -m pytest -q -s tests/faults tests/integration/test_poison_pill.py tests/replay/test_byte_faithful.py

# Speed goals live here, not in timed tests. Each prints its figures; results land in bench-out/.
bench: $(STAMP)
	$(PY) -m laswrr.bench.micro
	$(PY) -m laswrr.bench.bus_bench
	$(PY) -m laswrr.bench.event_cpu
	$(PY) -m laswrr.bench.recorder_bench
	$(PY) -m laswrr.bench.replay_bench
	$(PY) -m laswrr.bench.proxy_bench

# The whole stack under 60 % load for SOAK_MIN minutes (default 60), sampled for leaks and recorder
# lag (bench/soak.py); not part of `make test`. `make soak SOAK_MIN=10` for a short one.
SOAK_MIN ?= 60
soak: $(STAMP)
	$(PY) -m laswrr.bench.soak --duration-min $(SOAK_MIN) --warmup-min $$(( $(SOAK_MIN) < 20 ? $(SOAK_MIN) / 4 : 10 ))

demo: $(STAMP)
	$(VENV)/bin/laswrr demo --out demo-out

clean:
	rm -rf $(VENV) .laswrr demo-out bench-out
