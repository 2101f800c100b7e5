"""The one spec of what to evaluate (remote_payload/contract/spec.py): one rule for --cache, checked once."""
from __future__ import annotations

import hashlib

import pytest

from remote_payload.contract.spec import CacheRef, EvalSpec, SpecError, joined_fingerprint, parse_caches


def test_the_cache_rule_is_decided_by_the_text_alone():
    assert CacheRef.parse("/eval/c") == CacheRef("/eval/c")
    assert CacheRef.parse("gsm8k=/eval/x") == CacheRef("/eval/x", "gsm8k")
    assert CacheRef.parse("./a=b") == CacheRef("./a=b")            # '/' before '=': a path
    assert CacheRef.parse("/x/a=b") == CacheRef("/x/a=b")
    assert CacheRef.parse("-a=/x") == CacheRef("-a=/x")              # not a usable name
    assert CacheRef.parse("gsm=").name is None                      # no path after '='
    assert CacheRef.parse("m=/x=y") == CacheRef("/x=y", "m")


def test_one_named_cache_is_one_suite_and_a_bare_one_is_not():
    one = EvalSpec(drafter="/d", target="/t", cache="gsm8k=/eval/x")
    assert one.suites() == [("gsm8k", "/eval/x")] and one.cache_label() == "gsm8k=/eval/x"
    bare = EvalSpec(drafter="/d", target="/t", cache="/eval/x")
    assert bare.suites() is None and bare.cache_label() == "/eval/x"
    several = EvalSpec(drafter="/d", target="/t", cache=["/eval/gsm8k/", "mt=/eval/mt"])
    assert several.suites() == [("gsm8k", "/eval/gsm8k/"), ("mt", "/eval/mt")]


@pytest.mark.parametrize("caches, words", [
    (["a=/x", "a=/y"], "suite name 'a' is given twice"),
    (["/e/a", "b=/f/a", "/g/a"], "suite name 'a' is given twice"),
    (["x=/eval/c", "y=/eval/c/"], "given as two suites"),
    (["/", "b=/y"], "not a usable suite name"),
])
def test_bad_suites_are_refused_naming_the_problem(caches, words):
    with pytest.raises(SpecError, match=words) as e:
        parse_caches(caches)
    assert e.value.exit_code == 3 and e.value.hint


@pytest.mark.parametrize("kw, words", [
    ({"online": -3}, "--online"), ({"online": 1.5}, "--online"), ({"online": True}, "--online"),
    ({"num_prompts": 0}, "--num-prompts"), ({"max_blocks": "3"}, "--max-blocks"),
    ({"payload": "other"}, "payload"), ({"speedup": "yes"}, "speedup"),
    ({"extra": ["--online", "3"]}, "--online among the payload's extra"),
    ({"extra": ["--cache=/x"]}, "--cache among"), ({"allow_unknown_config": ["--x"]}, "allow-unknown-config"),
    ({"drafter": ""}, "--drafter"),
])
def test_a_spec_is_checked_when_made(kw, words):
    with pytest.raises(SpecError, match=words):
        EvalSpec(**{"drafter": "/d", "target": "/t", "cache": "/c", **kw})


def test_the_argv_parses_back_to_the_same_caches():
    spec = EvalSpec(drafter="/d", target="/t", cache=["gsm=/e/a=1", "/e/mt"], num_prompts=4, max_blocks=7,
                    speedup=True, online=2, allow_unknown_config=["foo"], extra=["--dtype", "fp32"])
    argv = spec.payload_argv(name="r1")
    assert argv[:5] == ["eval", "--drafter", "/d", "--target", "/t"]
    vals = [argv[i + 1] for i, a in enumerate(argv) if a == "--cache"]
    assert parse_caches(vals) == spec.cache
    for a in ("--name", "r1", "--num-prompts", "4", "--max-blocks", "7", "--speedup", "--online", "2",
              "--allow-unknown-config", "foo", "--dtype", "fp32"):
        assert a in argv
    assert spec.preflight_argv() == ["preflight", "--drafter", "/d", "--target", "/t", "--cache", "gsm=/e/a=1",
                                     "--cache", "/e/mt", "--allow-unknown-config", "foo"]
    assert EvalSpec(payload="dummy", extra=["--lines", "3"]).payload_argv() == ["dummy", "--lines", "3"]


def test_missing_names_what_an_eval_needs():
    assert EvalSpec(target="/t").missing() == ["--drafter", "--cache"]
    assert EvalSpec(payload="dummy").missing() == []


def test_paths_are_fixed_in_one_place():
    spec = EvalSpec(drafter="d", target="t", cache=["a=c1", "c2"]).with_paths(lambda k, p: f"/w/{k}/{p}")
    assert (spec.drafter, spec.target) == ("/w/drafter/d", "/w/target/t")
    assert spec.cache == (CacheRef("/w/cache/c1", "a"), CacheRef("/w/cache/c2"))


def test_the_joined_fingerprint_is_the_one_formula():
    named = [("gsm", "sha256:aa"), ("mt", "sha256:bb")]
    want = hashlib.sha256(b"gsm\0sha256:aa\nmt\0sha256:bb\n").hexdigest()
    assert joined_fingerprint(named) == "sha256:" + want


def test_the_numbers_key_of_old_sweeps_is_unchanged():
    spec = EvalSpec(target="/t", cache="/c", max_blocks=5)
    assert spec.numbers_key() == {"payload": "eval", "target": "/t", "cache": "/c", "num_prompts": None,
                                  "max_blocks": 5, "eval_args": []}
    assert EvalSpec(target="/t", cache="/c", online=2).numbers_key()["online"] == 2


def test_the_payload_applies_the_same_checks(tmp_path):
    """The eval's own argument parsing goes through the spec: a negative --online is refused (it was clamped to
    0 in silence), a cache given as two suites is refused, one NAME=PATH is one suite."""
    import argparse

    from remote_payload.contract.errors import PayloadError
    from remote_payload.eval import evalopts
    p = argparse.ArgumentParser()
    evalopts.add_arguments(p)
    base = ["--drafter", "/d", "--target", "/t", "--run-dir", str(tmp_path / "r")]
    with pytest.raises(PayloadError, match="--online must be a whole number of at least 0"):
        evalopts.options_from_args(p.parse_args([*base, "--cache", "/c", "--online", "-1"]))
    with pytest.raises(PayloadError, match="given as two suites"):
        evalopts.options_from_args(p.parse_args([*base, "--cache", "a=/c", "--cache", "b=/c"]))
    opts = evalopts.options_from_args(p.parse_args([*base, "--cache", "gsm8k=/eval/x"]))
    assert opts.suites == [("gsm8k", "/eval/x")] and opts.cache == "gsm8k=/eval/x"
