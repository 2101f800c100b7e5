"""Issue 32 item 12: names are shown, never obeyed. A prompt named with an OSC 0 (sets the terminal's title),
an OSC 52 (writes the clipboard), a C1 CSI or a bidi override, a suite named so, a host's error or status
saying so: every command that prints one (run, logs, logs -f on a terminal, logs --json, status, ls, compare
and its --per-prompt / --by suite tables in every format, the sweep's lines, the HTML page, the demo's relayed
extract lines) shows its control characters escaped (`\\x1b]0;...`), through one function, words.printable;
a CSV cell a spreadsheet would take for a formula (=, +, -, @, also after spaces) is written behind a `'`.
The run is a real eval of the trained fixtures over a cache whose prompts carry those names."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from orchestrator import sweep
from orchestrator.render import formats, html
from orchestrator.render.tables import Cell, Column, Row, Table
from orchestrator.rundir.registry import RunState
from orchestrator.words import printable
from remote_payload.runtime.dummy import fake_results, with_suites
from reval.cli.commands.runs import states_table
from reval.cli.display import json_line
from tests.resultsgen import write_run
from tests.test_hostile_files import bounded, on_terminal

TITLE = "\x1b]0;pwned-title\x07"                # OSC 0: the terminal's title
CLIP = "\x1b]52;c;cHduZWQ=\x07clip"             # OSC 52: the clipboard
CSI = "\u202egnp.exe\x9b2J"                     # a bidi override, then a C1 CSI (clear the screen)
FORMULA = '=HYPERLINK("http://evil","x")'       # a live cell in a spreadsheet
NAMES = [TITLE, CLIP, CSI, FORMULA]
OBEYED = ("\x1b]", "\x07", "\x9b", "\u202e")     # none of these may reach a terminal from a name


def assert_shown_not_obeyed(text: str, *names: str, tty: bool = False) -> None:
    """No raw control character of a name in `text` (on a terminal: rich's own CSI styling aside), and each
    name there in its escaped form."""
    raw = OBEYED if tty else ("\x1b", *OBEYED)
    assert not [c for c in raw if c in text], [text[max(0, text.find(c) - 60):text.find(c) + 20]
                                               for c in raw if c in text]
    for name in names:
        assert printable(name) in text, (printable(name), text[-3000:])


def test_printable_escapes_what_a_terminal_obeys_and_nothing_else():
    assert printable(TITLE) == "\\x1b]0;pwned-title\\x07"
    assert printable(CSI) == "\\u202egnp.exe\\x9b2J"
    assert printable("tab\there\nand\rthere") == "tab\\there\\nand\\rthere"
    assert printable("tab\there\nline", keep="\t\n") == "tab\there\nline"
    for plain in ("step-0080", "gsm8k/prompt-3", "τ 4.10 · Δ +0.2 [95% CI] — ≠ ü 日本", ""):
        assert printable(plain) == plain
    assert printable("\0" * 5) == "\\x00" * 5  # a log's hole of NULs, at C speed
    assert printable(1.5) == "1.5"


def test_csv_cells_that_would_be_formulas_are_text():
    for cell in (FORMULA, "@SUM(A1:A9)", "+1+1", "-2+3", "  =1+1", "\t=1+1", "\n@x"):
        assert formats.csv_cell(cell).startswith("'"), cell
    assert formats.csv_cell("step-0080") == "step-0080" and formats.csv_cell(-0.25) == -0.25
    assert formats.csv_cell(TITLE) == "\\x1b]0;pwned-title\\x07"


def test_json_lines_escape_what_json_leaves_raw():
    line = json_line(7, f"[1/4] {CSI}: 123 tokens {TITLE}")
    assert "\x9b" not in line and "\u202e" not in line and "\x1b" not in line
    assert json.loads(line) == {"offset": 7, "line": f"[1/4] {CSI}: 123 tokens {TITLE}"}  # the data exact
    assert json_line(0, "τ 4.10") == '{"offset": 0, "line": "τ 4.10"}\n'  # UTF-8 stays readable


@pytest.fixture(scope="module")
def hostile_run(trained_fixtures, tmp_path_factory) -> tuple[Path, str, str]:
    """A real eval on the local host over a cache whose four prompts carry NAMES: (its folder, the run's
    stdout, stderr)."""
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    paths = {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}
    index = json.loads((paths["cache"] / "cache.json").read_text())
    here = tmp_path_factory.mktemp("names")
    cache = here / "hostile-cache"
    cache.mkdir()
    prompts = [{**p, "name": n} for p, n in zip(index["prompts"], NAMES)]
    (cache / "cache.json").write_text(json.dumps({**index, "prompts": prompts}))
    for p in prompts:
        (cache / p["file"]).symlink_to(paths["cache"] / p["file"])
    p = bounded(here, "run", "local", "--drafter", str(paths["drafter_good"]),
                "--target", str(paths["target"]),
                "--cache", str(cache), "--max-blocks", "3", "--name", "hn", mem_mb=4096, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return here, p.stdout, p.stderr


def test_run_logs_status_and_ls_show_the_names_escaped(hostile_run):
    here, out, err = hostile_run
    assert_shown_not_obeyed(out + err, *NAMES)  # the log lines as `reval run` followed them
    for argv in (["logs", "hn"], ["logs", "hn", "--tail", "40"], ["logs", "hn", "-f", "--from-start"]):
        p = bounded(here, *argv, timeout=60)
        assert p.returncode == 0, (argv, p.stderr[-2000:])
        assert_shown_not_obeyed(p.stdout + p.stderr, *NAMES)
    p = bounded(here, "logs", "hn", "--json", timeout=60)
    assert p.returncode == 0 and not [c for c in OBEYED if c in p.stdout]
    lines = [json.loads(x)["line"] for x in p.stdout.splitlines()]
    assert all(any(n in line for line in lines) for n in NAMES)  # the data exact, only its writing escaped
    for argv in (["status", "hn"], ["ls"], ["status"]):
        p = bounded(here, *argv, timeout=60)
        assert p.returncode == 0 and "hn" in p.stdout, (argv, p.stderr[-2000:])
        assert_shown_not_obeyed(p.stdout + p.stderr)


def test_logs_f_on_a_terminal_shows_the_names_escaped(hostile_run):
    here, _, _ = hostile_run
    rc, shown, err = on_terminal(here, "logs", "hn", "-f", "--from-start", mem_mb=1024)
    assert rc == 0 and "done    hn succeeded" in shown, (shown[-3000:], err[-2000:])
    assert_shown_not_obeyed(shown + err, TITLE, CLIP, tty=True)


def test_compare_per_prompt_in_every_format(hostile_run):
    here, _, _ = hostile_run
    for fmt in ("table", "md", "csv"):
        p = bounded(here, "compare", "hn", "--per-prompt", "--format", fmt, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert_shown_not_obeyed(p.stdout + p.stderr, TITLE, CLIP, CSI)
    rows = list(csv.reader(io.StringIO(p.stdout)))
    prompt_cells = [r[0] for r in rows if r and r[0] not in ("prompt", "run")]
    assert f"'{FORMULA}" in prompt_cells, prompt_cells
    assert not [c for r in rows for c in r if c.lstrip(" \t").startswith(formats.FORMULA_LEADS)], rows


def test_compare_by_suite_and_its_csv_header(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    suites = ["gsm" + TITLE, "@SUM(A1:A9)"]
    for run in ("a", "b"):
        write_run(tmp_path / "runs", "h", run, results=with_suites(fake_results(run, 6), suites))
    for fmt in ("table", "md", "csv"):
        p = bounded(tmp_path, "compare", "h/a", "h/b", "--by", "suite", "--format", fmt, timeout=120,
                    env={"COLUMNS": "200"})
        assert p.returncode == 0, p.stderr[-2000:]
        assert_shown_not_obeyed(p.stdout + p.stderr, suites[0])
    cells = [c for r in csv.reader(io.StringIO(p.stdout)) for c in r]
    assert not [c for c in cells if c.lstrip(" \t").startswith(formats.FORMULA_LEADS)], cells


def test_a_host_s_words_in_the_listing_and_the_sweep_lines_are_escaped():
    from rich.console import Console
    con = Console(file=io.StringIO(), width=200, color_system=None)
    st = {"started_at": "2026-11-30T10:00:00Z" + TITLE, "finished_at": "2026-11-30T10:02:41Z", "exit_code": 1,
          "error": f"RuntimeError: prompt {CLIP} [bold]broke[/bold]"}
    con.print(states_table([RunState("gpu1", "r1", "failed", st)], {"gpu9": "ssh: " + CSI}))
    text = con.file.getvalue()
    assert_shown_not_obeyed(text, TITLE, CLIP, CSI)
    assert "[bold]broke[/bold]" in text  # text, not markup
    o = sweep.Outcome("step-5", 5, "failed", "gpu1", "step-5-abc",
                      error=f"cache: prompt {TITLE} is truncated")
    ok = sweep.Outcome("step-6", 6, "succeeded", "gpu1", "step-6-abc", tau=4.0)
    ok.suites = {"g" + CLIP: {"tau": 4.1, "ci": None}, "mean": {"tau": 4.0, "ci": None}}
    rep = sweep.SweepReport("s1", Path("/tmp/s1"), [o, ok], None, {"gpu9": "ssh: " + CSI}, 0.1)
    for width in (100, 400):  # the lines alone, and the table with its lines
        con = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
        sweep.print_report(rep, con)
        assert_shown_not_obeyed(con.file.getvalue(), TITLE, tty=True)


def test_the_html_page_holds_no_control_character():
    t = Table("per prompt", [Column("prompt", "prompt", digits=None)],
              [Row({"prompt": Cell(n, n)}) for n in NAMES])
    page = html.table_html(t)
    assert not [c for c in ("\x1b", *OBEYED) if c in page] and html.e(TITLE) in page
    assert "\\x1b]0;pwned-title\\x07" in page



def test_the_demo_relays_extract_s_lines_escaped(tmp_path, capsys, monkeypatch):
    """`reval demo` relays the fixtures build's lines (extract's `[i/n] PROMPT: ...`) as the host wrote them:
    escaped, the failure's stderr too. The seam: reval.prepare / build_fixtures (the real build is
    test_new_user's demo)."""
    import reval as api
    from tests.runtools import reval as cli

    def build(host, *, out, prepared, on_line):
        on_line(f"[1/4] {TITLE}: 123 tokens")
        on_line(f"[2/4] {CLIP}\t{CSI}: 124 tokens")
        e = api.Error("building the fixtures on local failed (exit 1)")
        e.stderr = f"RuntimeError: prompt {TITLE} broke\n"
        raise e
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(api, "prepare", lambda host: type("P", (), {"workdir": str(tmp_path / "w")})())
    monkeypatch.setattr(api, "build_fixtures", build)
    rc, out, err = cli(capsys, "demo")
    assert rc != 0 and "building the fixtures on local failed" in err
    assert_shown_not_obeyed(out + err, TITLE, CLIP, CSI)
    assert f"  [2/4] {printable(CLIP)}\t{printable(CSI)}" in out  # a tab kept: the line's own layout
