"""The results.json schema: one versioned set of dataclasses that the payload writes and the orchestrator reads.

Stdlib only (beside protocol.py): the laptop half imports it without torch. Reading is strict where it must be
and lenient where it can be:
- a missing required field, or a value of the wrong type, is one line naming the file and the field
  (`ResultsError`, a ValueError);
- unknown fields (a newer payload's additions) are kept in `.extra` and written back unchanged;
- files written before schema `reval.results/2` still load (the fields added since are optional).

    res = Result.load("runs/gpu1/step4000/results.json")
    res.metrics.tau, res.per_prompt[0].acceptance_lengths, res.health.suspect, res.drafter.attention

The record machinery (strict reading, `extra`, writing back) is records.py's.
`docs/results.md` is generated from these classes (`python -m remote_payload.tools.results_docs > docs/results.md`;
a test fails when the two differ).
"""
# ruff: noqa: RUF009 — `doc(...)` is dataclasses.field(...) with the field's documentation
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remote_payload.contract import runstate
from remote_payload.contract.protocol import RESULTS_SCHEMA as SCHEMA
from remote_payload.contract.records import Record, ResultsError, doc, record_from_dict
from remote_payload.contract.results_speedup import (  # noqa: F401 - part of the schema
    BatchSpeedup,
    Online,
    OnlinePrompt,
    OnlineRegime,
    Speedup,
    StepLatency,
    SuiteSpeedup,
)

SCHEMA_VERSION = int(SCHEMA.rsplit("/", 1)[1])
_SCHEMA_RE = re.compile(r"^reval\.results/(\d+)$")


# --------------------------------------------------------------------------------------------- the schema

@dataclass(kw_only=True)
class LayerAttention(Record):
    layer: int = doc("drafter layer index (0-based)")
    type: str = doc("`full_attention` or `sliding_attention` (config.json layer_types)")
    window: int | None = doc("keys a query sees, itself included (sliding layers); null: no window")
    causal_in_block: bool = doc("block positions see only earlier block positions (else bidirectional inside "
                                "the block); the context before the anchor is always visible (within the window)")


@dataclass(kw_only=True)
class Drafter(Record):
    path: str = doc("the drafter as given to --drafter")
    name: str = doc("display name (folder or file name)")
    layout: str = doc("`zlab` (config.json + safetensors) or `pt` (team .pt file)")
    step: int | None = doc("training step, when the checkpoint records one")
    content_hash: str = doc("checkpoint content hash `sha256-64MiB-tree:<hex>` over the files that decide "
                            "the drafter (config.json and the weight files the loader reads; "
                            "remote_payload/contract/contenthash.py): the same hash the sweep ledger records")
    target_layer_ids: list[int] = doc("target layers the drafter was trained on")
    fc_layer_ids: list[int] = doc("target layers its fc input reads from the cache")
    num_parameters: int = doc("parameters loaded")
    attention: list[LayerAttention] | None = doc(
        "per drafter layer, the attention the eval used (window, causal inside the block), resolved from "
        "layer_types / dflash_config.use_swa / swa_window_size / causal / is_causal as vLLM's DFlash loader "
        "does (remote_payload/contract/drafterconfig.py); part of the comparability key. Absent in files "
        "written before reval.results/2", None)
    mask_embedding: str | None = doc("the mask_embedding.pt that replaced embed_tokens[mask_token_id] in the "
                                     "drafted block; null: none", None)
    renamed_weights: list[str] | None = doc("weight-name rules applied (vLLM's names, e.g. `midlayer. -> "
                                            "layers.0.`); null: none", None)
    allowed_unknown_config: dict[str, str] | None = doc(
        "config keys reval does not interpret that the user allowed (--allow-unknown-config): key -> its value "
        "as JSON text; null: none", None)
    family: str | None = doc("drafter family: `dflash` (block drafter) or `eagle3` (EAGLE-3 head: chain or tree); "
                             "null in files written before families were recorded (DFlash)", None)
    eagle3: dict[str, Any] | None = doc(
        "EAGLE-3 only: decoding (`chain` or `tree`), chain_length (drafts per round; null for the tree), tree "
        "({total_token, depth, top_k}: EAGLE's dynamic tree, --eagle-tree; null for the chain), "
        "taps_hf_hidden_states (HF output_hidden_states indices of "
        "the three tapped states), layer_id_convention, explicit_layer_ids, draft_vocab_size, vocab_size, "
        "embed_source (`checkpoint` or `target`), config_source; null for DFlash", None)


