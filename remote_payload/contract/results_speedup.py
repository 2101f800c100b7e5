"""results.json's serving-speed sections: `online` (the online check's decode) and `speedup` (the latency
table's projection per method and batch), with their records; re-exported by results.py, the schema's one
entry point (split off for size)."""
# ruff: noqa: RUF009 — `doc(...)` is dataclasses.field(...) with the field's documentation
from __future__ import annotations

from dataclasses import dataclass

from remote_payload.contract.records import Record, doc


@dataclass(kw_only=True)
class OnlinePrompt(Record):
    name: str = doc("prompt name")
    acceptance_lengths: list[int] = doc("per round of the online decoder, incl. the bonus token (at T > 0: every "
                                        "seed's rounds, seed by seed)")
    agree: bool | None = doc("equal, round by round, to the offline walk's acceptance lengths of this prompt (null "
                             "at T > 0: the online decode samples its own completions)")
    spec_s: float = doc("wall seconds of speculative decoding (prefill included; at T > 0 the seeds' decodes summed)")
    target_only_s: float = doc("wall seconds of target-only decoding of the same tokens (prefill included)")
    seed_taus: list[float | None] | None = doc("at T > 0: each seed's decode tau (tokens / rounds), seed index "
                                               "0..seeds-1", None)
    seed_rounds: list[int] | None = doc("at T > 0: each seed's rounds (splits acceptance_lengths)", None)
    tau_online: float | None = doc("at T > 0: the mean of seed_taus", None)
    tau_offline: float | None = doc("at T > 0: the eval's tau of this prompt (the mean over the cache's samples)",
                                    None)


@dataclass(kw_only=True)
class OnlineRegime(Record):
    temperature: float = doc("the cache's temperature (the target's posterior and sampled drafts, after it top-k "
                             "and top-p)")
    top_k: int = doc("the cache's top-k (0: off)")
    top_p: float = doc("the cache's top-p (1: off)")
    seed: int = doc("the cache's seed: decode i of a prompt draws from a generator seeded by it, the prompt's name "
                    "and i (never the cache's own draws)")
    samples: int = doc("the cache's samples a prompt (the offline figures' completions)")
    seeds: int = doc("decodes a prompt (--online-seeds)")
    draft: str = doc("greedy: argmax drafts kept while equal to the target's samples; sampled: drafts drawn from the "
                     "drafter, verified by rejection sampling (--draft)")


@dataclass(kw_only=True)
class Online(Record):
    method: str = doc("`block`: the plain DFlash block, verified by the target over its KV cache; an EAGLE-3 head's "
                      "`eagle3-chain-<K>` or `eagle3-tree-<total_token>,<depth>,<top_k>`")
    regime: OnlineRegime | None = doc("null: greedy (the check of the walk round by round); on a sampled cache "
                                      "the online decode's regime", None)
    device: str = doc("where it ran")
    dtype: str = doc("the target's and drafter's compute dtype")
    prompts: int = doc("prompts decoded online (the first N of the cache; with suites, of the first suite)")
    prompts_agreeing: int | None = doc("prompts whose every round's acceptance length equals the offline walk's "
                                       "(null at T > 0)")
    rounds: int = doc("rounds decoded")
    rounds_agreeing: int | None = doc("rounds whose acceptance length equals the offline walk's (exact in fp32 on CPU; "
                               "bf16 on a GPU may differ at near-ties, this says how often; null at T > 0)")
    tau_pooled_online: float | None = doc("mean acceptance length of the online rounds")
    tau_pooled_offline: float | None = doc("the offline walk's mean over the same prompts and rounds (at T > 0: "
                                           "over the cache's samples of these prompts)")
    tau_online: float | None = doc("at T > 0: the online tau, per prompt the mean over its seeds of each decode's "
                                   "tokens / rounds, then the mean over prompts (results.json's tau, online)", None)
    tau_online_ci: list[float] | None = doc("at T > 0: its 95% interval, a bootstrap over prompts (seeds nested)",
                                            None)
    tau_online_seed_ci: list[float] | None = doc("at T > 0: its 95% interval, a bootstrap over the seed indices "
                                                 "(prompts fixed: the online decode's randomness alone)", None)
    tau_offline: float | None = doc("at T > 0: the eval's tau over the same prompts (each the mean over its "
                                    "samples; sampled drafts: of E[tau | y])", None)
    tau_offline_ci: list[float] | None = doc("at T > 0: its 95% interval, a bootstrap over prompts (samples nested)",
                                             None)
    tau_difference: float | None = doc("at T > 0: tau_online - tau_offline (0 in expectation: both estimate the "
                                       "same tau at T)", None)
    tau_difference_ci: list[float] | None = doc("at T > 0: its 95% interval, a bootstrap over prompts paired (the "
                                                "same prompts for both)", None)
    ci_note: str | None = doc("at T > 0: how the intervals were made", None)
    tokens: int = doc("tokens the rounds produced")
    spec_s: float = doc("total wall seconds, speculative decoding (the median over the timed runs)")
    target_only_s: float = doc("total wall seconds, target-only greedy decoding of the same prompts (the median "
                               "over the timed runs)")
    measured_speedup: float | None = doc("target_only_s / spec_s (this device, batch 1, eager transformers); each "
                                         "the median over the timed runs of the prompts' total")
    projected_speedup: float | None = doc(
        "the block's projected speedup at batch 1 over THE SAME prompts, from their pooled offline tau "
        "(`projected_tau`) and --speedup's latencies (null without --speedup); its regime may differ (see "
        "speedup.regime). In older files: `speedup.projected.block`, over all prompts", None)
    projected_tau: float | None = doc("the pooled offline tau of these prompts that projected_speedup uses", None)
    repeats: int | None = doc("timed runs of each prompt, each way (--online-repeats); measured_speedup is their "
                              "median", None)
    measured_speedup_runs: list[float] | None = doc("per timed run: target-only seconds / speculative seconds over "
                                                    "all the prompts (the spread of measured_speedup)", None)
    prompts_with_cache_mismatch: int | None = doc("prompts where the target's own greedy tokens differ from the "
                                                  "cache's (the cache was not made by this target in this dtype; "
                                                  "null at T > 0)")
    per_prompt: list[OnlinePrompt] = doc("per prompt")


