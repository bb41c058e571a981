"""Drafter configuration (pure python, no torch).

The drafter is a Qwen3-style decoder stack whose width equals the target's
hidden size; it reuses the target's token embedding and lm_head (frozen).
A DFlash2 drafter (``conv_kernel_size`` set) adds grouped dynamic causal
convolutions around every sublayer and a candidate selector; its config.json
names ``DFlash2DraftModel`` and carries the DFlash2 fields in ``dflash_config``
(the layout the Rust loader and the z-lab reference read).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> List[int]:
    """Default tapped target layers (0-based layer outputs).

    Published default rule: one tap -> the middle layer ``n // 2``; otherwise
    ``num_taps`` points evenly spaced from layer 1 to layer ``n - 3`` where each
    point ``1 + i * (n - 4) / (num_taps - 1)`` is rounded with Python's
    built-in ``round`` on a float, i.e. round-half-to-even ("banker's
    rounding").  This matches the published helper exactly (it also uses
    ``int(round(float))``).  The tie rule matters: for SmolLM2 (30 layers,
    5 taps) the exact points are 1, 7.5, 14, 20.5, 27 -> [1, 8, 14, 20, 27]
    (round-half-up would give 21 instead of 20).  Implementations in other
    languages should read ``dflash_config.target_layer_ids`` from config.json
    rather than recompute it.
    """
    if num_taps < 1:
        raise ValueError("num_taps must be >= 1")
    if num_taps == 1:
        return [num_target_layers // 2]
    start = 1
    end = num_target_layers - 3
    if end < start:
        raise ValueError(f"target too shallow ({num_target_layers} layers) for the default rule")
    span = end - start
    return [int(round(start + (i * span) / (num_taps - 1))) for i in range(num_taps)]


def default_gamma(block_size: int) -> float:
    """Loss position-decay constant: 7 for B=16 and 4 for B=8 (paper values);
    other sizes interpolate linearly (7/16 per slot), never below 1."""
    table = {16: 7.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, block_size * 7.0 / 16.0)


@dataclasses.dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[int] = None
    initializer_range: float = 0.02
    # DFlash2 (all four set, or none)
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    # sliding-window (non-causal) layers: every layer, or those ``layer_types``
    # marks "sliding_attention"; None = every layer full attention
    sliding_window: Optional[int] = None
    layer_types: Optional[List[str]] = None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    def layer_window(self, layer: int) -> Optional[int]:
        """The attention window of ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def validate(self) -> None:
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside vocab {self.vocab_size}")
        for l in self.target_layer_ids:
            if not 0 <= l < self.num_target_layers:
                raise ValueError(f"target layer {l} outside 0..{self.num_target_layers - 1}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")
        v2 = [self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k]
        if any(x is not None for x in v2):
            if any(x is None for x in v2):
                raise ValueError("a DFlash2 drafter needs conv_kernel_size, conv_group_size, selector_rank "
                                 "and selector_top_k")
            if not 1 <= self.conv_kernel_size <= self.block_size:
                raise ValueError(f"conv_kernel_size {self.conv_kernel_size} outside 1..{self.block_size}")
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_group_size {self.conv_group_size} must divide {self.hidden_size}")
            if self.selector_rank < 1:
                raise ValueError("selector_rank must be >= 1")
            if not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_top_k {self.selector_top_k} outside 1..{self.vocab_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("layer_types needs one entry per layer")
            if set(self.layer_types) - {"full_attention", "sliding_attention"}:
                raise ValueError(f"unsupported layer types {self.layer_types}")

    # ---- published config.json format -------------------------------------------------
    def to_hf_dict(self) -> Dict[str, Any]:
        """config.json in the published DFlash drafter format (Qwen3-style)."""
        d: Dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "initializer_range": self.initializer_range,
            "use_cache": True,
            "torch_dtype": "bfloat16",
        }
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.sliding_window is not None:
            d["use_sliding_window"] = True
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = ["sliding_attention" if self.layer_window(i) else "full_attention"
                                for i in range(self.num_hidden_layers)]
            d["is_causal"] = False
        if self.is_dflash2:
            d["architectures"] = ["DFlash2DraftModel"]
            d["dflash_config"].update({
                "block_size": self.block_size,
                "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k,
            })
        return d

    @classmethod
    def from_hf_dict(cls, d: Dict[str, Any]) -> "DrafterConfig":
        dc = d.get("dflash_config") or {}
        block_size = d.get("block_size", dc.get("block_size", 16))
        n_layers = d["num_hidden_layers"]
        taps = dc.get("target_layer_ids")
        if taps is None:
            taps = build_target_layer_ids(d["num_target_layers"], n_layers)
        mask_id = dc.get("mask_token_id", d.get("mask_token_id"))
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        cfg = cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            vocab_size=d["vocab_size"],
            num_target_layers=d["num_target_layers"],
            target_layer_ids=list(taps),
            mask_token_id=int(mask_id),
            block_size=int(block_size),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            initializer_range=d.get("initializer_range", 0.02),
            conv_kernel_size=dc.get("conv_kernel_size", d.get("conv_kernel_size")),
            conv_group_size=dc.get("conv_group_size", d.get("conv_group_size")),
            selector_rank=dc.get("selector_rank", d.get("selector_rank")),
            selector_top_k=dc.get("selector_top_k", d.get("selector_top_k")),
            sliding_window=(d.get("sliding_window")
                            if "sliding_attention" in (d.get("layer_types") or []) else None),
            # kept only when layers differ (all sliding: ``sliding_window`` says it)
            layer_types=(list(d["layer_types"])
                         if len(set(d.get("layer_types") or [])) > 1 else None),
        )
        for k in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
            v = dc.get(k, d.get(k))
            if v is not None and float(v) != (1.0 if k != "final_logit_softcapping" else 0.0):
                raise ValueError(f"{k}={v} is not supported by the training drafter")
        if d.get("is_causal") or ((d.get("layer_types") and "sliding_attention" in d["layer_types"])
                                  and d.get("is_causal") is None):
            raise ValueError("only non-causal drafters (is_causal: false) are supported for training")
        cfg.validate()
        return cfg

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2)


