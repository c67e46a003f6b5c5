# The two commands of the README: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench compare compare-small perf install browser clean sites sites-drill wan

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || (echo "need $(PY)"; exit 1)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first: the CPU wheel on this machine; other specs pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[platform,dev]"
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium for the browser tests (Playwright cannot download its own here).
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: $(STAMP)
	$(BIN)/python manage.py demo

lint: $(STAMP)
	$(BIN)/ruff check .

# The suite runs against PostgreSQL and Redis on 127.0.0.1 (override with the env vars).
test: $(STAMP) browser
	$(BIN)/ruff check .
	DATABASE_URL=$${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/diloco} \
	REDIS_URL=$${TEST_REDIS_URL:-redis://127.0.0.1:6379/0} \
	SECRET_KEY=$${SECRET_KEY:-$$($(BIN)/python -c 'import secrets; print(secrets.token_urlsafe(50))')} \
	DJANGO_ALLOW_ASYNC_UNSAFE=true \
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python -m trainer.bench all --json bench/results/all.json --plot-dir bench/results \
		--markdown bench/results/all.md

# Decoupled with the defaults against ddp at its own best inner lr (4e-3), equal tokens, three
# seeds: tiny, M=4, H=20, 400 inner steps (about 15 min). `--preset acceptance` gives issue 3's run.
compare: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python -m trainer compare --model tiny -M 4 -H 20 --steps 400 --seeds 0,1,2 --baseline-inner-lr 4e-3 \
		--eval-batches 32 --eval-every 1 \
		--json bench/results/compare.json --plot bench/results/compare.png \
		--markdown bench/results/compare.md

# The same for `small` on the CPU, 600 inner steps, seed 0, ddp at 1e-3, its best of 1e-3 / 1.5e-3 /
# 2e-3 (docs/engine.md, "Defaults"): about an hour on 2 cores (the two runs one after the other).
compare-small: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python -m trainer compare --model small -M 4 -H 20 --steps 600 --seeds 0 --baseline-inner-lr 1e-3 \
		--eval-batches 32 --eval-every 1 \
		--json bench/results/compare_small.json --plot bench/results/compare_small.png \
		--markdown bench/results/compare_small.md

# Issue 19's figures in one table: engine (trainer.perf), in-process runner (ddp/diloco/decoupled,
# tiny M=4 1600 steps: several minutes) and the API (api_bench: needs DATABASE_URL, REDIS_URL).
# PERF_QUICK=1 make perf: a shorter run. Writes bench/results/perf.json and perf.md.
perf: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python bench/perf_report.py

# A control plane and three sites in network namespaces behind shaped uplinks (needs root;
# docs/sites.md): `make sites` stays up until Ctrl-C; `make sites-drill` runs the fault drill
# (SITES_QUICK=1 for the shorter one) and writes bench/results/sites-drill.json.
sites: $(STAMP)
	$(BIN)/python manage.py sites up

sites-drill: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python manage.py sites_drill $(if $(SITES_QUICK),--quick,) --json bench/results/sites-drill.json

# The WAN advantage on real processes: decoupled, diloco and data-parallel across three sites at
# 1000 / 100 / 20 Mbit/s per uplink (needs root; WAN_QUICK=1: 100 and 20, half the budget).
# Writes bench/results/wan-real.json, .md and .png.
wan: $(STAMP)
	mkdir -p bench/results
	DJANGO_SETTINGS_MODULE=diloco_platform.settings $(BIN)/python -m harness.wan

clean:
	rm -rf var test-artifacts