@dataclass(kw_only=True)
class SuiteSpeedup(Record):
    name: str = doc("the suite")
    projected: dict[str, float | None] = doc("per method (`block`, `ddtree_<B>`): tau x t(decode) / (t(draft) + "
                                             "t(verify)) with this suite's tau")
    best_method: str | None = doc("the method with the highest projected speedup, when its lead exceeds the "
                                  "latencies' spread (else null and `tied` names the methods within noise)")
    tied: list[str] | None = doc("the methods within noise of the highest (empty: a clear best)", None)


@dataclass(kw_only=True)
class StepLatency(Record):
    step: str = doc("`decode` (1 token a sequence), `verify` (`tokens` a sequence) or `draft` (one drafter block "
                    "a sequence)")
    tokens: int = doc("tokens a sequence the step feeds")
    batch: int = doc("sequences in the batch")
    median: float = doc("seconds, the median of n timed runs (a run: the mean of back-to-back calls)")
    q1: float = doc("first quartile of the runs")
    q3: float = doc("third quartile of the runs")
    min: float = doc("fastest run")
    max: float = doc("slowest run")
    n: int = doc("timed runs (at least --speedup-repeats; more while the IQR exceeded 5% of the median)")


@dataclass(kw_only=True)
class BatchSpeedup(Record):
    batch: int = doc("sequences decoded together")
    projected: dict[str, float | None] = doc("per method: tau_pooled x decode / (draft + verify), medians")
    low: dict[str, float | None] = doc("per method: the same from the quartiles' worst case (decode q1, draft "
                                       "and verify q3)")
    high: dict[str, float | None] = doc("per method: the quartiles' best case")
    best_method: str | None = doc("the highest median, named when its low exceeds every other method's high; "
                                  "null: within noise (see tied) or nothing projected")
    best_speedup: float | None = doc("the highest median")
    tied: list[str] = doc("the methods within noise of the highest (empty: a clear best)")


@dataclass(kw_only=True)
class Speedup(Record):
    regime: str = doc("`cuda-graphs` (every step captured and replayed, as a serving engine runs) or `eager`")
    device: str = doc("where the latencies were measured")
    gpu: str | None = doc("the GPU's name (null on CPU)")
    dtype: str = doc("the target's dtype")
    context_len: int = doc("KV-cache length the steps were measured at (the evaluated prompts' mean length)")
    decode_s: float = doc("one target decode step (1 token), at the first batch (median)")
    draft_s: float = doc("one drafter block at one anchor (context K/V precomputed), lm_head and top-k included")
    verify_s: dict[str, float] = doc("target verify forward of n tokens (key n): the block (block_size) and each "
                                     "DDTree budget's tree (B + 1 tokens, tree attention mask)")
    target_hash: str = doc("the target's content hash (part of the latency table's key)")
    reused: bool = doc("taken from the latency table (same GPU, dtype, target, versions, context length, "
                       "batches, repeats) instead of measured by this run")
    measure_s: float = doc("seconds this run spent measuring (0 when reused)")
    note: str = doc("why the regime fell back to eager, when it did", "")
    projected: dict[str, float | None] = doc("per method (`block`, `ddtree_<B>`; an EAGLE-3 head's `eagle3-chain-<K>` "
                                             "or `eagle3-tree-<T>,<D>,<K>`): tau x t(decode) / (t(draft) + "
                                             "t(verify)) over all prompts, at the first batch")
    best_method: str | None = doc("the method with the highest projected speedup (the DDTree budget that pays, "
                                  "not the largest one), named when its lead exceeds the latencies' spread (else "
                                  "null and `tied` names the methods within noise)")
    best_speedup: float | None = doc("the highest projected speedup")
    by_suite: list[SuiteSpeedup] | None = doc("the same per benchmark suite (null: one cache)", None)
    tau: str | None = doc("the tau the projections use: `pooled` (tokens / rounds over every round of every prompt, "
                          "what the time saved follows); null in older files: the per-prompt mean", None)
    tied: list[str] | None = doc("at the first batch: the methods within noise of the highest (empty: a clear "
                                 "best_method)", None)
    batches: list[int] | None = doc("the batch sizes measured (--speedup-batches); decode_s, draft_s, verify_s "
                                    "and projected are at the first", None)
    repeats: int | None = doc("the least timed runs per latency (--speedup-repeats)", None)
    latencies: list[StepLatency] | None = doc("every latency measured, with its spread", None)
    by_batch: list[BatchSpeedup] | None = doc("the projection per batch size, the best method per batch", None)
    stops_paying: dict[str, int | None] | None = doc("per method: the smallest batch measured whose projected "
                                                     "speedup is below 1 (null: it pays at every batch measured)",
                                                     None)
    measured_at: str | None = doc("when the latencies were measured (UTC, ISO 8601): the table entry's age", None)
    table: str | None = doc("the latency table the numbers are kept in (--latency-table, $REVAL_LATENCY_TABLE, "
                            "$REVAL_HOME/latency.json, ~/.cache/reval/latency.json)", None)
    table_note: str | None = doc("why they were measured rather than reused (no entry, --remeasure, a refused "
                                 "entry and why); null when reused", None)
