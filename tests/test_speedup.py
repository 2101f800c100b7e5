"""`eval --speedup`: the target's latencies measured at each batch size with their spread, kept in the latency
table (reused by later runs, measured again on --remeasure, on other batches, on a damaged, incomplete or absurd
entry, on a target changed in place), the projection pooled tau x t(decode) / (t(draft) + t(verify)) per method,
batch and suite, the best method named only outside the noise; the online check projected over its own prompts.
On the CPU fixtures (numbers: the tiny model's, only their arithmetic counts)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from remote_payload.__main__ import main as payload_main
from remote_payload.eval.latency import projected_speedup
from tests.runtools import cut_cache

FAST = ["--speedup-batches", "1,4", "--speedup-repeats", "2"]  # tiny shapes, few runs: seconds on a busy CPU


def _eval(work: Path, name: str, fx, *caches: str, more=(), target=None, table=True) -> dict:
    argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(target or fx["target"]), "--device", "cpu",
            "--num-prompts", "2", "--max-blocks", "4", "--ddtree-budgets", "16,64", "--speedup", *FAST,
            "--run-dir", str(work / "runs" / name), *more]
    argv += ["--latency-table", str(work / "latency.json")] if table else []
    for c in caches or (str(fx["cache"]),):
        argv += ["--cache", c]
    assert payload_main(argv) == 0
    return json.loads((work / "runs" / name / "results.json").read_text(), parse_constant=_no_constant)


def _no_constant(name):
    raise AssertionError(f"results.json holds {name}: not valid JSON")


@pytest.fixture(scope="module")
def halves(fx, tmp_path_factory) -> tuple[Path, Path]:
    """Two suites: the fixture cache's first five prompts and its last five."""
    root = tmp_path_factory.mktemp("halves")
    return cut_cache(fx["cache"], root / "x", 0, 5), cut_cache(fx["cache"], root / "y", 5, 10)


def _pooled(records, key=None) -> float:
    rounds = [x for r in records for x in (r["acceptance_lengths"] if key is None
                                           else r["ddtree_acceptance_lengths"][key])]
    return sum(rounds) / len(rounds)


def _lat(sp, step, tokens, batch) -> dict:
    return next(x for x in sp["latencies"] if (x["step"], x["tokens"], x["batch"]) == (step, tokens, batch))


