#!/usr/bin/env bash
# A cooled-down study that outlives the 10-minute limit of one device command: benchmarks/study_gpu.sh started in
# a process session of its own (setsid), which the device keeps running between the calls of one lease, then
# watched and collected by later calls. Runs are never stopped and resumed between calls, so a lease's whole
# time trains; what is unfinished when SECONDS run out is stopped by study_gpu.sh's BUDGET as usual.
# Usage (repo root, on the GPU machine; the variables of study_gpu.sh, OUT excepted, go to `start`):
#   bash benchmarks/study_lease.sh mark              # the lease's first call: note its start (PARTS/t0)
#   bash benchmarks/study_lease.sh start SECONDS     # study_gpu.sh in the background, BUDGET=SECONDS
#   bash benchmarks/study_lease.sh start auto        # SECONDS = LEASE (1800) - 45 - time since `mark` - MARGIN
#                                                    # (200: collecting and the call's transfers); START_BY=auto
#                                                    # is SECONDS - RUN_SECONDS (680: a 30m run with its
#                                                    # branches, 6 under MPS on an H100)
#   bash benchmarks/study_lease.sh watch SECONDS     # wait up to SECONDS or until it ends; print its progress
#   bash benchmarks/study_lease.sh stop              # end the training now (SIGTERM to study_gpu.sh's `timeout`,
#                                                    # as its BUDGET would): the report and study.tgz follow
#   OUT=$OUT bash benchmarks/study_lease.sh collect  # wait for it to end; copy study.tgz, summary.json, report.md,
#                                                    # device.txt and study_log.txt to OUT; with PACK=1 everything
#                                                    # in one archive, OUT/NAME-collected.tgz, and report.md beside it
#                                                    # (two files a study: a device call returns a few files only)
# (Never `pkill -f` a pattern of the study's command line from a device command: that command's own shell
# carries the same text and is killed with it.)
# State in PARTS (default /root/mx): NAME.out (study_gpu.sh's OUT), NAME.log (its output), NAME.pid, with NAME
# (default `lease`) naming one study: two studies (different models or lengths) share a multi-GPU lease with
# NAME and GPUS on every call of each, e.g. `NAME=trend GPUS=3 PRESET=trend ... start auto` beside
# `NAME=main GPUS=0,1,2 ARMS=... start auto`; a named study's folder is PARTS/study-NAME (unless STUDY is set),
# GPUS (`start` only) its CUDA_VISIBLE_DEVICES, and with MPS=1 both share one daemon (study_gpu.sh).
# POLL (default 5): seconds between the checks of `watch` and `collect` (the tests use less).
# Exit status: 0 done; 1 `watch` found it still running; 2 a usage error or nothing started.
set -u
PARTS=${PARTS:-/root/mx}; NAME=${NAME:-lease}
case "$NAME" in ''|*[!A-Za-z0-9_-]*) echo "study_lease: NAME=$NAME: letters, digits, - and _ only" >&2; exit 2;; esac
if [ "$NAME" = lease ]; then S=${STUDY:-$PARTS/study}; else S=${STUDY:-$PARTS/study-$NAME}; fi
LO="$PARTS/$NAME.out"; PIDF="$PARTS/$NAME.pid"; LOG="$PARTS/$NAME.log"
running() { [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; }
progress() {
  echo "--- $(date -u +%FT%TZ): study $(running && echo running || echo ended)"
  if [ -d "$S" ]; then
    echo "runs and branches done: $(cat "$S"/worker*.log 2>/dev/null | grep -c ': done')"
    for f in "$S"/worker*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(tail -n 1 "$f" | cut -c1-200)"; done
  fi
  [ -f "$LOG" ] && tail -n 3 "$LOG"
}
case "${1:-}" in
  mark)
    mkdir -p "$PARTS" || exit 2
    [ -f "$PARTS/t0" ] || date +%s > "$PARTS/t0"
    echo "study_lease: lease started at $(date -u -d "@$(cat "$PARTS/t0")" +%TZ 2>/dev/null || cat "$PARTS/t0")";;
  start)
    secs=${2:?start SECONDS}
    if [ "$secs" = auto ]; then
      [ -f "$PARTS/t0" ] || { echo "study_lease: start auto needs \`study_lease.sh mark\` in the lease's first call" >&2; exit 2; }
      secs=$(( ${LEASE:-1800} - 45 - $(date +%s) + $(cat "$PARTS/t0") - ${MARGIN:-200} ))
      [ "$secs" -gt 60 ] || { echo "study_lease: only $secs s of the lease left: nothing started" >&2; exit 2; }
    fi
    if [ "${START_BY:-}" = auto ]; then
      START_BY=$(( secs - ${RUN_SECONDS:-680} )); [ "$START_BY" -gt 0 ] || START_BY=0; export START_BY
    fi
    if running; then echo "study_lease: a study is running already (pid $(cat "$PIDF"))" >&2; exit 2; fi
    mkdir -p "$PARTS" "$LO" || exit 2
    if [ -n "${GPUS:-}" ]; then export CUDA_VISIBLE_DEVICES=$GPUS; fi
    BUDGET=$secs OUT="$LO" STUDY="$S" setsid nohup bash benchmarks/study_gpu.sh > "$LOG" 2>&1 < /dev/null &
    echo $! > "$PIDF"
    sleep 2
    running || { echo "study_lease: study_gpu.sh ended at once:" >&2; tail -n 20 "$LOG" >&2; exit 2; }
    echo "study_lease: started (pid $(cat "$PIDF")), at most $secs s${START_BY:+, no run starting after $START_BY s}";;
  watch)
    secs=${2:?watch SECONDS}; end=$(( $(date +%s) + secs ))
    while running && [ "$(date +%s)" -lt "$end" ]; do sleep "${POLL:-5}"; done
    progress; running && exit 1; exit 0;;
  stop)
    running || { echo "study_lease: no study is running" >&2; exit 2; }
    pkill -TERM -x -P "$(cat "$PIDF")" timeout || { echo "study_lease: no training to stop (reporting already?)" >&2; }
    echo "study_lease: training stopped; \`collect\` waits for the report";;
  collect)
    OUT=${OUT:?set OUT}
    [ -f "$PIDF" ] || { echo "study_lease: nothing was started" >&2; exit 2; }
    while running; do sleep "${POLL:-5}"; done
    progress
    if [ "${PACK:-0}" = 1 ]; then
      cp "$LOG" "$LO/lease.log" 2>/dev/null
      mkdir -p "$OUT" && tar -C "$LO" -czf "$OUT/$NAME-collected.tgz" . && cp "$LO/report.md" "$OUT/$NAME-report.md" 2>/dev/null
    else
      mkdir -p "$OUT" && cp "$LO"/* "$OUT"/ 2>/dev/null; cp "$LOG" "$OUT/lease.log" 2>/dev/null
    fi
    ls -la "$OUT";;
  *) echo "usage: study_lease.sh mark | start SECONDS|auto | watch SECONDS | stop | collect" >&2; exit 2;;
esac
