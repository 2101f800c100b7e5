"""EAGLE-3 on a sampled cache (issue 29's rules, docs/sampling.md, for an autoregressive head).

A sampled cache (extract --temperature T --seed S [--samples N]) holds completions y drawn from the target at the
serving transform (temperature, then top-k, then top-p: eval/sampling.py) and log p(y) under it. The two draft
rules (`--draft`), as for DFlash (eval/samples.py):

- greedy: the head's argmax chain (walk.chain_drafts) at every anchor of every sample, and the walk over each
  sample: the committed sequence of a speculative decode with greedy drafts and a sampled posterior is an
  ancestral sample of the target and a round accepts exactly its leading drafts equal to it (vLLM's default);
- sampled: the chain's drafts drawn from the head's distribution q at the transform, accepted by the rejection
  rule min(1, p/q): given y, position k of the round at anchor a is accepted with probability
  min(1, q_k(y[a+k]) / p(y[a+k])) independently of the others, q_k the head's distribution with
  y[a+1..a+k-1] fed back (the teacher-forced chain: walk.ttt_steps, the TTT form), so E[tau | y] is eval/expect.py's
  program over `chain_logq`'s numbers and log p(y) from the cache.

q is the transform applied to the DRAFT vocabulary's logits (what vLLM samples: the draft logits scattered into
the full vocabulary filled with -inf, whose top-k/top-p keep only draft tokens), mapped to target ids through d2t;
a target token outside the draft vocabulary has q = 0 (never drafted, never accepted). Ties between equal logits
are ordered by the draft id, which is the target id's order whenever d2t maps the draft vocabulary in increasing
target order (the SpecForge and SafeAILab builds: sorted top-Vd ids).

EAGLE's tree at T > 0 samples by recursive rejection over a node's children, another law: `refuse_tree` refuses
--eagle-tree with --draft sampled (the tree with --draft greedy is the walk over every sample, as above).
"""
from __future__ import annotations

import torch
from torch import Tensor

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.spec import TREE_SAMPLED_REFUSED
from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eagle3.walk import CHUNK, ttt_steps
from remote_payload.eval.sampling import NEG_INF, transform_logprobs

TREE_REFUSED = TREE_SAMPLED_REFUSED  # the laptop's spec refuses the pair in the same words before a launch


def refuse_tree(eagle_tree: str | None, draft: str) -> None:
    """--eagle-tree with --draft sampled: one line, exit 3 (module doc)."""
    if eagle_tree is not None and draft == "sampled":
        raise PayloadError(TREE_REFUSED)


def draft_index(drafter: Eagle3Drafter) -> Tensor:
    """[vocab_size] long: each target id's draft-vocabulary index, -1 outside the draft vocabulary."""
    vd = drafter.cfg.draft_vocab_size
    dev = drafter.d2t.device
    out = torch.full((drafter.cfg.vocab_size,), -1, dtype=torch.long, device=dev)
    return out.scatter_(0, drafter.to_target(torch.arange(vd, device=dev)), torch.arange(vd, device=dev))


def logq_of(logits: Tensor, targets: Tensor, index: Tensor, transform: tuple[float, int, float]) -> Tensor:
    """Draft-vocabulary logits [m, Vd], target ids [m], `draft_index` -> [m] fp32: log q(target) under the transform
    (-inf where the target is outside the draft vocabulary or the transform gives it no mass)."""
    lp = transform_logprobs(logits, *transform)
    idx = index[targets.to(index.device)].to(lp.device)
    got = lp.gather(-1, idx.clamp(min=0)[:, None])[:, 0]
    return got.masked_fill(idx < 0, NEG_INF)


def full_logq(drafter: Eagle3Drafter, logits: Tensor, transform: tuple[float, int, float]) -> Tensor:
    """Draft-vocabulary logits [m, Vd] -> [m, vocab_size] fp32 log q over target ids (-inf outside the draft
    vocabulary): the q the online rejection rule reads (eval/online_sampled._verify_sampled)."""
    lp = transform_logprobs(logits, *transform)
    out = torch.full((lp.shape[0], drafter.cfg.vocab_size), NEG_INF, dtype=lp.dtype, device=lp.device)
    ids = drafter.to_target(torch.arange(lp.shape[1], device=drafter.d2t.device)).to(lp.device)
    return out.index_copy_(1, ids, lp)


@torch.no_grad()
def chain_logq(drafter: Eagle3Drafter, feats: Tensor, ids: Tensor, anchors: Tensor, K: int,
               transform: tuple[float, int, float], chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """-> (drafts [n, K]: the argmax chain, as walk.chain_drafts; logq [n, K] fp32: log q(y[a+k]) of the
    teacher-forced chain at anchor a = anchors[j], k = 1..K, under the transform; past y's end any finite value
    (expect.acceptance_probs never accepts there)). One pass of the K TTT steps gives both."""
    n, T = anchors.numel(), ids.shape[0]
    drafts = torch.empty((n, K), dtype=torch.long)
    logq = torch.empty((n, K), dtype=torch.float32)
    index = draft_index(drafter)
    a_all = anchors.to(drafter.d2t.device)
    for rows, s, logits in ttt_steps(drafter, feats, ids, anchors - 1, K, chunk):
        drafts[rows, s] = drafter.to_target(logits.argmax(-1)).cpu()
        want = ids.to(a_all.device)[(a_all[rows] + 1 + s).clamp(max=T - 1)]
        logq[rows, s] = logq_of(logits, want, index, transform).cpu()
    return drafts, logq
