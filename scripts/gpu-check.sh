#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU, in steps that each finish inside 10 minutes on one H100 with
# 16 cores (a GPU lease may limit one command to that); every table is appended, dated, to bench/RESULTS.md.
#   bash scripts/gpu-check.sh                      # every step, in order
#   bash scripts/gpu-check.sh cuda-tests memory    # or any of the steps below, by name
#   bash scripts/gpu-check.sh capture --out DIR    # the capture, into DIR (options below)
#   bash scripts/gpu-check.sh capture --out DIR --accelerator cpu   # the same on CPU (tiny preset; CI runs it)
# Steps:
#   capture      the performance model's capture, first (meant to end within 8 minutes on an H100/H200 with 16
#                cores: each bench run has 200 s; not yet timed on one): the machine (GPU, PCIe link, lscpu, NUMA,
#                memlock limit) in env.txt, lightning-dos calibrate (with its contention measurements) in
#                profile.json, bench/run.py for stock, auto, auto@off and auto@forward with clipping off and at
#                --clip, one JSON line per step of each in steps.jsonl (bench/steps.py), a trace of two steady steps
#                of each under traces/, each run's log, and bench/fit.py's table of measured beside predicted in
#                fit.txt (appended to bench/RESULTS.md). Commit DIR under bench/captures/<date>-<gpu>/. Options:
#                --out DIR     the capture's folder (default $OUT/capture, else under the logs folder; given, the
#                              other steps' logs go there too)
#                --accelerator cuda|cpu  cpu: run without a GPU (tiny preset, 2+3 steps, 32-bit; CI runs it),
#                              appending nothing to bench/RESULTS.md
#                --preset P, --warmup W, --steps N  on a GPU 1b, 3 and 6
#                --clip C      the clipped runs' threshold; default auto: 1.25x the largest gradient norm of the
#                              steady steps run without clipping, which the clipped run's steps then mostly stay
#                              under, as training's do past its warm-up (1.0 if none was recorded)
#   cuda-tests   the CUDA pass (tests/test_gpu.py), the delayed-stream test under TORCH_CUDA_SANITIZER=1 included,
#                the mutation test left to the next three steps (on an H200: 101 s for the other tests, more than
#                150 s for the sanitizer's)
#   mutations-1, mutations-2, mutations-3  the mutation test of tests/test_gpu.py in three parts (each removal of a
#                synchronisation must make a delayed-stream run differ; 15 to 120 s each on an H200), one line
#                per removal as it is caught or missed
#   cpu-tests-1  the CPU pass, Trainer-heavy files (equivalence, behaviour, atomic training, stream sanitizer)
#   cpu-tests-2  the CPU pass, the other Trainer files (monitor, reliability, CLI, evaluation, recipes, ...)
#   cpu-tests-3  the CPU pass, every other test file (units, kernels, planner, simulate, ...)
#   calibrate    lightning-dos calibrate on this GPU
#   bench-1b     bench/run.py --preset 1b (stock offload against ours: update time, peak GPU memory)
#   bench-3b     bench/run.py --preset 3b
#   memory       bench/memory.py: host and pinned bytes per parameter against stock offload (device bytes
#                against stock offload are bench-1b/3b's peak-GPU column)
#   startup-memory  bench/memory.py --accelerator cuda: on the GPU, start-up's host peak (registration faults in
#                the slabs' pages) beside the pre-flight figure, ours and stock; fails above 1.1x the figure
#   threads      tests/jobs/gpu_threads.py: the update's thread selects the engine's GPU before any stream operation
#                (no CUDA context on a GPU the process does not use; with one GPU only the call is checked), and
#                overlap="auto" plans in the memory free at the step, not what backward's activations leave
#   forward-peak bench/forward_peak.py: the next forward's peak GPU memory with overlap="forward" and "auto"
#                against overlap="off" (a small LM, a few steps, default settings); fails if above off's
#   peers        bench/run.py --preset 1b --exactness --isolate: stock offload, TwinFlow, ours (auto), SuperOffload,
#                ZenFlow and FSDP's CPU offload, each in a process of its own, clip off then clip 1.0 (each under
#                4 minutes: 1+3 measured steps and the two of the injected non-finite batch); raw JSON, tables and
#                each system's log in $OUT/peers (the run tool's folder, else the logs folder) for bench/captures/
# Python: .venv/bin/python if there is one, else $PYTHON or python3: on the GPU machine its own torch (a CUDA
# torch wheel cannot be carried there), under which tests that pin this project's torch internals skip by name
# (tests/conftest.py, PINNED_TORCH_TESTS). On a bare GPU machine that reaches no registry, ship the missing
# wheels first (`bash scripts/gpu-wheels.sh` here, then send .whl along): they are installed into /tmp/site.
# With no GPU it says so and exits 0 (the capture with --accelerator cpu runs on the CPU instead).
set -uo pipefail
cd "$(dirname "$0")/.."
# Options (the capture's) anywhere among the step names.
capture_out='' accelerator=cuda preset='' warmup='' measured='' clip=auto
names=()
while [ $# -gt 0 ]; do
  case $1 in
    --out|--accelerator|--preset|--warmup|--steps|--clip)
      [ $# -ge 2 ] || { echo "gpu-check: $1 takes a value" >&2; exit 2; }
      case $1 in
        --out) capture_out=$2 ;; --accelerator) accelerator=$2 ;; --preset) preset=$2 ;;
        --warmup) warmup=$2 ;; --steps) measured=$2 ;; --clip) clip=$2 ;;
      esac
      shift 2 ;;
    -*) echo "gpu-check: unknown option '$1'; the capture takes --out, --accelerator, --preset, --warmup, --steps," \
          "--clip" >&2
        exit 2 ;;
    *) names+=("$1"); shift ;;
  esac
