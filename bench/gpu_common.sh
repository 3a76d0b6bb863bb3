# Sourced by the device calls' scripts (bench/gpu_session*.sh) after setting DEFAULT_STEPS: the carried wheels
# installed, the environment, el (seconds since the start), left (seconds left of LIMIT, default 570), want STEP
# (whether STEP is in STEPS, default DEFAULT_STEPS), and the machine's GPU and cores printed.
set -u
t0=$(date +%s)
# (once a machine: a call may chain several scripts)
[ -f /tmp/site/.beatflow-wheels ] || { bash .whl/install.sh >/dev/null 2>&1 && touch /tmp/site/.beatflow-wheels; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
el() { echo "$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${LIMIT:-570} - ($(date +%s) - t0) )); }
want() { case " ${STEPS:-$DEFAULT_STEPS} " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; echo "cores: $(nproc)"
# what the cores are (threads per core, model) and any CPU quota of this container (cgroup v2 cpu.max)
echo "cpu: $(lscpu 2>/dev/null | grep -E '^(Model name|Thread\(s\) per core|Socket\(s\))' | tr -s ' ' | paste -sd';'); \
cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none); load: $(cut -d' ' -f1-3 /proc/loadavg)"
