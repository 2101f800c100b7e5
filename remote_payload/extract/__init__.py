"""Extraction: the `extract` command (command.py), its generation (decode.py, fastgen.py), prefill (prefill.py),
batches (batching.py, pool.py) and the cache it writes."""
