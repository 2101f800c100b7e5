"""Every command line in README.md and docs/*.md runs as written, as far as parsing goes: each `reval ...` line of a
fenced code block is parsed by the real argument parser (strictly: a mistyped flag, a missing value or an unknown
command fails), each `python -m remote_payload ...` line by the payload's, each `make TARGET` names a target of the
Makefile, each hosts.yaml example loads as an inventory, each Python example compiles, and each relative link
points at a file (and heading) that exists. The same idea as docs/results.md, which a test keeps equal to the
schema it documents."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli():
    """The real parsers: the one place that names where the CLI lives (change it here when the CLI moves).
    `run_options`: `reval run` takes everything after HOST as one REMAINDER list and parses the options in it
    itself (a typo there is only caught by that second parse), so a `run` line is checked by both."""
    from orchestrator.hosts.inventory import parse_inventory
    from reval.cli import build_parser
    from reval.cli.commands.run import _split_extra as run_options
    return argparse.Namespace(build_parser=build_parser, run_options=run_options, parse_inventory=parse_inventory)


# Command lines in the docs that must NOT parse, each with the reason it is shown. The test fails when one of them
# parses (the example no longer shows what it says) or is no longer in the docs (the entry is stale).
MUST_FAIL = {
    "reval ls --jsn": "docs/cli.md shows the 'did you mean' that a mistyped flag gets",
}

# Linked pages that another change writes; a link to one of them may point nowhere until it lands.
PENDING_PAGES: set[str] = set()

SHELL_OPERATORS = {"|", "||", "&&", ";", "&", "<"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def fenced_blocks(text: str):
    """(language, first line number, lines) of every fenced code block (``` or ~~~)."""
    lang, start, lines, fence = None, 0, [], None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if m:
                fence, lang, start, lines = m.group(1), m.group(2).lower(), n + 1, []
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            yield lang, start, lines
            fence = None
        else:
            lines.append(line)


def joined_lines(start: int, lines: list[str]):
    """(line number, text) with `\\` continuations joined into one line."""
    buf, first = "", None
    for n, line in enumerate(lines, start):
        if first is None:
            first = n
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        yield first, buf + line
        buf, first = "", None
    if first is not None:
        yield first, buf


def command_argv(line: str, program: str) -> list[str] | None:
    """The words of the `program ...` command in a shell line (after a `$ ` prompt, a `cd ... &&`, a path such as
    `.venv/bin/reval` or `ExecStart=`), up to a `# comment`, a pipe or a redirection; None when the line runs no
    such command. `program` may be several words (`python -m remote_payload`)."""
    words = re.escape(program).replace(r"\ ", r"\s+")
    m = re.search(rf"(?:^|[\s/]){words}(?:\s|$)", line)
    if not m or re.search(r"(?:^|\s)#", line[:m.start()]):  # none, or only inside a comment
        return None
    seg = line[m.start():].lstrip().lstrip("/")
    try:
        tokens = shlex.split(seg, comments=True)
    except ValueError as e:  # an unclosed quote
        return [f"<unparsable shell line: {e}>"]
    cut = next((i for i, t in enumerate(tokens)
                if t in SHELL_OPERATORS or re.fullmatch(r"\d*(>>?|<)(&\d*)?|&>>?", t)), len(tokens))
    return tokens[len(program.split()):cut]


def doc_commands(program: str, paths=None):
    """(where, the line as written, argv) of every `program` command in a shell code block of the docs. In a
    transcript (a block with `$ ` prompts) only the prompted lines are commands; the rest is their output."""
    for path in paths or doc_files():
        for lang, start, lines in fenced_blocks(path.read_text(encoding="utf-8")):
            if lang in ("python", "py", "yaml", "yml", "json"):
                continue
            transcript = any(ln.startswith("$ ") for ln in lines)
            for n, line in joined_lines(start, lines):
                if transcript and not line.startswith("$ "):
                    continue
                argv = command_argv(line, program)
                if argv is not None:
                    yield f"{rel(path)}:{n}", " ".join(line.split()), argv


def parse_error(parse) -> str | None:
    """None when `parse()` accepts its argv; else argparse's own message (it exits: caught here)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse()
    except SystemExit as e:
        if e.code in (0, None):  # --help, --version
            return None
        lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
        first = next((i for i, ln in enumerate(lines) if "error:" in ln), 0)  # after the usage text
        return " / ".join(lines[first:]) or f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 - the command's own check (reval run's options after HOST)
        return f"{e}" + (f" ({e.hint})" if getattr(e, "hint", None) else "")
    return None


