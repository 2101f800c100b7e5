"""Prompts: the prompt files `extract` reads (files.py) and the target's chat template (chat.py)."""
