# shellcheck shell=bash
# The pieces of tools/gpu-check.sh that need no GPU, sourced by it and tested
# on machines without one (tests/test_gpu_check.py): which stages to run, the
# driver check, the build stamp, each invocation's time budget, and the
# records that tools/gpu_check_summary.py assembles the summary from.
#
# The caller sets GC_ROOT (the checkout), GC_BUILD (absolute build folder),
# GC_STATE (absolute; records and logs, kept with the build so that a later
# invocation summarizes what an earlier one did) and GC_OUT (absolute; where
# the logs and the summary are copied as the run goes).
# shellcheck disable=SC2153  # those are the caller's

GC_ALL_STAGES=(build suite python go memcheck racecheck bench demo)

# gc_select_stages WORD... : sets GC_SELECTED to the stages named, in the order
# they run, from names and aliases separated by spaces or commas: sanitize
# (memcheck racecheck), run (every stage but build), all; none named: all.
# "driver" alone runs only the driver check. Returns 2 naming an unknown word.
gc_select_stages() {
  local w s want=() parts=()
  for w in "$@"; do
    IFS=', ' read -ra parts <<<"$w"
    for s in "${parts[@]}"; do
      case $s in
        "") ;;
        all) want+=("${GC_ALL_STAGES[@]}") ;;
        run) want+=(suite python go memcheck racecheck bench demo) ;;
        sanitize) want+=(memcheck racecheck) ;;
        driver | build | suite | python | go | memcheck | racecheck | bench | demo) want+=("$s") ;;
        *)
          echo "gpu-check: unknown stage '$s' (stages: driver ${GC_ALL_STAGES[*]}; sanitize = memcheck racecheck;" \
               "run = all but build; all)" >&2
          return 2
          ;;
      esac
    done
  done
  [ ${#want[@]} -gt 0 ] || want=("${GC_ALL_STAGES[@]}")
  GC_SELECTED=()
  for s in driver "${GC_ALL_STAGES[@]}"; do
    for w in "${want[@]}"; do
      if [ "$w" = "$s" ]; then
        GC_SELECTED+=("$s")
        break
      fi
    done
  done
}

# ----------------------------------------------------------------------------- time

# Each invocation ends within FSDP_GPU_CHECK_BUDGET_S (default 570 s: the
# device tool's limit is 600 s a command), so that its summary is always
# written; a step is given the smaller of its own limit and what is left.
gc_start_clock() {
  GC_DEADLINE=$(($(date +%s) + ${FSDP_GPU_CHECK_BUDGET_S:-570}))
}
gc_time_left() {
  echo $((GC_DEADLINE - $(date +%s)))
}
# gc_limit CAP: seconds for the next step (0: no time left for it).
gc_limit() {
  local left
  left=$(($(gc_time_left) - 15))  # kept for the summary
  if [ "$left" -lt 20 ]; then
    echo 0
  elif [ "$left" -lt "$1" ]; then
    echo "$left"
  else
    echo "$1"
  fi
}
# gc_timed CAP LOG CMD...: runs CMD with its output in LOG, stopped after its
# limit (TERM, then KILL 10 s later, the whole process group); returns its
# status, 124 or 137 when stopped, 125 without time to start it.
gc_timed() {
  local cap=$1 log=$2 limit
  shift 2
  limit=$(gc_limit "$cap")
  if [ "$limit" -eq 0 ]; then
    echo "gpu-check: no time left in this invocation for: $*" >"$log"
    return 125
  fi
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
}

# ----------------------------------------------------------------------------- records

gc_rec() { echo "$GC_STATE/records"; }

# gc_stage_begin STAGE: forgets what an earlier run of STAGE recorded.
gc_stage_begin() {
  local r
  r=$(gc_rec)
  mkdir -p "$r/versions" "$GC_STATE/logs" "$GC_STATE/bench"
  rm -f "$r/$1.status" "$r/$1.items" "$r/$1.notes"
  GC_STAGE=$1
  GC_STAGE_T0=$(date +%s)
  GC_STAGE_FAILED=0
  printf 'RUNNING\t\t%s\t\n' "$(gc_current_source)" >"$r/$1.status"
  echo "gpu-check: == $1 =="
}
# gc_note TEXT: a line of the current stage's record, printed and copied out at once.
gc_note() {
  echo "gpu-check: $*"
  printf '%s\n' "$*" >>"$(gc_rec)/$GC_STAGE.notes"
  [ "$GC_OUT" = "$GC_STATE" ] || printf '[%s] %s\n' "$GC_STAGE" "$*" >>"$GC_OUT/progress.log"
}
# gc_item NAME VERDICT SECONDS DETAIL: one test, pass or run; FAIL and TIMEOUT fail the stage.
# failed_verdict RC: the verdict of a step that did not pass, from its exit
# status: TIMEOUT when gc_timed's timeout ended it (124, or 137 after KILL),
# FAIL otherwise.
failed_verdict() {
  if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo TIMEOUT; else echo FAIL; fi
}

gc_item() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >>"$(gc_rec)/$GC_STAGE.items"
  case $2 in FAIL | TIMEOUT) GC_STAGE_FAILED=1 ;; esac
  echo "gpu-check:   $2 $1${4:+ ($4)}"
}
# gc_stage_end [VERDICT [REASON]]: VERDICT defaults to FAIL if an item failed, else PASS.
gc_stage_end() {
  local verdict=${1:-} reason=${2:-}
  [ -n "$verdict" ] || { [ "$GC_STAGE_FAILED" -eq 0 ] && verdict=PASS || verdict=FAIL; }
  printf '%s\t%s\t%s\t%s\n' "$verdict" "$(($(date +%s) - GC_STAGE_T0))" "$(gc_current_source)" "$reason" \
    >"$(gc_rec)/$GC_STAGE.status"
  [ -z "$reason" ] || echo "gpu-check: $GC_STAGE: $verdict: $reason"
  gc_summarize >/dev/null
}
# gc_version KEY VALUE: one line of the summary's versions.
gc_version() {
  mkdir -p "$(gc_rec)/versions"
  printf '%s\n' "$2" >"$(gc_rec)/versions/$1"
}
# Writes the summary from the records into GC_STATE and GC_OUT, and copies
# the logs and benchmark lines to GC_OUT; prints the summary.
gc_summarize() {
  if [ "$GC_OUT" != "$GC_STATE" ]; then
    mkdir -p "$GC_OUT"
    cp -R "$GC_STATE/records" "$GC_STATE/logs" "$GC_STATE/bench" "$GC_OUT/" 2>/dev/null
  fi
  python3 "$GC_ROOT/tools/gpu_check_summary.py" summarize "$GC_STATE" "$GC_OUT"
}

