#!/usr/bin/env bash
# Empties the session's checkout for device calls that carry large files, and brings it back.
#
# The device tool sends the checkout the session started in (tracked files and untracked ones
# git does not ignore) plus the carried paths, at most 64 MiB a call. The tracked tree (the
# shipped drafter's 31 MB, the test fixtures) is about 45 MiB, which leaves too little room for
# the default model's parts (`h200_session.sh --pack` puts up to 60 MiB in a stage). So:
#
#   bash tools/device_checkout.sh empty     # HEAD on an unborn branch: no tracked files
#   run  carry [".gpu/common", ".gpu/A"] ...    # the device calls
#   bash .gpu/device_checkout.sh restore    # back to the branch (or commit) it was on
#
# (`empty` leaves a copy of this script in .gpu/, which stays: tools/ is gone until `restore`.)
#
# `empty` first copies the patterns of .gitignore (and /.gpu/) into the repository's info/exclude
# once, so what the checkout ignores (target/, .venv/, .gpu/ ...) stays ignored without the
# tracked .gitignore; then it refuses a checkout with changes or untracked files (commit or
# stash them first).
# Ignored paths, such as the packed .gpu/ stages and the build folder, stay where they are.
# Edit code meanwhile in another worktree (`git worktree add ../wt main` after `empty`, so the
# branch is free there; remove it before `restore`).
set -euo pipefail
cd "$(dirname "$0")/.."

record=$(git rev-parse --git-path dflash-device-checkout)
exclude=$(git rev-parse --git-path info/exclude)
empty_branch=dflash-device-empty

case "${1:-}" in
    empty)
        [ ! -f "$record" ] || { echo "already empty (restore first): $(cat "$record")" >&2; exit 2; }
        mkdir -p "$(dirname "$exclude")"
        marker="# device_checkout.sh: the patterns of .gitignore"
        if ! grep -qxF "$marker" "$exclude" 2>/dev/null; then
            { echo "$marker"; grep -v '^[[:space:]]*$' .gitignore; echo /.gpu/; } >> "$exclude"
        fi
        if [ -n "$(git status --porcelain)" ]; then
            echo "the checkout has changes or untracked files; commit or stash them first:" >&2
            git status --short >&2
            exit 2
        fi
        at=$(git symbolic-ref -q --short HEAD || git rev-parse HEAD)
        echo "$at" > "$record"
        mkdir -p .gpu
        [ "$0" -ef .gpu/device_checkout.sh ] || cp "$0" .gpu/device_checkout.sh
        git checkout -q --orphan "$empty_branch"
        git rm -rfq --ignore-unmatch .
        echo "empty: the checkout carries no tracked files; back to $at with: bash .gpu/device_checkout.sh restore"
        ;;
    restore)
        [ -f "$record" ] || { echo "not emptied by this script (no $record)" >&2; exit 2; }
        at=$(cat "$record")
        git checkout -q -f "$at"
        rm -f "$record"
        echo "restored: $(git symbolic-ref -q --short HEAD || git rev-parse --short HEAD)"
        ;;
    *)
        echo "usage: $0 empty | restore" >&2
        exit 2
        ;;
esac
