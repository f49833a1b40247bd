#!/bin/bash
# profagent on a real NVIDIA GPU, in three phases (README.md beside this file). Run from the
# repository root: bash tools/gpu_check/run.sh OUT_DIR. Needs python3 with CUDA torch,
# nvidia-smi and curl; profagent's own dependencies from WHEELS (a folder of wheels) when
# they are not importable. Prints the comparison (compare.py); exit status 1 on a mismatch.
set -u
OUT=${1:?usage: run.sh OUT_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d /tmp/profagent-gpu-check.XXXXXX); R=$W/out
mkdir -p $W/gt $W/gt2 $W/traces $W/traces2 $W/state $W/od $R/traces "$OUT"
if [ -d "${WHEELS:-.whl}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site "${WHEELS:-.whl}"/*.whl || exit 3
  export PYTHONPATH=$PWD/src:$W/site PATH=$W/site/bin:$PATH
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
PA="python3 -m profagent"
cat > $W/agent.toml <<T
state_dir = '$W/state'
[ondemand]
control_socket = '$W/control.sock'
trace_dir = '$W/od'
T
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch; print(torch.__version__)" >> $R/gpu.txt
scrape() {  # $1: phase; nvidia-smi and the agent's /metrics, one after the other
  echo "$(date +%s.%N) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits)" >> $R/smi_$1.txt
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | sed "s/^/$(date +%s.%N) /" >> $R/smi_apps_$1.txt
  curl -s 127.0.0.1:19400/metrics | grep -E '^profagent_(gpu_utilization_ratio|process_gpu_|gpu_memory_used_bytes)' \
    | sed "s/^/$(date +%s.%N) /" >> $R/prof_$1.txt
}
# A: utilisation on a steady load (30 s busy, 20 s idle), against nvidia-smi
GT_DIR=$W/gt BUSY_S=30 IDLE_S=20 python3 $HERE/steady.py > $R/steady.log 2>&1 &
S=$!; sleep 2
$PA attach --pid $S --listen 127.0.0.1:19400 --config $W/agent.toml --interval 1 --no-stacks > $R/agentA.log 2>&1 &
AG=$!
while kill -0 $S 2>/dev/null; do sleep 1.5; scrape A; done
sleep 2; kill $AG; wait $AG; echo "A: agent rc=$?"
# B: a DDP job: per-rank memory, its own CUDA traces, then an on-demand trace (KINETO_USE_DAEMON=1)
GT_DIR=$W/gt TRACE_DIR=$W/traces SECONDS_TO_RUN=40 KINETO_USE_DAEMON=1 \
  setsid python3 -m torch.distributed.run --nproc-per-node 2 $HERE/train_ddp_cuda.py > $R/jobB.log 2>&1 &
JOB=$!
$PA attach --pid $JOB --listen 127.0.0.1:19400 --trace-dir $W/traces --config $W/agent.toml --interval 1 > $R/agentB.log 2>&1 &
AG=$!
sleep 25; scrape B; curl -s 127.0.0.1:19400/api/findings > $R/findingsB.json
timeout 40 $PA trace --pid $JOB --duration-ms 1000 --json --config $W/agent.toml > $R/ondemandB.json 2> $R/ondemandB.err
echo "B: on-demand trace rc=$?"
scrape B; wait $JOB; echo "B: job rc=$?" | tee $R/jobB.rc; sleep 3; kill $AG; wait $AG; echo "B: agent rc=$?"
$PA analyze $W/traces --json > $R/analyzeB.json 2> $R/analyzeB.err; echo "B: analyze rc=$?"
$PA analyze $W/traces $W/od > $R/analyzeB.txt 2>&1
cp $W/traces/* $R/traces/; find $W/od -type f -exec cp {} $R/traces/ \;; rm -f $W/od/*
# C: an on-demand trace while the job's own profiler is active (steps 12-14): a rank died
# with SIGSEGV once so (README.md); the job must end well
GT_DIR=$W/gt2 TRACE_DIR=$W/traces2 SECONDS_TO_RUN=30 PROF_WAIT=10 KINETO_USE_DAEMON=1 \
  setsid python3 -m torch.distributed.run --nproc-per-node 2 $HERE/train_ddp_cuda.py > $R/jobC.log 2>&1 &
JOB=$!
$PA attach --pid $JOB --listen 127.0.0.1:19400 --trace-dir $W/traces2 --config $W/agent.toml --interval 1 --no-stacks > $R/agentC.log 2>&1 &
AG=$!
for _ in $(seq 120); do grep -qs '"step": 10,' $W/gt2/rank1.jsonl && break; sleep 0.5; done
timeout 40 $PA trace --pid $JOB --duration-ms 2000 --json --config $W/agent.toml > $R/ondemandC.json 2> $R/ondemandC.err
echo "C: on-demand trace rc=$?"
wait $JOB; echo "C: job rc=$?" | tee $R/jobC.rc; kill $AG; wait $AG
cp -r $W/gt $R/gt; cp -r $W/gt2 $R/gt2
python3 $HERE/compare.py $R | tee $R/compare.txt; rc=${PIPESTATUS[0]}
tar -C $W -czf "$OUT/result.tar.gz" out
exit $rc
