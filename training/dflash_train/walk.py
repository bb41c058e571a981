"""Walk tau: the greedy decoding loop simulated over held-out sequences.

Live speculative decoding does not visit anchors uniformly: each round starts right after the
previous round's first rejection.  For a greedily generated answer (the target's own greedy
tokens), round r with anchor position a feeds the block [token_a, MASK x (B-1)] at positions
a..a+B-1 (context: the target's tapped features strictly before a), accepts the k leading
drafts equal to the answer's tokens, commits k + 1 tokens (the target's bonus token) and moves
the anchor to a + k + 1.  The first anchor is the answer's first token (the target's output of
the prefill).  tau = committed tokens / rounds, as ``dflash eval`` counts it.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .drafter import dense_mask_torch
from .target import target_features


def selector_path(selector, logits: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """A DFlash2 drafter's greedy draft (as the engine's selector walk): slot k picks, among
    the top-k tokens of its logits, the best path score given slot k - 1's pick (the anchor for
    slot 1).  ``logits`` [b, B, V], ``h`` [b, B, H] -> [b, B] (slot 0 holds the anchor).  Equal
    logits among the top-k come in torch's order, where the engine takes the lower id: a walk
    estimate may differ there, which exact float ties make rare."""
    path = torch.empty(logits.shape[:2], dtype=torch.long, device=logits.device)
    path[:, 0] = prev = anchor
    for k in range(1, logits.shape[1]):
        unary, cand = logits[:, k].topk(selector.top_k, dim=-1)
        sc = selector.scores(unary, cand, h[:, k], prev)
        prev = cand.gather(1, sc.argmax(-1, keepdim=True)).squeeze(1)
        path[:, k] = prev
    return path


@torch.no_grad()
def walk_tau(drafter, target, emb_w: torch.Tensor, head_w: torch.Tensor, recs: Sequence[dict],
             max_new: int = 256, batch: int = 32, autocast=None, block: Optional[int] = None,
             verify: Optional[int] = None) -> Dict:
    """``recs``: dicts with ``ids`` (int64 numpy) and ``first_span`` (start, end) of a greedy
    answer.  ``block``: the drafted block size (default the drafter's trained one; the engine
    drafts smaller blocks as [anchor, MASK x (block - 1)] too).  ``verify``: the verified block
    size (default ``block``): a round keeps at most ``verify - 1`` drafts of its ``block - 1``
    (a drafter fed more masks than the target checks).  Returns tau, rounds, tokens and the
    acceptance rate by slot (share of rounds that accepted at least k drafts)."""
    cfg = drafter.cfg
    B = cfg.block_size if block is None else block
    if not 2 <= B <= cfg.block_size:
        raise ValueError(f"walk block {B}: must be 2..{cfg.block_size} (the drafter's block size)")
    V = B if verify is None else verify
    if not 2 <= V <= B:
        raise ValueError(f"walk verify {V}: must be 2..{B} (the drafted block)")
    if B < cfg.block_size and cfg.is_dflash2:
        raise ValueError(f"walk block {B}: a DFlash2 drafter's convolutions span its whole block "
                         f"({cfg.block_size}), so it walks at that size only")
    dev = emb_w.device
    was_training = drafter.training
    drafter.eval()
    tokens = rounds = 0
    at_least = np.zeros(V, dtype=np.int64)
    per_seq: List[float] = []
    ac = autocast if autocast is not None else contextlib.nullcontext
    for st in range(0, len(recs), batch):
        part = recs[st:st + batch]
        ends = [min(r["first_span"][1], r["first_span"][0] + max_new, r["ids"].size) for r in part]
        S = max(ends)
        b = len(part)
        ids = torch.zeros(b, S, dtype=torch.long)
        att = torch.zeros(b, S, dtype=torch.long)
        for i, (r, e) in enumerate(zip(part, ends)):
            ids[i, :e] = torch.from_numpy(r["ids"][:e])
            att[i, :e] = 1
        ids, att = ids.to(dev), att.to(dev)
        feats = target_features(target, ids, att, cfg.target_layer_ids)
        a = torch.tensor([r["first_span"][0] for r in part], device=dev)
        end = torch.tensor(ends, device=dev)
        pos_s = torch.arange(S, device=dev)
        ctx_pos = pos_s[None].expand(b, S)
        kk = torch.arange(B, device=dev)
        seq_tok = torch.zeros(b, dtype=torch.long, device=dev)
        seq_rounds = torch.zeros(b, dtype=torch.long, device=dev)
        active = a < end - 1
        while bool(active.any()):
            bpos = a[:, None] + kk[None]  # [b, B]
            valid = bpos < end[:, None]
            lab = ids.gather(1, bpos.clamp(max=S - 1))
            blk = torch.full((b, B), cfg.mask_token_id, dtype=torch.long, device=dev)
            blk[:, 0] = lab[:, 0]
            vis = (pos_s[None] < a[:, None])[:, None]  # [b, 1, S]
            mask = dense_mask_torch(vis, B)
            with ac():
                h = drafter(F.embedding(blk, emb_w), bpos, feats, ctx_pos, mask)
                logits = F.linear(h, head_w).float()
                sel = drafter.candidate_selector
                pred = logits.argmax(-1) if sel is None else selector_path(sel, logits, h, blk[:, 0])
            ok = (pred[:, 1:] == lab[:, 1:]) & valid[:, 1:]
            acc = torch.cumprod(ok.long(), dim=1).sum(1).clamp(max=V - 1)
            commit = torch.minimum(acc + 1, end - 1 - a)
            commit = torch.where(active, commit, torch.zeros_like(commit))
            for k in range(V):
                at_least[k] += int(((acc >= k) & active).sum())
            seq_tok += commit
            seq_rounds += active.long()
            a = a + commit
            active = active & (a < end - 1)
        tokens += int(seq_tok.sum())
        rounds += int(seq_rounds.sum())
        per_seq.extend((seq_tok.float() / seq_rounds.clamp_min(1).float()).tolist())
    if was_training:
        drafter.train()
    rate = (at_least[1:] / max(rounds, 1)).round(4).tolist()
    return {"walk_tau": round(tokens / max(rounds, 1), 4), "walk_rounds": rounds, "walk_tokens": tokens,
            "walk_tau_mean_seq": round(float(np.mean(per_seq)), 4) if per_seq else None,
            "walk_accept_by_slot": rate[:8]}
