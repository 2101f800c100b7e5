"""The target's tokenizer.json read by a child interpreter, beside the weight load.

The eval needs the tokenizer only to show tokens (each prompt's first block, the health guard's repeated
token); reading a large tokenizer.json takes about a second, and the tokenizers library holds the GIL for all
of it (docs/benchmarks.md), so a thread cannot hide it, and it ran at step 1, before the weights began to
load. `TokenizerProcess` starts `python -c HELPER tokenizer.json` (this interpreter, the tokenizers package) at
once and answers `get_vocab_size()` and `decode(ids)` like a `tokenizers.Tokenizer`, each over one JSON line of
a pipe; the first call waits for the child to have read the file. A file the library cannot read is bad input (exit 3,
naming it); a child that dies or does not answer in time is an error naming it. The child ends when its stdin
closes (this process gone, or `close()`).
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from pathlib import Path

from remote_payload.contract.errors import PayloadError

HELPER = r"""
import json, sys
try:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(sys.argv[1])
except Exception as e:
    print(json.dumps({"error": " ".join(f"{type(e).__name__}: {e}".split())[:300]}), flush=True)
    sys.exit(0)
print(json.dumps({"vocab_size": tok.get_vocab_size()}), flush=True)
for line in sys.stdin:
    print(json.dumps(tok.decode(json.loads(line), skip_special_tokens=False)), flush=True)
"""
LOAD_TIMEOUT_S = 300.0  # reading the file (a 25 MB one takes seconds, not minutes)
CALL_TIMEOUT_S = 60.0


class TokenizerProcess:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._vocab: int | None = None
        self._p = subprocess.Popen([sys.executable, "-c", HELPER, str(self.path)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, encoding="utf-8")

    def _line(self, timeout: float, what: str):
        if not select.select([self._p.stdout], [], [], timeout)[0]:
            self._p.kill()  # our child, by its Popen: it did not answer
            raise PayloadError(f"{self.path}: the tokenizer helper did not {what} within {timeout:.0f}s")
        line = self._p.stdout.readline()
        if not line:
            raise PayloadError(f"{self.path}: the tokenizer helper exited (code {self._p.wait()}) before it could "
                               f"{what}")
        return json.loads(line)

    def _ready(self) -> int:
        if self._vocab is None:
            msg = self._line(LOAD_TIMEOUT_S, "read the file")
            if "error" in msg:
                raise PayloadError(f"{self.path} cannot be read as a tokenizer ({msg['error']}): fix or remove it "
                                   f"(without it, tokens are shown as ids)")
            self._vocab = int(msg["vocab_size"])
        return self._vocab

    def get_vocab_size(self) -> int:
        with self._lock:
            return self._ready()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            raise ValueError("TokenizerProcess decodes with the special tokens (skip_special_tokens=False)")
        with self._lock:
            self._ready()
            try:
                self._p.stdin.write(json.dumps([int(i) for i in ids]) + "\n")
                self._p.stdin.flush()
            except OSError:
                raise PayloadError(f"{self.path}: the tokenizer helper exited (code {self._p.wait()})") from None
            return self._line(CALL_TIMEOUT_S, "decode")

    def close(self) -> None:
        with self._lock:
            if self._p.poll() is None:
                try:
                    self._p.stdin.close()
                except OSError:
                    pass
                try:
                    self._p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._p.kill()
                    self._p.wait()
