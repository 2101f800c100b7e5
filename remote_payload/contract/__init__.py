"""The contract between the two halves (stdlib only): the run-directory protocol, the results schema, checkpoint
content hashes, run-state probes, GPU listing and the payload's errors. The ONLY part of remote_payload that
orchestrator/ imports."""
