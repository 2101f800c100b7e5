"""reval's laptop half, the core under the `reval` API (reval/) and its CLI (reval/cli/). Never imports torch,
never imports reval. Its rooms, each importing only those listed before it (tests/test_boundaries.py):

    errors.py, words.py   the one error model and exit codes; the user's words (did you mean, 36h)
    hosts/                hosts.yaml, transport (SSH / local), payload sync and venv, hosts check, Slurm text
    rundir/               a run directory: names, paths, states, local copies, follow stream, log, pull
    results/              pulled runs read and compared, their intervals and statistics
    backends/             the seam: an SSH host or the local folder (ssh.py), a Slurm cluster (slurm.py)
    runs/                 one run's lifecycle over a backend, which host a RUN names, removing runs
    render/               tables, formats (rich/md/csv/json), the HTML report, plots
    sweep/                nightly checkpoint sweeps over the hosts, their ledger and report
"""
__version__ = "0.1.0"
