"""Shell completion scripts for bash and zsh, generated from the argparse tree (so they never go stale):
sub-commands, their options, the choices of an option, host names for HOST arguments (read at completion
time from `reval hosts --names`) and run names for RUN arguments (`reval ls --names`: the runs kept here, no
host asked)."""
from __future__ import annotations

import argparse
import shlex

from .argparsing import subparsers

SHELLS = ("bash", "zsh")
# arguments that name an inventory host (or group): completed from `reval hosts --names`
_HOST_METAVARS = ("HOST", "HOST|GROUP", "GROUP|HOST")
HOSTS = ["$HOSTS"]  # a placeholder: the host names, read when completing
_RUN_METAVARS = ("RUN",)  # arguments that name a run: completed from `reval ls --names`
RUNS = ["$RUNS"]  # a placeholder: the run names, read when completing


def _words(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]], bool | list[str]]:
    """(option strings, {option: its choices}, what a positional takes: True for HOST, RUNS for RUN, else its
    choices)."""
    opts, choices, host = [], {}, []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        if a.option_strings:
            if a.help == argparse.SUPPRESS:
                continue
            opts += [s for s in a.option_strings if s.startswith("--")] or list(a.option_strings)
            if a.choices:
                for s in a.option_strings:
                    choices[s] = [str(c) for c in a.choices]
            elif (a.metavar or a.dest.upper()) in _HOST_METAVARS:
                for s in a.option_strings:
                    choices[s] = HOSTS
            elif a.metavar in _RUN_METAVARS:
                for s in a.option_strings:
                    choices[s] = RUNS
        elif a.metavar in _HOST_METAVARS:
            host = True
        elif a.metavar in _RUN_METAVARS and not host:
            host = RUNS
        elif a.choices and not host:
            host = [str(c) for c in a.choices]
    return opts, choices, host


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return [name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]


def bash_script(parser: argparse.ArgumentParser, prog: str = "reval") -> str:
    """A bash completion script for `prog` (pure)."""
    cases = []
    # the hosts of the inventory named on the line being completed (-i FILE), else the default one
    hosts_words = '"$(' + prog + ' ${inv:+-i "$inv"} hosts --names 2>/dev/null)"'
    runs_words = '"$(' + prog + ' ls --names 2>/dev/null)"'  # the runs in runs/ here (NAME and HOST/NAME)
    takes_value: list[str] = []  # options that take a value, every parser's (the root's is tree[0])
    tree = [("", parser)] + [(sp.prog.split(" ", 1)[1], sp) for _, sp in subparsers(parser)]
    for path, sp in tree:
        opts, choices, host = _words(sp)
        subs = _commands(sp)
        takes_value += [s for a in sp._actions if a.option_strings and a.nargs != 0 for s in a.option_strings]
        lines = []
        for opt, ch in choices.items():
            words = hosts_words if ch is HOSTS else runs_words if ch is RUNS else shlex.quote(" ".join(ch))
            lines.append(f'    [[ $prev == {opt} ]] && {{ COMPREPLY=($(compgen -W {words} -- "$cur")); return; }}')
        lines.append('    if [[ $cur == -* ]]; then COMPREPLY=($(compgen -W '
                     f'{shlex.quote(" ".join(opts))} -- "$cur")); return; fi')
        if subs:
            lines.append(f'    COMPREPLY=($(compgen -W {shlex.quote(" ".join(subs))} -- "$cur")); return')
        elif host is RUNS:
            lines.append(f'    COMPREPLY=($(compgen -W {runs_words} -- "$cur")); return')
        elif isinstance(host, list) and host:
            lines.append(f'    COMPREPLY=($(compgen -W {shlex.quote(" ".join(host))} -- "$cur")); return')
        elif host:
            lines.append(f'    COMPREPLY=($(compgen -W {hosts_words} -- "$cur")); return')
        cases.append(f"  {shlex.quote(path) if path else chr(39) * 2})\n" + "\n".join(lines) + "\n    ;;")
    value_opts = " ".join(sorted(set(takes_value)))
    fn = "_" + prog.replace("-", "_")
    return f"""# {prog} completion for bash (and zsh through bashcompinit). Install:
#   {prog} completion bash > ~/.local/share/bash-completion/completions/{prog}
{fn}() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}} path="" w i skip=0 inv=""
  local value_opts=" {value_opts} "
  for ((i = 1; i < COMP_CWORD; i++)); do
    w=${{COMP_WORDS[i]}}
    if ((skip)); then skip=0; continue; fi
    case $w in
      -i|--inventory) ((i + 1 < COMP_CWORD)) && inv=${{COMP_WORDS[i+1]}} ;;
      --inventory=*) inv=${{w#*=}} ;;
    esac
    inv=${{inv/#\\~/$HOME}}
    [[ $w == -- ]] && return
    if [[ $w == -* ]]; then [[ $w != *=* && $value_opts == *" $w "* ]] && skip=1; continue; fi
    case "${{path:+$path }}$w" in
{chr(10).join(f"      {shlex.quote(p)}) path={shlex.quote(p)} ;;" for p, _ in tree if p)}
      *) ;;
    esac
  done
  case "$path" in
{chr(10).join(cases)}
  esac
}}
complete -o default -F {fn} {prog}
"""


def zsh_script(parser: argparse.ArgumentParser, prog: str = "reval") -> str:
    """zsh: the bash script through bashcompinit (one implementation) (pure)."""
    return (f"#compdef {prog}\n"
            f"# {prog} completion for zsh. Install: {prog} completion zsh > \"${{fpath[1]}}/_{prog}\"\n"
            "autoload -U +X bashcompinit && bashcompinit\n" + bash_script(parser, prog).split("\n", 2)[2])


def script(shell: str, parser: argparse.ArgumentParser, prog: str = "reval") -> str:
    return bash_script(parser, prog) if shell == "bash" else zsh_script(parser, prog)
