"""`reval completion bash|zsh`: print a shell completion script (sub-commands, options, choices, hosts)."""
from __future__ import annotations

import sys

from ..completion import SHELLS, script


def register(sub) -> None:
    p = sub.add_parser("completion", help="print a bash or zsh completion script",
                       description="Print a completion script for bash or zsh: sub-commands, their options and "
                                   "choices, and inventory host names.\n"
                                   "  bash: reval completion bash > ~/.local/share/bash-completion/completions/reval\n"
                                   "  zsh:  reval completion zsh > \"${fpath[1]}/_reval\"  (then restart the shell)")
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=main)


def main(args) -> int:
    sys.stdout.write(script(args.shell, args._root))  # the whole tree (cli.build_parser), every command named
    return 0
