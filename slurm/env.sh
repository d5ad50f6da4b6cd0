# shellcheck shell=bash
# Sourced by every script in slurm/ (inside the batch job, before srun). Defaults only: a variable
# already set when you submit (sbatch exports your environment) wins.

# The hvrep checkout and the virtual environment `make setup` built in it. Submit from the checkout,
# or set HVREP_HOME (and HVREP_VENV for a venv elsewhere). srun passes the activated PATH to every task.
HVREP_HOME=${HVREP_HOME:-$SLURM_SUBMIT_DIR}
# shellcheck source=/dev/null
source "${HVREP_VENV:-$HVREP_HOME/.venv}/bin/activate"

# NCCL prints warnings only; INFO prints every rank's rings and transports (set it to debug a hang
# or a slow all-reduce: it says whether NVLink/P2P, shared memory, InfiniBand or sockets were chosen).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Uncomment on clusters without InfiniBand, or whose IB stack NCCL picks up but cannot use
# (a hang at the first all-reduce): NCCL then falls back to TCP sockets.
# export NCCL_IB_DISABLE=1
# Uncomment when nodes have several NICs and NCCL picks the wrong one (docker0, a management LAN):
# export NCCL_SOCKET_IFNAME=ib0
#
# Horovod's knobs are deliberately not set: hvrep fills in HOROVOD_FUSION_THRESHOLD and
# HOROVOD_CYCLE_TIME from its configuration (comm.horovod_fusion_threshold_bytes, comm.cycle_time_ms;
# None by default: Horovod's own values) only when they are unset, so an export here would silently
# win over the configuration recorded in metrics.jsonl. Change them with overrides instead:
# comm.horovod_fusion_threshold_bytes=67108864. (comm.fusion_threshold_bytes is hvrep's own bucket.)

# One OpenMP/oneDNN thread pool per rank sized to the rank's CPUs, not to the whole node (8 ranks
# each starting a pool of all the node's cores oversubscribe it).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# Slurm 22.05 stopped handing the job's --cpus-per-task to srun (srun's man page); this does.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
  export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}
fi
# TensorFlow's C++ INFO lines (oneDNN, CPU features), once per rank, drown the job's output.
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

# The output folder of a run: OUTPUT_DIR if set, else runs/<job name>-<job id> (the job id survives
# a requeue, so a requeued job finds its checkpoints). An output_dir=... among the script's
# arguments wins, as it does in `hvrep train`.
hvrep_output_dir() {
  local dir=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME:-hvrep}-${SLURM_JOB_ID:-local}} arg
  for arg in "$@"; do
    case $arg in output_dir=*) dir=${arg#output_dir=} ;; esac
  done
  printf '%s\n' "$dir"
}

# Python that reads a metrics.jsonl (argv[2]) into `events` with hvrep's own reader (read_events in
# hvrep/train/metrics.py, argv[1]): a line cut off by a crash, or any line that is not an event, is skipped with
# a warning on stderr; under `set -e` an error here would end the script before srun and its requeue. The file
# is loaded by its path: importing the hvrep package would import TensorFlow on GPU builds (seconds a call). A
# missing file holds no events.
_HVREP_EVENTS='import importlib.util, sys
spec = importlib.util.spec_from_file_location("hvrep_metrics", sys.argv[1])
metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(metrics)
try:
    events = metrics.read_events(sys.argv[2])
except OSError:
    events = []
'

# The runs of hvrep train a metrics.jsonl holds: each start appends one run, which begins with its
# `config` event (rank 0 writes it once the configuration is read). 0 when the file is missing.
hvrep_runs() {
  python -c "${_HVREP_EVENTS}
print(sum(e['event'] == 'config' for e in events))" "$HVREP_HOME/hvrep/train/metrics.py" "$1"
}

# The events of the run that came after the first N runs of a metrics.jsonl ([] when it never began), in Python.
_HVREP_RUN="${_HVREP_EVENTS}
starts = [i for i, e in enumerate(events) if e['event'] == 'config']
before = int(sys.argv[3])
run = events[starts[before]:starts[before + 1] if len(starts) > before + 1 else None] if len(starts) > before else []
"

