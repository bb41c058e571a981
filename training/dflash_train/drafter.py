"""DFlash drafter in PyTorch (own implementation of the published format).

Module/parameter names equal the published tensor names, so ``state_dict()``
keys are exactly: fc.weight, hidden_norm.weight, norm.weight,
layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight.  The token embedding and the lm_head
are the target's (frozen, passed in, never stored here).

Forward (one packed sequence set):
  context c = hidden_norm(fc(concat(tapped target layer outputs)))        [b, S, H]
  block tokens x = target_embedding([token_a, MASK, ..., MASK])            [b, Q, H]
  every layer i:  h = x + o_proj(attn(q = block, k/v = [ctx ; block]))
                  x = h + mlp(post_attention_layernorm(h))
    - block q/k/v come from input_layernorm(x); q_norm/k_norm per head; RoPE
      (rotate_half) at absolute positions;
    - context k/v = k_proj(c) -> k_norm -> RoPE(context positions), v_proj(c);
      the context does not go through input_layernorm and is the same for
      every layer;
  output = norm(x); logits = target lm_head(output).

DFlash2 (``cfg.is_dflash2``; names as the published ``DFlash2DraftModel``):
  every layer wraps both sublayers in a grouped dynamic causal convolution
  (``attention_conv`` / ``mlp_conv``: ``base_kernel [2, taps, H]``,
  ``kernel_projection.weight [2*taps*H/group, H]``) computed within each block:
      y[t] = sum_o (base[side][o] + dyn[t, side, o, group]) * x[t - o]
  side 0 on the normalised sublayer input, side 1 on the sublayer output, the
  coefficients of both sides projected from the normalised input;
  ``candidate_selector`` (``predecessor_codebook``/``successor_codebook [V, r]``,
  ``hidden_projection.weight [r, H]``) scores a slot's top-k candidates c after
  predecessor p as ``logit(c) + <P[p] * W_h h, S[c]>``.  Fresh modules are exact
  no-ops (identity base taps, zero projection, zero successor codebook), as in
  the reference trainer, so a DFlash2 drafter starts as a DFlash one.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from .config import DrafterConfig
from .flexattn import FlexBlocks, attend, pad_context


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # computed in fp32, returned in the input dtype (bf16 under autocast, so
        # q/k/v reach SDPA in one dtype; fp32 on CPU)
        return (self.weight.float() * xf).to(dt)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin [*, head_dim] (fp32) for integer positions [*]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                           / head_dim))
    f = positions.float()[..., None] * inv
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]; cos/sin [b, T, d]."""
    cos = cos[:, None]
    sin = sin[:, None]
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos_b, sin_b, cos_c, sin_c, mask):
        b, q_len, _ = x.shape
        s = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2)
        kb = self.k_norm(self.k_proj(x).view(b, q_len, self.nkv, self.hd)).transpose(1, 2)
        vb = self.v_proj(x).view(b, q_len, self.nkv, self.hd).transpose(1, 2)
        kc = self.k_norm(self.k_proj(ctx).view(b, s, self.nkv, self.hd)).transpose(1, 2)
        vc = self.v_proj(ctx).view(b, s, self.nkv, self.hd).transpose(1, 2)
        q = apply_rope(q, cos_b, sin_b)
        kb = apply_rope(kb, cos_b, sin_b)
        kc = apply_rope(kc, cos_c, sin_c)
        k = torch.cat([kc, kb], dim=2)
        v = torch.cat([vc, vb], dim=2)
        if isinstance(mask, FlexBlocks):
            o = attend(q, k.to(q.dtype), v.to(q.dtype), mask, 1.0 / math.sqrt(self.hd))
            return self.o_proj(o.transpose(1, 2).reshape(b, q_len, self.nh * self.hd))
        if self.nh != self.nkv:
            rep = self.nh // self.nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if v.dtype != q.dtype:
            v = v.to(q.dtype)
        if k.dtype != q.dtype:
            k = k.to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.hd))
        o = o.transpose(1, 2).reshape(b, q_len, self.nh * self.hd)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedConv(nn.Module):
    """DFlash2 grouped dynamic causal convolution, within blocks of ``block_size`` tokens."""

    def __init__(self, hidden: int, taps: int, group: int, block_size: int):
        super().__init__()
        self.taps, self.group, self.groups, self.block = taps, group, hidden // group, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _conv(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        b, q, h = x.shape
        n, bs = q // self.block, self.block
        xb = x.view(b, n, bs, self.groups, self.group)
        d = dyn.reshape(b, n, bs, self.taps, self.groups, 1)
        base = self.base_kernel[side].to(x.dtype).view(self.taps, self.groups, self.group)
        out = torch.zeros_like(xb)
        for o in range(self.taps):
            v = xb if o == 0 else F.pad(xb[:, :, :bs - o], (0, 0, 0, 0, o, 0))
            out = out + base[o] * v + d[:, :, :, o] * v
        return out.view(b, q, h)

    def prepare(self, x: torch.Tensor):
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return self._conv(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def finish(self, x: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return self._conv(x, dyn, 1)


class CandidateSelector(nn.Module):
    """DFlash2 candidate selector: low-rank transition scores between block slots."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int, init_range: float):
        super().__init__()
        self.top_k, self.init_range = top_k, init_range
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, generator=None):
        with torch.no_grad():
            self.predecessor_codebook.copy_(
                torch.randn(self.predecessor_codebook.shape, generator=generator) * self.init_range)
            self.successor_codebook.zero_()
            self.hidden_projection.weight.copy_(
                torch.randn(self.hidden_projection.weight.shape, generator=generator) * self.init_range)

    def scores(self, unary: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """unary/candidates [R, K], hidden [R, H], predecessors [R] -> path scores [R, K]."""
        ctx = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)
        succ = self.successor_codebook[candidates]
        return unary + torch.einsum("nr,nkr->nk", ctx.float(), succ.float())


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.is_dflash2:
            conv = lambda: GroupedConv(cfg.hidden_size, cfg.conv_kernel_size,  # noqa: E731
                                       cfg.conv_group_size, cfg.block_size)
            self.attention_conv = conv()
            self.mlp_conv = conv()
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, ctx, cos_b, sin_b, cos_c, sin_c, mask):
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, ctx, cos_b, sin_b, cos_c, sin_c, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, dyn = self.attention_conv.prepare(h)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, cos_b, sin_b, cos_c, sin_c, mask), dyn)
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dyn)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = (
            CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k,
                              cfg.initializer_range) if cfg.is_dflash2 else None)
        self.reset_parameters()

    def reset_parameters(self, seed: Optional[int] = None):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * self.cfg.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        # DFlash2 parts start as exact no-ops (after the generic pass above).
        for m in self.modules():
            if isinstance(m, GroupedConv):
                m.reset_parameters()
            elif isinstance(m, CandidateSelector):
                m.reset_parameters(g)

    def fuse_context(self, target_feats: torch.Tensor) -> torch.Tensor:
        """[b, S, K*H] tapped target features -> fused context [b, S, H]."""
        return self.hidden_norm(self.fc(target_feats))

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, target_feats: torch.Tensor,
                ctx_pos: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """block_emb [b,Q,H] (target embeddings of the block ids), block_pos [b,Q],
        target_feats [b,S,K*H], ctx_pos [b,S], mask bool [b,1,Q,S+Q] (True = attend)
        or None (everything visible; no window either).  Sliding layers further
        restrict the mask to |query pos - key pos| < window.  Returns normed
        hidden states [b,Q,H]."""
        windowed = None
        if isinstance(mask, FlexBlocks):
            if self.cfg.sliding_window is not None:
                raise ValueError("block-sparse (flex) attention does not support sliding-window drafters")
        elif self.cfg.sliding_window is not None and mask is not None:
            windowed = window_mask(mask, block_pos, ctx_pos, self.cfg.sliding_window)
        ctx = self.fuse_context(target_feats)
        cos_b, sin_b = rope_cos_sin(block_pos, self.cfg.head_dim, self.cfg.rope_theta)
        cos_c, sin_c = rope_cos_sin(ctx_pos, self.cfg.head_dim, self.cfg.rope_theta)
        x = block_emb
        for i, layer in enumerate(self.layers):
            m = windowed if self.cfg.layer_window(i) is not None and windowed is not None else mask
            x = layer(x, ctx, cos_b, sin_b, cos_c, sin_c, m)
        return self.norm(x)


# ------------------------------------------------------------------------------ training glue
def dense_mask_torch(ctx_visible: torch.Tensor, block_size: int,
                     block_len: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expand the numpy-built per-block context visibility [b, N, S] to the
    dense mask [b, 1, N*B, S + N*B] of masks.dense_block_attention_mask:
    context part repeated for the B queries of each block, block part
    block-diagonal (own block only, bidirectional; with ``block_len`` [b, N], a
    block's keys only up to its length)."""
    b, n, s = ctx_visible.shape
    dev = ctx_visible.device
    ctx = ctx_visible.repeat_interleave(block_size, dim=1)
    bid = torch.arange(n, device=dev).repeat_interleave(block_size)
    own = (bid[:, None] == bid[None, :]).expand(b, -1, -1)
    if block_len is not None:
        slot = torch.arange(block_size, device=dev).repeat(n)
        inside = slot[None, :] < block_len.to(dev).repeat_interleave(block_size, dim=1)  # [b, N*B] keys
        own = own & inside[:, None, :]
    return torch.cat([ctx, own], dim=2)[:, None]


def window_mask(mask: torch.Tensor, block_pos: torch.Tensor, ctx_pos: torch.Tensor,
                window: int) -> torch.Tensor:
    """Restricts a dense mask [b,1,Q,S+Q] to a non-causal sliding window: query
    at position p sees keys at positions k with |p - k| < window (the
    reference's non-causal sliding layers)."""
    keys = torch.cat([ctx_pos, block_pos], dim=1)
    dist = (block_pos[:, :, None] - keys[:, None, :]).abs()
    return mask & (dist < window)[:, None]


def _ce_chunk(h, w_head, labels):
    logits = F.linear(h, w_head).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return ce, logits.argmax(-1)


def _ce_kd_chunk(h, w_head, labels, h_target, kd_alpha: float):
    """(1 - a) * CE + a * KL(p_target || q_drafter) per row, and the drafter's argmax.
    ``h_target``: the target's final normed hidden state at the position that predicts the
    label (so ``p_target`` is the target's own next-token distribution there)."""
    logits = F.linear(h, w_head).float()
    logq = F.log_softmax(logits, dim=-1)
    ce = -logq.gather(1, labels[:, None])[:, 0]
    logp = F.log_softmax(F.linear(h_target, w_head).float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return (1.0 - kd_alpha) * ce + kd_alpha * kl, logits.argmax(-1)


def _ce_selector_chunk(h, w_head, labels, preds, selector):
    """Unary CE plus the selector's teacher-forced CE over the unary top-k (as the
    reference trainer computes it): candidates = top-k of the logits; the
    target's index among them; score = selector(predecessor = the true previous
    token).  Rows whose target is not a candidate get no selector loss
    (``covered`` = 0).  Returns (ce, unary argmax, selector ce, covered, selector pick)."""
    logits = F.linear(h, w_head).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    unary, cand = logits.topk(selector.top_k, dim=-1)
    match = cand.eq(labels[:, None])
    covered = match.any(-1)
    target = match.long().argmax(-1)
    scores = selector.scores(unary, cand, h, preds)
    sel_ce = F.cross_entropy(scores, target, reduction="none")
    pick = cand.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
    return ce, logits.argmax(-1), sel_ce, covered.float(), pick


def block_loss(drafter: DFlashDrafter, emb_w: torch.Tensor, head_w: torch.Tensor,
               target_feats: torch.Tensor, batch: dict, chunk_rows: int = 8192,
               checkpoint_ce: bool = True, selector_alpha: float = 1.0, stats: Optional[dict] = None,
               target_final: Optional[torch.Tensor] = None, kd_alpha: float = 0.0, ctx_pad: int = 0):
    """Weighted block CE for a collated batch (torch tensors on the device).

    Returns (loss, correct [b,N,B] bool, weights [b,N,B]).  Only rows with
    weight > 0 go through the (frozen) lm_head, in checkpointed chunks so the
    [rows, vocab] logits are never all alive at once.

    DFlash2: loss = (sum w*CE + selector_alpha * sum w*covered*selector_CE) / sum w,
    the reference trainer's objective; ``correct`` then holds the selector's
    teacher-forced pick, and ``stats`` (when given) receives the selector loss
    (per covered weight) and the coverage (share of weight whose target is a
    candidate).

    Distillation (``kd_alpha`` > 0 with ``target_final`` [b, S, H], the target's final normed
    hidden states): each row's loss is (1 - kd_alpha) * CE + kd_alpha * KL(p || q), p the
    target's distribution at position a + k - 1 (the one that predicts the slot's label).

    ``ctx_pad`` > 0: block-sparse attention (flexattn.py) with the context padded to ``ctx_pad``
    positions instead of the dense mask (same result up to rounding, a fraction of the work).
    """
    block_ids = batch["block_ids"]
    b, n, bs = block_ids.shape
    x = F.embedding(block_ids.view(b, n * bs), emb_w)
    ctx_pos = batch["position_ids"]
    block_len = batch.get("block_len")
    if ctx_pad:
        mask = FlexBlocks(batch["block_pos"][:, :, 0], batch["block_valid"], bs, ctx_pad, block_len)
        target_feats = pad_context(target_feats, ctx_pad, 1)
        ctx_pos = pad_context(ctx_pos, ctx_pad, 1)
    else:
        mask = dense_mask_torch(batch["ctx_visible"], bs, block_len)
    h = drafter(x, batch["block_pos"].view(b, n * bs), target_feats, ctx_pos, mask)
    w = batch["weights"].view(-1)
    sel = torch.nonzero(w > 0, as_tuple=False).squeeze(1)
    hs = h.reshape(b * n * bs, -1).index_select(0, sel)
    lab = batch["labels"].view(-1).index_select(0, sel)
    ws = w.index_select(0, sel)
    selector = drafter.candidate_selector
    if selector is not None:
        # Teacher forcing: slot k's predecessor is the true token at a + k - 1 (slot 1: the anchor).
        s_len = batch["input_ids"].shape[1]
        prev_pos = (batch["block_pos"] - 1).clamp(0, s_len - 1).view(b, n * bs)
        prev_ids = batch["input_ids"].gather(1, prev_pos).view(-1).index_select(0, sel)
    kd = kd_alpha > 0 and target_final is not None and selector is None
    if kd:
        s_len = batch["input_ids"].shape[1]
        tpos = (batch["block_pos"].view(b, n * bs) - 1).clamp(0, s_len - 1)
        tpos = tpos + torch.arange(b, device=tpos.device)[:, None] * s_len
        ht_all = target_final.reshape(b * s_len, -1).index_select(0, tpos.reshape(-1).index_select(0, sel))
    tot = torch.zeros((), device=h.device, dtype=torch.float32)
    sel_tot = torch.zeros((), device=h.device, dtype=torch.float32)
    cov_w = torch.zeros((), device=h.device, dtype=torch.float32)
    preds = []
    for st in range(0, hs.shape[0], chunk_rows):
        hc, lc = hs[st:st + chunk_rows], lab[st:st + chunk_rows]
        wc = ws[st:st + chunk_rows]
        if selector is not None:
            args = (hc, head_w, lc, prev_ids[st:st + chunk_rows], selector)
            if checkpoint_ce and hc.requires_grad:
                ce, _, sce, cov, pr = torch.utils.checkpoint.checkpoint(_ce_selector_chunk, *args,
                                                                       use_reentrant=False)
            else:
                ce, _, sce, cov, pr = _ce_selector_chunk(*args)
            sel_tot = sel_tot + (sce * wc * cov).sum()
            cov_w = cov_w + (wc * cov).sum()
        elif kd:
            args = (hc, head_w, lc, ht_all[st:st + chunk_rows].to(hc.dtype), kd_alpha)
            if checkpoint_ce and hc.requires_grad:
                ce, pr = torch.utils.checkpoint.checkpoint(_ce_kd_chunk, *args, use_reentrant=False)
            else:
                ce, pr = _ce_kd_chunk(*args)
        elif checkpoint_ce and hc.requires_grad:
            ce, pr = torch.utils.checkpoint.checkpoint(_ce_chunk, hc, head_w, lc, use_reentrant=False)
        else:
            ce, pr = _ce_chunk(hc, head_w, lc)
        tot = tot + (ce * wc).sum()
        preds.append(pr)
    wsum = ws.sum().clamp_min(1e-8)
    loss = (tot + selector_alpha * sel_tot) / wsum
    if stats is not None and selector is not None:
        stats["selector_loss"] = float(sel_tot.detach() / cov_w.clamp_min(1e-8))
        stats["selector_coverage"] = float(cov_w.detach() / wsum)
    correct = torch.zeros(b * n * bs, dtype=torch.bool, device=h.device)
    if preds:
        correct[sel] = torch.cat(preds) == lab
    return loss, correct.view(b, n, bs), batch["weights"]


def batch_to_torch(nb: dict, device, pin: bool = False) -> dict:
    out = {}
    for k, v in nb.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        if pin:
            t = t.pin_memory()
        out[k] = t.to(device, non_blocking=pin)
    return out