def no_abbreviations(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser and its sub-commands' refusing abbreviated flags: the docs spell each flag in full (an
    abbreviation argparse accepts today stops working once a flag with the same prefix is added)."""
    todo = [parser]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        todo += [sp for a in p._actions if isinstance(a, argparse._SubParsersAction) for sp in a.choices.values()]
    return parser


def reval_error(argv: list[str]) -> str | None:
    """Why the real `reval` parser refuses argv (None: it parses), strictly: no parse_known_args."""
    c = cli()

    def parse():
        args = no_abbreviations(c.build_parser()).parse_args(argv)
        if getattr(args, "command", None) == "run":
            c.run_options(args)
    return parse_error(parse)


def payload_error(argv: list[str]) -> str | None:
    """Why `python -m remote_payload` refuses argv; its parser built as its main() builds it (only the named
    command's module is imported)."""
    from remote_payload.__main__ import COMMANDS, Parser, command_of

    def parse():
        p = Parser(prog="python -m remote_payload")
        sub = p.add_subparsers(dest="command", metavar="COMMAND")
        wanted = command_of(argv)
        for name, (mod, _) in COMMANDS.items():
            sp = sub.add_parser(name)
            if name == wanted:
                importlib.import_module(mod).add_arguments(sp)
        p.parse_args(argv)
    return parse_error(parse)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.MULTILINE)}


def make_targets_named(words: list[str]) -> list[str]:
    """The targets of a `make` command's words (not its options or VAR=value assignments)."""
    return [w for w in words if not w.startswith("-") and "=" not in w]


def doc_make_commands():
    """(where, words after `make`) for every `make ...` in a code block or an inline code span."""
    yield from ((where, argv) for where, _, argv in doc_commands("make"))
    for path in doc_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"`make ([^`]+)`", line):
                yield f"{rel(path)}:{n}", shlex.split(m.group(1))


# --- the docs -------------------------------------------------------------------------------------------------

def test_every_reval_line_in_the_docs_parses():
    found = list(doc_commands("reval"))
    assert len(found) >= 60, f"only {len(found)} reval lines found in the docs: is the extraction broken?"
    bad, seen_must_fail = [], set()
    for where, line, argv in found:
        key = " ".join(["reval", *argv])
        err = reval_error(argv)
        if key in MUST_FAIL:
            seen_must_fail.add(key)
            if err is None:
                bad.append(f"{where}: {line}\n    parses, but MUST_FAIL says it must not ({MUST_FAIL[key]})")
        elif err is not None:
            bad.append(f"{where}: {line}\n    {err}")
    stale = sorted(set(MUST_FAIL) - seen_must_fail)
    assert not stale, f"MUST_FAIL entries no longer in the docs (remove them): {stale}"
    assert not bad, "command lines in the docs that the real parser refuses:\n" + "\n".join(bad)


def test_every_payload_line_in_the_docs_parses():
    found = list(doc_commands("python -m remote_payload"))
    assert len(found) >= 5, f"only {len(found)} payload lines found in the docs"
    bad = [f"{where}: {line}\n    {err}" for where, line, argv in found if (err := payload_error(argv))]
    assert not bad, "payload command lines in the docs that its parser refuses:\n" + "\n".join(bad)


def test_every_make_target_in_the_docs_exists():
    targets = makefile_targets()
    assert {"setup", "demo", "test", "test-fast", "bench"} <= targets, f"Makefile parsed wrong: {sorted(targets)}"
    found = list(doc_make_commands())
    assert len(found) >= 5
    bad = [f"{where}: make {' '.join(words)} (no target {t!r})"
           for where, words in found for t in make_targets_named(words) if t not in targets]
    assert not bad, f"make targets the Makefile lacks (it has {', '.join(sorted(targets))}):\n" + "\n".join(bad)


def test_the_readme_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: it is the front door, the rest goes to docs/"
    head = "\n".join(lines[:20])
    assert re.search(r"^make demo\s+#", head, re.MULTILINE) and re.search(r"^make test\s+#", head, re.MULTILINE), head


