#!/usr/bin/env bash
# Run a method on a real Flower deployment on this machine: one SuperLink and several SuperNodes on
# loopback (127.0.0.1 only), driven by `flwr run`. Everything started here is stopped on exit.
#
# Usage: [MODE=run|churn|resume] [METHOD=feddpa-t] [OPTIONS='{}'] training/flower/loopback.sh [OUT_DIR]
#   run     two SuperNodes, 2 rounds (the default).
#   churn   three SuperNodes, 4 rounds; SuperNode 1 is killed (SIGKILL) while round 1 runs and restarted once
#           round 1 is over: its client must be out of round 1 and back in the last round.
#   resume  two SuperNodes, 3 rounds; once round 0 is complete the SuperLink and its ServerApp are killed
#           (SIGKILL), a new SuperLink starts on the same state and `flwr run ... resume=true` finishes the run;
#           its adapters must equal the in-process simulator's (to 1e-6).
# Defaults: FedDPA-T, the tiny model, generated data (2-3 clients, 4 examples each); OUT_DIR must not hold a run.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=$(realpath -m "${VENV:-.venv}")
OUT=$(realpath -m "${1:-runs/flower-loopback}")
MODE=${MODE:-run}
PORT=${PORT:-18093}
MODEL=${MODEL:-tiny}
METHOD=${METHOD:-feddpa-t}
OPTIONS=${OPTIONS:-"{}"}
case "$MODE" in
  run) NODES=2; ROUNDS=2; FAMILIES='["sorting", "capitals"]';;
  churn) NODES=3; ROUNDS=4; FAMILIES='["sorting", "capitals", "arithmetic"]';;
  resume) NODES=2; ROUNDS=3; FAMILIES='["sorting", "capitals"]';;
  *) echo "MODE must be run, churn or resume, got $MODE" >&2; exit 2;;
esac
# a dead node's reply is waited for this long (churn); the first round waits as long for every node
TIMEOUT=${TIMEOUT:-60}
DATA_OPTIONS="{\"n_train\": 4, \"n_test\": 2, \"families\": $FAMILIES}"
if [ -e "$OUT/run.json" ]; then echo "$OUT already holds a run; pass another OUT_DIR" >&2; exit 1; fi
export PATH="$VENV/bin:$PATH" FLWR_TELEMETRY_ENABLED=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FLWR_HOME=$(mktemp -d); export FLWR_HOME
LOGS="$OUT.logs"; mkdir -p "$LOGS"
declare -A group=()  # name -> process group id (each started process leads its own group: setsid)
stop() { if [ -n "${group[$1]:-}" ]; then kill -9 -- "-${group[$1]}" 2>/dev/null || true; unset "group[$1]"; fi; }
cleanup() { for name in "${!group[@]}"; do stop "$name"; done; wait 2>/dev/null || true; rm -rf "$FLWR_HOME"; }
trap cleanup EXIT

start_superlink() {  # the state database outlives a SuperLink, so a new one knows the nodes
  setsid flower-superlink --insecure --host 127.0.0.1 --port "$PORT" --disable-runtime-dependency-installation \
    --database "$FLWR_HOME/state.db" >> "$LOGS/superlink.log" 2>&1 &
  group[superlink]=$!
}
start_supernode() {
  setsid flower-supernode --insecure --superlink "127.0.0.1:$PORT" \
    --node-config "partition-id=$1 num-partitions=$NODES" --host 127.0.0.1 --port "$((PORT + 10 + $1))" \
    >> "$LOGS/supernode-$1.log" 2>&1 &
  group[node$1]=$!
}
wait_for() {  # wait_for SECONDS PYTHON-CONDITION: poll until the condition (on $OUT) holds
  python - "$OUT" "$1" "$2" <<'PY'
import json, sys, time
from pathlib import Path
out, limit, cond = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
def rows():
    p = out / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")] if p.is_file() else []
deadline = time.monotonic() + limit
while not eval(cond):
    if time.monotonic() > deadline:
        sys.exit(f"timed out waiting for: {cond}")
    time.sleep(0.5)
PY
}
submit() {  # submit RUN_CONFIG_EXTRA [--stream]
  flwr run . loopback "${@:2}" --run-config \
    "method=\"$METHOD\" data=\"generated\" rounds=$ROUNDS model=\"$MODEL\" preset=\"tiny\" out=\"$OUT\" timeout=$TIMEOUT options='$OPTIONS' data-options='$DATA_OPTIONS' $1"
}