# results.json rounds the projections to 4 decimals: abs=5e-5 beside rel=1e-3 (a projection under 0.05x, seen on a
# busy CPU, is otherwise farther than 1e-3 of itself)
def test_projection_per_method_batch_and_suite_and_the_table_reused(fx, halves, tmp_path, capsys):
    x, y = halves
    first = _eval(tmp_path, "a", fx, f"x={x}", f"y={y}")
    sp = first["speedup"]
    assert not sp["reused"] and sp["measure_s"] > 0 and (tmp_path / "latency.json").is_file()
    assert sp["table"] == str(tmp_path / "latency.json") and sp["table_note"].startswith("no entry")
    assert set(sp["verify_s"]) == {"16", "17", "65"}  # the block, DDTree-16 (17 tokens), DDTree-64 (65 tokens)
    assert sp["batches"] == [1, 4] and sp["repeats"] == 2 and sp["tau"] == "pooled" and sp["measured_at"]
    # every latency: at least the asked runs, its quartiles around the median; the batch-1 medians are the old fields
    assert len(sp["latencies"]) == 2 * (1 + 1 + 3)  # batches x (decode, draft, 3 verify sizes)
    for lat in sp["latencies"]:
        assert lat["n"] >= 2 and lat["min"] <= lat["q1"] <= lat["median"] <= lat["q3"] <= lat["max"]
    assert sp["decode_s"] == _lat(sp, "decode", 1, 1)["median"] and sp["draft_s"] == _lat(sp, "draft", 16, 1)["median"]
    # the projection uses the POOLED tau (rounds of every prompt pooled), per batch from that batch's medians
    pp = first["per_prompt"]
    for row in sp["by_batch"]:
        b = row["batch"]
        d, dr = _lat(sp, "decode", 1, b)["median"], _lat(sp, "draft", 16, b)["median"]
        assert row["projected"]["block"] == pytest.approx(
            projected_speedup(_pooled(pp), d, dr, _lat(sp, "verify", 16, b)["median"]), rel=1e-3, abs=5e-5)
        assert row["projected"]["ddtree_64"] == pytest.approx(
            projected_speedup(_pooled(pp, "64"), d, dr, _lat(sp, "verify", 65, b)["median"]), rel=1e-3, abs=5e-5)
        for m, v in row["projected"].items():
            assert row["low"][m] <= v <= row["high"][m]
        # a best method is named only when its low clears every other's high; else the tied ones are named
        assert row["best_speedup"] == max(row["projected"].values())
        if row["best_method"]:
            assert row["tied"] == [] and all(row["low"][row["best_method"]] > row["high"][m]
                                             for m in row["projected"] if m != row["best_method"])
        else:
            assert len(row["tied"]) >= 2 and row["projected"][row["tied"][0]] == row["best_speedup"]
    assert sp["projected"] == sp["by_batch"][0]["projected"] and sp["tied"] == sp["by_batch"][0]["tied"]
    for m, b in sp["stops_paying"].items():  # the first batch below 1x, or none
        below = [r["batch"] for r in sp["by_batch"] if r["projected"][m] < 1]
        assert b == (below[0] if below else None)
    assert [s["name"] for s in sp["by_suite"]] == ["x", "y"]
    for suite, by in zip(first["suites"], sp["by_suite"]):  # each suite projected from its own pooled tau
        lo, hi = suite["prompt_range"]
        want = projected_speedup(_pooled(pp[lo:hi]), sp["decode_s"], sp["draft_s"], sp["verify_s"]["16"])
        assert by["projected"]["block"] == pytest.approx(want, rel=1e-3, abs=5e-5)
    out = capsys.readouterr().out
    assert "speedup at batch 1" in out and "speedup at batch 4" in out and "stops paying" in out
    assert "latency at batch 1" in out and "[" in out.split("latency at batch 1")[1].splitlines()[0]  # the spread
    from orchestrator.render import tables
    from orchestrator.results import compare
    cmp = compare.compare([compare.load_run(tmp_path / "runs" / "a")])
    main = tables.main_table(cmp)
    assert main.rows[0].cells["speedup_best"].value == sp["best_speedup"]
    assert tables.comparison_json(cmp)["runs"][0]["speedup"]["by_batch"] == sp["by_batch"]
    again = _eval(tmp_path, "b", fx, f"x={x}", f"y={y}")
    assert again["speedup"]["reused"] and again["speedup"]["measure_s"] == 0 and again["speedup"]["table_note"] is None
    assert again["speedup"]["latencies"] == sp["latencies"] and again["speedup"]["measured_at"] == sp["measured_at"]
    assert "reused from" in capsys.readouterr().out
    # the target's hash comes from the table while its files are unchanged (a stat each, no re-read of the weights)
    from remote_payload.eval.latencytable import LatencyTable, target_content_hash, target_signature
    table, sig = LatencyTable(tmp_path / "latency.json"), target_signature(fx["target"])
    assert table.known_hash(sig) == target_content_hash(fx["target"]) == sp["target_hash"]
    assert table.known_hash(sig.replace("-sha256:", "-sha256:0")) is None
    # other batches: another entry; --remeasure: measured again, replacing its entry
    other = _eval(tmp_path, "c", fx, more=["--speedup-batches", "2"])
    assert not other["speedup"]["reused"] and other["speedup"]["batches"] == [2]
    n_entries = len(json.loads((tmp_path / "latency.json").read_text())["entries"])
    fresh = _eval(tmp_path, "d", fx, f"x={x}", f"y={y}", more=["--remeasure"])
    assert not fresh["speedup"]["reused"] and fresh["speedup"]["table_note"] == "--remeasure"
    assert fresh["speedup"]["measured_at"] >= sp["measured_at"]
    entries = json.loads((tmp_path / "latency.json").read_text())["entries"]
    assert len(entries) == n_entries  # replaced, not added
    assert [e["measured_at"] for e in entries if e["batches"] == [1, 4]] == [fresh["speedup"]["measured_at"]]


@pytest.fixture(scope="module")
def measured(fx, tmp_path_factory) -> Path:
    """A latency table holding this fixture run's entry (batches 1,4; two runs)."""
    work = tmp_path_factory.mktemp("measured")
    _eval(work, "first", fx)
    return work / "latency.json"


