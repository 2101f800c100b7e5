"""What to evaluate, as options: one set for `reval run` and `reval sweep`, parsed into the one spec
(reval.EvalSpec, checked when made)."""
from __future__ import annotations

import argparse

import reval

from .argparsing import positive_int


def add_spec_options(p: argparse.ArgumentParser, *, drafter: bool = True, payload_help: str | None = None) -> None:
    """--drafter (run: one checkpoint; a sweep has --checkpoints), --target, --cache, the limits and the eval's
    options."""
    if drafter:
        p.add_argument("--drafter", metavar="PATH", help="drafter checkpoint (dir or .pt) on the host")
    p.add_argument("--target", metavar="PATH",
                   help="target model dir on the host (embed_tokens / lm_head are borrowed)")
    p.add_argument("--cache", metavar="[NAME=]PATH", action="append",
                   help="hidden-state cache dir on the host; repeat it as NAME=PATH to evaluate benchmark suites "
                        "in one process (per-suite tau and their mean; reval compare --by suite). A path "
                        "holding '=' is written with a '/' before it (./a=b)")
    p.add_argument("--prompts", metavar="NAME=FILE", action="append",
                   help="a suite given by its prompt file here: its cache is the host's (reval caches), built "
                        "first when missing (layers: the drafter's); repeat it once per suite")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                   help="with --prompts: the greedy completion cap of the caches built for them (default 512; "
                        "part of each cache's recipe)")
    p.add_argument("--num-prompts", type=positive_int, metavar="N",
                   help="evaluate the first N prompts of the cache (of each suite's cache)")
    p.add_argument("--max-blocks", type=positive_int, metavar="M", help="at most M draft rounds per prompt")
    p.add_argument("--allow-unknown-config", action="append", default=[], metavar="KEY",
                   help="evaluate although the drafter's config.json has KEY, which reval does not interpret "
                        "(dflash_config.KEY when nested; repeatable; recorded in results.json). Without it "
                        "such a key is refused before the run starts (exit 3)")
    p.add_argument("--speedup", action="store_true",
                   help="also load the whole target on the host and measure its latencies (decode, block and "
                        "DDTree verify, drafter block; CUDA graphs on a GPU): the projected speedup per method "
                        "and the best DDTree budget by speedup; measured once per host, GPU, target and dtype")
    p.add_argument("--online", type=positive_int, metavar="N",
                   help="also decode the first N prompts by real speculative decoding with the whole target: "
                        "acceptance checked against the offline walk, measured speedup beside the projection")
    p.add_argument("--draft", choices=("greedy", "sampled"), default="greedy",
                   help="the draft rule on a sampled cache (extract --temperature T): greedy = argmax drafts, the "
                        "walk over every sample (default); sampled = drafts drawn from the drafter, verified by "
                        "rejection sampling: the exact expected tau; over suites it applies to the sampled ones, "
                        "a greedy suite staying greedy (at T=0 the rule is irrelevant) (docs/sampling.md)")
    p.add_argument("--chain", type=positive_int, metavar="K",
                   help="EAGLE-3 drafters: K drafts per round, the greedy chain (default 5); refused for a DFlash "
                        "drafter (its block_size is in its config.json) (docs/eagle3.md)")
    p.add_argument("--eagle-tree", metavar="TOTAL,DEPTH,TOPK",
                   help="EAGLE-3 drafters: EAGLE's dynamic draft tree instead of the chain, SafeAILab's total_token, "
                        "depth, top_k (`default` = 60,7,10); not with --chain; refused for a DFlash drafter; part "
                        "of the run's spec and of a sweep's ledger key (docs/eagle3.md)")
    p.add_argument("--payload", choices=("eval", "dummy"), default="eval",
                   help=payload_help or "what to run: the eval, or a torch-free stand-in (tests, demos of the "
                                        "plumbing)")


def spec_from_args(args: argparse.Namespace, extra: list[str], gpus: str | None = None) -> reval.EvalSpec:
    """The spec of the parsed options (raises reval.Error, exit 3, on a value it refuses)."""
    return reval.EvalSpec(drafter=getattr(args, "drafter", None), target=args.target, cache=args.cache,
                          num_prompts=args.num_prompts, max_blocks=args.max_blocks, extra=list(extra),
                          payload=args.payload, gpus=gpus, allow_unknown_config=list(args.allow_unknown_config),
                          speedup=bool(args.speedup), online=args.online or 0, prompts=args.prompts or (),
                          max_new_tokens=args.max_new_tokens, draft=args.draft, chain=args.chain,
                          eagle_tree=args.eagle_tree)