# How the run that came after the first N runs of a metrics.jsonl ended: its `final` event's
# `stopped`, or nothing when it wrote no `final` event (it crashed) or never began (no `config` event
# after the N: a start that died before hvrep read its configuration). Count the runs before a start
# (hvrep_runs) and ask about that start: the file's last run may be an earlier start's.
hvrep_run_stopped() {
  python -c "${_HVREP_RUN}
print(next((e.get('stopped', '') for e in reversed(run) if e['event'] == 'final'), ''))" \
    "$HVREP_HOME/hvrep/train/metrics.py" "$1" "$2"
}

# The step the run after the first N runs of a metrics.jsonl got to: the `step` of its last event that has one
# (its `final` event's, or the last `train` line before a crash); nothing when it recorded none.
hvrep_run_step() {
  python -c "${_HVREP_RUN}
print(next((e['step'] for e in reversed(run) if isinstance(e.get('step'), int)), ''))" \
    "$HVREP_HOME/hvrep/train/metrics.py" "$1" "$2"
}

# Whether a start's failure (a text naming its exit code and step) is the one the previous start of the job ended
# with: prints "repeated" then, else nothing; either way records it in DIR for the next start. A requeue that
# fails the same way twice in a row is deterministic, not transient (a hang at the same step), and would fail so
# up to MAX_REQUEUES times. hvrep_forget_failure DIR: a start that did not fail.
HVREP_FAILURE_FILE=.preemptible-last-failure
hvrep_repeated_failure() {
  local previous=""
  mkdir -p "$1"
  [[ -f $1/$HVREP_FAILURE_FILE ]] && previous=$(<"$1/$HVREP_FAILURE_FILE")
  printf '%s\n' "$2" >"$1/$HVREP_FAILURE_FILE"
  if [[ $previous == "$2" ]]; then echo repeated; fi
}
hvrep_forget_failure() {
  rm -f "$1/$HVREP_FAILURE_FILE"
}

# srun "$@", started again when a rank crashed inside MPI_Init, at most MPI_INIT_RETRIES times (default 2).
# Open MPI 5.0 under srun --mpi=pmix crashes one rank there in a few percent of starts, at random: a start-up
# race (docs/slurm-multi-node.md, "MPI_Init crash under srun"). Such a start has done nothing yet (MPI starts
# before hvrep reads a checkpoint or writes an event), so it is started again in the same allocation, on the same
# nodes. What tells it: srun failed, and its output has a segmentation fault and an MPI_Init frame in the stack
# Open MPI prints. Any other failure returns srun's exit code at once. srun's stdout goes to this function's
# stdout, its stderr to this function's stderr and, when HVREP_SRUN_ERRS names a file, to that file as well
# (the last start's).
hvrep_srun() {
  local errs=${HVREP_SRUN_ERRS:-} own="" status attempt=0 retries=${MPI_INIT_RETRIES:-2} errexit=""
  [[ $- == *e* ]] && errexit=1
  if [[ -z $errs ]]; then
    errs=$(mktemp "${TMPDIR:-/tmp}/hvrep-srun-stderr.XXXXXX")
    own=1
  fi
  while true; do
    : >"$errs"
    set +e
    { srun "$@" 2>&1 1>&3 3>&- | tee -a "$errs" 1>&2 3>&-; } 3>&1
    status=${PIPESTATUS[0]}
    [[ -n $errexit ]] && set -e
    if [[ $status -eq 0 ]] || ((attempt >= retries)) || ! hvrep_mpi_init_crashed "$errs"; then
      break
    fi
    attempt=$((attempt + 1))
    echo "hvrep: a rank crashed inside MPI_Init (srun exited ${status}; Open MPI's start-up race under srun, see docs/slurm-multi-node.md); nothing ran yet, starting the ranks again (${attempt} of ${retries}, MPI_INIT_RETRIES)" >&2
  done
  [[ -n $own ]] && rm -f "$errs"
  return "$status"
}

# Whether srun's output (FILE) shows a rank that crashed inside MPI_Init: Open MPI's report of a segmentation
# fault with an MPI_Init frame in its stack ("libmpi.so.40(PMPI_Init_thread+0xbf)"; MPI_Init_thread itself
# where a library stands in front of it). A message that merely names MPI_Init is not a stack frame.
hvrep_mpi_init_crashed() {
  grep -q "Segmentation fault" "$1" && grep -qE '[(]P?MPI_Init(_thread)?[+]0x' "$1"
}
