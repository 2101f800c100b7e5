"""The eval's options: `python -m remote_payload eval` arguments -> EvalOptions (validated)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol, spec
from remote_payload.contract.drafterconfig import add_allow_unknown, parse_layer_ids
from remote_payload.contract.errors import PayloadError

DEFAULT_BUDGETS = spec.DEFAULT_DDTREE_BUDGETS
DEFAULT_WIDTHS = spec.DEFAULT_TREE_WIDTHS


@dataclass
class EvalOptions:
    drafter: str
    target: str
    cache: str  # one cache; with suites: "name=path,..." (what the log and results.json name)
    run_dir: str
    name: str
    num_prompts: int | None = None
    max_blocks: int = spec.DEFAULT_MAX_BLOCKS
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 0  # anchors per drafter forward; 0 = auto
    ddtree_budgets: list[int] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    tree_widths: list[int] = field(default_factory=lambda: list(DEFAULT_WIDTHS))
    cache_layers: list[int] | None = None
    strict: bool = False
    all_anchors: bool = False
    allow_unknown_config: list[str] = field(default_factory=list)
    suites: list[tuple[str, str]] | None = None  # (name, cache path) per benchmark suite; None: one cache
    online: int = 0  # first N prompts decoded online with the real target (speculative vs target-only)
    speedup: bool = False  # measure the target's latencies and project the speedup per method
    chain: int | None = None  # EAGLE-3: drafts per round (None: 5); refused for DFlash drafters
    eagle_tree: str | None = None  # EAGLE-3: EAGLE's dynamic tree "TOTAL_TOKEN,DEPTH,TOP_K" (None: the chain)
    speedup_batches: list[int] = field(default_factory=lambda: [1, 4, 16, 64])  # batch sizes measured
    speedup_repeats: int = 7  # least timed runs per latency
    remeasure: bool = False  # measure again even when the latency table holds the entry
    latency_table: str | None = None  # the table's path (else targetchecks.latency_table_path's order)
    online_repeats: int = 3  # timed runs of each online prompt, each way
    online_seeds: int | None = None  # decodes a prompt online on a sampled cache (None: online_section's default)
    draft: str = "greedy"  # the draft rule on a sampled cache: greedy (argmax drafts) | sampled (rejection sampling)


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="z-lab folder (config.json + safetensors) or team .pt file")
    p.add_argument("--target", required=True,
                   help="target model folder: its embed_tokens/lm_head (via model.safetensors.index.json) "
                        "and tokenizer.json are borrowed")
    p.add_argument("--cache", required=True, action="append", metavar="[NAME=]PATH",
                   help="hidden-state cache (from `extract`, or the seeds' layout). Repeat it, NAME=PATH, to "
                        "evaluate one drafter over several benchmark suites in one process (weights loaded "
                        "once; per-suite metrics and their mean in results.json); greedy and sampled caches may "
                        "be mixed, each suite evaluated in its own regime (docs/sampling.md)")
    p.add_argument("--cache-layers", type=parse_layer_ids, default=None,
                   help="layer ids of a seeds-layout cache, e.g. 1,16,31,46,61 (aux_hidden..., last_hidden)")
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<name>)")
    p.add_argument("--name", default=None,
                   help="run name (default: the --run-dir folder name, else <drafter>-<UTC timestamp>)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="first N prompts of the cache (default: all); with suites, the first N of each suite")
    p.add_argument("--max-blocks", type=int, default=spec.DEFAULT_MAX_BLOCKS,
                   help=f"draft rounds per prompt (default {spec.DEFAULT_MAX_BLOCKS})")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch-size", type=int, default=0, help="anchors per drafter forward (0: auto)")
    p.add_argument("--ddtree-budgets", type=_int_list, default=list(DEFAULT_BUDGETS),
                   help="DDTree node budgets (default 16,32,64,128,256,512)")
    p.add_argument("--tree-widths", type=_int_list, default=list(DEFAULT_WIDTHS),
                   help="width-k trees, the seeds' DDTree-4/DDTree-8 (default 4,8)")
    p.add_argument("--strict", action="store_true", help="a suspect result fails the run (exit 1)")
    add_allow_unknown(p)
    p.add_argument("--online", type=int, default=0, metavar="N",
                   help="also decode the first N prompts online: real speculative decoding with the whole "
                        "target (block drafting, verification over its KV cache). A greedy cache: greedy decoding, "
                        "the per-round acceptance lengths checked against the offline walk; a sampled cache: the "
                        "target's posterior sampled at the cache's T/top-k/top-p, --draft's rule, --online-seeds "
                        "decodes a prompt, their mean tau beside the offline tau with 95%% intervals. Either way the "
                        "measured speedup over target-only decoding (with suites: the first suite's prompts; N "
                        "above the prompts there are decodes them all, said in the log and results.json's notes). "
                        "An EAGLE-3 head (greedy caches): its chain or --eagle-tree tree, verified under the tree "
                        "mask")
    p.add_argument("--speedup", action="store_true",
                   help="load the whole target and measure at batch 1 on this device: a decode step, the verify "
                        "forward of a block and of each DDTree budget's tree, one drafter block (an EAGLE-3 head: "
                        "its K sequential chain steps or the tree's depth+1 level steps, and the verify of K+1 "
                        "tokens or of the tree's total_token); results.json then holds the projected speedup per "
                        "method (tau x t(decode) / (t(draft) + t(verify)))")
    p.add_argument("--chain", type=int, default=None, metavar="K",
                   help="EAGLE-3 drafters: drafts per round, the greedy chain (default 5; docs/eagle3.md); refused "
                        "for DFlash drafters, whose block_size is in their config.json")
    p.add_argument("--eagle-tree", default=None, metavar="TOTAL,DEPTH,TOPK",
                   help="EAGLE-3 drafters: EAGLE's dynamic draft tree instead of the chain: the best TOTAL-1 nodes "
                        "by cumulative log-prob, DEPTH expansions of the TOPK best nodes per level, TOPK children "
                        "each (SafeAILab's total_token, depth, top_k; `default` = 60,7,10; docs/eagle3.md); "
                        "not with --chain or --draft sampled; refused for DFlash drafters")
    from remote_payload.eval.speedupopts import add_speedup_arguments
    add_speedup_arguments(p)
    p.add_argument("--draft", choices=spec.DRAFT_RULES, default="greedy",
                   help="on a sampled cache (extract --temperature T): greedy = the drafter's argmax drafts, the walk "
                        "over every sample (default, as vLLM); sampled = drafts drawn from the drafter at the "
                        "cache's transform, verified by rejection sampling: the exact E[tau | y] (EAGLE-3: q of the "
                        "chain fed y's tokens, the draft vocabulary's; docs/eagle3.md). Over suites of "
                        "several regimes it applies to the sampled ones; a greedy suite is draft greedy (at T=0 "
                        "the rule is irrelevant) (docs/sampling.md)")
    p.add_argument("--all-anchors", action="store_true",
                   help="teacher-forced position accuracy at every completion anchor (default: the anchors "
                        "the walk can reach within --max-blocks; the walks are the same either way)")


def options_from_args(args: argparse.Namespace) -> EvalOptions:
    from remote_payload.eval.speedupopts import speedup_options
    # A run directory names its run (the controller passes --run-dir <workdir>/runs/<name>).
    name = args.name or (Path(args.run_dir).name if args.run_dir else protocol.default_run_name(args.drafter))
    protocol.validate_run_name(name)
    try:  # the one spec's checks and --cache rule, as the controller applied them
        ask = spec.EvalSpec(drafter=args.drafter, target=args.target, cache=args.cache,
                            num_prompts=args.num_prompts, max_blocks=args.max_blocks, online=args.online,
                            speedup=bool(args.speedup), allow_unknown_config=args.allow_unknown_config,
                            draft=args.draft, chain=getattr(args, "chain", None),
                            eagle_tree=getattr(args, "eagle_tree", None))
    except spec.SpecError as e:
        raise PayloadError(str(e)) from None
    cache, suites = ask.cache_label(), ask.suites()
    return EvalOptions(drafter=args.drafter, target=args.target, cache=cache, suites=suites,
                       run_dir=args.run_dir or str(Path("runs") / name), name=name, num_prompts=args.num_prompts,
                       max_blocks=args.max_blocks, device=args.device, dtype=args.dtype,
                       batch_size=args.batch_size, ddtree_budgets=sorted(set(args.ddtree_budgets)),
                       tree_widths=sorted(set(args.tree_widths)), cache_layers=args.cache_layers,
                       strict=args.strict, all_anchors=args.all_anchors,
                       allow_unknown_config=list(args.allow_unknown_config), online=args.online,
                       speedup=bool(args.speedup), chain=ask.chain, eagle_tree=ask.eagle_tree, draft=ask.draft,
                       **speedup_options(args))
