#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU: the CUDA tests, the CPU suite, `lightning-dos calibrate` and
# the benchmark presets that fit one GPU (1b, 3b); every table is appended, dated, to bench/RESULTS.md.
# Steps can run one at a time (a GPU lease may limit one command to 10 minutes):
#   bash scripts/gpu-check.sh                 # all steps (about 20 minutes on one H100 with 16 cores)
#   bash scripts/gpu-check.sh tests calibrate # or any of: tests, calibrate, bench-1b, bench-3b
# Python: .venv/bin/python if there is one, else $PYTHON or python3. On a bare GPU machine that reaches no
# registry, ship the missing wheels first (`bash scripts/gpu-wheels.sh` here, then send .whl along): they are
# installed into /tmp/site. With no GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ -d .whl ] && ! $py -c "import deepspeed" 2>/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
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

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests calibrate bench-1b bench-3b)
stamp=$(date -u +%Y-%m-%dT%H:%MZ)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
out=bench/out/gpu-check-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$out"
status=0
section() {  # title, file: append a dated section to bench/RESULTS.md
  { printf '\n## GPU check: %s (%s, %s)\n\n```\n' "$1" "${gpu:-CUDA GPU}" "$stamp"; cat "$2"; printf '```\n'; } \
    >> bench/RESULTS.md
}
for step in "${steps[@]}"; do
  echo "== gpu-check: $step"
  case $step in
    tests)
      $py -m pytest -q -p no:cacheprovider --accelerator cuda tests/test_gpu.py 2>&1 | tee "$out/cuda-tests.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      $py -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/cpu-tests.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      tail -n 3 "$out/cuda-tests.txt" > "$out/tests-summary.txt"
      tail -n 3 "$out/cpu-tests.txt" >> "$out/tests-summary.txt"
      section "tests (CUDA pass, then CPU pass)" "$out/tests-summary.txt" ;;
    calibrate)
      $py -m lightning_dos calibrate --out "$out/profile.yaml" 2>&1 | tee "$out/calibrate.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      section "lightning-dos calibrate" "$out/calibrate.txt" ;;
    bench-1b|bench-3b)
      preset=${step#bench-}
      DS_ACCELERATOR=cuda $py bench/run.py --preset "$preset" --out "$out/$preset.json" 2>&1 | tee "$out/$step.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      grep -E '^(#|\|)' "$out/$step.txt" > "$out/$step-table.txt"
      section "bench/run.py --preset $preset" "$out/$step-table.txt" ;;
    *)
      echo "gpu-check: unknown step '$step'; use tests, calibrate, bench-1b or bench-3b" >&2
      exit 2 ;;
  esac
done
echo "gpu-check: tables appended to bench/RESULTS.md; logs in $out"
exit $status