@dataclass(kw_only=True)
class Target(Record):
    path: str = doc("the target folder (--target): its embed_tokens / lm_head and tokenizer are borrowed")
    embed_key: str = doc("weight key of the embedding read")
    lm_head_key: str | None = doc("weight key of the lm_head read; null when tied to the embedding")
    tied: bool | None = doc("lm_head tied to embed_tokens", None)
    config_matches_cache: bool | None = doc("the target's config.json is the one the cache was extracted with "
                                            "(null: the cache does not record it)", None)


@dataclass(kw_only=True)
class CacheInfo(Record):
    path: str = doc("the hidden-state cache (--cache)")
    fingerprint: str = doc("content fingerprint of the cache (`sha256:<hex>`)")
    layer_ids: list[int] = doc("target layers the cache holds")
    num_prompts_total: int = doc("prompts in the cache (the eval reads the first options.num_prompts)")
    argmax_agreement: float | None = doc(
        "exactness of the cache as `extract` recorded it: the fraction of its completion positions (all prompts) "
        "where the target's argmax over its own prefill is the cached next token; 1.0: tokens and hidden states "
        "agree exactly; below 0.99 the run is marked suspect (health.reasons). On a sampled cache (regime."
        "temperature > 0) the figure generalised: the fraction of positions whose token has probability > 0 "
        "under the transform from the prefill's own logits. Null: not recorded (a cache extracted before it was, "
        "or a seeds cache)", None)
    key: str | None = doc("the cache's recipe key: its name in a host's cache store (`reval caches`); null: a "
                          "cache made without a recipe (an older extract, a seeds cache)", None)
    recipe: dict[str, Any] | None = doc(
        "what the cache was made of, as its cache.json records it: target (content hash), tokenizer, prompts "
        "(sha256, count, entries), template (applied, enable_thinking), options (layers, max_new_tokens, dtype, "
        "sampling), generator; null when it records none", None)


@dataclass(kw_only=True)
class Options(Record):
    num_prompts: int = doc("prompts evaluated")
    max_blocks: int = doc("draft rounds per prompt (--max-blocks)")
    block_size: int = doc("drafter block size (bonus token + block_size-1 drafts)")
    ddtree_budgets: list[int] = doc("DDTree node budgets evaluated")
    tree_widths: list[int] = doc("width-k trees evaluated")
    device: str = doc("torch device, e.g. `cuda:0`, `cpu`")
    dtype: str = doc("compute dtype, e.g. `bfloat16`")
    batch_size: int = doc("anchors per drafter forward")
    strict: bool = doc("--strict: a suspect result failed the run")
    position_accuracy_anchors: str = doc("`walk_reach` (anchors the walk can reach) or `all` (--all-anchors)",
                                         "walk_reach")


