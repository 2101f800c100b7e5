"""One root exception for the server half.

An expected failure (bad checkpoint, bad config, cache/drafter mismatch) raises a `PayloadError`
subclass whose `str()` is the one line the user sees: what is wrong, where, and the fix. The run
loop translates it into `exit_code` (3 = bad input) and writes nothing half-done.
"""
from __future__ import annotations


class PayloadError(Exception):
    exit_code = 3


class ConfigError(PayloadError):
    """A drafter/target config.json that is missing a field, has a wrong type or an unknown value."""


class CheckpointError(PayloadError):
    """A weight file that is missing, corrupt, or whose keys/shapes do not match the config."""


class FeatureMismatchError(PayloadError):
    """The drafter's fc input does not match the hidden-state cache (layers or hidden size)."""