done
case $accelerator in
  cuda) ;;
  cpu)
    [ ${#names[@]} -eq 0 ] && names=(capture)
    for name in "${names[@]}"; do
      [ "$name" = capture ] && continue
      echo "gpu-check: with --accelerator cpu only the capture runs, not '$name'" >&2
      exit 2
    done ;;
  *) echo "gpu-check: --accelerator takes cuda or cpu, got '$accelerator'" >&2; exit 2 ;;
esac
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ -d .whl ] && ! $py -c "import deepspeed" 2>/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# libaio for the NVMe tier's CUDA test (DeepSpeed's async I/O op): a bare GPU machine lacks it and reaches no
# package registry; scripts/gpu-wheels.sh ships the .deb files, unpacked here (as root) when the header is missing.
if [ ! -f /usr/include/libaio.h ] && compgen -G ".whl/*.deb" >/dev/null && [ "$(id -u)" = 0 ]; then
  for deb in .whl/*.deb; do dpkg -x "$deb" /; done
  ldconfig
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A step cut off by a lease's deadline keeps what it printed: output unbuffered, each test's outcome as it ends,
# each failure's report at once (tests/conftest.py).
export PYTHONUNBUFFERED=1 DOS_TEST_FAILURES_AT_ONCE=1
if [ "$accelerator" = cuda ] &&
   ! $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA GPU visible to $py (or no torch); nothing to check here. Run it on a GPU machine."
  exit 0
fi
missing=$($py -c "
import importlib.util as u
print(' '.join(m for m in ('deepspeed', 'pytest', 'hypothesis', 'jsonargparse', 'yaml') if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "gpu-check: missing Python packages: $missing (ship them: bash scripts/gpu-wheels.sh, then send .whl along)" >&2
  exit 2
fi

all_steps=(capture cuda-tests mutations-1 mutations-2 mutations-3 cpu-tests-1 cpu-tests-2 cpu-tests-3 calibrate bench-1b
           bench-3b memory startup-memory threads forward-peak peers)
# The CPU pass in three parts of a few minutes each on 16 cores; part 3 is every file not named in 1 or 2.
cpu_part1=(test_equivalence test_engine_behaviour test_atomic_training test_stream_sanitizer)
cpu_part2=(test_monitor test_reliability test_cli test_evaluation test_recipes test_device_memory test_resources
           test_strategy_config test_atomic_engine)
cpu_files() {  # part number -> its test files
  local part=$1 f name
  case $part in
    1) for name in "${cpu_part1[@]}"; do echo "tests/$name.py"; done ;;
    2) for name in "${cpu_part2[@]}"; do echo "tests/$name.py"; done ;;
    3) for f in tests/test_*.py; do
         name=$(basename "$f" .py)
         [[ $name == test_gpu || " ${cpu_part1[*]} ${cpu_part2[*]} " == *" $name "* ]] || echo "$f"
       done ;;
  esac
}

steps=(${names[@]+"${names[@]}"})
[ ${#steps[@]} -eq 0 ] && steps=("${all_steps[@]}")
for step in "${steps[@]}"; do
  [[ " ${all_steps[*]} " == *" $step "* ]] || {
    echo "gpu-check: unknown step '$step'; use any of: ${all_steps[*]}" >&2
    exit 2
  }
done
#: The peers step's systems: stock, TwinFlow's best ratio on the CPU bench (0.3), ours, then the peers.
peer_systems=stock,twinflow:0.3,auto,superoffload:0.9,zenflow:0.1:4,fsdp-offload
stamp=$(date -u +%Y-%m-%dT%H:%MZ)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
torch_version=$($py -c "import torch; print(torch.__version__)")
out=${capture_out:-bench/out/gpu-check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$out"
status=0
section() {  # title, file: append a dated section to bench/RESULTS.md
  { printf '\n## GPU check: %s (%s, torch %s, %s)\n\n```\n' "$1" "${gpu:-CUDA GPU}" "$torch_version" "$stamp"
    cat "$2"; printf '```\n'; } >> bench/RESULTS.md
}
run_logged() {  # log file, command...: run it, tee its output, remember a failure
  local log=$1
  shift
  "$@" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
environment() {  # the machine a capture ran on: GPU and its PCIe link, CPUs, NUMA nodes, memory, memlock limit
  echo "# $stamp, commit $(git rev-parse --short HEAD 2>/dev/null) ($(git status --porcelain 2>/dev/null | wc -l)" \
    "file(s) changed), $($py --version 2>&1), torch $torch_version, deepspeed" \
    "$($py -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null)"
  uname -a
  if command -v nvidia-smi >/dev/null; then
    echo "## nvidia-smi"
    nvidia-smi
    nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,\
pcie.link.width.current,pcie.link.width.max,clocks.max.sm
    echo "## PCIe link (nvidia-smi -q)"
    nvidia-smi -q | sed -n '/GPU Link Info/,/Bridge Chip/p'
    nvidia-smi topo -m
  fi
  if command -v lspci >/dev/null; then
    echo "## lspci (NVIDIA devices' links)"
    lspci -vv -d 10de: 2>/dev/null | grep -E '^[0-9a-f]|LnkCap:|LnkSta:'
  fi
  echo "## lscpu"
  lscpu
  if command -v numactl >/dev/null; then
    echo "## numactl -H"
    numactl -H
  fi
  echo "## memory"
  head -n 3 /proc/meminfo
  echo "## memlock limit (ulimit -l)"
  ulimit -l
  echo "## CPUs this process may run on: $(nproc)"
}
for step in "${steps[@]}"; do
  echo "== gpu-check: $step"
  case $step in
    capture)
      # Everything into one folder, so that a machine lent for minutes hands it back as files; each bench run under a
      # deadline, so that what it wrote (its systems' lines, appended as each ends) and the fit survive a slow one.
      cap=${capture_out:-${OUT:-$out}/capture}
      mkdir -p "$cap"
      if [ "$accelerator" = cpu ]; then
        bench_args=(--preset "${preset:-tiny}" --warmup "${warmup:-2}" --steps "${measured:-3}" --precision 32-true
                    --max-bytes 100000)
        deadline=300
      else
        bench_args=(--preset "${preset:-1b}" --warmup "${warmup:-3}" --steps "${measured:-6}")
        deadline=200
      fi
      environment > "$cap/env.txt" 2>&1
      run_logged "$cap/calibrate.log" env DS_ACCELERATOR="$accelerator" $py -m lightning_dos calibrate \
        --device "$accelerator" --out "$cap/profile.json"
      for clip_value in off "$clip"; do
        if [ "$clip_value" = auto ]; then
          clip_value=$($py bench/fit.py "$cap" --clip-under) || clip_value=1.0
          echo "gpu-check: the capture clips at $clip_value"
        fi
        clip_arg=()
        [ "$clip_value" = off ] || clip_arg=(--clip "$clip_value")
        run_logged "$cap/bench-clip-$clip_value.log" env DS_ACCELERATOR="$accelerator" timeout "$deadline" \
          $py bench/run.py --accelerator "$accelerator" "${bench_args[@]}" "${clip_arg[@]}" \
          --systems stock,auto,auto@off,auto@forward --steps-jsonl "$cap/steps.jsonl" --trace-dir "$cap/traces" \
          --out "$cap/bench-clip-$clip_value.json"
        rmdir "$cap/bench-clip-$clip_value-systems" 2>/dev/null  # the isolated systems' logs: none here
      done
      run_logged "$cap/fit.txt" $py bench/fit.py "$cap"
      [ "$accelerator" = cpu ] || section "capture (bench/fit.py $cap)" "$cap/fit.txt" ;;
    cuda-tests)
      run_logged "$out/cuda-tests.txt" $py -m pytest -v --tb=short -rs -p no:cacheprovider --accelerator cuda \
        tests/test_gpu.py -k "not removing_any"
      tail -n 3 "$out/cuda-tests.txt" > "$out/cuda-tests-summary.txt"
      section "CUDA tests (tests/test_gpu.py)" "$out/cuda-tests-summary.txt" ;;
    mutations-[123])
      part=${step#mutations-}
      run_logged "$out/$step.txt" env DS_ACCELERATOR=cuda $py -m tests.delayed_streams --mutate all --part "$part/3"
      grep -E 'caught|MISSED|mutations:' "$out/$step.txt" > "$out/$step-summary.txt"
      section "each synchronisation removed, part $part of 3 (python -m tests.delayed_streams --mutate all)" \
        "$out/$step-summary.txt" ;;
    cpu-tests-[123])
      part=${step#cpu-tests-}
      mapfile -t files < <(cpu_files "$part")
      run_logged "$out/$step.txt" $py -m pytest -v --tb=short -rs -p no:cacheprovider "${files[@]}"
      { grep -E '^SKIPPED' "$out/$step.txt" | cut -c1-200; tail -n 1 "$out/$step.txt"; } > "$out/$step-summary.txt"
      section "CPU tests, part $part of 3" "$out/$step-summary.txt" ;;
    calibrate)
      run_logged "$out/calibrate.txt" $py -m lightning_dos calibrate --out "$out/profile.yaml"
      section "lightning-dos calibrate" "$out/calibrate.txt" ;;
    bench-1b|bench-3b)
      preset=${step#bench-}
      run_logged "$out/$step.txt" env DS_ACCELERATOR=cuda $py bench/run.py --preset "$preset" --out "$out/$preset.json"
      grep -E '^(#|\|)' "$out/$step.txt" > "$out/$step-table.txt"
      section "bench/run.py --preset $preset" "$out/$step-table.txt" ;;
    memory)
      run_logged "$out/memory.txt" $py bench/memory.py
      grep -E '^(#|\||pre-flight)' "$out/memory.txt" > "$out/memory-table.txt"
      section "bench/memory.py" "$out/memory-table.txt" ;;
    startup-memory)
      run_logged "$out/startup-memory.txt" env DS_ACCELERATOR=cuda $py bench/memory.py --accelerator cuda --repeats 1 \
        --max-startup-ratio 1.1
      grep -E '^(#|\||start-up)' "$out/startup-memory.txt" > "$out/startup-memory-table.txt"
      section "bench/memory.py --accelerator cuda (start-up host peak against the pre-flight figure)" \
        "$out/startup-memory-table.txt" ;;
    threads)
      for part in binding budget; do
        run_logged "$out/threads-$part.txt" env DS_ACCELERATOR=cuda timeout 280 $py tests/jobs/gpu_threads.py "$part"
      done
      grep -hvE '^(\[|INFO|WARNING|Seed set)' "$out/threads-binding.txt" "$out/threads-budget.txt" > "$out/threads-summary.txt"
      section "update thread's device and auto's plan budget (tests/jobs/gpu_threads.py)" "$out/threads-summary.txt" ;;
    forward-peak)
      run_logged "$out/forward-peak.txt" env DS_ACCELERATOR=cuda $py bench/forward_peak.py
      grep -E '^(#|\|)' "$out/forward-peak.txt" > "$out/forward-peak-table.txt"
      section "bench/forward_peak.py (forward peak with overlap against off)" "$out/forward-peak-table.txt" ;;
    peers)
      # The systems a user could switch on instead (bench/peers.py); a system that cannot run is a row saying why.
      cap=${OUT:-$out}/peers
      mkdir -p "$cap"
      for clip in off 1.0; do
        clip_arg=()
        [ "$clip" = off ] || clip_arg=(--clip "$clip")
        run_logged "$cap/peers-clip-$clip.txt" env DS_ACCELERATOR=cuda timeout 235 $py bench/run.py --preset 1b \
          --warmup 1 --steps 3 --exactness --isolate --system-timeout 100 "${clip_arg[@]}" \
          --systems "$peer_systems" --out "$cap/peers-clip-$clip.json"
        grep -E '^(#|\||After|Fastest|Best|Last)' "$cap/peers-clip-$clip.txt" > "$cap/peers-clip-$clip-table.txt"
        section "peers, clip $clip (bench/run.py --preset 1b --exactness --isolate)" "$cap/peers-clip-$clip-table.txt"
      done ;;
  esac
done
if [ "$accelerator" = cpu ]; then
  echo "gpu-check: the capture on CPU in $out (nothing appended to bench/RESULTS.md)"
else
  echo "gpu-check: tables appended to bench/RESULTS.md; logs in $out"
fi
exit $status
