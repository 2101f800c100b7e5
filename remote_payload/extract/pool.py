"""`extract --gpus 0,1,...`: one process a GPU, one cache — the cache a one-GPU run writes.

The `extract` process (the coordinator) forms the batches exactly as a one-process run does (`batching.batches`,
round by round for multi-turn files) and puts them on a task queue; each worker process (spawned: its own CUDA
context) loads the target on its device and takes the next batch whenever it is free. A worker runs what a
one-process extract runs per batch (`batching.extract_batch`: the same generator, the same prefill) and writes the
batch's prompt files into the cache's work dir (`writer.write_prompt`, from a background thread); the coordinator
keeps the books (`CacheWriter.record`: partial.json, at the end cache.json) as the workers report the files.
Same batches and the same kernels give the same numbers, so the merged cache is the one-process cache, file for
file and cache.json field for field but its created_at (on GPUs of one model: the workers must report the same
generation record, or the run stops). Resume works as for one process: a file counts once it is recorded.

`--gpus cpu,cpu` runs CPU worker processes (the tests' stand-in for GPUs), each with this process's thread count.
"""
from __future__ import annotations

import os
import queue
import re
import traceback
from pathlib import Path

import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.gpus import gpu_indices
from remote_payload.eval.regime import Regime
from remote_payload.extract.batching import Background, batch_rows, extract_batch
from remote_payload.extract.decode import choose_generator, generation_record
from remote_payload.extract.writer import write_prompt
from remote_payload.target.load import load_target


def parse_gpus(text: str) -> list[str]:
    """--gpus: "0,1,3" -> ["cuda:0", "cuda:1", "cuda:3"] (each index once); "all" -> every visible GPU; "cpu,cpu" ->
    CPU processes; devices named ("cuda:0,cuda:0") -> those processes, one GPU twice allowed (tests)."""
    items = [x.strip() for x in text.split(",")]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if items == ["all"]:
        if not n:
            raise PayloadError("--gpus all: no CUDA device is visible on this host; use --device cpu")
        return [f"cuda:{i}" for i in range(n)]
    if items and all(x == "cpu" for x in items):
        return items
    if items and all(re.fullmatch(r"cuda:[0-9]+", x) for x in items):  # devices named: several processes on one
        bad = [x for x in items if int(x[5:]) >= n]                   # GPU allowed (tests: cuda:0,cuda:0)
        if bad:
            raise PayloadError(f"--gpus {text!r}: {bad[0]} is not visible on this host ({n} CUDA devices)")
        return items
    try:
        ids = gpu_indices(text)
    except ValueError as e:  # not indices, or one given twice
        more = ", or all (cpu,cpu: CPU processes)" if str(e).startswith("expected") else ""
        raise PayloadError(f"--gpus {text!r}: {e}{more}") from None
    bad = [i for i in ids if i >= n]
    if bad:
        have = "no CUDA device is visible" if not n else f"this host has GPUs 0..{n - 1}"
        raise PayloadError(f"--gpus {text}: {have}; GPU{'s' if len(bad) > 1 else ''} {bad} do not exist")
    return [f"cuda:{i}" for i in ids]


