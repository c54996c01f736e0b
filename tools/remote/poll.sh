#!/bin/bash
# Wait up to $1 seconds for the command tools/remote/start.sh started (by its pid), then print the end of its output
# and the GPU memory peak, and pack directory $2 (if given) into one file under $OUT (a machine that returns few files):
# logs and metrics, not checkpoints or databases.
#   bash tools/remote/poll.sh 540 /tmp/pipe
limit=${1:-540}; t0=$(date +%s)
[ -f /tmp/job.out ] || { echo "no /tmp/job.out: a fresh machine, nothing was started here"; exit 9; }
while kill -0 "$(cat /tmp/job.pid)" 2>/dev/null; do
    [ $(( $(date +%s) - t0 )) -ge "$limit" ] && break
    sleep 10
done
running=no; kill -0 "$(cat /tmp/job.pid)" 2>/dev/null && running=yes
echo "waited $(( $(date +%s) - t0 )) s, running=$running, GPU memory peak $(sort -n /tmp/gpu.log 2>/dev/null | tail -1) MiB"
tail -60 /tmp/job.out
if [ -n "${2:-}" ] && [ -d "$2" ] && [ -n "${OUT:-}" ]; then
    (cd "$2" && tar czf "$OUT/results.tgz" --exclude='*.db' --exclude='*.db-*' --exclude=checkpoints --exclude=weights \
        --exclude=merged --exclude=export --exclude=wandb . /tmp/job.out /tmp/gpu.log 2>/dev/null)
    ls -la "$OUT"
fi
