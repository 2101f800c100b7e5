"""What to evaluate: one value, parsed and checked once, that both halves carry (stdlib only).

The laptop builds an `EvalSpec` from the CLI or the API, makes its paths the host's, and hands the payload
`spec.payload_argv()`; the payload parses that argv back with the same rules (`parse_caches`), so a cache
argument means the same thing on both sides. One definition of every default and limit lives here.

The cache rule (one rule, decided by the text alone, never by the filesystem): `NAME=PATH` names a benchmark
suite when NAME is a usable name (A-Z a-z 0-9 . _ -, not starting with '.' or '-') and PATH is not empty;
anything else is a path. A path that holds '=' is written with a '/' before it (`./a=b`). Several caches are
several suites; a bare path among several is named by its folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass

PAYLOADS = ("eval", "dummy")
DEFAULT_MAX_BLOCKS = 30                       # draft rounds per prompt when --max-blocks is not given
DEFAULT_DDTREE_BUDGETS = (16, 32, 64, 128, 256, 512)
DEFAULT_TREE_WIDTHS = (4, 8)
DRAFT_RULES = ("greedy", "sampled")           # --draft: how drafts are made and verified on a sampled cache
DEFAULT_EAGLE_TREE = (60, 7, 10)              # SafeAILab EaModel.from_pretrained(total_token=60, depth=7, top_k=10)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# eval options the spec owns: given among the payload's extra arguments they would be a second, unchecked copy
OWNED_OPTIONS = ("--drafter", "--target", "--cache", "--num-prompts", "--max-blocks", "--speedup", "--online",
                 "--allow-unknown-config", "--name", "--run-dir", "--draft", "--chain", "--eagle-tree")


class SpecError(ValueError):
    """A spec that cannot be evaluated: `str(e)` is the one line, `hint` the fix; bad input (exit 3)."""
    exit_code = 3

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def usable_name(name: str) -> bool:
    """A suite (or run) name: 1-64 of A-Z a-z 0-9 . _ -, not starting with '.' or '-'."""
    return isinstance(name, str) and bool(_NAME.match(name)) and not name.startswith((".", "-"))


@dataclass(frozen=True)
class CacheRef:
    """One --cache value: a path on the host, and the suite's name when given as NAME=PATH."""
    path: str
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> CacheRef:
        if not isinstance(text, str) or not text:
            raise SpecError(f"--cache {text!r}: give a cache folder, or NAME=PATH for a benchmark suite")
        name, sep, path = text.partition("=")
        if sep and path and usable_name(name):
            return cls(path=path, name=name)
        return cls(path=text)

    @property
    def suite(self) -> str:
        """The suite's name: the one given, else the folder's."""
        return self.name or os.path.basename(self.path.rstrip("/")) or self.path

    def text(self) -> str:
        """The --cache argument that parses back to this value."""
        return f"{self.name}={self.path}" if self.name else self.path


