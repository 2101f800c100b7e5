"""Hostile files (issue 19, items 5-11): alias bombs, huge and deeply nested hosts.yaml / JSON, NaN and
Infinity in results.json, 20,000 prompts, a 384 MiB eval.log, a 20 MB line, absurd event times. Each command
runs as the user runs it, in its own process under an address-space limit and a timeout, so that a
regression fails here instead of eating the machine: one line, a documented exit code, bounded time and memory."""
from __future__ import annotations

import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTED = {0, 1, 2, 3, 4, 101, 102, 103}
MiB = 1 << 20


def bounded(cwd: Path, *argv, mem_mb: int = 512, timeout: float = 30, env: dict | None = None,
            module: str = "reval", pipe: str = "") -> subprocess.CompletedProcess:
    """`python -m reval ARGV` in its own process, its address space capped at mem_mb (a MemoryError
    or a timeout here is the regression, not a stuck machine). `pipe`: a shell command its stdout goes
    through (`tail -c 100`: a huge output never reaches this process; pipefail keeps the exit code)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb * MiB, mem_mb * MiB))
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    for k in ("REVAL_HOSTS", "REVAL_RUNS_DIR"):
        if env is None or k not in env:
            full_env.pop(k, None)
    cmd = [sys.executable, "-m", module, *argv]
    if pipe:
        import shlex
        cmd = ["bash", "-o", "pipefail", "-c", f"{shlex.join(cmd)} | {pipe}"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True,
                       text=True, errors="replace", timeout=timeout, preexec_fn=limit, check=False)
    p.elapsed = time.monotonic() - t0
    return p


def assert_one_line(p: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit `code`, no traceback, stderr's first line names the problem (every needle in it)."""
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr, p.stderr[-3000:]
    first = p.stderr.strip().splitlines()[0] if p.stderr.strip() else ""
    for n in needles:
        assert n in first, (n, p.stderr[:2000])


# --- 5. hosts.yaml: alias bombs, huge files ----------------------------------------------------------------
def alias_bomb() -> str:
    """A few hundred bytes whose nine levels of aliases expand to 9**9 strings (through `tags:`)."""
    rows = ["&a0 [" + ", ".join(["x"] * 9) + "]"]
    rows += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "hosts:\n  h1:\n    ssh: h\n    tags:\n" + "".join(f"      - {r}\n" for r in rows)


def test_an_alias_bomb_in_hosts_yaml_is_one_line_at_once(tmp_path):
    bomb = tmp_path / "hosts.yaml"
    bomb.write_text(alias_bomb())
    assert bomb.stat().st_size < 1024
    p = bounded(tmp_path, "-i", str(bomb), "hosts", mem_mb=400, timeout=15)
    assert_one_line(p, 3, str(bomb), "expands through yaml aliases")
    assert p.elapsed < 10
    # an alias to itself; a chain of 3,000 aliases each nesting the last (construct would recurse 3,000 deep)
    bomb.write_text("hosts:\n  h1: {ssh: h, tags: &t [a, *t]}\n")
    assert_one_line(bounded(tmp_path, "-i", str(bomb), "hosts", mem_mb=400), 3, "line 2", "refers to the value")
    chain = ["&a0 [x]"] + [f"&a{i} [*a{i - 1}]" for i in range(1, 3000)]
    bomb.write_text("hosts:\n  h1:\n    ssh: h\n    tags:\n" + "".join(f"      - {r}\n" for r in chain))
    assert_one_line(bounded(tmp_path, "-i", str(bomb), "hosts", mem_mb=400), 3, "nested more than 64 levels")


