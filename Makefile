# make run: the platform on the embedded default (SQLite, Celery eager, demo data, offline planner),
#   its periodic work (sweeps, scheduled tasks) run beside the server by periodic_run.
# make test: the whole suite on PostgreSQL and Redis.
# make bench: governance overhead per run and per tool call, the floor, runs/s end to end,
#   and the auditor pages over a large history.
# make bench-ids: the WAL and time per event-log row with random and with time-ordered ids.
# make load: the message ingress at a steady rate with duplicates and one noisy actor.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
# pytest-xdist processes of `make test` (tests that start processes run on one of them).
TEST_WORKERS ?= 2

TEST_ENV := DEBUG=0 SECRET_KEY=test-only-secret-key-not-for-production-use-1234567890abcdef \
	DATABASE_URL=postgres://postgres@127.0.0.1:5432/agentgov \
	REDIS_URL=redis://127.0.0.1:6379/0 SECURE_SSL_REDIRECT=0
RUN_ENV := env -u DATABASE_URL -u REDIS_URL DEBUG=1

.PHONY: install run test bench bench-ids load lint format migrations-check schema-check ci clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed .env

.env:
	cp .env.example .env

run: install
	$(RUN_ENV) $(BIN)/python manage.py migrate --noinput
	$(RUN_ENV) $(BIN)/python manage.py seed_demo
	$(RUN_ENV) $(BIN)/python manage.py mcp_discover
	$(RUN_ENV) $(BIN)/python manage.py eval_suites_install
	@echo ""
	@echo "  Home:      http://$(HOST):$(PORT)/"
	@echo "  Admin:     http://$(HOST):$(PORT)/admin/"
	@echo "  API docs:  http://$(HOST):$(PORT)/api/docs/"
	@echo "  Logins (password agents-demo): admin (platform admin), dave (publisher, acme),"
	@echo "    alice (member, acme), bob (approver, acme), carol (auditor, acme), erin (member, globex)"
	@echo "  Model: the offline deterministic planner (no provider is called)."
	@echo ""
	$(RUN_ENV) $(BIN)/python manage.py periodic_run & periodic=$$!; \
		trap 'kill $$periodic' EXIT; trap 'exit 130' INT TERM; \
		$(RUN_ENV) $(BIN)/python manage.py runserver $(HOST):$(PORT)

test: install
	./scripts/services.sh
	./scripts/browser.sh
	$(TEST_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Governance overhead, the raw-insert floor and end-to-end runs/s, in a scratch database
# (agentgov_bench, dropped afterwards; BENCH_RUNS=200 by default); then the auditor pages
# over 100,000 runs and 1,000,000 events against raw SQL (agentgov_bench_audit).
bench: install
	./scripts/services.sh
	$(TEST_ENV) $(BIN)/python scripts/bench.py
	$(TEST_ENV) $(BIN)/python scripts/bench_audit.py

# Row ids: a million rows in a table shaped like the event log, then inserts timed, with
# random and with time-ordered ids (agentgov_bench_ids, dropped afterwards).
bench-ids: install
	./scripts/services.sh
	$(TEST_ENV) $(BIN)/python scripts/bench_ids.py

# The message ingress under load: uvicorn on loopback, LOAD_RATE requests/s (20) for
# LOAD_SECONDS (60), 10% duplicate deliveries and one actor above its rate limit, in a scratch
# database (agentgov_load, dropped afterwards); prints throughput, latency and errors by class.
load: install
	./scripts/services.sh
	$(TEST_ENV) $(BIN)/python scripts/load.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

migrations-check: install
	$(RUN_ENV) $(BIN)/python manage.py makemigrations --check --dry-run

schema-check: install
	$(RUN_ENV) $(BIN)/python manage.py spectacular --validate --fail-on-warn --file /dev/null

ci: lint migrations-check schema-check test

clean:
	rm -rf $(VENV) db.sqlite3 staticfiles
