#!/usr/bin/env bash
# Commit finished science points as they land (a session's end kills what runs and loses what is
# not committed): every INTERVAL seconds (default 120), whatever changed under results/science/
# is committed on its own (`git commit -- results/science`: nothing else that is staged), with a
# retry when another git command holds the index. Stops when the file STOP_FILE appears.
set -uo pipefail
cd "$(dirname "$0")/../.."
interval=${INTERVAL:-120}
stop=${STOP_FILE:-runs/science/.stop-committer}
while [ ! -e "$stop" ]; do
    if [ -n "$(git status --porcelain -- results/science)" ]; then
        for _ in 1 2 3 4 5; do
            git add -- results/science &&
                git commit -q -m "science: points recorded $(date -u +%FT%TZ)" -- results/science &&
                break
            sleep 5
        done
    fi
    sleep "$interval"
done
