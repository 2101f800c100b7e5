"""The argparse pieces every `reval` parser shares: bad usage exits 3 (argparse's own 2 means "partial"
here), mistyped flags and commands get a "did you mean", and every option's help shows its default."""
from __future__ import annotations

import argparse
import re
import sys
import textwrap

from reval import EXIT_BAD_INPUT, did_you_mean, duration_s

# what other tools call reval's commands (Slurm's scancel/squeue, docker's stop/ps, job queues): "did you mean"
SYNONYMS = {"cancel": "kill", "stop": "kill", "abort": "kill", "terminate": "kill", "scancel": "kill",
            "queue": "ls", "list": "ls", "ps": "ls", "jobs": "ls", "squeue": "ls", "log": "logs", "tail": "logs",
            "remove": "rm", "delete": "rm", "show": "status", "info": "status", "fetch": "pull",
            "download": "pull", "diff": "compare", "submit": "run", "start": "run", "launch": "run"}


def option_suggestions(parser: argparse.ArgumentParser, words) -> list[str]:
    """`--drafer -> --drafter` for each unknown option word that is close to one of the parser's (pure)."""
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    out = []
    for w in words:
        if w.startswith("--"):
            close = did_you_mean(w.split("=", 1)[0], known)
            if close:
                out.append(f"{w.split('=', 1)[0]} -> {close}")
    return out


def usage_hint(parser: argparse.ArgumentParser, message: str) -> str | None:
    """A "did you mean" for argparse's own messages (unknown option, invalid choice), or None (pure)."""
    m = re.match(r"unrecognized arguments: (.*)", message)
    if m:
        sugg = option_suggestions(parser, m.group(1).split())
        return f"did you mean: {', '.join(sugg)}" if sugg else None
    m = re.match(r"argument [^:]+: invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        choices = re.findall(r"'([^']*)'", m.group(2))
        close = SYNONYMS.get(m.group(1).lower()) if SYNONYMS.get(m.group(1).lower()) in choices else None
        close = close or did_you_mean(m.group(1), choices)
        return f"did you mean {close!r}?" if close else None
    return None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, each line longer than the terminal (at most 100 columns) folded at a word
    under its own indentation (an example's `# comment` under its `#`); every option with a default says it
    (unless its help already does)."""

    def _fill_text(self, text, width, indent):
        width = min(width, 100 - len(indent))
        out = []
        for line in text.splitlines():
            if len(line) <= width:
                out.append(indent + line)
                continue
            lead = re.match(r"\s*", line).group(0)
            example = re.match(r"(\s*\S.*?\s{2,})#", line)
            under = " " * len(example.group(1)) if example and len(example.group(1)) < width // 2 else lead
            out += [indent + x for x in textwrap.wrap(line, width, initial_indent="", subsequent_indent=under,
                                                      break_on_hyphens=False, drop_whitespace=True)]
        return "\n".join(out)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or action.option_strings == []
                or "default" in text or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; 2 means "partial" here, so bad usage exits 3 (bad input)."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        hint = usage_hint(self, message)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n" + (f"       {hint}\n" if hint else ""))


def subparsers(parser: argparse.ArgumentParser):
    """(prog, parser) of every sub-command, depth first (pure)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield sp.prog, sp
                yield from subparsers(sp)


def inventory_option(parser: argparse.ArgumentParser) -> None:
    """`-i/--inventory FILE` on a sub-command, so that it may come after the command (`reval ls -i FILE`, as
    other CLIs take their global options); unset there, the one before the command (or the default) holds."""
    parser.add_argument("-i", "--inventory", metavar="FILE", default=argparse.SUPPRESS,
                        help="hosts file, here or before the command (reval -i FILE COMMAND)")


def add_inventory_option(parser: argparse.ArgumentParser) -> None:
    """inventory_option on every sub-command that has none yet."""
    for _, sp in subparsers(parser):
        if "--inventory" not in sp._option_string_actions:
            inventory_option(sp)


def bind_usage_errors(parser: argparse.ArgumentParser) -> None:
    """Each sub-command remembers its own parser (`_parser`), so that an argument that only the top level
    finds unknown (`reval ls --jsn`) is reported with the usage of `ls`, not of `reval`."""
    for _, sp in subparsers(parser):
        sp.set_defaults(_parser=sp)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return n


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, >= 0."""
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not s >= 0 or s == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds >= 0")
    return s


def age_s(text: str) -> float:
    """An argparse type: an age like 90m, 36h, 7d or 2w -> seconds."""
    s = duration_s(text)
    if s is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: use e.g. 36h, 7d or 2w")
    return s
