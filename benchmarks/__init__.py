"""Dev-only benchmarks of the orchestrator (they use the test harness: real sshd hosts in a netns), outside
the installed packages: `make bench-orchestrator` (python -m benchmarks.bench), `make bench-sweep`
(python -m benchmarks.bench_sweep). The payload's own speed table is `python -m remote_payload bench`."""
