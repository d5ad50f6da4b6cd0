#!/bin/bash
# A survivor stuck after a kill, reproduced without the namespace bed (root not needed), see worker.py:
#   benchmarks/gloo_stuck/run.sh N OUTDIR
# N launches without and N with the shutdown of the old world's connections (FIX=0, FIX=1), alternating. Each:
# horovodrun --gloo -np 3 --min-np 2 --max-np 3 on the host names localhost, 127.0.0.1 and this machine's first
# address (all local to horovodrun), HOROVOD_GLOO_TIMEOUT_SECONDS=${GT:-30}. One line per launch: the seconds
# from the kill to the last survivor's first step in the 2-worker world (a stuck survivor: about GT).
set -u
N=$1; OUT=$(realpath -m $2); HERE=$(cd $(dirname $0) && pwd); ROOT=$(cd $HERE/../.. && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
mkdir -p $OUT
printf 'localhost:1\n127.0.0.1:1\n%s:1\n' "$(hostname -I | awk '{print $1}')" > $OUT/hosts
printf '#!/bin/sh\ncat %s/hosts\n' "$OUT" > $OUT/discover.sh; chmod +x $OUT/discover.sh
for i in $(seq 1 $N); do for fix in 0 1; do
  o=$OUT/fix$fix.$i; rm -rf $o; mkdir -p $o
  FIX=$fix PYTHONPATH=$ROOT HOROVOD_GLOO_TIMEOUT_SECONDS=${GT:-30} timeout 300 $PY $(dirname $PY)/horovodrun --gloo \
    -np 3 --min-np 2 --max-np 3 --host-discovery-script $OUT/discover.sh --network-interface lo \
    $PY $HERE/worker.py $o > $o/job.log 2>&1
  $PY - $o $fix <<'P'
import glob, json, sys
rs = [json.loads(line) for f in glob.glob(sys.argv[1] + "/*.jsonl") for line in open(f)]
kill = [r["t"] for r in rs if r["event"] == "kill"]
back = [r["t"] for r in rs if r["event"] == "step" and r.get("size") == 2]
print(json.dumps({"fix": int(sys.argv[2]), "launch": sys.argv[1],
                  "resume_s": round(max(back) - kill[0], 2) if kill and len(back) == 2 else None}), flush=True)
P
done; done