def _plant(measured: Path, work: Path, damage) -> None:
    data = json.loads(measured.read_text())
    damage(data["entries"][-1])
    work.mkdir(exist_ok=True)
    (work / "latency.json").write_text(json.dumps(data))


def _absurd(entry):
    for by in entry["verify"].values():
        for s in by.values():
            s.update(min=1e-300, q1=1e-300, median=1e-300, q3=1e-300, max=1e-300)
    for s in entry["draft"].values():
        s.update(min=0, q1=0, median=0, q3=0, max=0)
    for s in entry["decode"].values():
        s.update(min=1e308, q1=1e308, median=1e308, q3=1e308, max=1e308)


@pytest.mark.parametrize("damage,says", [
    (lambda e: e["verify"].pop("17"), "lacks the verify time of 17 tokens"),
    (_absurd, "is not a time within")])
def test_a_damaged_or_absurd_entry_is_a_miss_measured_again(fx, measured, tmp_path, capsys, damage, says):
    """An entry lacking a verify time, or holding absurd times (which made `infx` and `Infinity`), is refused
    and measured again: no traceback, a valid results.json (no Infinity/NaN), and the next run reuses the new
    entry."""
    _plant(measured, tmp_path, damage)
    res = _eval(tmp_path, "c", fx)  # strict JSON: parse_constant refuses Infinity/NaN
    assert res["speedup"]["reused"] is False and says in res["speedup"]["table_note"]
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not re.search(r"\binfx?\b|infinity|\bnan\b", out.lower())
    assert "refused" in out
    from remote_payload.eval.latency import Latencies
    (entry,) = json.loads((tmp_path / "latency.json").read_text())["entries"]  # the good entry replaced it
    assert Latencies.from_json(entry).to_json() == entry and entry["measured_at"] == res["speedup"]["measured_at"]


def test_a_damaged_latency_table_is_measured_again_not_a_traceback(fx, tmp_path, capsys):
    (tmp_path / "latency.json").write_text('{"schema": "reval.latency-table/1", "entries": [{"key": 1}')
    res = _eval(tmp_path, "c", fx)
    assert res["speedup"]["reused"] is False and res["speedup"]["by_suite"] is None
    assert json.loads((tmp_path / "latency.json").read_text())["entries"]  # replaced by a good table
    assert "Traceback" not in capsys.readouterr().err


def test_the_hash_shortcut_does_not_trust_names_sizes_and_mtimes(fx, measured, tmp_path):
    """Target weights changed in place with the same names, sizes and mtimes (cp -p, touch -r, tarballs) are
    hashed again: the old latencies are not reused under the old hash; another folder is hashed again too."""
    import os
    shutil.copy(measured, tmp_path / "latency.json")
    target = tmp_path / "target"
    shutil.copytree(fx["target"], target)  # copy2: the mtimes kept, as cp -p
    same = _eval(tmp_path, "copy", fx, target=target)
    assert same["speedup"]["reused"]  # same content in another folder: hashed again, the same hash, reused
    shard = min(target.glob("*.safetensors"))
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one weight bit, the size kept
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back, as touch -r does
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    changed = _eval(tmp_path, "changed", fx, target=target)
    assert changed["speedup"]["target_hash"] != same["speedup"]["target_hash"]
    assert changed["speedup"]["reused"] is False