def drafter_config_from_target(
    tcfg: Any,
    *,
    num_draft_layers: int,
    num_taps: int,
    mask_token_id: int,
    block_size: int = 16,
    target_layer_ids: Optional[List[int]] = None,
    dflash2: Optional[Dict[str, int]] = None,
    sliding_window: Optional[int] = None,
) -> DrafterConfig:
    """Derive the drafter config from a (HF) target config object or dict.

    Width/heads/intermediate/eps/rope theta are copied from the target so that
    the target's embedding and lm_head can be shared.  ``dflash2`` (keys
    conv_kernel_size, conv_group_size, selector_rank, selector_top_k) makes it
    a DFlash2 drafter.
    """
    get = (lambda k, dflt=None: tcfg.get(k, dflt)) if isinstance(tcfg, dict) else (
        lambda k, dflt=None: getattr(tcfg, k, dflt))
    n_target = get("num_hidden_layers")
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or hidden // heads
    rope_theta = get("rope_theta")
    if rope_theta is None:
        rp = get("rope_parameters") or {}
        rope_theta = rp.get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0
    taps = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(n_target, num_taps)
    eos = get("eos_token_id")
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab_size=get("vocab_size"),
        num_target_layers=n_target,
        target_layer_ids=taps,
        mask_token_id=mask_token_id,
        block_size=block_size,
        # GGUF stores eps as f32 (1e-5 -> 9.9999997e-06): keep 7 significant digits
        rms_norm_eps=float(f"{float(get('rms_norm_eps', 1e-6)):.7g}"),
        rope_theta=float(rope_theta),
        max_position_embeddings=get("max_position_embeddings", 8192) or 8192,
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=get("pad_token_id"),
        sliding_window=sliding_window,
        **(dflash2 or {}),
    )
    cfg.validate()
    return cfg
