"""The sampling regime of a cache (issue 29): how `extract --temperature T` sampled its completions, as cache.json
records it under "sampling", and the names of its entries. Stdlib only.

    "sampling": {"temperature": T, "top_k": K, "top_p": P, "seed": S, "samples": N}   (absent: greedy)

Each sample is its own cache entry, named `<prompt>~s<i>` (i = 0..N-1), cache.json's entry listing the prompt's
name ("prompt") and the sample index ("sample") beside it; its file also holds `logp` [completion tokens] fp32,
log p(y_i) under the transform from the prefill's own logits (sha256 in cache.json's "logp_sha256").
Temperature 0 is greedy: no regime, today's cache byte for byte.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from remote_payload.contract.errors import PayloadError

SAMPLE_SEP = "~s"
DRAFT_RULES = ("greedy", "sampled")


@dataclass(frozen=True)
class Regime:
    """The serving transform (temperature, then top-k, then top-p; sampling.py) and the draws' identity."""
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    samples: int = 1

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def transform(self) -> tuple[float, int, float]:
        return (self.temperature, self.top_k, self.top_p)

    def label(self) -> str:
        """'T=1 top_k=0 top_p=1 seed=0 samples=4' (logs, the comparability key)."""
        return (f"T={self.temperature:g} top_k={self.top_k} top_p={self.top_p:g} seed={self.seed} "
                f"samples={self.samples}")


def regime_of(temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None,
              samples: int | None) -> Regime | None:
    """extract's options -> the regime, or None for greedy (no --temperature, or 0 with nothing else asked).
    Every value is checked here; a sampling option without a temperature > 0 is refused, never ignored."""
    if temperature is None or temperature == 0:
        given = [f"--{k}" for k, v in (("top-k", top_k), ("top-p", top_p), ("seed", seed), ("samples", samples))
                 if v is not None]
        if given:
            raise PayloadError(f"{', '.join(given)} without --temperature > 0: greedy decoding (temperature 0) "
                               "samples nothing; give --temperature T or drop them")
        return None
    if not 0 < temperature < float("inf"):
        raise PayloadError(f"--temperature {temperature}: need a finite number >= 0 (0 = greedy)")
    if top_k is not None and top_k < 0:
        raise PayloadError(f"--top-k {top_k}: need an integer >= 0 (0 = off)")
    if top_p is not None and not 0 < top_p <= 1:
        raise PayloadError(f"--top-p {top_p}: need a number in (0, 1] (1 = off)")
    if seed is None:
        raise PayloadError("--temperature > 0 needs --seed S: the sampled completions are reproducible from it")
    if seed < 0:
        raise PayloadError(f"--seed {seed}: need an integer >= 0")
    if samples is not None and samples < 1:
        raise PayloadError(f"--samples {samples}: need at least 1")
    return Regime(float(temperature), int(top_k or 0), float(1.0 if top_p is None else top_p), int(seed),
                  int(samples or 1))


def from_meta(meta: dict | None, where: str) -> Regime | None:
    """cache.json's "sampling" (absent or null: greedy) -> the regime; a malformed one is one line."""
    rec = (meta or {}).get("sampling") if isinstance(meta, dict) else None
    if rec is None:
        return None
    try:
        r = Regime(float(rec["temperature"]), int(rec["top_k"]), float(rec["top_p"]), int(rec["seed"]),
                   int(rec["samples"]))
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"{where}: malformed \"sampling\" ({e!r}); re-extract") from None
    if not (r.temperature > 0 and r.top_k >= 0 and 0 < r.top_p <= 1 and r.samples >= 1):
        raise PayloadError(f"{where}: \"sampling\" {rec} is out of range; re-extract")
    return r


def check_resume(partial_regime, regime: Regime | None, partial: str) -> None:
    """Refuse to continue an interrupted extract made under another regime (its partial.json's "sampling")."""
    ours = None if regime is None else regime.to_json()
    if partial_regime != ours:
        def say(r):
            try:
                return "greedy" if r is None else Regime(**r).label()
            except TypeError:
                return repr(r)
        raise PayloadError(f"interrupted cache {partial} was sampled {say(partial_regime)}, this command asks "
                           f"{say(ours)}; re-run that command to finish it, or remove {partial} to start over")


def entry_name(prompt: str, sample: int) -> str:
    return f"{prompt}{SAMPLE_SEP}{sample}"
