"""Writing to the user's stdout/stderr when the reader may be gone (`reval run ... | head -2`): a closed
pipe silences that stream (its fd now points at /dev/null) instead of ending the command, so a run is
still followed and pulled, and nothing prints a BrokenPipeError traceback at exit."""
from __future__ import annotations

import io
import os


def silence(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null (later writes and the exit-time flush succeed)."""
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # not a real file (a test's capture): nothing to redirect
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def write(stream, text: str) -> bool:
    """Write and flush `text`; False (and the stream silenced) when its reader has gone."""
    try:
        stream.write(text)
        stream.flush()
        return True
    except BrokenPipeError:
        silence(stream)
        return False