# ----------------------------------------------------------------------------- the driver

# The CUDA toolkit's version (e.g. 13.0): nvcc on PATH, under CUDA_HOME, or
# /usr/local/cuda; else what the last build recorded; else nothing.
gc_nvcc() {
  local c
  for c in "$(command -v nvcc 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}
gc_toolkit_version() {
  local nvcc text
  if nvcc=$(gc_nvcc) && text=$("$nvcc" --version 2>/dev/null) && [[ $text =~ release\ ([0-9]+\.[0-9]+) ]]; then
    echo "${BASH_REMATCH[1]}"
  elif [ -f "$GC_STATE/records/versions/toolkit" ]; then
    cat "$GC_STATE/records/versions/toolkit"
  fi
}
# The oldest Linux driver branch that runs a CUDA major version's programs
# (NVIDIA's CUDA Toolkit release notes, "CUDA Driver": 13.x needs >= 580,
# 12.x >= 525 with minor version compatibility, 11.x >= 450).
gc_required_driver() {
  case $1 in
    13) echo 580 ;;
    12) echo 525 ;;
    11) echo 450 ;;
    *) echo 0 ;;
  esac
}
# gc_driver_check: that a GPU is there and that its driver runs this toolkit's
# code. Records the versions. Returns 0, 2 (no GPU) or 3 (the driver is too
# old, or its version or the toolkit's cannot be read), saying so plainly.
gc_driver_check() {
  local listing listed rc smi drv major cuda need driver_cuda
  if ! command -v nvidia-smi >/dev/null; then
    gc_note "STOP: nvidia-smi is not here: this machine shows no NVIDIA GPU and driver; this check needs one"
    return 2
  fi
  listing=$(nvidia-smi -L 2>&1)
  rc=$?
  listed=$(grep -c '^GPU' <<<"$listing")
  if [ "$listed" -eq 0 ]; then
    if [ $rc -eq 0 ] || [[ $listing == *"No devices were found"* ]]; then
      gc_note "STOP: nvidia-smi -L lists no GPU; this check needs one"
    else
      gc_note "STOP: nvidia-smi -L failed (exit $rc: ${listing//$'\n'/ }): the NVIDIA driver does not answer; this check needs a GPU"
    fi
    return 2
  fi
  smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)
  gc_version gpu "$(sort <<<"$smi" | uniq -c | sed 's/^ *\([0-9]*\) /\1x /' | tr '\n' ';' | sed 's/;$//')"
  gc_version gpus_listed "$listed"
  gc_version gpus_visible "$("$GC_ROOT/examples/cuda/launch_local.sh" --count-gpus)"
  drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)
  drv=${drv%%$'\n'*}
  drv=${drv//[[:space:]]/}
  driver_cuda=$(nvidia-smi 2>/dev/null)
  [[ $driver_cuda =~ CUDA\ Version:\ *([0-9]+\.[0-9]+) ]] && driver_cuda=${BASH_REMATCH[1]} || driver_cuda="?"
  gc_version driver "$drv"
  gc_version driver_cuda "$driver_cuda"
  if ! [[ $drv =~ ^([0-9]+)\. ]]; then
    gc_note "STOP: could not read the driver's version from nvidia-smi ('$drv')"
    return 3
  fi
  major=${BASH_REMATCH[1]}
  cuda=$(gc_toolkit_version)
  if [ -z "$cuda" ]; then
    gc_note "STOP: the CUDA toolkit was not found (nvcc on PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin) and no build recorded its version"
    return 3
  fi
  gc_version toolkit "$cuda"
  need=$(gc_required_driver "${cuda%%.*}")
  if [ "$major" -lt "$need" ]; then
    gc_note "STOP: the NVIDIA driver here is $drv (it runs CUDA up to $driver_cuda), but code built with the CUDA $cuda" \
      "toolkit needs driver R$need or newer. With this driver CUDA cannot run libfsdp's GPU code (cudaErrorInsufficientDriver):" \
      "every GPU test would fail. Update the driver to R$need or newer, or build with a toolkit this driver supports." \
      "Nothing else was run."
    return 3
  fi
  gc_note "driver $drv runs CUDA $cuda code (R$need or newer needed); $listed GPU(s) listed: ${smi//$'\n'/; }"
  return 0
}

