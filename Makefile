# The README's commands: `make demo` and `make test`. Everything runs from .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-faults demo bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'   # test: the suite; bench: plots of make demo / make bench
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

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

demo: $(STAMP)
	$(VENV)/bin/laswrr demo --out demo-out

clean:
	rm -rf $(VENV) .laswrr demo-out bench-out
