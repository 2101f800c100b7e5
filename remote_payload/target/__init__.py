"""The target model: its checks and loading (load.py) and its plain one-sequence forwards (forward.py)."""
