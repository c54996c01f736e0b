#!/bin/bash
# Start a long command detached on a machine that runs one short command at a time (a GPU lent call by call): the
# checkout is copied to /tmp/repo first (later calls may re-sync the working tree under a running process), the
# command runs there in its own session with its pid in /tmp/job.pid and its output in /tmp/job.out. Poll with
# tools/remote/poll.sh, which waits on that pid (never `pgrep -f`: it matches the polling shell itself).
#   bash tools/remote/start.sh python3 bench/pipeline_smollm2.py --no-ray --out /tmp/pipe
set -e
rm -rf /tmp/repo && mkdir -p /tmp/repo
tar --exclude=./runs --exclude=./.whl --exclude=./.venv --exclude=./.git -cf - . | (cd /tmp/repo && tar xf -)
cd /tmp/repo
export PYTHONPATH="/tmp/repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
setsid bash -c 'while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> /tmp/gpu.log 2>/dev/null; sleep 5; done' \
    < /dev/null > /dev/null 2>&1 &
setsid bash -c 'echo $$ > /tmp/job.pid; exec "$@"' job "$@" < /dev/null > /tmp/job.out 2>&1 &
sleep 5
echo "started pid $(cat /tmp/job.pid): $*"
head -5 /tmp/job.out
