"""`reval extract HOST --target PATH --prompts NAME=FILE ... (--layers L | --for-drafter PATH)`: the suites'
hidden-state caches built on the host, in its cache store (<workdir>/caches), each under the key of its recipe:
one already there is reused, a missing one built once (a second request for it waits and reuses it). The
prompt files are read here and copied to the host (named by their content: only what changed travels). The
extract runs detached like `reval run` (live bar, Ctrl-C detaches, `reval logs NAME -f`, `status`, `kill`,
`rm`); pulled: caches.json (what each suite resolved to), never the tensors.

`reval caches [HOST|GROUP] [--json]` lists the stores; `reval caches rm HOST KEY...` removes caches (refused
while a running eval reads one)."""
from __future__ import annotations

import json
import sys

import reval
from reval import EXIT_PARTIAL, EXIT_STILL_RUNNING

from ..argparsing import HelpFormatter, inventory_option, positive_int, seconds
from .run import launch_line
from .runs import detached_message, err, make_sink, out, report_extract, shown_on

EPILOG = """\
exit codes: 0 the caches are there · 1 the extract failed · 3 bad input (the target, a prompt file, the
            layers, a damaged store entry, too little disk: nothing was started) · 4 host unreachable ·
            101 still running (--detach, Ctrl-C; re-attach: reval logs NAME -f) · 103 cancelled
"""


def register(sub) -> None:
    p = sub.add_parser("extract", help="build hidden-state caches on a host from prompt files here (its store)",
                       description=__doc__, epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("host", metavar="HOST", help="an inventory host (or a Slurm cluster)")
    p.add_argument("--target", required=True, metavar="PATH", help="the target model's folder on the host")
    p.add_argument("--prompts", required=True, action="append", metavar="NAME=FILE",
                   help="a suite's prompt file here (.jsonl of {\"turns\": [...]} or {\"prompt\": ...}, or .txt, "
                        "one prompt a line); once per suite")
    p.add_argument("--layers", metavar="L", help="tapped target layers, e.g. 1,16,31,46,61")
    p.add_argument("--for-drafter", metavar="PATH", help="take the layers from this drafter's target_layer_ids "
                                                          "(on the host)")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="greedy completion cap (default 512)")
    p.add_argument("--num-prompts", type=positive_int, metavar="N", help="only the first N prompts of each file")
    p.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="render prompts with the target's chat template (auto: when it has one)")
    p.add_argument("--enable-thinking", action="store_true", help="enable_thinking for the chat template")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default="auto",
                   help="auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--gpus", metavar="auto|none|0,1",
                   help="auto (one free GPU) | none | 0,1 (several: one extract process a GPU)")
    p.add_argument("--name", help="run name (default extract-<UTC time>)")
    p.add_argument("--detach", action="store_true", help="start it and return (exit 101)")
    p.add_argument("--give-up-s", type=seconds, default=120.0, metavar="S",
                   help="stop reconnecting after this long (exit 4)")
    inventory_option(p)
    p.set_defaults(func=cmd_extract)

    c = sub.add_parser("caches", help="the hidden-state caches in the hosts' stores; caches rm removes some",
                       description="List the caches in the store of HOST (or every host of a group; default: "
                                   "every inventory host): suite, target (content hash), layers, prompts, tokens, "
                                   "template, thinking, sampling, size, age, argmax agreement, and the running runs "
                                   "that read it. `reval caches rm HOST KEY...` removes caches (refused while a "
                                   "running run reads one).")
    c.add_argument("words", nargs="*", metavar="[rm] HOST [KEY...]", help="HOST|GROUP, or rm HOST KEY...")
    c.add_argument("--json", action="store_true", help="print the caches as JSON")
    inventory_option(c)
    c.set_defaults(func=cmd_caches)


def cmd_extract(args) -> int:
    spec = reval.ExtractSpec(target=args.target, prompts=args.prompts, layers=args.layers,
                             for_drafter=args.for_drafter, max_new_tokens=args.max_new_tokens,
                             num_prompts=args.num_prompts, chat_template=args.chat_template,
                             enable_thinking=args.enable_thinking, dtype=args.dtype, gpus=args.gpus)
    inv = reval.Inventory.load(args.inventory)
    host = inv[args.host]
    prep = reval.prepare(host)
    run = reval.extract(host, spec, name=args.name, prepared=prep, argv=sys.argv[1:])
    sent = len(run.prompts_sent)
    out(f"sync    prompts: {sent} of {len(spec.prompts)} files copied"
        + (" (the others are on the host already)" if sent < len(spec.prompts) else ""))
    out(f"launch  {launch_line(run.launch)}")
    if args.detach:
        out(detached_message(run.name, host.name))
        return EXIT_STILL_RUNNING
    sink = make_sink()
    try:
        fin = run.finish(on_event=shown_on(sink), log_offset=0, give_up_s=args.give_up_s)
    except KeyboardInterrupt:
        sink.close()
        out(detached_message(run.name, host.name))
        return EXIT_STILL_RUNNING
    sink.close()
    return report_extract(fin)


def _size(n) -> str:
    if not isinstance(n, int):
        return "?"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_caches(args) -> int:
    words = list(args.words)
    if words and words[0] == "rm":
        if len(words) < 3:
            raise reval.Error("reval caches rm: give HOST and the KEY(s) to remove",
                              hint="reval caches rm gpu1 3f2a9c01 (reval caches gpu1 lists them)")
        for k in reval.remove_caches(words[1], words[2:], inventory=args.inventory):
            out(f"removed {words[1]}:{k}")
        return 0
    if len(words) > 1:
        raise reval.Error(f"reval caches: one HOST or group, got {' '.join(words)}",
                          hint="reval caches gpu1 ; reval caches rm gpu1 KEY")
    listing = reval.caches(words[0] if words else None, inventory=args.inventory)
    if args.json:
        out(json.dumps(listing.to_json(), indent=1))
    else:
        for c in listing.caches:
            if c.damaged:
                out(f"{c.host}:{c.key[:12]}  DAMAGED ({c.damaged}): never used; reval caches rm {c.host} "
                    f"{c.key[:12]}")
                continue
            agree = f"{c.agreement:.4f}" if isinstance(c.agreement, float) else "-"
            out(f"{c.host}:{c.key[:12]}  {c.suite or '-'} · target {str(c.target)[-12:]} · layers {c.layers} · "
                f"{c.entries} prompts · {c.tokens} tokens · template {'on' if c.template else 'off'}"
                f"{' (thinking)' if c.thinking else ''} · {c.sampling} · {_size(c.bytes)} · {c.created_at} · "
                f"agreement {agree}" + (f" · read by {', '.join(c.readers)}" if c.readers else ""))
    for h, why in listing.unreachable.items():
        err(f"failed  {h}: {why}")
    return EXIT_PARTIAL if listing.unreachable else 0
