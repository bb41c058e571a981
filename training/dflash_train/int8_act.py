"""The CPU engine's int8 activations, simulated for training data (``gen_data --int8-act``).

On the CPU the engine feeds the target's layer projections (q, k, v, o, gate, up, down) int8
activations: each row is cut into 32-value blocks, and block ``x`` becomes the codes
``q = clamp(round_half_even(x * (127 / amax)), -127, 127)`` with the scale ``d = amax / 127``
(``amax`` the block's largest |x|; an all-zero block stays zero), both quotients rounded once
in f32 (crates/runtime/src/cpu/int8/quantize.rs). The integer dot products then compute
``sum(q * d * w)`` exactly, so a float ``Linear`` applied to ``q * d`` reproduces the engine's
product up to float summation order. The generator (``fastgen``) applies it to the inputs of
the target's projections so that the answers it writes are those of the CPU's default path:
the int8 target's greedy text parts from the float target's after ~20 tokens (median), and
the shipped drafter, trained on float text, accepts 9 % fewer tokens per round on it
(docs/benchmarks/2026-12-02-drafter-h200.md). ``round_projection_inputs`` puts the same rounding
on an HF model, the reference the generator is tested against.
"""

from __future__ import annotations

import torch

from .target import decoder_layers

BLOCK = 32


# Values rounded per pass: the float32 temporaries of a pass stay near 64 MiB whatever the
# tensor (a generator prefill's MLP input reaches ~1.5 GiB in float32, which did not fit beside
# the generator's KV cache and a trainer on one GPU).
CHUNK_VALUES = 1 << 24


@torch.no_grad()
def fake_quant_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every 32-value block of its last axis replaced by ``codes * scale``, computed
    in float32 as the engine computes them; returned in ``x``'s dtype."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"int8 activations need whole {BLOCK}-value blocks (last axis {k})")
    flat = x.reshape(-1, k)
    out = torch.empty_like(flat)
    rows = max(1, CHUNK_VALUES // k)
    for i in range(0, flat.shape[0], rows):
        out[i:i + rows] = _round_rows(flat[i:i + rows])
    return out.reshape(x.shape)


def _round_rows(x: torch.Tensor) -> torch.Tensor:
    """The rounding of ``fake_quant_blocks`` on a 2-D slice of rows."""
    xb = x.float().reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    pos = amax > 0
    one = torch.ones_like(amax)
    inv = torch.where(pos, torch.full_like(amax, 127.0) / torch.where(pos, amax, one), torch.zeros_like(amax))
    d = amax / 127.0
    q = torch.round(xb * inv).clamp_(-127.0, 127.0)
    return (q * d).reshape(x.shape).to(x.dtype)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def round_projection_inputs(model) -> list:
    """Puts the engine's int8 rounding on the input of every decoder-layer projection of an HF
    Llama-family ``model`` (forward pre-hooks): the reference the generator is tested against,
    and the int8-rounded features of tools/walk_cpu_paths.py. Returns the hook handles
    (``h.remove()`` takes each off)."""
    def pre(_module, args):
        return (fake_quant_blocks(args[0]),) + tuple(args[1:])

    return [mod.register_forward_pre_hook(pre) for layer in decoder_layers(model)
            for name, mod in layer.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS]