@dataclass(kw_only=True)
class Comparability(Record):
    cache_fingerprint: str = doc("the cache's fingerprint")
    prompt_set: str = doc("sha256 of the evaluated prompts' token ids (prompt and completion, ids only) and prompt "
                          "lengths: the same for any two runs over the same prompts and completions, whatever "
                          "target layers their caches hold (the fingerprint runs of different drafter families are "
                          "matched on)")
    num_prompts: int = doc("prompts evaluated")
    max_blocks: int = doc("draft rounds per prompt")
    block_size: int = doc("drafter block size")
    metrics_version: str = doc("metric definitions version (`dflash-metrics/N`, `+all-anchors`)")
    attention: str | None = doc("the drafter's attention semantics, one `type/window/causal|bidirectional` per "
                                "layer (drafter.attention); null: not recorded (before reval.results/2)", None)
    family: str | None = doc("the drafter family (drafter.family): a DFlash block and an EAGLE-3 chain are "
                             "different decoders; null: not recorded (DFlash, before families)", None)
    regime: str | None = doc("the decoding regime (`Regime.signature`: `T=1/top_k=0/top_p=1/seed=0/samples=4/"
                             "draft=greedy`): runs of different regimes are never ranked against each other; "
                             "null: greedy decoding (T = 0) with greedy drafts, as every run before issue 29; a run "
                             "over suites of several regimes: `mixed:<suite>=<signature, or greedy>;...` (each "
                             "suite's own key is in suites[].comparability)", None)

    KEY_FIELDS = ("cache_fingerprint", "prompt_set", "num_prompts", "max_blocks", "block_size", "metrics_version",
                  "attention", "family", "regime")

    # Runs of two drafter families (a DFlash block, an EAGLE-3 chain or tree) read different target layers, so
    # their caches differ, and their blocks and attention are the decoders' own: they are ranked against each
    # other on tau over the same prompts and completions (prompt_set), rounds, metrics and regime.
    CROSS_FAMILY_FIELDS = ("prompt_set", "num_prompts", "max_blocks", "metrics_version", "regime")

    def key(self) -> dict[str, Any]:
        """What must be equal for two results to be ranked against each other (null attention or family:
        unknown)."""
        return {k: getattr(self, k) for k in self.KEY_FIELDS}


def fields_to_match(key: dict[str, Any], other: dict[str, Any]) -> tuple[str, ...]:
    """The comparability fields two keys (Comparability.key()) must agree on: all of them, or, when their
    drafter families differ (null: DFlash, written before families were recorded),
    Comparability.CROSS_FAMILY_FIELDS."""
    if (key.get("family") or "dflash") != (other.get("family") or "dflash"):
        return Comparability.CROSS_FAMILY_FIELDS
    return Comparability.KEY_FIELDS


@dataclass(kw_only=True)
class DDTreeBest(Record):
    budget: int = doc("the budget with the largest ddtree_tau (equal tau: the smaller budget)")
    tau: float = doc("its tau")


@dataclass(kw_only=True)
class Metrics(Record):
    tau: float | None = doc("mean acceptance length incl. the bonus token, macro over prompts (tokens per round)")
    tau_pooled: float | None = doc("mean acceptance length incl. bonus over all rounds of all prompts")
    streak: float | None = doc("tau - 1: drafts accepted per round excl. the bonus token")
    streak_pooled: float | None = doc("tau_pooled - 1")
    num_prompts: int = doc("prompts evaluated")
    num_rounds: float = doc("rounds of the vanilla walk over all prompts (sampled drafts: the expected number, "
                            "regime.notes)")
    num_anchors: int = doc("teacher-forced anchors evaluated")
    acceptance_histogram: list[float] = doc("index L = rounds whose acceptance length incl. bonus was L (index 0 "
                                            "is always 0), block_size+1 entries (sampled drafts: expected counts)")
    per_position_acceptance_unconditional: list[float | None] = doc("k=1..block_size-1: #(acc>=k)/#rounds")
    per_position_acceptance_conditional: list[float | None] = doc("k=1..block_size-1: #(acc>=k)/#(acc>=k-1)")
    position_accuracy: list[float | None] = doc("k=1..block_size-1, teacher-forced, pooled over anchors")
    position_accuracy_macro: list[float | None] | None = doc("as position_accuracy, averaged over prompts", None)
    position_1_accuracy: float | None = doc("position_accuracy at k=1 (teacher-forced)")
    ddtree_tau: dict[str, float | None] = doc("per node budget (string key): DDTree tau, macro over prompts")
    ddtree_best: DDTreeBest | None = doc("the best budget and its tau")
    tree_width_tau: dict[str, float | None] = doc("per width k (string key): width-k tree tau, macro over prompts")
    num_samples: int | None = doc("a sampled cache: the completions evaluated (every sample of each prompt; tau "
                                  "is the mean over prompts of each prompt's mean over its samples, tau_pooled "
                                  "pools every round of every sample); null: a greedy cache", None)


