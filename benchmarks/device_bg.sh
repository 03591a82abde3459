#!/usr/bin/env bash
# Run a long GPU job beside short device calls (e.g. the sweep while vLLM's pieces arrive): the device tool ends
# a call's processes when it returns, except ones in their own session (setsid), which live while the machine
# stays warm (30 s after each call). The job runs from a copy of the tree in /tmp/bg/repo, since the next call
# re-syncs the working tree (and drops carried paths it does not name).
#   bash benchmarks/device_bg.sh start SCRIPT [ARGS...]   # SCRIPT relative to the repo root; its $OUT is /tmp/bg/out
#   bash benchmarks/device_bg.sh wait SECONDS             # until the job ends or SECONDS pass; the log's tail
#   bash benchmarks/device_bg.sh collect                  # /tmp/bg/out's files -> $OUT, its logs/ folder and the job's
#                                                         # log as $OUT/bg_logs.tar.gz (the tool returns 8 files); exit 1
#                                                         # if the job still runs
set -u
BG=/tmp/bg
cmd=${1:?usage: device_bg.sh start SCRIPT [ARGS] | wait SECONDS | collect}; shift
running() { [ -f $BG/pid ] && kill -0 "$(cat $BG/pid)" 2>/dev/null; }
case $cmd in
  start)
    if running; then echo "[bg] a job is running (pid $(cat $BG/pid))" >&2; exit 1; fi
    rm -rf $BG && mkdir -p $BG/out $BG/repo
    tar --exclude=./.ship --exclude=./.ship-sglang --exclude=./.git -cf - . | tar -xf - -C $BG/repo
    # the job writes its own pid: setsid forks when its caller leads a process group, so $! can be a parent
    # that has already exited (2026-12-02: 'done' reported while the job ran on)
    (cd $BG/repo && OUT=$BG/out setsid bash -c 'echo $$ > /tmp/bg/pid; exec bash "$@"' job "$@" > $BG/log 2>&1 < /dev/null &)
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s $BG/pid ] && break; sleep 0.5; done
    echo "[bg] started pid $(cat $BG/pid 2>/dev/null): $*" ;;
  wait)
    end=$((SECONDS + ${1:?seconds})); while running && [ $SECONDS -lt $end ]; do sleep 5; done
    running && echo "[bg] still running after ${1} s" || echo "[bg] done, rc=$(cat $BG/rc 2>/dev/null || echo '?')"
    tail -n ${TAIL:-30} $BG/log ;;
  collect)
    find $BG/out -maxdepth 1 -type f -exec cp {} "${OUT:?}/" \;
    tar czf "$OUT/bg_logs.tar.gz" -C $BG log $( [ -d $BG/out/logs ] && echo out/logs )
    running && { echo "[bg] still running"; exit 1; }; exit 0 ;;
  *) echo "usage: device_bg.sh start SCRIPT [ARGS] | wait SECONDS | collect" >&2; exit 2 ;;
esac
