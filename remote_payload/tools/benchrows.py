"""What the bench modules share: a table row, a synthetic prompt (so bench_extract/bench_process need not
import bench, which imports them), and benchdoc's readings (`Sample`) with its tables' titles and notes (so
benchparts, which measures them, and benchdoc, which writes them, import neither the other). Torch-free at import."""
from __future__ import annotations

from dataclasses import dataclass

from remote_payload.contract.drafterconfig import DrafterConfig


@dataclass
class Row:
    name: str
    rounds: int
    seconds: float
    flops: float
    note: str = ""


def synthetic_prompt(cfg: DrafterConfig, prompt_len: int, completion: int, dev, dtype, seed: int):
    import torch
    g = torch.Generator(device=dev).manual_seed(seed)
    T = prompt_len + completion
    ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g, device=dev)
    feats = torch.randn(T, cfg.fc_in_features, generator=g, device=dev, dtype=dtype)
    return ids, feats


DEFAULT_ROW = "default (warm caches)"
AFTER_IMPORTS = "after the imports (s)"  # wall less interpreter start and imports: what no knob touches
FRESH_ROW, AGAIN_ROW = "fresh host (empty kernel caches)", "again, same caches"
WARMED_ROW = "fresh host after warm (caches filled by `warm`)"
T_PEAKS = "Ceilings and the weight load"
T_EVAL = "The eval stage in-process (27B drafter sizes, random weights)"
T_PROCESS = "The `eval` process against its floor"
T_TIMELINE = "Where an `eval` process's seconds go (the seeds' run, seconds)"
T_EXTRACT = "Extraction, end to end (8B-class target, random weights)"
T_DECODE = "Extraction's greedy decoding"  # + " (batch 32, N new tokens)"
T_SAMPLED = "Sampled extraction against greedy (8B-class target, random weights)"
T_LATENCY = "The latency table at batch sizes (eval --speedup; random weights, bf16, context 1,024)"
T_EAGLE3 = "The EAGLE-3 eval stage in-process (8B-class head, random weights)"
T_PROJECTION = "Projected speedup against the online decode (tiny trained fixtures, batch 1)"
SERVING_NOTES = {
    T_SAMPLED: "Completion tokens per second of extract's fast path, disk writes left out; the two regimes "
               "interleaved in each run on the same prompts. Sampled: T=0.7, top-k 20, top-p 0.95, one sample a "
               "prompt, each row's uniforms drawn from its own (seed, prompt, sample) generator, and the prefill "
               "also gives log p(y) under the transform. Target: within 10% of greedy.",
    T_LATENCY: "Each latency is the median of >= 7 timed runs (CUDA graphs); \"measure\" is what `--speedup` adds "
               "the first time on a host (every batch, every tree), \"reuse\" the key and table lookup that "
               "replaces it on later runs. verify(n): the block (16 tokens) or DDTree-B's tree (B+1 nodes).",
    T_PROJECTION: "The fixtures' `eval --speedup --online N` on this GPU in fp32: the online decode (target alone "
                  "against speculative decoding, each timed --online-repeats times, the median) beside the "
                  "projection over the same prompts from their pooled tau and the run's latency table. Tiny models "
                  "are launch-bound, so this row checks the projection's arithmetic and timing, not a real "
                  "model's speedup.",
}
NOTES = {
    T_PEAKS: "Raw read: the weight files read into host memory (page cache warm); eval's load: the drafter and "
             "the target's embed and lm_head onto the GPU as `eval` reads them. The peak: an 8192^3 bf16 matmul on "
             "random data, the median of 5 readings; every \"% of peak\" below is against its own run's peak.",
    T_EVAL: "One round = one anchor's 16-token block. Useful FLOPs only (block GEMMs, attention, lm_head, context "
            "projections). A row with a knob set is the same scenario with that fast path off.",
    T_PROCESS: "floor = a bare interpreter importing torch and making the CUDA context + the raw read + the warm "
               "eval stage in-process, each round's own. A fresh host runs with its kernel caches (CUDA's JIT, "
               "the CUDA C cubins, Triton's, Inductor's, torch's: every variable of runtime/kcache.py) in an empty "
               "folder; \"again\" reruns on the caches it filled; \"after warm\" on empty caches that "
               "`python -m remote_payload warm --only eval` filled first (what `reval sync --warm` does); the "
               "default uses the venv's caches, warm. Rounds interleave every row, the order "
               "rotated each round. \"after the imports\": the wall less the interpreter's start and imports, "
               "which no knob touches and which move by tenths of a second from run to run.",
    T_TIMELINE: "From the parent's spawn to its wait returning: the child's clock at its first line, after "
                "`import torch`, after the eval's imports; its events (step 1, step 4, the load's end, done); "
                "results.json's mtime. \"load + warm-up left\" is what the load and the warm-up add after the "
                "features are checked.",
    T_EXTRACT: "Completion tokens per second, disk writes left out. batch-1: one prompt at a time (3 prompts); "
               "batched: dynamic cache and every layer's hidden states; fast: what `extract` runs (static cache, "
               "CUDA graph, hooked prefill).",
    T_DECODE: "Whole call: prefill, capture and decode, what extract pays (tokens/s and the fraction of the floor). "
              "A step: one decode step after the warm-up. Floor: the weights' bytes over the device copy bandwidth "
              "measured in the same run (each step reads them once).",
    T_EAGLE3: "One round = one anchor's chain (K=5: 5 sequential head forwards) or EAGLE's default tree (60,7,10: 8 "
              "level steps of up to 10 forwards), drafted at every anchor of the seeds' run (10 prompts x 540 tokens, "
              "random features and ids) and walked (bench_eagle3.py). Useful FLOPs only (the prefix's fc and K/V once "
              "a prompt; per forward q/k/v, attention, o_proj, MLP, lm_head over the 32,000-token draft vocabulary). "
              "The DFlash row: the payload part's seeds scenario on this run's DFlash checkpoint (its own sizes, "
              "27B-class on CUDA), for scale.",
}


@dataclass(frozen=True)
class Sample:
    """One run's reading of one cell: `table`, `row`, `col` (the quantity, with its unit), `value`."""
    table: str
    row: str
    col: str
    value: float
