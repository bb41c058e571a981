#!/usr/bin/env python3
"""Per-kernel durations of a decode step from Nsight Compute's CSV, one row per kernel name.

On the GPU machine (ncu times each kernel alone, so the overlap of programmatic dependent
launch is gone; the table says where the kernel time is, not the step's wall time):

    ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip 4000 \
        --launch-count 500 --csv dflash bench -m M --device cuda --no-draft -p 512 -n 64 -r 1 \
        | python3 tools/ncu_kernel_table.py --steps 2

`--steps` divides the totals by the decode steps the launches cover (launches / launches per
step). Lines that are not ncu's CSV (the bench's own output) are skipped.
"""
import argparse
import collections
import csv
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def durations(lines):
    """(kernel name, µs) for every profiled launch in ncu's CSV lines."""
    header = None
    for row in csv.reader(lines):
        if header is None:
            if "Kernel Name" in row and "Metric Value" in row:
                header = {name: i for i, name in enumerate(row)}
            continue
        if len(row) != len(header) or row[header["Metric Name"]] != "gpu__time_duration.sum":
            continue
        unit = row[header["Metric Unit"]]
        if unit not in UNITS:
            raise SystemExit(f"unknown time unit {unit!r} in ncu's CSV")
        value = float(row[header["Metric Value"]].replace(",", "")) * UNITS[unit]
        yield row[header["Kernel Name"]].split("(")[0], value
    if header is None:
        raise SystemExit("no ncu CSV header (Kernel Name, Metric Value) in the input")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=float, default=1.0, help="decode steps the launches cover")
    args = ap.parse_args()
    if args.steps <= 0:
        raise SystemExit("--steps must be positive")
    by = collections.defaultdict(list)
    for name, us in durations(sys.stdin):
        by[name].append(us)
    total = sum(sum(v) for v in by.values())
    print(f"{sum(len(v) for v in by.values())} launches, {total:.1f} us "
          f"({total / args.steps:.1f} us per step)")
    print("| kernel | launches per step | us each (median) | min | max | us per step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        v.sort()
        print(f"| {name} | {len(v) / args.steps:g} | {v[len(v) // 2]:.2f} | {v[0]:.2f} | "
              f"{v[-1]:.2f} | {sum(v) / args.steps:.1f} |")


if __name__ == "__main__":
    main()
