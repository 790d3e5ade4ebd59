#!/usr/bin/env bash
# The GPU check (issue 38): one command, under 5 minutes, for anyone with a GPU machine (it runs on CPUs too).
#
#   benchmarks/gpu_check.sh [FOLDER] [doctor options...]     e.g.  benchmarks/gpu_check.sh gpu-check
#
# From the repository root, with parlab importable (pip install -e . or PYTHONPATH=.); PYTHON picks the
# interpreter (default: python3). Everything goes into FOLDER (default: gpu-check-<date>-<host>):
#   doctor.txt     `python -m parlab doctor`'s tables: the machine, a launch's phases (cold, warm, NCCL, spares)
#                  and the issue's launch goals, every scheme with its twin at the largest world the machine allows
#   doctor.json    the same, one JSON object
#   startup.txt    seconds of `import torch`, of `import torch._dynamo` after it (the rank server imports both), and
#                  of one whole command-line run (`python -m parlab run tp --world 1 --no-twin --json`), beside the
#                  goal "a CLI run under 2 x (import torch + the run itself)"
#   log.txt        what the commands wrote to stderr, nvidia-smi, the versions
# Doctor options (--quick, --only SCHEME...) are passed on. The exit status is the doctor's (0: every scheme passed).
# Put doctor.txt's tables into the README's "What runs where", with the date and the machine.

set -uo pipefail
PYTHON=${PYTHON:-python3}
out=gpu-check-$(date +%Y%m%d-%H%M)-$(hostname -s)
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then  # a first argument that is no option: the folder
    out=$1
    shift
fi
mkdir -p "$out"
log="$out/log.txt"
: >"$log"

say() { echo "$*" | tee -a "$log"; }

say "parlab GPU check, $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname), into $out/"
{
    echo "--- nvidia-smi"
    nvidia-smi 2>&1 || echo "(no nvidia-smi: no NVIDIA GPU or driver here)"
    echo "--- versions"
    "$PYTHON" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} >>"$log" 2>&1

# 1. The doctor (at most 4 minutes: the whole check stays under 5).
say "doctor $* ..."
timeout 240 "$PYTHON" -m parlab doctor --json-file "$out/doctor.json" "$@" >"$out/doctor.txt" 2>>"$log"
status=$?
if [ $status -eq 124 ]; then
    say "doctor: stopped after 240 s (see $log); try: benchmarks/gpu_check.sh $out --quick"
fi
cat "$out/doctor.txt"

# 2. Start-up: what a command-line run pays before and around its ranks (the doctor timed the launch itself).
say "start-up timings ..."
"$PYTHON" - "$out/startup.txt" >>"$log" 2>&1 <<'EOF'
import json, subprocess, sys, time

def run(*argv, timeout=180):
    """(wall seconds, the finished process) of a fresh `python ARGV`."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - began, done

def last_number(done):
    return float(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else float("nan")

torch_s, _ = run("-c", "import torch")
_, dynamo = run("-c", "import time, torch; t = time.perf_counter(); import torch._dynamo; print(time.perf_counter() - t)")
cli_s, cli = run("-m", "parlab", "run", "tp", "--world", "1", "--no-twin", "--json")
passed = cli.returncode == 0 and json.loads(cli.stdout.strip().splitlines()[-1])["passed"]
# "The run itself": the same run again in a process that has imported torch, with its rank server up.
warm = "import time, parlab; from parlab.runs.registry import launch_scheme as run\n"
warm += "parlab.warm_up(wait=True); run('tp', world_size=1)\n"
warm += "t = time.perf_counter(); run('tp', world_size=1); print(time.perf_counter() - t)"
run_s = last_number(run("-c", warm)[1])
goal = 2 * (torch_s + run_s)
lines = [
    f"import torch:                                   {torch_s:6.2f} s",
    f"import torch._dynamo after torch:               {last_number(dynamo):6.2f} s",
    f"python -m parlab run tp --world 1 --no-twin:    {cli_s:6.2f} s ({'PASS' if passed else 'FAIL'})",
    f"the same run, warm (torch imported, server up): {run_s:6.2f} s",
    f"goal: the CLI run under 2 x (import torch + the run) = {goal:.2f} s: {'met' if cli_s < goal else 'NOT met'}",
]
if not passed:
    lines.append("the CLI run failed: " + cli.stderr.strip()[-2000:])
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
cat "$out/startup.txt" 2>/dev/null || say "start-up timings failed: see $log"

say "GPU check written to $out/ (doctor exit status $status)"
exit $status
