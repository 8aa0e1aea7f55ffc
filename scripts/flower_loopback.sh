#!/usr/bin/env bash
# Run a method on a real Flower deployment on this machine: one SuperLink and two SuperNodes on
# loopback (127.0.0.1 only), driven by `flwr run`. Everything started here is stopped on exit.
# Usage: [METHOD=fedamole OPTIONS='{"num_experts": 4, "expert_choices": 1}'] scripts/flower_loopback.sh [OUT_DIR]
# (defaults: FedDPA-T, tiny model, generated data with 2 clients, 2 rounds; OUT_DIR must not hold a run yet)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=$(realpath -m "${1:-runs/flower-loopback}")
PORT=${PORT:-18093}
MODEL=${MODEL:-tiny}
METHOD=${METHOD:-feddpa-t}
OPTIONS=${OPTIONS:-"{}"}
if [ -e "$OUT/run.json" ]; then echo "$OUT already holds a run; pass another OUT_DIR" >&2; exit 1; fi
export PATH="$PWD/$VENV/bin:$PATH" FLWR_TELEMETRY_ENABLED=0
FLWR_HOME=$(mktemp -d); export FLWR_HOME
LOGS="$OUT.logs"; mkdir -p "$LOGS"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$FLWR_HOME"; }
trap cleanup EXIT

flower-superlink --insecure --host 127.0.0.1 --port "$PORT" --disable-runtime-dependency-installation \
  --database "$FLWR_HOME/state.db" > "$LOGS/superlink.log" 2>&1 &
pids+=($!)
sleep 5
for i in 0 1; do
  flower-supernode --insecure --superlink "127.0.0.1:$PORT" --node-config "partition-id=$i num-partitions=2" \
    --host 127.0.0.1 --port "$((PORT + 10 + i))" > "$LOGS/supernode-$i.log" 2>&1 &
  pids+=($!)
done
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink.loopback]
address = "127.0.0.1:$PORT"
insecure = true
TOML
sleep 5
flwr run . loopback --stream --run-config \
  "method=\"$METHOD\" data=\"generated\" rounds=2 model=\"$MODEL\" preset=\"tiny\" out=\"$OUT\" options='$OPTIONS' data-options='{\"n_train\": 4, \"n_test\": 2, \"families\": [\"sorting\", \"capitals\"]}'"
test -f "$OUT/summary.json"  # written last by the server
test -f "$OUT/adapters/global/adapter_model.safetensors" || test -f "$OUT/adapters/amole/amole_config.json"
echo "flower loopback run complete: $OUT"
