# reval — the README's commands. Everything runs from the project venv (.venv).
PY      ?= .venv/bin/python
PYTEST  ?= .venv/bin/pytest
# test workers (pytest-xdist): two, as CI's machine has two cores; WORKERS=0 runs the suite in one process
WORKERS ?= 2

.PHONY: setup system-deps demo test test-fast test-gpu bench bench-payload bench-decode bench-speedup bench-orchestrator bench-sweep bench-doc lint clean

# CPU torch: the wheel that lies on this machine kind's disk (torch==2.13.0, pip finds it via
# /opt/wheels); a plain `pip install torch` would pull a ~3 GB CUDA build instead. GPU servers
# bring their own CUDA torch (hosts.yaml: venv.system_site_packages).
setup: .venv/.done
.venv/.done: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e ".[payload,orchestrator,dev]"
	touch $@

demo: setup
	.venv/bin/reval demo

# The Debian packages the suite needs (sshd, rsync, iptables, Slurm, chromium, ...): installed when missing
# (root + apt-get), else a failure naming them. One list, shared with .ci/run.
system-deps:
	scripts/install-system-deps

# The whole suite runs inside a private network namespace (scripts/netns-run): nothing a test
# does can leave the machine, and sshd/iptables fault injection stay inside it. A test that skips
# fails here (tests/whole.py): `make test` passes only when every test ran.
test: system-deps setup
	scripts/netns-run $(PYTEST) -q -ra -n $(WORKERS) $(ARGS)

# The explicit opt-out: no ssh/Slurm/slow tests, no Debian packages needed, and skips stay skips.
test-fast: setup
	REVAL_ALLOW_SKIPS=1 $(PYTEST) -q -ra -m "not ssh and not slurm and not slow" $(ARGS)

# On a CUDA host (CI has none): the GPU paths against their CPU references.
test-gpu:
	REVAL_GPU_TESTS=1 python3 -m pytest -q -ra tests/gpu $(ARGS)

# Speed tables, each a ratio against a baseline measured in the same run (see the issue notes / README).
bench: bench-payload bench-decode bench-speedup bench-orchestrator bench-sweep
bench-payload: setup      # eval vs a naive loop; 27B-drafter sizes on a GPU, tiny sizes on CPU
	$(PY) -m remote_payload bench $(ARGS)
bench-decode: setup       # extract's greedy decoding vs transformers generate() and the memory-bandwidth floor
	$(PY) -m remote_payload.tools.bench_decode $(ARGS)
bench-doc: setup          # the payload's benches, each row >= 3 runs, written into docs/benchmarks.md (GPU host)
	$(PY) -m remote_payload.tools.benchdoc $(ARGS)
bench-speedup: setup      # what eval --speedup costs (first run, reused) and the verify-latency curve
	$(PY) -m remote_payload.tools.bench_speedup $(ARGS)
bench-orchestrator: setup # sync vs bare rsync, hosts check fan-out, follow latency, `reval run` and `run --prompts` overhead
	scripts/netns-run $(PY) -m benchmarks.bench
bench-sweep: setup        # a sweep's per-checkpoint overhead beyond the eval
	scripts/netns-run $(PY) -m benchmarks.bench_sweep

lint: setup
	.venv/bin/ruff check orchestrator remote_payload reval benchmarks tests

clean:
	rm -rf .venv .cache runs .reval