def test_a_standalone_run_keeps_its_table_in_the_payloads_place(fx, tmp_path, monkeypatch):
    """`eval --run-dir out --speedup` without --latency-table: $REVAL_HOME/latency.json (else
    ~/.cache/reval/latency.json), never out/../../latency.json."""
    monkeypatch.setenv("REVAL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("REVAL_LATENCY_TABLE", raising=False)
    work = tmp_path / "a" / "b"
    res = _eval(work, "out", fx, table=False)
    assert res["speedup"]["table"] == str(tmp_path / "home" / "latency.json")
    assert (tmp_path / "home" / "latency.json").is_file()
    assert not list(tmp_path.glob("a/**/latency.json"))  # nothing beside the run directory
    monkeypatch.delenv("REVAL_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from remote_payload.eval.latencytable import table_path
    assert table_path() == tmp_path / "xdg" / "reval" / "latency.json"


def test_speedup_options_without_the_switch_are_refused(fx, tmp_path, capsys):
    for more, says in ((["--speedup-batches", "1,4"], "--speedup-batches tunes --speedup"),
                       (["--remeasure"], "--remeasure tunes --speedup"),
                       (["--online-repeats", "2"], "--online-repeats tunes --online")):
        argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device", "cpu",
                "--cache", str(fx["cache"]), "--num-prompts", "1", "--run-dir", str(tmp_path / "r"), *more]
        assert payload_main(argv) == 3
        assert says in capsys.readouterr().err


def test_the_same_cache_as_two_suites_is_refused_even_as_a_copy(fx, tmp_path, capsys):
    """Its prompts would count twice in every pooled figure: refused by the spec for the same path, and by the
    payload when a copy holds the same data under another path (exit 3, no results.json)."""
    copy = tmp_path / "copy"
    shutil.copytree(fx["cache"], copy)
    for caches, says in (([f"x={fx['cache']}", f"y={fx['cache']}"], "given as two suites"),
                         ([f"x={fx['cache']}", f"y={copy}"], "holds the same data as suite x's")):
        argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device", "cpu",
                "--num-prompts", "1", "--run-dir", str(tmp_path / "runs" / "dup")]
        for c in caches:
            argv += ["--cache", c]
        assert payload_main(argv) == 3
        assert says in capsys.readouterr().err
        assert not (tmp_path / "runs" / "dup" / "results.json").exists()


def test_reval_run_passes_speedup_and_online_to_the_host(fx, halves, here, capsys):
    """The issue's command shape: `reval run HOST ... --speedup --online N`; the pulled results hold both, the
    latency table lives in the host's workdir, and the online check's projection is over the same prompts it
    decoded, from their pooled tau, beside the median of its repeated timings."""
    from tests.runtools import reval
    rc, _out, err = reval(capsys, "run", "local", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]),
                         "--cache", f"s1={halves[0]}", "--cache", f"s2={halves[1]}", "--num-prompts", "3",
                         "--max-blocks", "4", "--speedup", "--online", "2", "--name", "sp", "--",
                         "--ddtree-budgets", "16", *FAST, "--online-repeats", "3")
    assert rc == 0, err
    res = json.loads((here / "runs" / "local" / "sp" / "results.json").read_text())
    events = [json.loads(x) for x in (here / "runs" / "local" / "sp" / "events.jsonl").read_text().splitlines()]
    online = [(e["i"], e["n"]) for e in events if e.get("stage") == "online" and "i" in e]
    assert online == [(1, 2), (2, 2)]  # the online phase's bar: one event a decoded prompt (issue 32 item 4)
    assert res["speedup"]["projected"]["block"] > 0 and [s["name"] for s in res["speedup"]["by_suite"]] == ["s1", "s2"]
    on = res["online"]
    assert on["prompts"] == 2 and on["rounds_agreeing"] == on["rounds"]
    same = res["per_prompt"][:2]  # the prompts decoded online, not all of them
    assert on["projected_tau"] == pytest.approx(_pooled(same), abs=1e-4) == on["tau_pooled_offline"]
    sp = res["speedup"]
    assert on["projected_speedup"] == pytest.approx(projected_speedup(
        _pooled(same), sp["decode_s"], sp["draft_s"], sp["verify_s"]["16"]), rel=1e-3, abs=5e-5)
    assert on["repeats"] == 3 and len(on["measured_speedup_runs"]) == 3
    assert all(x > 0 for x in on["measured_speedup_runs"])  # its spread: one figure per timed run
    assert on["measured_speedup"] == pytest.approx(on["target_only_s"] / on["spec_s"], rel=2e-2)  # the medians
    tables = list((here / ".reval").rglob("latency.json"))  # <workdir>/latency.json on the host
    assert len(tables) == 1 and sp["table"] == str(tables[0].resolve())


def test_the_eval_log_shows_the_online_speedups_spread():
    """The eval's summary line for --online: the measured speedup beside the range of its timed runs (a median
    alone hid a 1.12x-3.57x swing, issue 29 3b)."""
    from remote_payload.eval.summary import _online
    o = {"measured_speedup": 1.8, "measured_speedup_runs": [1.2, 1.8, 3.5], "rounds_agreeing": 4, "rounds": 4,
         "regime": None}
    assert _online(o) == "4/4 rounds = offline · measured speedup 1.80x (median of 3 timed runs, 1.20-3.50x)"
    assert _online({**o, "measured_speedup_runs": None}).endswith("measured speedup 1.80x")
