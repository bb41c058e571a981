"""Fast batched generation for a Llama-family target: own forward, static per-row KV cache.

The weights are the HF model's (for a GGUF target: the tensors transformers de-quantizes),
re-packed into fused matrices; the math is HF Llama's (RMSNorm in fp32, rotate-half RoPE with
the model's own rotary table, GQA attention, SiLU MLP, tied or separate lm_head).

State (all static, so a decode step can be captured in a CUDA graph):
  K, V   [L, B, kv_heads, T, head_dim]   one cache row per batch slot
  cur    [B]  token fed at the next step      pos  [B]  its position (= tokens cached)
  samp   [B]  bool: sample at T (Gumbel-max) instead of argmax
A decode step embeds ``cur``, writes k/v at ``pos`` of every row, attends over t <= pos, picks
the next token on the GPU and advances ``pos``.  Two decode attentions (``Engine(attn=...)``):

* ``bucket``: two batched matmuls over the first ``Tb`` cache positions of every row with a
  -inf bias for t > pos; ``Tb`` is a length bucket (multiple of ``bucket``) covering the
  longest active row, so every row reads ``Tb`` positions whatever its own length.
* ``flex``: FlexAttention over the whole cache with a BlockMask whose per-row block counts
  (``ceil((pos+1) / bucket)``) are rewritten in place from ``pos`` every step, so each row reads
  only its own blocks.  The g query heads of a KV group are passed as g query positions of
  that KV head (the mask ignores the query index), so one K/V load serves all of them and the
  compiled kernel is flex *decoding* (its GQA packing needs a power-of-two group, 3 is not).
  Compiled (Triton) on CUDA; eager on the CPU by default (tests).

Token choice: argmax for every row; Gumbel-max at T for the sampled rows only.  The noise is
drawn for a static subset of ``ns`` rows (the sampled slots, padded with greedy ones; ``ns``
from a few sizes, 0 when no row samples), listed in a static index tensor updated on the host
when the slots change.  One CUDA graph of ``steps`` decode steps is captured per (Tb, ns)
(flex: Tb is always the full cache).  Prefill of new rows runs eagerly in padded batches and
writes their cache rows in place.  ``Engine`` keeps slots busy: finished rows are handed back
to the caller (``Scheduler`` in gen_data.py) and refilled.
"""

from __future__ import annotations

