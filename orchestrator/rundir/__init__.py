"""A run directory, on its host and here: names, paths and the state vocabulary, the local copies in runs/
(registry), the follow stream (follow) and its typed events (events), the run's log (logs), and pulling its
files (pull). Below the backends: they read and write run directories through these."""