@dataclass(kw_only=True)
class FirstBlock(Record):
    draft: str = doc("the first drafted block, decoded")
    target: str = doc("the target's tokens at the same positions, decoded")


@dataclass(kw_only=True)
class ExpectedWalk(Record):
    tau: float | None = doc("E[tau | y]: the walk's tokens / rounds in expectation over the drafts given the "
                            "completion (exact, remote_payload/eval/expect.py)")
    tokens: float = doc("E[tokens committed]")
    rounds: float = doc("E[rounds]")
    histogram: list[float] = doc("index L: E[rounds of acceptance length L], block_size+1 entries")
    at_least: list[float] = doc("index k = 0..block_size-1: E[rounds with drafts accepted >= k]")


@dataclass(kw_only=True)
class SampleResult(Record):
    name: str = doc("the cache entry (`<prompt>~s<i>`)")
    sample: int = doc("the sample index i")
    prompt_len: int = doc("prompt tokens of this sample's entry")
    seq_len: int = doc("prompt + completion tokens")
    tau: float | None = doc("the walk's tau over this sample (sampled drafts: E[tau | y])")
    acceptance_lengths: list[int] | None = doc("greedy drafts: the walk's acceptance lengths; null: sampled", None)
    expected: ExpectedWalk | None = doc("sampled drafts: the exact expected walk; null: greedy drafts", None)
    ddtree_tau: dict[str, float | None] | None = doc("greedy drafts: per budget, the DDTree walk's tau", None)


@dataclass(kw_only=True)
class PromptResult(Record):
    name: str = doc("prompt name (from the cache)")
    prompt_len: int = doc("prompt tokens (the completion starts here)")
    seq_len: int = doc("prompt + completion tokens")
    acceptance_lengths: list[int] = doc("per round of the vanilla walk: drafts accepted + 1 (bonus)")
    tau: float | None = doc("mean of acceptance_lengths")
    num_anchors: int | None = doc("anchors drafted at", None)
    position_hits: list[int] | None = doc("k=1..block_size-1: anchors whose draft k equals the target", None)
    position_totals: list[int] | None = doc("k=1..block_size-1: anchors with a+k < seq_len", None)
    position_accuracy: list[float | None] | None = doc("position_hits / position_totals", None)
    ddtree_acceptance_lengths: dict[str, list[int]] | None = doc("per budget: the DDTree walk's lengths", None)
    ddtree_tau: dict[str, float | None] | None = doc("per budget: mean of those", None)
    tree_width_acceptance_lengths: dict[str, list[int]] | None = doc("per width: the width-k walk's lengths", None)
    tree_width_tau: dict[str, float | None] | None = doc("per width: mean of those", None)
    first_block: FirstBlock | None = doc("the first block, drafted vs target", None)
    samples: list[SampleResult] | None = doc("a sampled cache: this prompt's samples (its tau, ddtree_tau and "
                                             "tree_width_tau are their means, its hits and acceptance lengths "
                                             "pooled); null: a greedy cache", None)


@dataclass(kw_only=True)
class Health(Record):
    suspect: bool = doc("the result looks like a broken load (see reasons); never ranked silently")
    reasons: list[str] = doc("why it is suspect")
    hints: list[str] = doc("what to check", factory=list)
    top_draft_token: dict[str, Any] | None = doc("the most common draft token: id, share, target_share", None)
    feature_stats: dict[str, Any] | None = doc("per prompt: mean/std of the cached features", None)
    weight_stats: dict[str, Any] | None = doc("per weight key: mean/std", None)
    embed_stats: dict[str, Any] | None = doc("embed_tokens mean/std", None)


@dataclass(kw_only=True)
class Timing(Record):
    load_s: float | None = doc("seconds loading the drafter and the target head")
    eval_s: float | None = doc("seconds drafting and walking (the eval proper)")
    anchors_per_s: float | None = doc("anchors drafted per second of eval_s")
    total_s: float | None = doc("seconds of the whole payload run (wall)")