# ----------------------------------------------------------------------------- the build stamp

# What the build is made from: a hash of the contents of every file CMake
# reads (tracked and untracked, not ignored; everything under those folders
# where there is no git), plus the configure arguments. The commit alone is
# not enough: the device tool copies uncommitted changes too.
gc_source_files() {
  local paths=(CMakeLists.txt CMakePresets.json cmake src kernels include tests examples benchmarks tools/fsdp-ckpt)
  if git -C "$GC_ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$GC_ROOT" ls-files -co --exclude-standard -- "${paths[@]}"
  else
    (cd "$GC_ROOT" && find "${paths[@]}" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' 2>/dev/null)
  fi
}
# gc_source_id CONFIGURE-ARGS...: the id a build stamp records.
gc_source_id() {
  local files
  files=$(gc_source_files | LC_ALL=C sort)
  {
    printf '%s\n' "$@"
    cd "$GC_ROOT" && while IFS= read -r f; do [ -f "$f" ] && printf '%s\n' "$f" && cat -- "$f"; done <<<"$files"
  } | sha256sum | cut -c1-16
}
# A readable name for the source: the commit and whether files differ from it.
gc_source_name() {
  local c
  if c=$(git -C "$GC_ROOT" rev-parse --short HEAD 2>/dev/null); then
    if [ -n "$(git -C "$GC_ROOT" status --porcelain -- . 2>/dev/null)" ]; then
      echo "$c with uncommitted changes"
    else
      echo "$c"
    fi
  else
    echo "a copy without git history"
  fi
}
gc_stamp() { echo "$GC_BUILD/gpu-check-build.stamp"; }
# The source id of the finished build in GC_BUILD, empty if none finished.
gc_current_source() {
  sed -n 's/^id=//p' "$(gc_stamp)" 2>/dev/null
}
# gc_build_is_current ID: whether GC_BUILD holds a finished build of ID.
gc_build_is_current() {
  [ -n "$1" ] && [ "$(gc_current_source)" = "$1" ]
}
gc_write_stamp() {
  printf 'id=%s\nsource=%s\nfinished=%s\n' "$1" "$(gc_source_name)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$(gc_stamp)"
  printf '%s\n' "$1" >"$(gc_rec)/source_id"
}
