"""The tokenizer read by a helper process beside the weight load (remote_payload/eval/tokproc.py): it answers
as the tokenizers library does, the weights start loading before it has read the file, a file it cannot read
is bad input (exit 3, named), a helper that dies or stalls is an error and never a hang, and no helper
outlives its eval."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from tokenizers import Tokenizer

from remote_payload.__main__ import main as payload_main
from remote_payload.contract import protocol
from remote_payload.contract.errors import PayloadError
from remote_payload.eval import steps, tokproc
from remote_payload.eval.tokproc import TokenizerProcess


def _eval(fx, tmp_path, target, name="r"):
    return payload_main(["eval", "--drafter", str(fx["drafter_good"]), "--target", str(target), "--cache",
                         str(fx["cache"]), "--run-dir", str(tmp_path / name), "--device", "cpu", "--max-blocks", "3"])


def test_the_helper_answers_as_the_tokenizers_library(fx):
    path = fx["target"] / "tokenizer.json"
    ref = Tokenizer.from_file(str(path))
    tp = TokenizerProcess(path)
    try:
        assert tp.get_vocab_size() == ref.get_vocab_size()
        n = ref.get_vocab_size()
        for ids in ([], [0], list(range(min(n, 40))), [n - 1, 3, 3, 7], list(range(n - 5, n))):
            assert tp.decode(ids) == ref.decode(ids, skip_special_tokens=False), ids
        with pytest.raises(ValueError):
            tp.decode([1], skip_special_tokens=True)
    finally:
        tp.close()
    assert tp._p.poll() == 0  # gone when its stdin closed


def test_the_weights_start_loading_before_the_tokenizer_is_read_and_no_helper_outlives_the_eval(
        fx, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "tokenizer-read"
    # the helper takes 2 s before it reads the file and leaves a mark when it has
    hello = 'print(json.dumps({"vocab_size"'
    assert hello in tokproc.HELPER
    monkeypatch.setattr(tokproc, "HELPER", "import time, pathlib; time.sleep(2)\n" + tokproc.HELPER.replace(
        hello, f"pathlib.Path({str(marker)!r}).touch()\n" + hello, 1))
    seen, helpers = [], []
    real_load, real_tp = steps.load_weights, tokproc.TokenizerProcess

    def load(*a, **kw):
        seen.append(marker.exists())
        return real_load(*a, **kw)

    def tp(path):
        helpers.append(real_tp(path))
        return helpers[-1]
    monkeypatch.setattr(steps, "load_weights", load)
    monkeypatch.setattr(tokproc, "TokenizerProcess", tp)
    assert _eval(fx, tmp_path, fx["target"]) == 0
    out = capsys.readouterr().out
    assert seen == [False] and marker.exists()  # the load began while the helper had not read the file yet
    assert "read by a helper process beside the weights" in out
    ref = Tokenizer.from_file(str(fx["target"] / "tokenizer.json"))
    assert f"tokenizer: vocab_size={ref.get_vocab_size()}" in out
    res = json.loads((tmp_path / "r" / protocol.RESULTS_JSON).read_text())
    p0 = res["per_prompt"][0]["first_block"]
    assert p0["draft"] and p0["target"]  # decoded text, through the helper
    assert len(helpers) == 1 and helpers[0]._p.poll() is not None


def test_a_tokenizer_file_that_cannot_be_read_is_bad_input_named(fx, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(fx["target"], target)
    (target / "tokenizer.json").write_text('{"model": {"type": "nothing-known"')
    assert _eval(fx, tmp_path, target, name="bad") == protocol.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"error: {target / 'tokenizer.json'} cannot be read as a tokenizer (")
    assert "fix or remove it" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad" / protocol.RESULTS_JSON).exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_tokenizer_json_that_is_not_a_regular_file_is_refused_at_once(fx, tmp_path, capsys, kind):
    """A FIFO held the helper's read until its 300 s timeout; a link to /dev/zero would read forever. Both are
    refused before the helper starts: exit 3 naming the file, no result written."""
    target = tmp_path / "target"
    shutil.copytree(fx["target"], target)
    tok = target / "tokenizer.json"
    tok.unlink()
    if kind == "fifo":
        os.mkfifo(tok)
    else:
        tok.symlink_to("/dev/zero")
    assert _eval(fx, tmp_path, target, name="bad") == protocol.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == f"error: {tok} is not a regular file: replace it with the target's tokenizer.json or remove it " \
                  "(without it, tokens are shown as ids)\n"
    assert not (tmp_path / "bad" / protocol.RESULTS_JSON).exists()


def test_a_helper_that_dies_or_stalls_is_an_error_not_a_hang(fx, monkeypatch):
    path = fx["target"] / "tokenizer.json"
    tp = TokenizerProcess(path)
    assert tp.get_vocab_size() > 0
    tp._p.kill()
    tp._p.wait()
    with pytest.raises(PayloadError, match="the tokenizer helper exited"):
        tp.decode([1, 2])
    monkeypatch.setattr(tokproc, "HELPER", "import time; time.sleep(60)")
    monkeypatch.setattr(tokproc, "LOAD_TIMEOUT_S", 0.5)
    slow = TokenizerProcess(path)
    with pytest.raises(PayloadError, match="the tokenizer helper did not read the file within"):
        slow.get_vocab_size()
    assert slow._p.wait(timeout=10) != 0  # killed: it is ours (its Popen), nothing else is signalled
