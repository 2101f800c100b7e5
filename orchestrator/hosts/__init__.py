"""Hosts: hosts.yaml (inventory, its Slurm section, the yaml checks), how commands and files reach a host
(transport), the payload pushed there (sync) and its Python (environment), `reval hosts check` (hostcheck),
Slurm as text (slurmjobs) and the GPU vocabulary of a run and a host's run slots (gpuspec)."""