@dataclass(kw_only=True)
class Environment(Record):
    torch: str | None = doc("torch version")
    cuda: str | None = doc("CUDA version torch was built with")
    gpu: str | None = doc("GPU name; null on CPU")
    hostname: str = doc("host the eval ran on")
    python: str | None = doc("Python version", None)
    payload_version: str | None = doc("reval payload version", None)


@dataclass(kw_only=True)
class Regime(Record):
    temperature: float | None = doc("the cache's sampling temperature (0: greedy); null: mixed (below)")
    top_k: int | None = doc("top-k of the transform (0: off); null: mixed")
    top_p: float | None = doc("top-p of the transform (1: off); null: mixed")
    seed: int | None = doc("the draws' seed (null: greedy, or mixed)")
    samples: int | None = doc("completions per prompt; null: mixed")
    draft: str = doc("`greedy` (argmax drafts, the walk over every sample) or `sampled` (drafts from the drafter "
                     "at the same transform, verified by rejection sampling: exact expectations). At T = 0 the "
                     "rule is irrelevant (the drafter's sample is its argmax and the target's one-hot: rejection "
                     "sampling accepts exactly the greedy matches): a greedy cache records `greedy`. Mixed: the "
                     "--draft given (it applies to the sampled suites)")
    notes: list[str] = doc("how the figures of this regime are made and what is left out", factory=list)
    mixed: bool = doc("the run's suites were evaluated in different regimes (`--cache NAME=PATH` repeated over "
                      "greedy and sampled caches, or caches sampled differently): the transform's fields are "
                      "null here and each suite's regime is in suites[].regime", False)

    def signature(self) -> str | None:
        """The comparability key's form; None for greedy decoding with greedy drafts (every run before it).
        A mixed run's key names each suite's regime (run.py's mixed_signature), not this."""
        if self.mixed:
            return "mixed"
        if self.temperature == 0 and self.draft == "greedy":
            return None
        return (f"T={self.temperature:g}/top_k={self.top_k}/top_p={self.top_p:g}/seed={self.seed}/"
                f"samples={self.samples}/draft={self.draft}")


@dataclass(kw_only=True)
class Suite(Record):
    name: str = doc("the suite's name (`--cache NAME=PATH`), e.g. `gsm8k`")
    cache: CacheInfo = doc("its hidden-state cache")
    comparability: Comparability = doc("what must be equal for this suite to be ranked against another run's")
    metrics: Metrics = doc("the headline numbers over this suite's prompts")
    prompt_range: list[int] = doc("[first, end): its prompts in the top-level per_prompt (names `<suite>/<prompt>`)")
    regime: Regime | None = doc("this suite's decoding regime (its cache's sampling transform and the draft rule it "
                                "was evaluated with; comparability.regime is its signature); null: the run's "
                                "top-level regime (files written before suites carried their own)", None)


@dataclass(kw_only=True)
class SuiteMean(Record):
    num_suites: int = doc("suites averaged")
    tau: float | None = doc("unweighted mean over suites of each suite's tau (the papers' per-dataset average; "
                            "the top-level metrics pool every prompt instead)")
    streak: float | None = doc("tau - 1")
    position_1_accuracy: float | None = doc("unweighted mean over suites of position-1 accuracy")
    ddtree_tau: dict[str, float | None] = doc("per node budget: unweighted mean over suites of DDTree tau")