import inspect
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .int8_act import BLOCK, fake_quant_blocks
from .target import base_model, decoder_layers, target_hf_config


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class TargetWeights:
    """Fused copies of a Llama-family HF model's weights in ``dtype`` on ``device``."""

    def __init__(self, model, dtype: torch.dtype, device, max_positions: int, int8_act: bool = False):
        cfg = target_hf_config(model)
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                raise ValueError(f"fastgen supports Llama targets without biases ({flag} is set)")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"fastgen supports SiLU MLPs, not {act}")
        layers = decoder_layers(model)
        self.L = len(layers)
        self.H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or self.H // self.nh
        self.I = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.dtype, self.device = dtype, torch.device(device)

        def t(x):
            return x.detach().to(device=self.device, dtype=dtype).contiguous()

        self.wqkv, self.wo, self.wgu, self.wd, self.ln1, self.ln2 = [], [], [], [], [], []
        for lay in layers:
            a, m = lay.self_attn, lay.mlp
            self.wqkv.append(t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)))
            self.wo.append(t(a.o_proj.weight))
            self.wgu.append(t(torch.cat([m.gate_proj.weight, m.up_proj.weight], 0)))
            self.wd.append(t(m.down_proj.weight))
            self.ln1.append(t(lay.input_layernorm.weight))
            self.ln2.append(t(lay.post_attention_layernorm.weight))
        bm = base_model(model)
        self.norm = t(bm.norm.weight)
        self.embed = t(model.get_input_embeddings().weight)
        self.head = t(model.get_output_embeddings().weight)
        self.vocab = self.head.shape[0]
        # the model's own rotary table (handles any rope scaling the HF model implements)
        pos = torch.arange(max_positions, device=next(model.parameters()).device)[None]
        probe = torch.zeros(1, 1, self.hd, dtype=torch.float32, device=pos.device)
        with torch.no_grad():
            cos, sin = bm.rotary_emb(probe, pos)
        self.cos = cos[0].to(device=self.device, dtype=dtype).contiguous()  # [T, hd]
        self.sin = sin[0].to(device=self.device, dtype=dtype).contiguous()
        self.scale = 1.0 / math.sqrt(self.hd)
        # the CPU engine's int8 activations on every projection's input (int8_act.py)
        self.int8_act = int8_act
        if int8_act and any(k % BLOCK for k in (self.H, self.nh * self.hd, self.I)):
            raise ValueError(f"int8 activations need projection inputs in whole {BLOCK}-value blocks")

    def proj(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T``, with ``x`` on the int8 grid of the CPU engine when ``int8_act`` is set."""
        return (fake_quant_blocks(x) if self.int8_act else x) @ w.t()

    def kv_bytes_per_token(self) -> int:
        return self.L * 2 * self.nkv * self.hd * torch.finfo(self.dtype).bits // 8


ATTENTIONS = ("bucket", "flex")
_FLEX_COMPILED = None


def _flex_fn(compiled: bool):
    """flex_attention, compiled once per process when asked (one compile per shape and dtype)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _FLEX_COMPILED is None:
        import torch._dynamo.config as dcfg

        # one compile per (rows, cache length, dtype): engines of one shape share it (the mask's
        # pos is a lifted input, checked by tests); leave room for many shapes in one process
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(dcfg, knob):
                setattr(dcfg, knob, max(getattr(dcfg, knob), 64))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _FLEX_COMPILED


class Engine:
    """Slots, cache and the decode / prefill kernels (see the module doc)."""

    def __init__(self, w: TargetWeights, batch: int, max_len: int, steps: int = 16, bucket: int = 128,
                 temperature: float = 1.0, cuda_graphs: bool = True, attn: str = "bucket",
                 flex_compile: Optional[bool] = None):
        if attn not in ATTENTIONS:
            raise ValueError(f"attention {attn!r} is not one of {ATTENTIONS}")
        self.w, self.B, self.steps, self.bucket, self.attn = w, batch, steps, bucket, attn
        self.T = -(-(max_len + steps) // bucket) * bucket
        if self.T > w.cos.shape[0]:
            raise ValueError(f"cache length {self.T} exceeds the rotary table ({w.cos.shape[0]})")
        dev, dt = w.device, w.dtype
        self.K = torch.zeros(w.L, batch, w.nkv, self.T, w.hd, device=dev, dtype=dt)
        self.V = torch.zeros_like(self.K)
        self.cur = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)
        self.samp = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.samp_host = np.zeros(batch, dtype=bool)
        # sizes of the sampled-row subset that gets Gumbel noise: B, B/2, ..., B/16 (rounded up)
        self.ns_sizes = sorted({-(-batch // 2**k) for k in range(5)})
        self.sidx: Dict[int, torch.Tensor] = {}
        self.sidx_rows: Dict[int, np.ndarray] = {}
        self.rows = torch.arange(batch, device=dev)
        self.tpos = torch.arange(self.T, device=dev)
        self.out = torch.zeros(steps, batch, dtype=torch.long, device=dev)
        self.inv_temp = 1.0 / temperature
        self.use_graphs = cuda_graphs and dev.type == "cuda"
        self.graphs: Dict[Tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        if attn == "flex":
            self._init_flex(dev.type == "cuda" if flex_compile is None else flex_compile)

    # ------------------------------------------------------------------ flex attention
    def _init_flex(self, compiled: bool):
        from torch.nn.attention.flex_attention import BlockMask

        nb = self.T // self.bucket
        pos = self.pos

        def causal_row(b, h, q_idx, kv_idx):
            return kv_idx <= pos[b]

        # static block tables: row b visits kv blocks 0 .. kv_blocks[b]-1 (all partial: mask_mod
        # applies everywhere); only kv_blocks changes, in place, from pos (_update_blocks)
        self.kv_blocks = torch.ones(self.B, 1, 1, dtype=torch.int32, device=pos.device)
        kv_idx = torch.arange(nb, dtype=torch.int32, device=pos.device).expand(self.B, 1, 1, nb).contiguous()
        g = self.w.nh // self.w.nkv
        kw = dict(BLOCK_SIZE=(self.bucket, self.bucket), mask_mod=causal_row, seq_lengths=(g, self.T))
        if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
            kw["compute_q_blocks"] = False  # the q-major tables serve only the backward pass
        self.block_mask = BlockMask.from_kv_blocks(self.kv_blocks, kv_idx, **kw)
        self.flex = _flex_fn(compiled)

    def _update_blocks(self):
        self.kv_blocks.copy_((torch.div(self.pos, self.bucket, rounding_mode="floor") + 1)
                             .to(torch.int32)[:, None, None])

    def _attend(self, l: int, q: torch.Tensor, tb: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """q [B, kv, g, hd] (the g heads of each KV group) -> [B, kv, g, hd]."""
        w = self.w
        Kl, Vl = self.K[l], self.V[l]
        if self.attn == "flex":
            return self.flex(q, Kl, Vl, block_mask=self.block_mask, scale=w.scale)
        s = torch.matmul(q, Kl[:, :, :tb].transpose(-1, -2)).float()
        p = torch.softmax(s * w.scale + bias, dim=-1).to(w.dtype)
        return torch.matmul(p, Vl[:, :, :tb])

    # ------------------------------------------------------------------ token choice
    def _choose(self, logits: torch.Tensor, samp: torch.Tensor, idx: Optional[torch.Tensor]) -> torch.Tensor:
        """argmax of every row; rows ``idx`` (distinct) where ``samp`` is set: Gumbel-max at T."""
        greedy = logits.argmax(-1)
        if idx is None:
            return greedy
        sub = logits[idx]
        u = torch.rand_like(sub).clamp_(1e-20, 1.0)
        sampled = (sub * self.inv_temp - torch.log(-torch.log(u))).argmax(-1)
        return greedy.index_copy(0, idx, torch.where(samp[idx], sampled, greedy[idx]))

    def _subset(self) -> int:
        """Size of the noise subset for the current slots; fills its static index tensor."""
        n = int(self.samp_host.sum())
        if n == 0:
            return 0
        ns = next(s for s in self.ns_sizes if s >= n)
        rows = np.concatenate([np.flatnonzero(self.samp_host), np.flatnonzero(~self.samp_host)])[:ns]
        if ns not in self.sidx:
            self.sidx[ns] = torch.zeros(ns, dtype=torch.long, device=self.w.device)
        if not np.array_equal(self.sidx_rows.get(ns), rows):
            self.sidx[ns].copy_(torch.from_numpy(rows))
            self.sidx_rows[ns] = rows
        return ns

    # ------------------------------------------------------------------ decode
    def _step(self, tb: int, ns: int) -> torch.Tensor:
        w, B = self.w, self.B
        g = w.nh // w.nkv
        pos = self.pos
        x = w.embed[self.cur]
        cos, sin = w.cos[pos][:, None], w.sin[pos][:, None]  # [B,1,hd]
        bias = None
        if self.attn == "flex":
            self._update_blocks()
        else:
            bias = torch.zeros(B, 1, 1, tb, device=x.device, dtype=torch.float32)
            bias.masked_fill_((self.tpos[:tb][None] > pos[:, None])[:, None, None], float("-inf"))
        nq, nk = w.nh * w.hd, w.nkv * w.hd
        for l in range(w.L):
            h = _rms(x, w.ln1[l], w.eps)
            qkv = w.proj(h, w.wqkv[l])
            q = qkv[:, :nq].view(B, w.nh, w.hd)
            k = qkv[:, nq:nq + nk].view(B, w.nkv, w.hd)
            v = qkv[:, nq + nk:].view(B, w.nkv, w.hd)
            q = q * cos + _rot_half(q) * sin
            k = k * cos + _rot_half(k) * sin
            self.K[l][self.rows, :, pos] = k
            self.V[l][self.rows, :, pos] = v
            o = self._attend(l, q.view(B, w.nkv, g, w.hd), tb, bias).reshape(B, nq)
            x = x + w.proj(o, w.wo[l])
            h = _rms(x, w.ln2[l], w.eps)
            gu = w.proj(h, w.wgu[l])
            x = x + w.proj(F.silu(gu[:, :w.I]) * gu[:, w.I:], w.wd[l])
        logits = (_rms(x, w.norm, w.eps) @ w.head.t()).float()
        nxt = self._choose(logits, self.samp, self.sidx[ns] if ns else None)
        self.cur.copy_(nxt)
        self.pos.copy_((pos + 1).clamp_(max=self.T - 1))
        return nxt

    def _steps(self, tb: int, ns: int):
        for i in range(self.steps):
            self.out[i].copy_(self._step(tb, ns))

    def bucket_for(self, max_pos: int) -> int:
        if self.attn == "flex":
            return self.T  # the block mask limits every row to its own length
        return min(self.T, -(-(max_pos + self.steps) // self.bucket) * self.bucket)

    def _capture(self, tb: int, ns: int):
        saved = (self.cur.clone(), self.pos.clone())
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._steps(tb, ns)  # warm-up (and compile): writes only positions the replay rewrites first
        torch.cuda.current_stream().wait_stream(s)
        self.cur.copy_(saved[0])
        self.pos.copy_(saved[1])
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, pool=self.pool):
            self._steps(tb, ns)
        self.cur.copy_(saved[0])
        self.pos.copy_(saved[1])
        self.graphs[(tb, ns)] = gr

    @torch.no_grad()
    def decode(self, max_pos: int) -> torch.Tensor:
        """``steps`` decode steps for every slot; returns the chosen tokens [steps, B] (device)."""
        tb = self.bucket_for(max_pos)
        ns = self._subset()
        if self.use_graphs:
            if (tb, ns) not in self.graphs:
                self._capture(tb, ns)
            self.graphs[(tb, ns)].replay()
        else:
            self._steps(tb, ns)
        return self.out

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], sampled: Sequence[bool]) -> torch.Tensor:
        """Fill the cache rows ``slots`` with ``prompts`` (padded batch, causal attention),
        choose each row's first new token; sets cur/pos/samp of the slots.  Returns the first
        tokens [m] (device)."""
        w = self.w
        m = len(slots)
        lens = [len(p) for p in prompts]
        P = max(lens)
        if P + self.steps > self.T:
            raise ValueError(f"prompt of {P} tokens does not fit the cache ({self.T})")
        ids = torch.zeros(m, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        ids = ids.to(w.device)
        sl = torch.as_tensor(list(slots), dtype=torch.long, device=w.device)
        ln = torch.as_tensor(lens, dtype=torch.long, device=w.device)
        sp = torch.as_tensor(list(sampled), dtype=torch.bool, device=w.device)
        x = w.embed[ids]  # [m,P,H]
        cos, sin = w.cos[:P][None, None], w.sin[:P][None, None]  # [1,1,P,hd]
        nq, nk = w.nh * w.hd, w.nkv * w.hd
        for l in range(w.L):
            h = _rms(x, w.ln1[l], w.eps)
            qkv = w.proj(h, w.wqkv[l])
            q = qkv[..., :nq].view(m, P, w.nh, w.hd).transpose(1, 2)
            k = qkv[..., nq:nq + nk].view(m, P, w.nkv, w.hd).transpose(1, 2)
            v = qkv[..., nq + nk:].view(m, P, w.nkv, w.hd).transpose(1, 2)
            q = q * cos + _rot_half(q) * sin
            k = k * cos + _rot_half(k) * sin
            self.K[l][sl, :, :P] = k
            self.V[l][sl, :, :P] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=w.scale, enable_gqa=True)
            x = x + w.proj(o.transpose(1, 2).reshape(m, P, nq), w.wo[l])
            h = _rms(x, w.ln2[l], w.eps)
            gu = w.proj(h, w.wgu[l])
            x = x + w.proj(F.silu(gu[..., :w.I]) * gu[..., w.I:], w.wd[l])
        last = x[torch.arange(m, device=w.device), ln - 1]
        logits = (_rms(last, w.norm, w.eps) @ w.head.t()).float()
        sampled_rows = [i for i, f in enumerate(sampled) if f]
        idx = torch.as_tensor(sampled_rows, dtype=torch.long, device=w.device) if sampled_rows else None
        first = self._choose(logits, sp, idx)
        self.cur[sl] = first
        self.pos[sl] = ln
        self.samp[sl] = sp
        self.samp_host[list(slots)] = list(sampled)
        return first

    def idle(self, slots: Sequence[int]):
        """Park slots: position 0, greedy (their tokens are ignored by the caller)."""
        if len(slots):
            sl = torch.as_tensor(list(slots), dtype=torch.long, device=self.w.device)
            self.pos[sl] = 0
            self.cur[sl] = 0
            self.samp[sl] = False
            self.samp_host[list(slots)] = False


class Row:
    __slots__ = ("job", "prompt", "resp", "max_new", "limit", "sampled")

    def __init__(self, job, prompt, max_new, limit, sampled):
        self.job, self.prompt, self.resp = job, list(prompt), []
        self.max_new, self.limit, self.sampled = max_new, limit, sampled


def generate_loop(engine: Engine, source, eos: Sequence[int], should_stop, prefill_tokens: int = 262144,
                  min_refill: int = 0, stats: Optional[dict] = None):
    """Continuous batching.  ``source`` has ``next_request() -> (job, prompt_ids, max_new,
    sampled) | None`` (None: nothing ready now), ``exhausted() -> bool`` (nothing will come any
    more) and ``finish(job, prompt_ids, response_ids, finished: bool)``.
    Rows stop at an EOS id (kept), after ``max_new`` tokens, or when prompt+response reaches
    the engine's length limit.  Runs until ``should_stop()`` or the source is empty and no
    row is active."""
    B = engine.B
    limit_len = engine.T - engine.steps
    eos_set = np.array(sorted(set(int(e) for e in eos)), dtype=np.int64)
    rows: List[Optional[Row]] = [None] * B
    free = list(range(B))
    st = stats if stats is not None else {}
    for k in ("new_tokens", "rows_done", "decode_calls", "prefills", "prefill_tokens"):
        st.setdefault(k, 0)
    min_refill = min_refill or max(1, B // 16)

    def finish_row(i: int, fin: bool):
        r = rows[i]
        source.finish(r.job, r.prompt, r.resp, fin)
        rows[i] = None
        free.append(i)
        st["rows_done"] += 1

    def take(i: int, toks: np.ndarray, eos_at: int) -> None:
        """Row i gets ``toks`` up to its room; ``eos_at``: index of the first EOS in toks, or -1."""
        r = rows[i]
        room = min(len(toks), r.max_new - len(r.resp), r.limit - len(r.prompt) - len(r.resp))
        hit = 0 <= eos_at < room
        n = eos_at + 1 if hit else room
        r.resp.extend(toks[:n].tolist())
        st["new_tokens"] += n
        if hit:
            finish_row(i, True)
        elif len(r.resp) >= r.max_new or len(r.prompt) + len(r.resp) >= r.limit:
            finish_row(i, False)

    def first_eos(toks: np.ndarray) -> np.ndarray:
        """toks [B, n] -> index of each row's first EOS, -1 where none (one vectorised pass)."""
        hits = np.isin(toks, eos_set)
        return np.where(hits.any(1), hits.argmax(1), -1)

    while True:
        stop = should_stop()
        exhausted = source.exhausted()
        # ---- refill (batched prefill, sorted by length to limit padding)
        active_n = B - len(free)
        if not stop and not exhausted and (len(free) >= min(min_refill, B) or active_n == 0):
            reqs = []
            while free and len(reqs) < len(free):
                rq = source.next_request()
                if rq is None:
                    break
                job, prompt, max_new, sampled = rq
                if len(prompt) + 1 >= limit_len or not prompt:
                    source.finish(job, prompt, [], False)
                    continue
                reqs.append(rq)
            reqs.sort(key=lambda r: len(r[1]))
            j = 0
            while j < len(reqs):
                n = 1
                while j + n < len(reqs) and (n + 1) * len(reqs[j + n][1]) <= prefill_tokens:
                    n += 1
                grp = reqs[j:j + n]
                slots = [free.pop() for _ in grp]
                first = engine.prefill(slots, [g[1] for g in grp], [g[3] for g in grp]).cpu().numpy()
                first_at = first_eos(first[:, None])
                st["prefills"] += 1
                st["prefill_tokens"] += sum(len(g[1]) for g in grp)
                for s, g, t, e in zip(slots, grp, first, first_at):
                    job, prompt, max_new, sampled = g
                    rows[s] = Row(job, prompt, max_new, limit_len, sampled)
                    take(s, np.array([t]), int(e))
                j += n
        active = [i for i in range(B) if rows[i] is not None]
        if not active:
            if stop or source.exhausted():
                return st
            continue
        if stop:
            for i in active:
                finish_row(i, False)
            return st
        if free:
            engine.idle(free)
        max_pos = max(len(rows[i].prompt) + len(rows[i].resp) for i in active)
        toks = np.ascontiguousarray(engine.decode(max_pos).cpu().numpy().T)  # [B, steps]
        eos_at = first_eos(toks)
        st["decode_calls"] += 1
        for i in active:
            if rows[i] is not None:
                take(i, toks[i], int(eos_at[i]))


class ListSource:
    """A fixed list of prompts (benchmarks and tests): results by index."""

    def __init__(self, prompts: Sequence[Sequence[int]], max_new, sampled: Optional[Sequence[bool]] = None):
        self.prompts = list(prompts)
        self.max_new = list(max_new) if isinstance(max_new, (list, tuple)) else [int(max_new)] * len(self.prompts)
        self.sampled = list(sampled) if sampled is not None else [False] * len(prompts)
        self.i = 0
        self.results: Dict[int, Tuple[List[int], bool]] = {}

    def next_request(self):
        if self.i >= len(self.prompts):
            return None
        i = self.i
        self.i += 1
        return i, self.prompts[i], self.max_new[i], self.sampled[i]

    def exhausted(self) -> bool:
        return self.i >= len(self.prompts)

    def finish(self, job, prompt, resp, fin):
        self.results[job] = (list(resp), fin)


def generate_list(engine: Engine, prompts: Sequence[Sequence[int]], max_new, eos: Sequence[int],
                  sampled: Optional[Sequence[bool]] = None, stats: Optional[dict] = None
                  ) -> List[Tuple[List[int], bool]]:
    """Generate for a fixed prompt list (``max_new``: one int or one per prompt)."""
    src = ListSource(prompts, max_new, sampled)
    generate_loop(engine, src, eos, should_stop=lambda: False, stats=stats)
    return [src.results[i] for i in range(len(prompts))]
