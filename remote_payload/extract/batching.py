"""`extract`'s batches: how prompts are grouped (`batches`: longest first, a prompt and a token budget a batch),
what one batch computes (`extract_batch`: the generator, then the prefill; `batch_rows` its rows), and the
in-process runner (`LocalRunner`), whose cache files a background thread writes (`Background`) while the next
batch computes. pool.py runs the same batches in one process per GPU.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from remote_payload.eval.regime import Regime
from remote_payload.extract.decode import Generator, draws
from remote_payload.extract.prefill import prefill_batch
from remote_payload.extract.writer import CacheWriter


@dataclass
class BatchResult:
    """One batch's completions and features, the features on the host (on CUDA still being copied: `wait`)."""
    seqs: list[list[int]]
    features: torch.Tensor  # [B, T, n_layers, H], right-padded
    agree: torch.Tensor     # [B, 2]: argmax matches, completion positions
    lens: list[int]
    ready: object = None    # the CUDA event the copies end at
    logp: torch.Tensor | None = None  # sampled: the completion tokens' log-probs under the transform, row after row
    prompt_lens: list[int] | None = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def extract_batch(model, gen: Generator, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                  layer_ids: list[int], regime: Regime | None = None,
                  rows: list[tuple[str, int]] | None = None) -> BatchResult:
    """Greedy completions of `prompts`, then one prefill of prompt + completion: the tapped features and the
    argmax agreement. On CUDA the copies to the host are queued (pinned memory) and not waited for.
    regime (a sampled cache): the completions are sampled, row i from the uniforms of its (prompt key, sample)
    `rows[i]` (decode.draws), and the prefill gives each completion token's log-prob under the transform."""
    if regime is None:
        seqs = gen(model, prompts, max_new_tokens, eos)
    else:
        seqs = gen(model, prompts, max_new_tokens, eos, sampler=draws(regime, rows, max_new_tokens))
    lens_p = [len(p) for p in prompts]
    pre = prefill_batch(model, [torch.tensor(x) for x in seqs], layer_ids, lens_p,
                        transform=None if regime is None else regime.transform)
    if pre.features.device.type != "cuda":
        return BatchResult(seqs, pre.features, pre.agree, pre.lens, logp=pre.logp, prompt_lens=lens_p)
    feats, agree = pre.features.to("cpu", non_blocking=True), pre.agree.to("cpu", non_blocking=True)
    logp = None if pre.logp is None else pre.logp.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(pre.features.device))
    return BatchResult(seqs, feats, agree, pre.lens, ready, logp, lens_p)


def batch_rows(res: BatchResult):
    """(row, ids [T], features [T, n_layers, H], info, tensors) per row of a finished batch, info =
    {"argmax_agree": [matches, positions]}; a sampled batch: info {"sampled_agree": [...], "logp_sha256"} and
    tensors {"logp": [completion tokens] fp32} (else {})."""
    res.wait()
    agree = res.agree.tolist()
    parts = (None if res.logp is None else
             torch.split(res.logp, [n - p for n, p in zip(res.lens, res.prompt_lens)]))
    for r, seq in enumerate(res.seqs):
        ids, feats = torch.tensor(seq), res.features[r, :res.lens[r]]
        if parts is None:
            yield r, ids, feats, {"argmax_agree": agree[r]}, {}
            continue
        logp = parts[r].float().contiguous()
        sha = hashlib.sha256(logp.numpy().tobytes()).hexdigest()
        yield r, ids, feats, {"sampled_agree": agree[r], "logp_sha256": sha}, {"logp": logp}


class Background:
    """Jobs run in order on one thread, at most `depth` waiting (`put` blocks when full): the cache's files are
    written while the next batch computes. The thread's first error is raised in the caller's thread (at the
    next `put`, or on leaving the `with`); after it, or after an error of the caller's, the jobs left are
    dropped (the prompts they held are extracted again on resume)."""

    def __init__(self, depth: int = 2, name: str = "reval-extract-writer"):
        import queue
        import threading
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            if self._error is None and not self._stop:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 — handed to the caller's thread
                    self._error = e

    def put(self, job) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(job)

    def __enter__(self) -> Background:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._stop = True
        self._q.put(None)
        self._thread.join()
        if exc_type is None and self._error is not None:
            raise self._error


class LocalRunner:
    """`extract` in this process: the model here; each batch's files are written by a background thread while the
    next batch computes (`Background`)."""

    def __init__(self, model, gen: Generator, *, layer_ids: list[int], max_new_tokens: int, eos: set[int],
                 writer: CacheWriter, report, regime: Regime | None = None):
        self.model, self.gen, self.layer_ids, self.max_new_tokens, self.eos = model, gen, layer_ids, max_new_tokens, eos
        self.w, self.report, self.regime = writer, report, regime

    def __enter__(self) -> LocalRunner:  # noqa: PYI034
        self.bg = Background().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bg.__exit__(*exc)

    def run_round(self, groups: list[list[int]], prompts: dict[int, list[int]], entries) -> dict:
        """Every group (entry indices) as one batch; returns {entry: prompt + completion ids}. entries:
        command._Entries (names, each entry's draws and cache.json fields)."""
        seqs = {}
        for idx in groups:
            res = extract_batch(self.model, self.gen, [prompts[j] for j in idx], self.max_new_tokens, self.eos,
                                self.layer_ids, self.regime, [entries.draw[j] for j in idx])
            seqs.update(zip(idx, res.seqs))
            self.bg.put(lambda idx=idx, res=res: self._write(idx, res, prompts, entries))
        return seqs

    def _write(self, idx: list[int], res: BatchResult, prompts: dict, entries) -> None:
        for r, ids, feats, info, tensors in batch_rows(res):
            j = idx[r]
            self.w.add(entries.names[j], len(prompts[j]), ids, feats, index=j, info={**entries.info[j], **info},
                       tensors=tensors)
            self.report(j, len(prompts[j]), len(ids))


def batches(lengths: list[int], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped for batching: longest first (little padding), at most max_batch prompts and about
    max_tokens padded tokens (the longest member times the count) per group; every group has >= 1."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < max_batch and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
