"""The run runtime (stdlib only, no torch): the detached wrapper, the log/event stream, the launch's preflight and
the torch-free dummy job."""