def test_plain_aliases_as_yaml_safe_dump_writes_them_still_load(tmp_path):
    import yaml
    shared = {"env": {"A": "1"}, "tags": ["gpu"]}
    text = yaml.safe_dump({"hosts": {"a": {"ssh": "x", **shared}, "b": {"ssh": "y", **shared}}})
    assert "*id" in text
    (tmp_path / "hosts.yaml").write_text(text)
    p = bounded(tmp_path, "-i", str(tmp_path / "hosts.yaml"), "hosts", mem_mb=400, env={"COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("gpu") >= 2


def test_nesting_100000_deep_in_hosts_yaml_is_one_line(tmp_path):
    deep = tmp_path / "hosts.yaml"
    deep.write_text("hosts:\n  h: {ssh: a, tags: " + "[" * 100_000 + "]" * 100_000 + "}\n")  # 200 KB
    p = bounded(tmp_path, "-i", str(deep), "hosts", mem_mb=400, timeout=15)
    assert_one_line(p, 3, str(deep), "line 2", "nested more than 64 levels deep")


def test_a_huge_hosts_yaml_is_refused_by_size_without_parsing_it(tmp_path):
    big = tmp_path / "hosts.yaml"
    row = "  h{}: {{ssh: host{}, workdir: /w/r, tags: [a, b]}}\n"
    big.write_text("hosts:\n" + "".join(row.format(i, i) for i in range(20_000)))  # ~1 MB: 15 s to parse
    assert big.stat().st_size > MiB
    p = bounded(tmp_path, "-i", str(big), "hosts", mem_mb=400, timeout=10)
    assert_one_line(p, 3, str(big), "larger than 256 KiB")
    assert p.elapsed < 5
    # 50 MB (sparse): only the first 256 KiB are ever read, under an address space well below it
    with open(big, "r+b") as f:
        f.truncate(50 * MiB)
    p = bounded(tmp_path, "-i", str(big), "hosts", mem_mb=300, timeout=10)
    assert_one_line(p, 3, "larger than 256 KiB")


def test_a_hosts_yaml_of_a_thousand_hosts_still_loads(tmp_path):
    ok = tmp_path / "hosts.yaml"
    ok.write_text("hosts:\n" + "".join(f"  h{i}: {{ssh: host{i}, tags: [a, b]}}\n" for i in range(1000)))
    p = bounded(tmp_path, "-i", str(ok), "hosts", mem_mb=400, timeout=30)
    assert p.returncode == 0 and "h999" in p.stdout, p.stderr


# --- 6. nesting 100,000 deep in JSON -----------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000  # 200 KB
FAST = ["--payload", "dummy", "--", "--lines", "3", "--interval-s", "0"]


def launch(here: Path, name: str, *extra: str) -> None:
    """A finished dummy run `name` on the built-in local host (its folders: .reval/local/runs, runs/local)."""
    p = bounded(here, "run", "local", "--name", name, *FAST, *extra, mem_mb=1024, timeout=120)
    assert p.returncode in (0, 1, 2), p.stderr


def test_json_nested_100000_deep_in_a_run_is_one_line_for_that_run_only(tmp_path):
    for name in ("ok", "deep"):
        launch(tmp_path, name)
    launch(tmp_path, "bad", "--exit-code", "2")
    remote, local = tmp_path / ".reval/local/runs", tmp_path / "runs/local"
    (remote / "deep/status.json").write_bytes(DEEP)
    (remote / "ok/events.jsonl").open("ab").write(DEEP + b"\n")  # the last event: what the listing reports
    p = bounded(tmp_path, "ls", env={"COLUMNS": "200"})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    rows = {ln.split()[1]: ln.split()[2] for ln in p.stdout.splitlines()[1:] if ln.startswith("local")}
    assert rows == {"ok": "succeeded", "bad": "failed", "deep": "unknown"}, p.stdout
    assert bounded(tmp_path, "ls", "--json").returncode == 0
    p = bounded(tmp_path, "status", "deep")
    assert p.returncode in (1, 101) and "deep on local: unknown" in p.stdout, p.stderr[-2000:]  # not an end
    assert_one_line(bounded(tmp_path, "kill", "deep", "--grace-s", "0"), 3, "no readable status.json")
    p = bounded(tmp_path, "prune", "--failed", "--yes")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (remote / "bad").exists() and (remote / "ok").exists() and (remote / "deep").exists()
    # the laptop's copies: compare names the file, the other runs compare as before
    for f in ("status.json", "run.json", "results.json"):
        good = (local / "ok" / f).read_bytes()
        (local / "ok" / f).write_bytes(DEEP)
        p = bounded(tmp_path, "compare", "local/ok")
        assert_one_line(p, 3, f"runs/local/ok/{f}", "nested more than 64 levels deep")
        (local / "ok" / f).write_bytes(good)
    (local / "ok/.follow.json").write_bytes(DEEP)  # damaged follow state is none: the log from its start
    p = bounded(tmp_path, "logs", "ok", "-f", timeout=60)
    assert p.returncode == 0 and "prompt1" in p.stdout, p.stderr[-2000:]


def test_the_standalone_runstate_probe_reports_each_run_despite_a_deep_one(tmp_path):
    """runstate.py as the host runs it (a script on stdin, stdlib only): a deep status.json or last event is
    that run's damage; every other run is still listed, and every line it prints is JSON."""
    import json
    for name, status, events in (("a", b'{"state": "succeeded"}', b'{"t": 1, "type": "x"}\n'),
                                 ("b", DEEP, b""), ("c", b'{"state": "failed"}', DEEP + b"\n"),
                                 ("d", b"[" * 500 + b"]" * 500, b"")):  # parses, but too deep to pass on
        (tmp_path / name).mkdir()
        (tmp_path / name / "status.json").write_bytes(status)
        (tmp_path / name / "events.jsonl").write_bytes(events)
    src = (REPO / "remote_payload/contract/runstate.py").read_bytes()
    p = subprocess.run([sys.executable, "-", "probe", str(tmp_path)], input=src, capture_output=True,
                       timeout=30, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (256 * MiB,) * 2),
                       cwd="/", env={"PATH": os.environ["PATH"]}, check=False)
    assert p.returncode == 0, p.stderr
    recs = {r["name"]: r for r in map(json.loads, p.stdout.splitlines())}
    assert recs["a"]["status"] == {"state": "succeeded"} and recs["a"]["last_event"]["type"] == "x"
    assert recs["b"]["status"] is None and "nested more than 64" in recs["b"]["status_error"]
    assert recs["c"]["status"] == {"state": "failed"} and recs["c"]["last_event"] == {}
    assert recs["d"]["status"] is None and "nested more than 64" in recs["d"]["status_error"]


# --- 7. NaN / Infinity in results.json ---------------------------------------------------------------------
def strict_json(text: str):
    """json.loads that refuses bare NaN / Infinity (what no other JSON reader takes)."""
    import json

    def refuse(c):
        raise AssertionError(f"bare {c} in the JSON output")
    return json.loads(text, parse_constant=refuse)


def test_nan_and_infinity_in_results_json_show_as_missing_and_json_stays_json(tmp_path):
    from tests.resultsgen import make_results, write_run
    nan, inf = float("nan"), float("inf")
    res = make_results("bad")
    res["metrics"].update(tau=nan, streak=inf, position_1_accuracy=nan, custom=nan)
    res["metrics"]["ddtree_tau"]["16"] = inf
    res["metrics"]["position_accuracy"][0] = -inf
    res["per_prompt"][0]["tau"] = nan
    res["per_prompt"][1]["ddtree_tau"]["32"] = inf
    res["timing"].update(total_s=inf, eval_s=nan, load_s=-inf)
    res["unknown_field"] = inf
    bad = write_run(tmp_path, "h", "bad", res)
    base = write_run(tmp_path, "h", "base", make_results("base"))
    assert "NaN" in (bad / "results.json").read_text() and "Infinity" in (bad / "results.json").read_text()
    try:
        runs = [str(bad), str(base)]
        for extra in ([], ["--per-prompt", "--per-position"], ["--baseline", str(base)], ["--wide"],
                      ["--format", "md"], ["--html", str(tmp_path / "r.html")]):
            p = bounded(tmp_path, "compare", *runs, *extra, env={"COLUMNS": "200"})
            assert p.returncode == 0 and "Traceback" not in p.stderr, (extra, p.stderr[-3000:])
        for extra in ([], ["--per-prompt", "--per-position"], ["--baseline", str(base)]):
            p = bounded(tmp_path, "compare", *runs, *extra, "--format", "json")
            assert p.returncode == 0, p.stderr[-3000:]
            out = strict_json(p.stdout)  # valid JSON: no bare NaN / Infinity anywhere
            assert "NaN" not in p.stdout and "Infinity" not in p.stdout
        row = next(r for r in out["runs"] if r["name"] == "bad")
        assert row["metrics"]["tau"] is None and row["metrics"]["streak"] is None  # missing
        assert row["metrics"]["tau_pooled"] is not None  # what is finite is still there
        p = bounded(tmp_path, "compare", *runs, "--format", "csv")
        assert p.returncode == 0, p.stderr
        header, first = p.stdout.splitlines()[:2]
        cols = dict(zip(header.split(","), first.split(",")))
        assert cols["run"] == "bad" and cols["tau"] == "", cols  # missing, not "nan"
        assert "nan" not in first.lower() and "inf" not in first.lower(), first
    finally:
        (bad / "results.json").unlink()  # damaged on purpose: the session's round-trip check is for real outputs


# --- 8. 20,000 prompts -------------------------------------------------------------------------------------
def many_prompts(run: str, n: int, quality: float = 0.8) -> dict:
    """A results.json of n prompts, fast: a 4-prompt run's prompts repeated under new names (its headline
    numbers stay those of the per-prompt data: a mean of repeated values is their mean)."""
    from tests.resultsgen import make_results
    res = make_results(run, quality=quality, num_prompts=4, max_blocks=6)
    base = res["per_prompt"]
    res["per_prompt"] = [{**base[i % 4], "name": f"prompt-{i}"} for i in range(n)]
    res["options"]["num_prompts"] = res["comparability"]["num_prompts"] = res["metrics"]["num_prompts"] = n
    res["cache"]["num_prompts_total"] = n
    return res


def test_the_intervals_of_many_prompts_are_the_same_whatever_the_chunking(monkeypatch):
    """Chunked by memory (a few resamples at a time), the seeded intervals and p-values are exactly those of
    all draws at once."""
    import numpy as np

    from orchestrator.results import stats
    rng = np.random.default_rng(5)
    n = 300
    names = [f"p{i}" for i in range(n)]
    a = stats.Sample(names, rng.random(n) * 6 + 1, np.ones(n))
    b = stats.Sample(names, a.num + rng.normal(0.05, 0.4, n), np.ones(n))
    c = stats.Sample(names, rng.integers(0, 40, n).astype(float), rng.integers(40, 60, n).astype(float))
    d = stats.Sample(names, np.minimum(c.den, c.num + rng.integers(0, 3, n)), c.den)

    def everything():
        stats._indices.cache_clear()
        return (stats.bootstrap(a), stats.bootstrap_many({"a": a, "c": c}), stats.paired(a, b),
                stats.paired_many({"ab": (a, b), "cd": (c, d)}), stats.sign_flip_p(c, d))
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 10 ** 12)  # all draws at once, as before the chunking
    whole = everything()
    monkeypatch.setattr(stats, "CACHE_MAX_ELEMENTS", 0)
    for elements in (n * 10_000, 12_345, 999, 1):  # 10,000 resamples a chunk ... one resample a chunk
        monkeypatch.setattr(stats, "CHUNK_ELEMENTS", elements)
        assert everything() == whole, elements
    est, many, pair, pairs, p = whole
    assert many["a"] == est and pairs["ab"] == pair and pairs["cd"].p_value == p  # one pass, the same numbers
    assert est.lo < est.value < est.hi and pair.delta_lo < pair.delta < pair.delta_hi