start_superlink
sleep 5
for ((i = 0; i < NODES; i++)); do start_supernode "$i"; done
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink.loopback]
address = "127.0.0.1:$PORT"
insecure = true
TOML
sleep 5

case "$MODE" in
  run)
    submit "" --stream;;
  churn)
    submit "" > "$LOGS/flwr-run.log" 2>&1
    wait_for 900 'any(r.get("aggregate") and r["round"] == 0 for r in rows())'
    stop node1; echo "killed SuperNode 1 (capitals) during round 1"
    wait_for 900 'any(r.get("aggregate") and r["round"] == 1 for r in rows())'
    start_supernode 1; echo "restarted SuperNode 1"
    wait_for 1800 '(out / "summary.json").is_file()'
    python - "$OUT" "$ROUNDS" <<'PY'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
status = {(r["round"], r["client"]): r["status"] for r in rows if "client" in r}
assert status[(1, "capitals")] == "failed", status
assert status[(rounds - 1, "capitals")] == "ok", status
assert all(status[(r, c)] == "ok" for r in range(rounds) for c in ("sorting", "arithmetic")), status
print("churn: capitals out of round 1 and back by round", rounds - 1, {k: v for k, v in status.items() if k[1] == "capitals"})
PY
    ;;
  resume)
    submit "" > "$LOGS/flwr-run.log" 2>&1
    wait_for 900 '(out / "rounds" / "0" / "COMPLETE").is_file()'
    stop superlink; echo "killed the SuperLink and its ServerApp after round 0"
    sleep 2
    start_superlink
    sleep 5
    submit "resume=true" --stream
    python - "$OUT" "$METHOD" "$ROUNDS" "$DATA_OPTIONS" "$OPTIONS" <<'PY'
import json, sys, tempfile
from pathlib import Path
import torch
from safetensors.torch import load_file
from adapters.rundir import RunDir
from models import tiny_llama
from training.data import generate_suite
from training.federation.rounds import RoundConfig
from training.local.runtime import preset
from training.simulation import SimConfig, run_federated
out, method, rounds = RunDir(Path(sys.argv[1])), sys.argv[2], int(sys.argv[3])
data_options, options = json.loads(sys.argv[4]), json.loads(sys.argv[5])
ref = RunDir(Path(tempfile.mkdtemp()) / "sim")
run_federated(method, generate_suite(**data_options), tiny_llama(), ref.root, SimConfig(RoundConfig(rounds=rounds)),
              preset("tiny"), options=options, data_spec="generated", data_options=data_options)
folders = [(out.global_adapter, ref.global_adapter)]
folders += [(out.local_adapter(c), ref.local_adapter(c)) for c in data_options["families"] if ref.local_adapter(c).is_dir()]
for a_dir, b_dir in folders:
    a, b = (load_file(str(d / "adapter_model.safetensors")) for d in (a_dir, b_dir))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), a_dir
rows = [json.loads(x) for x in out.metrics.read_text().splitlines()]
assert [r["round"] for r in rows if r.get("aggregate")] == list(range(rounds)), rows
print(f"resume: {len(folders)} adapter folders equal the simulator's after the kill")
PY
    ;;
esac
test -f "$OUT/summary.json"  # written last by the server
test -f "$OUT/adapters/global/adapter_model.safetensors" || test -f "$OUT/adapters/amole/amole_config.json"
echo "flower loopback $MODE run complete: $OUT"
