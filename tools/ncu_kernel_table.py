#!/usr/bin/env python3
"""Per-kernel durations of a decode step from Nsight Compute's CSV, one row per kernel name.

On the GPU machine (ncu times each kernel alone, so the overlap of programmatic dependent
launch is gone; the table says where the kernel time is, not the step's wall time):

    ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip 4000 \
        --launch-count 500 --csv dflash bench -m M --device cuda --no-draft -p 512 -n 64 -r 1 \
        | python3 tools/ncu_kernel_table.py --steps 2

`--steps` divides the totals by the decode steps the launches cover (launches / launches per
step). Lines that are not ncu's CSV (the bench's own output) are skipped.

`--forwards` profiles a whole short bench instead (no --launch-skip/--launch-count; a few
thousand launches) and compares its kinds of forward side by side, e.g. a decode step against
the verify of 16 the bench measures:

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        dflash bench -m M --device cuda --no-draft -p 512 -n 4 -r 1 \
        | python3 tools/ncu_kernel_table.py --forwards

A forward ends at its `argmax_final` launch (every forward that chooses tokens has one); its
kind is the grid of that launch (one block per row choosing) and its number of launches. For
each kind seen at least twice, the forward with the median total (the upper one of an even
count) is tabled, kernel by kernel.

`--rounds` takes a DFlash run on the GPU, e.g.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv dflash generate -m M \
        --device cuda --draft D --block-size 4 --speculation always -n 96 "a prompt" \
        | python3 tools/ncu_kernel_table.py --rounds

and cuts it into rounds, each ending at its `verify_finish` launch (the verdict on the
device). A round's draft part runs through its first drafting launch (`argmax_final`, or
`draft_rows_f32` when sampling): the drafter's context write of the tokens the round before
committed, the draft forward and the choice of the drafts; its verify part is the rest: the
target's forward of the block and the verdict. The round with the median total is tabled,
kernel by kernel, the two parts side by side.
"""
import argparse
import collections
import csv
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def launches(lines):
    """(kernel name, grid, µs) for every profiled launch in ncu's CSV lines."""
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
        grid = row[header["Grid Size"]] if "Grid Size" in header else ""
        yield row[header["Kernel Name"]].split("(")[0], grid, value
    if header is None:
        raise SystemExit("no ncu CSV header (Kernel Name, Metric Value) in the input")


def forwards(rows):
    """The launches cut into forwards, each ending at an `argmax_final` launch (the launches
    after the last one are dropped): a list of (kind, launches), kind = (argmax grid, count)."""
    out, cur = [], []
    for name, grid, us in rows:
        cur.append((name, us))
        if name == "argmax_final":
            out.append(((grid, len(cur)), cur))
            cur = []
    return out


def by_kernel(launches_):
    """{kernel name: [µs of each launch]} in first-seen order."""
    by = collections.defaultdict(list)
    for name, us in launches_:
        by[name].append(us)
    return by


def forwards_table(rows):
    """Markdown lines comparing the median forward of every kind seen at least twice."""
    kinds = collections.defaultdict(list)
    for kind, fw in forwards(rows):
        kinds[kind].append(fw)
    picked = []
    for (grid, count), fws in kinds.items():
        if len(fws) < 2:
            continue
        fws.sort(key=lambda f: sum(us for _, us in f))
        picked.append((f"argmax grid {grid}, {count} launches, {len(fws)} forwards", fws[len(fws) // 2]))
    if not picked:
        raise SystemExit("no kind of forward (argmax_final grid, launches) occurs twice")
    lines = [f"- {label}: {sum(us for _, us in fw):.1f} us of kernels" for label, fw in picked]
    return lines + side_by_side([(f"kind {i + 1}", fw) for i, (_, fw) in enumerate(picked)])


def side_by_side(columns):
    """Markdown table lines: one row per kernel, one column per (title, launches) pair, each
    cell `launches x median us = total us`; kernels ordered by their largest column total."""
    tables = [by_kernel(launches_) for _, launches_ in columns]
    names = sorted({n for t in tables for n in t},
                   key=lambda n: -max(sum(t.get(n, [0.0])) for t in tables))
    lines = ["| kernel | " + " | ".join(f"{title}: launches x us each = us" for title, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for n in names:
        cells = []
        for t in tables:
            v = sorted(t.get(n, []))
            cells.append(f"{len(v)} x {v[len(v) // 2]:.2f} = {sum(v):.1f}" if v else "")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


DRAFTING = ("argmax_final", "draft_rows_f32")
VERDICT = "verify_finish"
# Launches of the token choice on the device (no forward's).
CHOICE = {"argmax_part_f32", "argmax_part", "argmax_final", "draft_rows_f32", "verify_slots_f32",
          VERDICT}


def rounds(rows):
    """The launches cut into DFlash rounds, each a (draft part, verify part) pair of launch
    lists (see the module docs); the prompt's forward, before the first round, counts in that
    round's draft part; launches after the last verdict are dropped."""
    out, cur = [], []
    for name, _grid, us in rows:
        cur.append((name, us))
        if name == VERDICT:
            # The drafting launch is the last one the target's forward follows (the target's
            # own choice is followed by choice launches only).
            forward = [i for i, (n, _) in enumerate(cur) if n not in CHOICE]
            cut = next((i for i in range(len(cur) - 1, -1, -1)
                        if cur[i][0] in DRAFTING and forward and forward[-1] > i), None)
            if cut is None:
                raise SystemExit("a verify_finish launch with no drafting launch before it")
            out.append((cur[:cut + 1], cur[cut + 1:]))
            cur = []
    return out


def rounds_table(rows):
    """Markdown lines: the median DFlash round, kernel by kernel, draft part and verify part."""
    rs = rounds(rows)
    if not rs:
        raise SystemExit("no DFlash round (no verify_finish launch) in the input")
    total = lambda r: sum(us for _, us in r[0]) + sum(us for _, us in r[1])
    rs.sort(key=total)
    draft, verify = rs[len(rs) // 2]
    part = lambda launches_: sum(us for _, us in launches_)
    lines = [f"- {len(rs)} rounds; the median round: {total((draft, verify)):.1f} us of kernels, "
             f"draft part {part(draft):.1f} us in {len(draft)} launches, "
             f"verify part {part(verify):.1f} us in {len(verify)} launches"]
    return lines + side_by_side([("draft part", draft), ("verify part", verify)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=float, default=1.0, help="decode steps the launches cover")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--forwards", action="store_true",
                      help="compare the kinds of forward (decode step, verify block) side by side")
    mode.add_argument("--rounds", action="store_true",
                      help="a DFlash run: the median round's draft part against its verify part")
    args = ap.parse_args()
    if args.steps <= 0:
        raise SystemExit("--steps must be positive")
    if args.rounds:
        print("\n".join(rounds_table(list(launches(sys.stdin)))))
        return
    if args.forwards:
        print("\n".join(forwards_table(list(launches(sys.stdin)))))
        return
    by = by_kernel((name, us) for name, _, us in launches(sys.stdin))
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