@dataclass(kw_only=True)
class Result(Record):
    schema: str = doc(f"`{SCHEMA}` (files with `reval.results/1` still load)")
    run: str = doc("run name")
    created_at: str = doc("UTC, ISO 8601")
    drafter: Drafter = doc("what was evaluated")
    target: Target = doc("the target model whose head and tokenizer were borrowed")
    cache: CacheInfo = doc("the hidden-state cache")
    options: Options = doc("eval options")
    comparability: Comparability = doc("what must be equal for two runs to be ranked against each other")
    definitions: dict[str, str] = doc("the exact definition of every metric (remote_payload/eval/metrics.py)")
    metrics: Metrics = doc("the headline numbers over all prompts")
    per_prompt: list[PromptResult] = doc("per prompt, in cache order (confidence intervals are computed from these)")
    health: Health = doc("guards against a broken load")
    timing: Timing = doc("durations")
    environment: Environment = doc("software and host")
    suites: list[Suite] | None = doc("per benchmark suite (`--cache NAME=PATH` repeated): its cache, metrics and "
                                     "prompts; null: one cache", None)
    suite_mean: SuiteMean | None = doc("the mean over suites (null: one cache, or suites of different regimes: a "
                                       "mean over T = 0 and T = 1 is no regime's figure)", None)
    speedup: Speedup | None = doc("`--speedup`: measured latencies and the projected speedup per method (null: "
                                  "not measured)", None)
    online: Online | None = doc("`--online N`: the spot check of the offline walk by real speculative decoding "
                                "(null: not run)", None)
    notes: list[str] | None = doc("what the run did that the options alone do not say, one sentence each: config "
                                  "fields that disagreed and which one won, `--online N` capped at the prompts "
                                  "there are (null: nothing to say)", None)
    regime: Regime | None = doc("the decoding regime: the cache's sampling transform and the draft rule (`mixed`: "
                                "suites of several regimes, each in suites[].regime; null: "
                                "written before it was recorded: greedy)", None)
    source: Path | None = field(default=None, repr=False, compare=False, metadata={"internal": True})

    @classmethod
    def from_dict(cls, d: Any, where: str = "", source: str | Path | None = None) -> Result:
        if not isinstance(d, dict):
            raise ResultsError(f"{_file(source)}not a JSON object")
        check_schema(d.get("schema"), source)
        try:
            res = record_from_dict(cls, d, where)
        except ResultsError as e:
            raise ResultsError(f"{_file(source)}{e}") from None
        names = [s.name for s in res.suites or []]
        for i, s in enumerate(res.suites or []):  # a suite's slice of per_prompt: what suite tables read
            if s.name in names[:i]:  # suites are matched across runs by name: a second one would be lost
                raise ResultsError(f"{_file(source)}field suites[{i}].name: suite {s.name!r} is given twice "
                                   f"(suites[{names.index(s.name)}] too)")
            r = s.prompt_range
            if len(r) != 2 or not 0 <= r[0] <= r[1] <= len(res.per_prompt):
                raise ResultsError(f"{_file(source)}field suites[{i}].prompt_range: expected [first, end] within "
                                   f"the {len(res.per_prompt)} per_prompt records, got {r}")
        res.source = Path(source) if source is not None else None
        return res

    @classmethod
    def load(cls, path: str | Path) -> Result:
        """Read and check a results.json; every problem is one ResultsError line naming the file."""
        try:
            text = runstate.read_regular(path).decode("utf-8")  # a FIFO or a device is an OSError
        except UnicodeDecodeError:
            raise ResultsError(f"{path}: not UTF-8 text") from None
        try:
            data = runstate.loads(text)
        except ValueError as e:  # JSONDecodeError, or nested past runstate.MAX_JSON_DEPTH
            raise ResultsError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, source=path)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

    @property
    def suspect(self) -> bool:
        return self.health.suspect


def check_schema(schema: Any, source: str | Path | None = None) -> int:
    """The schema's version number; an unknown or newer schema is a one-line error."""
    m = _SCHEMA_RE.match(schema) if isinstance(schema, str) else None
    if not m:
        raise ResultsError(f"{_file(source)}schema {schema!r} is not a reval results schema (expected {SCHEMA!r})")
    version = int(m.group(1))
    if version < 1 or version > SCHEMA_VERSION:
        raise ResultsError(f"{_file(source)}schema {schema!r} is newer than this reval reads ({SCHEMA!r}): "
                           "upgrade reval")
    return version


def attention_signature(layers: list[LayerAttention] | None) -> str | None:
    """'sliding_attention/4/causal,full_attention/-/bidirectional' (the comparability key's form)."""
    if layers is None:
        return None
    return ",".join(f"{a.type}/{a.window if a.window is not None else '-'}/"
                    f"{'causal' if a.causal_in_block else 'bidirectional'}" for a in layers)


def _file(source: str | Path | None) -> str:
    return f"{source}: " if source is not None else ""
