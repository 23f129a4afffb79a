#!/usr/bin/env bash
# Run the fedhier Flower app with `flwr run .` on a local Simulation Engine, then stop the
# detached SuperLink that `flwr run` leaves behind (by its pid, found via our FLWR_HOME).
#
#   scripts/flwr_run_local.sh NUM_SUPERNODES "key=value key=value ..."
# e.g. scripts/flwr_run_local.sh 20 "rounds=5 out='runs/flwr-demo'"
# `clients` is set to NUM_SUPERNODES. FLWR_HOME defaults to a fresh folder under /tmp;
# FEDHIER_VENV (default: the repo's .venv) is the venv whose flwr runs.
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
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = ":local:"
options.num-supernodes = $nodes
options.backend.client-resources.num-cpus = 1
options.backend.client-resources.num-gpus = 0.0
TOML
stop_superlink() {
  local pattern="$FLWR_HOME/local-superlink"
  pkill -f "$pattern" 2>/dev/null || return 0
  for _ in $(seq 50); do pgrep -f "$pattern" >/dev/null || return 0; sleep 0.2; done
  pkill -9 -f "$pattern" 2>/dev/null || true
}
trap stop_superlink EXIT
cd "$root"
flwr run . --run-config "clients=$nodes $overrides" --stream
