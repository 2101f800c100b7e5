"""Runs over a backend: one run's lifecycle (prepare, submit, attach, follow, wait, kill), which host a RUN
reference names (locate), and removing runs (remove). Above the backends and the run directory."""