def test_hosts_yaml_examples_load():
    c = cli()
    seen = 0
    for path in doc_files():
        for lang, start, lines in fenced_blocks(path.read_text(encoding="utf-8")):
            if lang in ("yaml", "yml") and any(re.match(r"hosts:\s*$", ln) for ln in lines):
                seen += 1
                where = f"{rel(path)}:{start}"
                try:
                    c.parse_inventory("\n".join(lines) + "\n", where)
                except Exception as e:  # noqa: BLE001 - ConfigError: reported with the example's place
                    pytest.fail(f"{where}: the hosts.yaml example does not load: {e}")
    assert seen >= 3, f"only {seen} hosts.yaml examples found"


def test_python_examples_compile():
    for path in doc_files():
        for lang, start, lines in fenced_blocks(path.read_text(encoding="utf-8")):
            if lang in ("python", "py"):
                where = f"{rel(path)}:{start}"
                try:
                    compile("\n".join(lines), where, "exec")
                except SyntaxError as e:
                    pytest.fail(f"{where}: {e}")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


def test_relative_links_point_at_files_and_headings():
    bad = []
    for path in doc_files():
        text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                if rel(dest) not in PENDING_PAGES:
                    bad.append(f"{rel(path)}: ({target}): no file {rel(dest)}")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                bad.append(f"{rel(path)}: ({target}): no heading #{anchor} in {rel(dest)}")
    assert not bad, "\n".join(bad)


# --- the checker itself -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, wrong", [
    ("reval run gpu1 --drafer /m/D --target /m/T --cache /e/c", "--drafer"),   # after HOST: run's own parse
    ("reval run --drafer /m/D gpu1 --target /m/T", "--drafer"),                # before HOST: argparse's
    ("reval run gpu1 --drafter /m/D --num-prompts ten", "ten"),
    ("reval ls --jsn", "--jsn"),
    ("reval compare a b --basline a", "--basline"),
    ("reval compare a b --baselin a", "--baselin"),                            # an abbreviation: spell it out
    ("reval cancle zlab_full", "cancle"),
    ("reval sweep --checkpoints 'h:/c/step-*' --target /m/T", "--hosts"),      # a required option missing
    ("reval prune --older-than fortnight", "fortnight"),
])
def test_a_wrong_line_is_caught(line, wrong):
    argv = command_argv(line, "reval")
    err = reval_error(argv)
    assert err is not None and wrong in err, f"{line!r} was not refused for {wrong!r}: {err!r}"


def test_a_right_line_passes():
    for line in ["reval run gpu1 --drafter /m/D --target /m/T --cache a=/e/a --cache b=/e/b -- --batch-size 8",
                 "reval -i lab.yaml ls gpu-boxes --json", "reval --version", "reval logs x -f --tail 5"]:
        assert reval_error(command_argv(line, "reval")) is None, line


def test_a_wrong_payload_line_and_make_target_are_caught():
    err = payload_error(command_argv("python -m remote_payload extract --target /m/T --prompts p --out c --layres 1",
                                     "python -m remote_payload"))
    assert err is not None and "--layres" in err, err
    assert payload_error(["hash", "/m/D"]) is None
    assert [t for t in make_targets_named(["tset", "ARGS=-x"]) if t not in makefile_targets()] == ["tset"]


def test_lines_are_extracted_as_a_shell_reads_them(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(textwrap.dedent("""\
        Prose: reval run is not in a block.
        ```
        reval run gpu1 --drafter /m/D \\
              --target /m/T   # a comment --not-an-option
        30 2 * * * cd /x && .venv/bin/reval sweep --hosts g --checkpoints 'h:/c/step-*' > out.json 2>> log || echo
        ExecStart=%h/e/.venv/bin/reval ls --json
        Description=reval nightly checkpoint sweep
        journalctl --user -u reval-sweep        # the reval ls lines
        reval completion zsh > "${fpath[1]}/_reval"
        ```
        ```
        $ reval logs x \\
            --tail 5
        reval ls: error: unrecognized arguments: --jsn (output, not a command)
        ```
        ```python
        reval run = 1
        ```
        """))
    got = [(where.rsplit(":", 1)[1], argv) for where, _, argv in doc_commands("reval", [doc])]
    assert got == [
        ("3", ["run", "gpu1", "--drafter", "/m/D", "--target", "/m/T"]),
        ("5", ["sweep", "--hosts", "g", "--checkpoints", "h:/c/step-*"]),
        ("6", ["ls", "--json"]),
        ("9", ["completion", "zsh"]),
        ("12", ["logs", "x", "--tail", "5"]),
    ], got
