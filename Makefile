# Single entry points. `make demo` and `make test` set everything up on first use.
PY := .venv/bin/python
STAMP := .venv/.magicpig-setup-ok

.PHONY: setup demo test test-fast lint bench-kernel bench-e2e clean

$(STAMP): setup.sh pyproject.toml setup.py $(wildcard cpp/*.cpp cpp/*.h)
	./setup.sh

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m vllm_magicpig.demo

# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
# The slowest tests are listed: CI must finish within 90 minutes, and that list says where it goes.
test: $(STAMP) lint
	$(PY) -m pytest -ra -q --durations=25 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran"; exit 1; fi; exit $$rc

test-fast: $(STAMP) lint
	$(PY) -m pytest -ra -q -m "not e2e and not server" tests; rc=$$?; if [ $$rc -eq 5 ]; then exit 1; fi; exit $$rc

# Style at the width the code uses (120): ruff for Python, clang-format for the kernel.
lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/clang-format --dry-run --Werror cpp/*.cpp cpp/*.h benchmarks/native/*.cpp

bench-kernel: $(STAMP)
	$(PY) benchmarks/kernel_bench.py

bench-e2e: $(STAMP)
	$(PY) benchmarks/e2e_decode.py

clean:
	rm -rf build *.egg-info vllm_magicpig/_C*.so
