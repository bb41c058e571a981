#!/usr/bin/env python3
"""Golden dequantization fixtures for the GGUF block formats, made by the `gguf` package.

The `gguf` Python package (maintained with llama.cpp) carries its own numpy dequantizers.
For each format we draw random blocks (random codes, finite random scales), dequantize them
with `gguf.quants.dequantize`, and store the raw block bytes (hex) with the expected values.
The Rust tests in crates/runtime decode the same bytes and compare.

Usage: python3 tools/make_quant_fixtures.py [--out crates/runtime/tests/fixtures/quant_golden.json]
"""

import argparse
import json
import struct

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

BLOCKS = {
    # name: (type, values per block, bytes per block, offsets of f16 scale fields)
    "Q4_0": (T.Q4_0, 32, 18, [0]),
    "Q4_1": (T.Q4_1, 32, 20, [0, 2]),
    "Q8_0": (T.Q8_0, 32, 34, [0]),
    "Q4_K": (T.Q4_K, 256, 144, [0, 2]),
    "Q6_K": (T.Q6_K, 256, 210, [208]),
}


def random_blocks(rng, n_blocks, size, scale_offsets):
    raw = bytearray(rng.integers(0, 256, size=n_blocks * size, dtype=np.uint8).tobytes())
    for b in range(n_blocks):
        for off in scale_offsets:
            # A finite f16 of moderate magnitude, either sign.
            val = np.float16(rng.uniform(-0.05, 0.05))
            raw[b * size + off : b * size + off + 2] = struct.pack("<e", float(val))
    return bytes(raw)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="crates/runtime/tests/fixtures/quant_golden.json")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    cases = []
    for name, (qtype, n_vals, size, scale_offsets) in BLOCKS.items():
        n_blocks = 2 if n_vals == 256 else 4
        raw = random_blocks(rng, n_blocks, size, scale_offsets)
        arr = np.frombuffer(raw, dtype=np.uint8).reshape(1, -1)
        values = dequantize(arr, qtype).reshape(-1).astype(np.float32)
        assert values.size == n_blocks * n_vals
        cases.append(
            {
                "dtype": name,
                "cols": int(values.size),
                "bytes_hex": raw.hex(),
                "values": [float(v) for v in values],
            }
        )
    meta = {
        "generator": "tools/make_quant_fixtures.py",
        "reference": "gguf.quants.dequantize (numpy)",
        "gguf_version": getattr(gguf, "__version__", None) or __import__("importlib.metadata").metadata.version("gguf"),
        "seed": args.seed,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "cases": cases}, f)
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
