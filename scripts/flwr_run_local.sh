#!/usr/bin/env bash
# Run the fedhier Flower app with `flwr run .` on a local Simulation Engine, then stop the
# detached SuperLink that `flwr run` leaves behind (by its pid, found via our FLWR_HOME).
#
#   scripts/flwr_run_local.sh NUM_SUPERNODES "key=value key=value ..."
# e.g. scripts/flwr_run_local.sh 20 "rounds=5 out='runs/flwr-demo'"
# `clients` is set to NUM_SUPERNODES. FLWR_HOME defaults to a fresh folder under /tmp;
# FEDHIER_VENV (default: the repo's .venv) is the venv whose flwr runs. The local SuperLink
# gets free ports of its own (FLWR_LOCAL_SUPERLINK_HTTP_API_PORT, FLWR_LOCAL_CONTROL_API_PORT,
# unless set): `flwr run` hands an app to whichever local SuperLink answers on its ports, and
# one left over from an earlier `flwr run` (another folder, another venv) would run it.
set -euo pipefail
nodes=${1:?usage: flwr_run_local.sh NUM_SUPERNODES [RUN_CONFIG]}
overrides=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
# The venv whose flwr and fedhier run the app: the repo's .venv, or FEDHIER_VENV (e.g. a venv
# where fedhier is installed from the wheel, not editable: the FAB carries the code).
export PATH="${FEDHIER_VENV:-$root/.venv}/bin:$PATH"
export FLWR_HOME=${FLWR_HOME:-$(mktemp -d /tmp/fedhier-flwr-XXXXXX)}
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
mkdir -p "$FLWR_HOME"
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-$(free_port)}
export FLWR_LOCAL_CONTROL_API_PORT=${FLWR_LOCAL_CONTROL_API_PORT:-$(free_port)}
# Local SuperLinks left by earlier `flwr run`s (their --log-file lies in their FLWR_HOME).
leftover=$(pgrep -af -- "/local-superlink/superlink.log" | grep -v -- "$FLWR_HOME/" || true)
if [ -n "$leftover" ]; then
  echo "note: local SuperLink(s) from an earlier flwr run still running (not used: own ports);" \
       "stop with kill PID:" >&2
  echo "$leftover" | cut -c1-160 >&2
fi
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = ":local:"
TOML
stop_superlink() {  # ours only: its command line names our FLWR_HOME
  local pids
  pids=$(pgrep -f -- "$FLWR_HOME/local-superlink" || true)
  [ -n "$pids" ] || return 0
  kill $pids 2>/dev/null || true
  for _ in $(seq 50); do pgrep -f -- "$FLWR_HOME/local-superlink" >/dev/null || return 0; sleep 0.2; done
  kill -9 $pids 2>/dev/null || true
}
trap stop_superlink EXIT
cd "$root"
# the simulation's size: --federation-config (flwr 1.42 deprecates options.* in config.toml)
flwr run . --run-config "clients=$nodes $overrides" --stream \
  --federation-config "num-supernodes=$nodes client-resources-num-cpus=1 client-resources-num-gpus=0.0"