class PoolRunner:
    """The worker processes, as `command.extract` uses a runner: `with` starts them (each loads the target) and
    stops them; `run_round(groups, prompts, entries)` has every group extracted as one batch, records each prompt
    as its file is reported and returns {entry: prompt + completion ids}."""

    def __init__(self, devices: list[str], *, target, dtype: torch.dtype, layer_ids: list[int], max_new_tokens: int,
                 eos: set[int], writer, report, batch_size: int, batch_tokens: int, compile: bool = False,
                 regime=None):
        self.devices, self.writer, self.report = devices, writer, report
        self.spec = {"target": str(target), "dtype": str(dtype).removeprefix("torch."), "layer_ids": list(layer_ids),
                     "max_new_tokens": max_new_tokens, "eos": sorted(eos), "num_layers": len(layer_ids),
                     "hidden_size": writer.hidden_size, "batch_size": batch_size, "batch_tokens": batch_tokens,
                     "compile": compile, "parent": os.getpid(),
                     "regime": None if regime is None else regime.to_json(),
                     "threads": torch.get_num_threads() if devices[0] == "cpu" else 0}
        self.procs: list = []
        self.generation: dict | None = None

    def __enter__(self) -> PoolRunner:  # noqa: PYI034
        import multiprocessing as mp
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state inherited
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        spec = {**self.spec, "workdir": str(self.writer.tmp)}
        self.procs = [ctx.Process(target=_worker, args=(rank, dev, spec, self.tasks, self.results),
                                  name=f"reval-extract-{rank}", daemon=True) for rank, dev in enumerate(self.devices)]
        try:
            for p in self.procs:
                p.start()
            ready: dict[int, dict] = {}
            while len(ready) < len(self.procs):
                msg = self._next()
                if msg[0] != "ready":
                    raise RuntimeError(f"extract worker {msg[1]}: {msg[0]!r} before it was ready")
                ready[msg[1]] = msg[2]
            first = ready[0]
            other = next((r for r in sorted(ready) if ready[r] != first), None)
            if other is not None:
                diff = sorted(k for k in first if first.get(k) != ready[other].get(k))
                raise PayloadError(f"--gpus: {self.devices[0]} and {self.devices[other]} would not compute the same "
                                   f"numbers (their {', '.join(diff)} differ); use GPUs of one kind")
            self.generation = first
        except BaseException:
            self._stop()
            raise
        return self

    def _next(self) -> tuple:
        """The next message of a worker; a worker's error, or a worker gone, raised here."""
        while True:
            try:
                msg = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = next(((r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()), None)
                if dead:
                    raise RuntimeError(f"extract worker {dead[0]} ({self.devices[dead[0]]}) exited with code "
                                       f"{dead[1]} before its work was done (killed? out of memory?)") from None
                continue
            if msg[0] == "error":
                _, rank, bad_input, text, tb = msg
                if bad_input:
                    raise PayloadError(f"{self.devices[rank]}: {text}")
                raise RuntimeError(f"extract worker {rank} ({self.devices[rank]}) failed: {text}\n{tb}")
            return msg

    def run_round(self, groups: list[list[int]], prompts: dict[int, list[int]], entries) -> dict:
        for idx in groups:
            self.tasks.put((idx, [entries.names[j] for j in idx], [prompts[j] for j in idx],
                            [entries.draw[j] for j in idx], [entries.info[j] for j in idx]))
        seqs: dict[int, list[int]] = {}
        want = sum(len(g) for g in groups)
        while len(seqs) < want:
            msg = self._next()
            if msg[0] != "done":
                raise RuntimeError(f"extract worker {msg[1]}: unexpected {msg[0]!r}")
            _, _rank, j, entry, seq = msg
            self.writer.record(entry)
            seqs[j] = seq
            self.report(j, len(prompts[j]), len(seq))
        return seqs

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            for _ in self.procs:
                self.tasks.put(None)
            for p in self.procs:
                p.join(timeout=60)
        self._stop()

    def _stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _worker(rank: int, device: str, spec: dict, tasks, results) -> None:
    """One worker process: load the target on `device`, then extract the batches of `tasks` until None."""
    try:
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        model = load_target(spec["target"], dev, getattr(torch, spec["dtype"]))
        gen = choose_generator(model, spec["compile"])
        results.put(("ready", rank, generation_record(model, gen, batch_size=spec["batch_size"],
                                                      batch_tokens=spec["batch_tokens"],
                                                      max_new_tokens=spec["max_new_tokens"])))
        eos, workdir = set(spec["eos"]), Path(spec["workdir"])
        regime = None if spec["regime"] is None else Regime(**spec["regime"])

        def write(idx, names, prompt_lens, res, infos) -> None:
            for r, ids, feats, info, tensors in batch_rows(res):
                entry = write_prompt(workdir, idx[r], names[r], prompt_lens[r], ids, feats,
                                     num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
                                     info={**infos[r], **info}, tensors=tensors)
                results.put(("done", rank, idx[r], entry, res.seqs[r]))

        with Background() as bg:
            while True:
                try:
                    task = tasks.get(timeout=5)
                except queue.Empty:
                    if os.getppid() != spec["parent"]:
                        return  # the coordinator is gone
                    continue
                if task is None:
                    break
                idx, names, prompts, rows, infos = task
                res = extract_batch(model, gen, prompts, spec["max_new_tokens"], eos, spec["layer_ids"], regime,
                                    rows)
                bg.put(lambda idx=idx, names=names, prompts=prompts, res=res, infos=infos:
                       write(idx, names, [len(p) for p in prompts], res, infos))
    except BaseException as e:  # noqa: BLE001 — reported to the coordinator, which raises it
        results.put(("error", rank, isinstance(e, PayloadError), f"{type(e).__name__}: {e}", traceback.format_exc()))
