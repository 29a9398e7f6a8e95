#!/usr/bin/env bash
# A real SLURM cluster on this machine, to try the SLURM path (train_slurm.sh, reproduce.sh --slurm,
# preprocessing with --slurm-partition) and to test it (`make test-cluster`):
#   scripts/local_slurm.sh start [NODES]   # munge + slurmctld + NODES slurmd (default 2), one partition
#   eval "$(scripts/local_slurm.sh env)"   # SLURM_CONF for sbatch, squeue, scontrol... in this shell
#   scripts/local_slurm.sh stop            # stops exactly the daemons `start` started (their pid files)
# Needs root; installs Debian's slurm-wlm and munge with apt-get when missing. Everything it writes
# (config, munge key and socket, state, logs, pid files) lives in $SLURM_DIR (default
# /tmp/xlm-pkm-slurm): /etc/slurm is not touched; node names n1..nN are added to /etc/hosts.
# Nodes: NodeAddr 127.0.0.1, ports 17001.., no cgroups (proctrack/linuxproc, task/none), CPUS_PER_NODE
# CPUs each (default: this machine's), partition `debug`; cred_expire=10 restarts a requeued job
# within seconds; KillWait 10 s between SIGTERM and SIGKILL.
set -euo pipefail
dir=${SLURM_DIR:-/tmp/xlm-pkm-slurm}
conf=$dir/slurm.conf
ctld_port=${SLURM_PORT:-17000}

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

# daemon_pid PIDFILE: the pid it names if that process is still the daemon it was (munged, slurmctld,
# slurmd: its name starts the pid file's), else nothing (a stale file; the pid may be another's now).
daemon_pid() {
  local pid name
  pid=$(cat "$1" 2>/dev/null) || return 0
  name=$(basename "$1"); name=${name%%.*}
  [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$name" ] && echo "$pid"
  return 0
}

install_slurm() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null && return
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed, and installing them needs root"
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed, and there is no apt-get"
  echo "installing slurm-wlm and munge (apt-get)..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
    || die "apt-get install slurm-wlm munge failed"
}

write_config() {
  local nodes=$1 cpus=${CPUS_PER_NODE:-$(nproc)} last=$((ctld_port + $1))
  cat >"$conf" <<EOF
ClusterName=xlmpkm
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$((ctld_port + 1))
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/pids/slurmctld.pid
SlurmdPidFile=$dir/pids/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
SlurmdTimeout=30
KillWait=10
MinJobAge=600
NodeName=n[1-$nodes] NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=[$((ctld_port + 1))-$last] CPUs=$cpus RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  local nodes=${1:-2}
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive number, got '$nodes'"
  install_slurm
  [ "$(id -u)" = 0 ] || die "starting slurmd needs root"
  local pidfile
  for pidfile in "$dir"/pids/*.pid; do
    [ -e "$pidfile" ] || continue
    [ -n "$(daemon_pid "$pidfile")" ] && die "a cluster of $dir runs already ($pidfile); run '$0 stop' first"
    rm -f "$pidfile"  # left by a cluster that did not stop cleanly
  done
  rm -rf "$dir/state" "$dir/spool"
  mkdir -p "$dir"/{munge,state,pids,log} && chmod 700 "$dir" "$dir/munge"
  for i in $(seq 1 "$nodes"); do
    mkdir -p "$dir/spool/n$i"
    grep -qE "^127\.0\.0\.1([[:space:]].*)?[[:space:]]n$i([[:space:]]|\$)" /etc/hosts || echo "127.0.0.1 n$i" >>/etc/hosts
  done
  write_config "$nodes"
  [ -s "$dir/munge/munge.key" ] || mungekey -c -k "$dir/munge/munge.key" >/dev/null
  chmod 400 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/pids/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  slurmctld -f "$conf"
  for i in $(seq 1 "$nodes"); do
    slurmd -f "$conf" -N "n$i"
  done
  export SLURM_CONF=$conf
  for _ in $(seq 60); do  # every node registered and idle
    [ "$(sinfo -h -t idle -o %D 2>/dev/null | awk '{s += $1} END {print s + 0}')" = "$nodes" ] && {
      echo "SLURM cluster up: $nodes node(s), partition debug; export SLURM_CONF=$conf"; return; }
    sleep 1
  done
  sinfo >&2 || true
  die "the nodes did not come up within 60 s; see $dir/log"
}

stop() {
  local pidfile pid jobs
  if [ -n "$(daemon_pid "$dir/pids/slurmctld.pid")" ] && jobs=$(SLURM_CONF=$conf squeue -h -o %A 2>/dev/null) \
      && [ -n "$jobs" ]; then
    SLURM_CONF=$conf scancel $jobs 2>/dev/null || true  # their processes end with them, not orphaned
    for _ in $(seq 30); do [ -z "$(SLURM_CONF=$conf squeue -h -o %A 2>/dev/null)" ] && break; sleep 1; done
  fi
  for pidfile in "$dir"/pids/slurmd.*.pid "$dir/pids/slurmctld.pid" "$dir/pids/munged.pid"; do
    [ -e "$pidfile" ] || continue
    pid=$(daemon_pid "$pidfile")
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  done
  echo "SLURM cluster of $dir stopped"
}

case ${1:-} in
  start) start "${2:-2}" ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$conf" ;;
  *) die "usage: $0 start [NODES] | stop | env" ;;
esac