def test_compare_of_20000_prompts_stays_within_its_memory(tmp_path):
    """10,000 resamples x 20,000 prompts at once was 1.49 GiB: under a 1 GiB address space the old code died
    with a MemoryError; chunked by memory it is done in bounded time."""
    from remote_payload.contract import protocol
    run = tmp_path / "h" / "big"
    run.mkdir(parents=True)
    protocol.atomic_write_json(run / "results.json", many_prompts("big", 20_000))
    try:
        p = bounded(tmp_path, "compare", str(run), "--format", "json", mem_mb=1024, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
        row = strict_json(p.stdout)["runs"][0]
        assert row["num_prompts"] == 20_000 and row["intervals"]["tau"]["n"] == 20_000
        lo, hi = row["intervals"]["tau"]["ci"]
        assert lo < row["metrics"]["tau"] < hi
    finally:
        (run / "results.json").unlink()  # 30 MB: no need for the session's round-trip check to read it


# --- 9. a 384 MiB eval.log ---------------------------------------------------------------------------------
def test_a_huge_eval_log_is_streamed_and_tailed_from_its_end(tmp_path):
    """A 384 MiB eval.log (sparse: a hole, then four lines) under a 256 MiB address space: `logs --tail 3`
    reads its end, `logs` streams it, `pull` copies it piece by piece (all of them buffered the whole log)."""
    launch(tmp_path, "big")
    log = tmp_path / ".reval/local/runs/big/eval.log"
    with open(log, "r+b") as f:
        f.truncate(384 * MiB)
        f.seek(0, os.SEEK_END)
        f.write(b"line a\nline b\nline c\nline d\n")
    end = log.stat().st_size
    try:
        p = bounded(tmp_path, "logs", "big", "--tail", "3", mem_mb=256, timeout=60)
        assert p.returncode == 0 and p.stdout == "line b\nline c\nline d\n", p.stderr[-2000:]
        assert p.elapsed < 30
        p = bounded(tmp_path, "logs", "big", "--tail", "2", "--json", mem_mb=256, timeout=60)
        assert [strict_json(x) for x in p.stdout.splitlines()] == [
            {"offset": end - 14, "line": "line c"}, {"offset": end - 7, "line": "line d"}], p.stderr[-2000:]
        p = bounded(tmp_path, "logs", "big", mem_mb=256, timeout=240, pipe="tail -c 14")
        assert p.returncode == 0 and p.stdout == "line c\nline d\n", p.stderr[-2000:]
        p = bounded(tmp_path, "logs", "big", "--json", mem_mb=256, timeout=60, pipe="head -c 300")
        assert p.stdout.startswith('{"offset": 0, "line": "[reval]') and "Traceback" not in p.stderr, p.stderr
        p = bounded(tmp_path, "pull", "big", mem_mb=256, timeout=240)
        assert p.returncode == 0 and "pulled  local/big" in p.stdout, p.stderr[-2000:]
        copy = tmp_path / "runs/local/big/eval.log"
        assert copy.stat().st_size == end
        with open(copy, "rb") as f:
            f.seek(end - 28)
            assert f.read() == b"line a\nline b\nline c\nline d\n"
    finally:
        for f in (log, tmp_path / "runs/local/big/eval.log"):
            f.unlink(missing_ok=True)  # 384 MiB each


# --- 10. a 20 MB line without a newline --------------------------------------------------------------------
def test_logs_f_delivers_a_20_mb_line_in_pieces_and_what_follows(tmp_path):
    """The stream sent nothing of a line with no newline within 1 MiB, nor anything after it: `logs -f` ended
    (or, on a running run, waited forever) without them. Now: pieces of 1 MiB (said once), then the rest."""
    launch(tmp_path, "long")
    run = tmp_path / ".reval/local/runs/long"
    start = (run / "eval.log").stat().st_size
    long = b"x" * (20 * MiB) + "é".encode() * 10  # a piece never ends inside a character
    with open(run / "eval.log", "ab") as f:
        f.write(long + b"\nafter 1\nafter 2\n")
    with open(run / "events.jsonl", "ab") as f:  # a 3 MB events line: dropped, never held (nor a hang)
        f.write(b"{" + b"y" * (3 * MiB) + b"\n")
    p = bounded(tmp_path, "logs", "long", "-f", "--json", mem_mb=512, timeout=120, pipe="cut -c1-80")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"eval.log has a line over 1 MiB at byte {start}: shown in pieces of 1 MiB" in p.stderr
    offsets = [int(x.split(",")[0].split(":")[1]) for x in p.stdout.splitlines()]
    pieces = [o for o in offsets if start <= o < start + len(long)]
    assert len(pieces) == 21 and pieces[0] == start and all(b - a <= MiB for a, b in itertools.pairwise(pieces))
    after = start + len(long) + 1
    assert p.stdout.splitlines()[-2:] == [f'{{"offset": {after}, "line": "after 1"}}',
                                          f'{{"offset": {after + 8}, "line": "after 2"}}']
    assert '"line": "éééééééééé"}' in p.stdout  # the last piece: whole characters


# --- 11. absurd event times --------------------------------------------------------------------------------
def on_terminal(cwd: Path, *argv, mem_mb: int = 512, timeout: float = 60) -> tuple[int, str, str]:
    """`python -m reval ARGV` with its stdout on a pseudo-terminal (the rich progress bar), under an
    address-space limit: (exit code, what the terminal showed, stderr)."""
    import pty
    import select
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120", "LINES": "40", "TERM": "xterm"}
    for k in ("REVAL_HOSTS", "REVAL_RUNS_DIR"):
        env.pop(k, None)
    limited = ["bash", "-c", f'ulimit -v {mem_mb * 1024} && exec "$@"', "bash"]  # RLIMIT_AS, then the command
    p = subprocess.Popen([*limited, sys.executable, "-m", "reval", *argv], cwd=cwd, env=env,
                         stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    shown, end = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the terminal's other end is closed (the command has ended)
                    break
                if not chunk:
                    break
                shown += chunk
            elif p.poll() is not None:
                break
        else:
            p.kill()
            raise AssertionError(f"{argv} still running after {timeout} s")
        return p.wait(timeout=10), shown.decode(errors="replace"), p.stderr.read().decode(errors="replace")
    finally:
        os.close(master)
        p.stderr.close()


def test_absurd_event_times_leave_the_progress_bar_standing(tmp_path):
    launch(tmp_path, "odd")
    events = tmp_path / ".reval/local/runs/odd/events.jsonl"
    times = ["0", "1e308", "Infinity", "-Infinity", "NaN", "1" + "0" * 400, "-1e308", "5"]  # not times
    with open(events, "a") as f:  # one count (stage x, n 10)
        f.writelines(f'{{"t": {t}, "stage": "x", "i": {i}, "n": 10}}\n' for i, t in enumerate(times, 1))
    (tmp_path / "runs/local/odd/.follow.json").unlink()  # replay it all: every event through the bar
    rc, shown, err = on_terminal(tmp_path, "logs", "odd", "-f")
    assert rc == 0 and "Traceback" not in shown + err, (shown[-3000:], err[-3000:])
    assert "[3/3] prompt3" in shown and "done    odd succeeded" in shown, shown[-3000:]


# --- 12. a FIFO (or a device) where a run's file belongs ----------------------------------------------------
def test_a_fifo_where_a_run_file_belongs_never_holds_a_command(tmp_path):
    """Every reader opened status.json, events.jsonl, eval.log, .follow.json, results.json and run.json as it
    found them: a FIFO planted there held `ls`, `status`, `logs`, `pull`, `kill`, `prune` and `compare` for
    ever (26 of 36 command/file pairs on the host's side; compare and the .follow.json readers here). Now a file
    that is not a regular file is never read: a damaged run for the listing, one line and exit 3 where the
    command needs it, and the other runs go on."""
    from concurrent.futures import ThreadPoolExecutor
    planted = {"st": "status.json", "ev": "events.jsonl", "lg": "eval.log"}  # on the host's side
    for name in [*planted, "ok"]:  # each followed to its end: its copy pulled into runs/local
        launch(tmp_path, name)
    remote, local = tmp_path / ".reval/local/runs", tmp_path / "runs/local"
    for name, f in planted.items():
        (remote / name / f).unlink()
        os.mkfifo(remote / name / f)
    (local / "ok/.follow.json").unlink(missing_ok=True)
    os.mkfifo(local / "ok/.follow.json")
    refused = "is not a regular file: refused, never read"
    cases = [  # argv, exit code, what stderr's first line says (or stdout, for a row)
        (["ls"], 0, None), (["prune", "--failed", "--yes"], 0, None),
        (["status", "st"], 1, None), (["kill", "st", "--grace-s", "0"], 3, "no readable status.json"),
        (["logs", "st"], 0, None), (["logs", "st", "-f"], 3, f"runs/st/status.json {refused}"),
        (["pull", "st"], 0, None),
        (["status", "ev"], 0, None), (["logs", "ev", "-f"], 3, f"runs/ev/events.jsonl {refused}"),
        (["logs", "lg"], 3, f"runs/lg/eval.log {refused}"), (["logs", "lg", "--tail", "2"], 3, refused),
        (["logs", "lg", "-f"], 3, refused), (["pull", "lg"], 0, None),
        (["status", "ok"], 0, None), (["logs", "ok", "--tail", "1"], 0, None),
    ]
    for f in ("status.json", "run.json", "results.json"):  # the pulled copy's files, each in a copy of its own
        copy = local / f"cp-{f.split('.')[0]}"
        shutil.copytree(local / "ok", copy, ignore=shutil.ignore_patterns(".follow.json"))
        (copy / f).unlink()
        os.mkfifo(copy / f)
        cases.append((["compare", str(copy), "ok"], 3, f"{copy / f}: cannot be read (not a regular file)"))
    with ThreadPoolExecutor(4) as ex:
        done = list(ex.map(lambda c: (c, bounded(tmp_path, *c[0], timeout=60, env={"COLUMNS": "200"})), cases))
    for (argv, code, says), p in done:
        assert p.returncode == code and "Traceback" not in p.stderr, (argv, p.returncode, p.stderr[-2000:])
        if says:
            assert says in p.stderr.splitlines()[0], (argv, p.stderr)
    ls = done[0][1]
    rows = {ln.split()[1]: ln.split()[2] for ln in ls.stdout.splitlines()[1:] if ln.startswith("local")}
    assert rows["st"] == "unknown" and rows["ok"] == rows["ev"] == rows["lg"] == "succeeded", ls.stdout
    assert (remote / "st/status.json").is_fifo() and (remote / "ok").exists()  # nothing removed by prune
    assert not (local / "lg/eval.log").exists() and (local / "lg/status.json").is_file()  # pulled without it
    assert bounded(tmp_path, "pull", "ok").returncode == 0  # after compare: it read ok's copy
    assert not (local / "ok/.follow.json").exists() and (local / "ok/results.json").is_file()  # state dropped


def test_a_fifo_or_a_device_in_an_eval_input_is_bad_input_named(trained_fixtures, tmp_path):
    """The eval's inputs read the same way: a drafter or target config.json, a weight shard or a cache's files
    that are a FIFO (every read of it blocks) or a link to /dev/zero (a read that never ends) are exit 3 with
    one line naming the file; no results.json (the target's config.json was a traceback, the others hangs; so was
    a FIFO at an optional mask_embedding.pt)."""
    from concurrent.futures import ThreadPoolExecutor
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    fx = {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}
    index = json.loads((fx["target"] / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index.get("lm_head.weight", index["model.embed_tokens.weight"])  # a shard the eval reads
    cases = [("drafter", "config.json", "fifo", "cannot read drafter config {f}: not a regular file"),
             ("drafter", "config.json", "zero", "cannot read drafter config {f}: not a regular file"),
             ("drafter", "model.safetensors", "fifo", "cannot read weight file {f}: not a regular file"),
             ("drafter", "mask_embedding.pt", "fifo", "cannot read {f}: not a regular file"),  # torch.load hung
             ("drafter", "mask_embedding.pt", "zero", "cannot read {f}: not a regular file"),
             ("target", "config.json", "fifo", "{f} cannot be read (not a regular file)"),
             ("target", shard, "zero", "{f}"),
             ("cache", "cache.json", "fifo", "{f}"), ("cache", "p0001.safetensors", "fifo", "p0001.safetensors")]

    def one(i: int):
        folder, name, kind, _ = cases[i]
        w = tmp_path / str(i)
        for k, src in (("drafter", fx["drafter_good"]), ("target", fx["target"]), ("cache", fx["cache"])):
            shutil.copytree(src, w / k)
        f = w / folder / name
        f.unlink(missing_ok=True)  # mask_embedding.pt: planted where the loader looks for one
        os.mkfifo(f) if kind == "fifo" else f.symlink_to("/dev/zero")
        p = bounded(REPO, "eval", "--drafter", str(w / "drafter"), "--target", str(w / "target"), "--cache",
                    str(w / "cache"), "--run-dir", str(w / "run"), "--device", "cpu", "--max-blocks", "2",
                    module="remote_payload", mem_mb=8192, timeout=120)
        return cases[i], f, p
    with ThreadPoolExecutor(2) as ex:
        for (_, _, _, says), f, p in ex.map(one, range(len(cases))):
            assert_one_line(p, 3, says.format(f=f))
            assert not (f.parent.parent / "run" / "results.json").exists()


def test_a_ledger_that_is_a_fifo_is_one_line(tmp_path):
    """The sweep's ledger read the same way: a FIFO there held `reval sweep` before its first line."""
    (tmp_path / "sweeps").mkdir()
    ledger = tmp_path / "sweeps/ledger.json"
    os.mkfifo(ledger)
    (tmp_path / "ckpt/step-1").mkdir(parents=True)
    p = bounded(tmp_path, "sweep", "--checkpoints", "./ckpt/step-*", "--hosts", "local", "--target", "/t",
                "--cache", "/c", timeout=60)
    assert_one_line(p, 3, "ledger sweeps/ledger.json cannot be read (not a regular file)")
    assert "--sweep-dir" in p.stderr


def test_a_state_file_of_gigabytes_is_never_read_whole(tmp_path):
    """status.json, run.json and .follow.json are KBs; a planted one of 3 GiB (sparse) was read whole by the
    follow stream on the host (`logs -f`) and by compare and status here. Now at most 1 MiB of it is read: the
    stream says the status is damaged, compare refuses the copy in one line, the follow state counts as none."""
    launch(tmp_path, "big")
    remote, local = tmp_path / ".reval/local/runs/big", tmp_path / "runs/local/big"
    for f in (remote / "status.json", local / "status.json", local / "run.json", local / ".follow.json"):
        with open(f, "r+b") as fh:
            fh.truncate(3 << 30)
    p = bounded(tmp_path, "logs", "big", "-f", mem_mb=256, timeout=60)
    assert_one_line(p, 1, "status.json is damaged (larger than 1024 KiB)")
    p = bounded(tmp_path, "compare", str(local), mem_mb=256, timeout=60)
    assert_one_line(p, 3, f"{local / 'status.json'}: not valid JSON (larger than 1024 KiB)")
    p = bounded(tmp_path, "status", "big", mem_mb=256, timeout=60)
    assert p.returncode in (1, 101) and "big on local: unknown" in p.stdout, p.stderr[-2000:]
    for f in (remote / "status.json", local / "status.json", local / "run.json", local / ".follow.json"):
        f.unlink()  # 3 GiB each, if read: the session's round-trip check never sees them