def parse_caches(values) -> tuple[CacheRef, ...]:
    """--cache values (a str, or a list of str / CacheRef) -> the checked tuple: suite names unique and usable,
    no cache given twice (its prompts would count twice in every pooled figure)."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str | CacheRef) else list(values)
    refs = tuple(v if isinstance(v, CacheRef) else CacheRef.parse(v) for v in items)
    if len(refs) > 1:
        names = [r.suite for r in refs]
        for n in names:
            if not usable_name(n):
                raise SpecError(f"--cache: {n!r} is not a usable suite name",
                                hint="give --cache NAME=PATH (NAME: letters, digits, . _ -)")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SpecError(f"--cache: suite name {dup[0]!r} is given twice",
                            hint="name each suite once (--cache NAME=PATH)")
        paths = [os.path.normpath(r.path) for r in refs]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise SpecError(f"--cache: the cache {twice[0]} is given as two suites; its prompts would count twice",
                            hint="give each cache once")
    return refs


@dataclass(frozen=True)
class PromptRef:
    """One --prompts value: NAME=FILE, a benchmark suite's prompt file (.jsonl or .txt) on the laptop; the host
    gets a copy named by its content, and its cache is the host's store's for that recipe (extract --store)."""
    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> PromptRef:
        name, sep, path = text.partition("=") if isinstance(text, str) else ("", "", "")
        if not (sep and path and usable_name(name)):
            raise SpecError(f"--prompts {text!r}: give NAME=FILE (NAME: letters, digits, . _ -), one per suite",
                            hint="e.g. --prompts gsm8k=prompts/gsm8k.jsonl")
        return cls(name=name, path=path)

    def text(self) -> str:
        return f"{self.name}={self.path}"


def parse_prompts(values) -> tuple[PromptRef, ...]:
    """--prompts values (a str, or a list of str / PromptRef) -> the checked tuple: suite names unique."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str | PromptRef) else list(values)
    refs = tuple(v if isinstance(v, PromptRef) else PromptRef.parse(v) for v in items)
    names = [r.name for r in refs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError(f"--prompts: suite name {dup[0]!r} is given twice", hint="name each suite once")
    return refs


@dataclass(frozen=True)
class TreeShape:
    """EAGLE's dynamic draft tree (--eagle-tree): SafeAILab's total_token, depth, top_k (docs/eagle3.md)."""
    total_token: int
    depth: int
    top_k: int

    @property
    def max_accept(self) -> int:
        """The deepest level a tree can hold (drafts accepted in a round, at most)."""
        return min(self.depth + 1, self.total_token - 1)

    def as_list(self) -> list[int]:
        return [self.total_token, self.depth, self.top_k]

    def text(self) -> str:
        """The --eagle-tree argument that parses back to this shape ('default' written out)."""
        return ",".join(map(str, self.as_list()))


def parse_tree(text) -> TreeShape:
    """`--eagle-tree TOTAL,DEPTH,TOPK` (or `default`; the API also takes three ints) -> TreeShape; SpecError
    (exit 3) naming what is wrong. The one parse of both halves (eagle3/tree.py's is this one)."""
    if isinstance(text, TreeShape):
        return text
    if isinstance(text, str) and text.strip() == "default":
        return TreeShape(*DEFAULT_EAGLE_TREE)
    try:
        parts = text.split(",") if isinstance(text, str) else list(text)
        if len(parts) != 3 or any(isinstance(x, bool | float) for x in parts):
            raise ValueError
        total, depth, k = (int(x) for x in parts)
    except (TypeError, ValueError):
        raise SpecError(f"--eagle-tree {text!r}: expected TOTAL_TOKEN,DEPTH,TOP_K (e.g. 60,7,10) or default") \
            from None
    shape = TreeShape(total, depth, k)
    if total < 2 or depth < 0 or k < 1:
        raise SpecError(f"--eagle-tree {shape.text()}: need total_token >= 2, depth >= 0, top_k >= 1")
    most = k + depth * k * k
    if total - 1 > most:
        raise SpecError(f"--eagle-tree {shape.text()}: total_token - 1 = {total - 1} nodes but depth {depth} and "
                        f"top_k {k} score only {most} candidates (top_k + depth * top_k^2); lower total_token")
    return shape


# EAGLE's tree at T > 0 (recursive rejection over a node's children) is not evaluated: the spec refuses the pair
# before anything is launched, the payload's eval (eagle3/sampled.py) in the same words
TREE_SAMPLED_REFUSED = ("--eagle-tree with --draft sampled: EAGLE's tree at T > 0 samples by recursive rejection "
                        "over a node's children, which reval does not evaluate; run the tree with --draft greedy (the "
                        "walk over every sample) or the chain (--chain K) with --draft sampled")


def refuse_eagle3_decoding(drafter: str, chain: int | None, eagle_tree: str | None) -> None:
    """--chain / --eagle-tree asked of a DFlash drafter: SpecError, the one line the user sees (the host's preflight
    when the drafter's config.json says its family; else the eval's own switch, eagle3/family.py)."""
    if chain is not None:
        raise SpecError(f"--chain {chain}: the chain length is for EAGLE-3 drafters; {drafter} is a DFlash "
                        "drafter (its block_size is in its config.json)")
    if eagle_tree is not None:
        raise SpecError(f"--eagle-tree {eagle_tree}: EAGLE's draft tree is for EAGLE-3 drafters; {drafter} is a "
                        "DFlash drafter (its trees: --ddtree-budgets, --tree-widths)")


def joined_fingerprint(named: list[tuple[str, str]]) -> str:
    """Several suites' caches as one fingerprint: sha256 over 'name\\0fingerprint\\n' per suite, in order."""
    blob = "".join(f"{name}\0{fp}\n" for name, fp in named)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def _count(name: str, v, *, zero_ok: bool) -> None:
    if v is None and not zero_ok:
        return
    lo = 0 if zero_ok else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpecError(f"--{name} must be a whole number of at least {lo}, got {v!r}")


@dataclass(frozen=True)
class EvalSpec:
    """What to evaluate (paths on the host) and how. Checked when made: a value of this type is valid.
    `cache` takes a path, NAME=PATH, or a list of them, and holds the parsed tuple of CacheRef.
    `payload="dummy"` runs the torch-free stand-in; `extra`: more `python -m remote_payload eval` options.
    `draft`: the draft rule on a sampled cache (DRAFT_RULES; the payload refuses `sampled` where no cache is sampled,
    and over suites applies it to the sampled ones). `chain` / `eagle_tree`: an EAGLE-3 drafter's decoding (the chain
    of K drafts per round, default 5; EAGLE's dynamic tree "TOTAL,DEPTH,TOPK" or "default", held written out); one
    of them at most, and the payload (and the host's preflight, when the drafter's config.json says) refuses both
    for a DFlash drafter."""
    drafter: str | None = None
    target: str | None = None
    cache: tuple[CacheRef, ...] = ()
    num_prompts: int | None = None
    max_blocks: int | None = None
    speedup: bool = False
    online: int = 0
    allow_unknown_config: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    payload: str = "eval"
    draft: str = "greedy"
    gpus: str | None = None     # where, not what: auto | none | 0,1 (None: the host's); not part of the argv
    # suites given by their prompt files (NAME=FILE, here): the laptop resolves each to its cache in the host's
    # store (built first when missing) and hands the payload those caches (--cache NAME=PATH)
    prompts: tuple[PromptRef, ...] = ()
    max_new_tokens: int | None = None  # with prompts: the completion cap of the caches built for them (recipe)
    chain: int | None = None  # EAGLE-3: drafts per round, the greedy chain (None: the payload's default, 5)
    eagle_tree: str | None = None  # EAGLE-3: EAGLE's dynamic tree, "TOTAL,DEPTH,TOPK" (None: the chain)

    def __post_init__(self):
        put = object.__setattr__
        put(self, "cache", parse_caches(self.cache))
        put(self, "prompts", parse_prompts(self.prompts))
        both = [c.suite for c in self.cache] + [p.name for p in self.prompts]
        if self.prompts and len(set(both)) != len(both):
            dup = min({n for n in both if both.count(n) > 1})
            raise SpecError(f"suite {dup!r} is given twice (--cache and --prompts)", hint="name each suite once")
        put(self, "allow_unknown_config", tuple(self.allow_unknown_config or ()))
        put(self, "extra", tuple(self.extra or ()))
        if self.payload not in PAYLOADS:
            raise SpecError(f"payload {self.payload!r}: use eval or dummy")
        for k in ("drafter", "target", "gpus"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise SpecError(f"--{k} {v!r}: give a path" if k != "gpus" else f"--gpus {v!r}: auto, none or 0,1")
        _count("num-prompts", self.num_prompts, zero_ok=False)
        _count("max-blocks", self.max_blocks, zero_ok=False)
        _count("online", self.online, zero_ok=True)
        _count("max-new-tokens", self.max_new_tokens, zero_ok=False)
        if self.max_new_tokens is not None and not self.prompts:
            raise SpecError("--max-new-tokens is the completion cap of caches built from --prompts; give "
                            "--prompts NAME=FILE, or leave it out")
        self._check_decoding()
        if self.draft not in DRAFT_RULES:
            raise SpecError(f"--draft {self.draft!r}: use {' or '.join(DRAFT_RULES)}")
        if not isinstance(self.speedup, bool):
            raise SpecError(f"speedup must be true or false, got {self.speedup!r}")
        for k in self.allow_unknown_config:
            if not isinstance(k, str) or not k or k.startswith("-"):
                raise SpecError(f"--allow-unknown-config {k!r}: give a config key (dflash_config.KEY when nested)")
        if self.payload == "eval":
            owned = [a for a in self.extra if a.split("=", 1)[0] in OWNED_OPTIONS]
            if owned:
                opt = owned[0].split("=", 1)[0]
                raise SpecError(f"{opt} among the payload's extra arguments: it is an option of the spec",
                                hint=f"give {opt} before --, as an option of reval run / reval sweep")

    def _check_decoding(self) -> None:
        """--chain / --eagle-tree: checked and the tree written out (`default` and 60,7,10 are one spec)."""
        _count("chain", self.chain, zero_ok=False)
        if self.chain is not None and self.eagle_tree is not None:
            raise SpecError(f"--chain {self.chain} and --eagle-tree {self.eagle_tree}: one decoding per run (the "
                            "chain of K is the tree K+1,K-1,1); give one")
        if self.eagle_tree is not None:
            object.__setattr__(self, "eagle_tree", parse_tree(self.eagle_tree).text())
            if self.draft == "sampled":
                raise SpecError(TREE_SAMPLED_REFUSED)
        if self.payload != "eval" and (self.chain is not None or self.eagle_tree is not None):
            raise SpecError(f"--{'chain' if self.chain is not None else 'eagle-tree'} is an option of the eval "
                            f"(EAGLE-3 drafters); the {self.payload} payload has no decoding to set",
                            hint="leave it out, or run --payload eval")

    def decoding_argv(self) -> list[str]:
        """--chain K / --eagle-tree T,D,K as the payload's eval and preflight take them ([] when not given)."""
        return (["--chain", str(self.chain)] if self.chain is not None else []) + \
            (["--eagle-tree", self.eagle_tree] if self.eagle_tree is not None else [])

    # -- what is asked ------------------------------------------------------------------------------------
    def missing(self) -> list[str]:
        """The options an eval needs that this spec lacks (a sweep's template lacks --drafter by design)."""
        if self.payload != "eval":
            return []
        return [f"--{k}" for k in ("drafter", "target", "cache") if not getattr(self, k)
                and not (k == "cache" and self.prompts)]

    def suites(self) -> list[tuple[str, str]] | None:
        """[(suite name, path)] when the caches are suites (several, or one NAME=PATH); None for one cache."""
        if len(self.cache) == 1 and self.cache[0].name is None:
            return None
        return [(c.suite, c.path) for c in self.cache]

    def cache_label(self) -> str:
        """What the log and results.json name: the path, or 'name=path,...' for suites."""
        s = self.suites()
        return self.cache[0].path if s is None else ",".join(f"{n}={p}" for n, p in s)

    def with_paths(self, fix) -> EvalSpec:
        """The spec with every host path passed through fix(option, path) (e.g. made absolute)."""
        caches = tuple(dataclasses.replace(c, path=fix("cache", c.path)) for c in self.cache)
        return dataclasses.replace(self, drafter=fix("drafter", self.drafter) if self.drafter else self.drafter,
                                   target=fix("target", self.target) if self.target else self.target, cache=caches)

    # -- what the payload gets ------------------------------------------------------------------------------
    def payload_argv(self, name: str | None = None) -> list[str]:
        """`python -m remote_payload ...` arguments, without --run-dir (the launcher adds it) (pure)."""
        if self.payload == "dummy":
            return ["dummy", *self.extra]
        if self.prompts:
            raise SpecError("--prompts: each suite's prompt file is resolved to its cache on the host first "
                            "(reval run and reval.submit do it)", hint="resolve_prompts(...) before the argv")
        argv = ["eval", "--drafter", str(self.drafter), "--target", str(self.target), *self._cache_argv()]
        argv += ["--name", name] if name else []
        argv += ["--num-prompts", str(self.num_prompts)] if self.num_prompts is not None else []
        argv += ["--max-blocks", str(self.max_blocks)] if self.max_blocks is not None else []
        argv += ["--speedup"] if self.speedup else []
        argv += ["--online", str(self.online)] if self.online else []
        argv += ["--draft", self.draft] if self.draft != "greedy" else []
        return argv + self.decoding_argv() + self._allow_argv() + list(self.extra)

    def preflight_argv(self) -> list[str] | None:
        """`python -m remote_payload preflight ...`: the paths checked on the host before anything starts."""
        if self.payload != "eval":
            return None
        return ["preflight", "--drafter", str(self.drafter), "--target", str(self.target), *self._cache_argv(),
                *self.decoding_argv(), *self._allow_argv()]

    def _cache_argv(self) -> list[str]:
        return [a for c in self.cache for a in ("--cache", c.text())]

    def _allow_argv(self) -> list[str]:
        return [a for k in self.allow_unknown_config for a in ("--allow-unknown-config", k)]

    def identity(self, host: str) -> str:
        """The same command on the same host = the same run (re-attach instead of a duplicate)."""
        blob = json.dumps({"host": host, "argv": self.payload_argv(), "gpus": self.gpus}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def numbers_key(self) -> dict:
        """What changes the numbers of an eval (a sweep ledger's key), the drafter aside."""
        caches = [c.text() for c in self.cache]
        key = {"payload": self.payload, "target": self.target,
               "cache": caches[0] if len(caches) == 1 and self.cache[0].name is None else caches,
               "num_prompts": self.num_prompts, "max_blocks": self.max_blocks, "eval_args": list(self.extra)}
        if self.speedup or self.online:  # absent when off: keys of sweeps made before these options stay the same
            key.update(speedup=self.speedup, online=self.online)
        if self.allow_unknown_config:
            key["allow_unknown_config"] = sorted(self.allow_unknown_config)
        if self.draft != "greedy":  # absent when greedy: keys of sweeps made before --draft stay the same
            key["draft"] = self.draft
        if self.chain is not None:  # absent when not given: keys of sweeps made before --chain stay the same
            key["chain"] = self.chain
        if self.eagle_tree is not None:  # written out: --eagle-tree default and 60,7,10 are one entry
            key["eagle_tree"] = self.eagle_tree
        if self.prompts:  # suites by their prompt files (absent otherwise: the keys of --cache sweeps stay)
            key.update(prompts=[p.text() for p in self.prompts], max_new_tokens=self.max_new_tokens)
        return key
