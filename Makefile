# `make train` and `make test` are the two commands a fresh machine needs: each
# creates .venv and installs the pinned versions first when they are missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= examples/configs/gpt_pp2.yaml

.PHONY: train test test-fast install clean gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@# Graphviz's dot renders diagrams and timelines as PNG/PDF; installed where we can
	@# (root with apt-get), otherwise those renderings (and their tests) are skipped.
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq graphviz >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq graphviz >/dev/null 2>&1; }; }; } || \
	  echo "note: Graphviz's dot is not installed (apt-get install graphviz / brew install graphviz); PNG/PDF renderings are skipped"
	@# sshd and rsync let the tests run `ray up cluster.yaml` against hosts in network namespaces
	@{ command -v sshd >/dev/null || [ -x /usr/sbin/sshd ]; } && command -v rsync >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq openssh-server rsync >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq openssh-server rsync >/dev/null 2>&1; }; }; } || \
	  echo "note: sshd or rsync is not installed (apt-get install openssh-server rsync); the ray up test is skipped"
	@# Prometheus (Debian's) for the test that scrapes a head through Ray's own service discovery
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; }; }; } || \
	  echo "note: prometheus is not installed (apt-get install prometheus); the Prometheus test is skipped"
	@# Debian and Ubuntu ship Python without venv's ensurepip until python3-venv is installed
	@test -x $(BIN)/python || $(PYTHON) -c "import venv, ensurepip" 2>/dev/null || { \
	  echo "error: $(PYTHON) cannot make a virtual environment (no venv/ensurepip): run 'sudo apt-get install python3-venv' (Debian/Ubuntu; python3.X-venv for another version), then make again" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# the distribution was called "raypipe" before it was renamed raypipe-train (the index's raypipe is another project)
	@! $(BIN)/pip show -q raypipe >/dev/null 2>&1 || $(BIN)/pip uninstall -q -y raypipe
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt "torch==2.13.0"
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/raypipe train $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

# Every parity axis once and the Ray-free units, in at most 5 minutes on 2 cores (tests/fast_tier.py):
# run it on every change; `make test` before an issue is resolved.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m fast

# On a lent GPU machine (docs/testing.md): every GPU path once, figures in $OUT (or gpu-check-out/).
# Its image has no Ray: the bundle `bash ../shared/tools/device_bundle.sh` packed into .devbundle/
# is unpacked first when Ray cannot be imported. No venv there: PYTHON is the image's python3.
GPU_OUT ?= $(or $(OUT),gpu-check-out)
GPU_SITE ?= /tmp/site
gpu-check:
	@$(PYTHON) -c "import ray" 2>/dev/null || [ -d $(GPU_SITE)/ray ] || { \
	  [ -f .devbundle/site.tar.xz ] || { echo "error: Ray cannot be imported and .devbundle/site.tar.xz is missing: run 'bash ../shared/tools/device_bundle.sh' here and carry .devbundle" >&2; exit 1; }; \
	  mkdir -p $(GPU_SITE) && tar xJf .devbundle/site.tar.xz -C $(GPU_SITE); }
	PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	  $(PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
