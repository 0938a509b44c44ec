#!/usr/bin/env bash
# An independent cross-check of the harness: the same servers (`idemkit-bench-peers
# serve`), driven by `wrk` (2 threads, 16 connections, a fresh key per request,
# every status counted), rounds alternating between the setups. Prints each
# setup's requests/s per round, the median, and the median ratio to its bare
# baseline; compare with the harness's own table from a run just before or after.
#
#   bash bench/peers/wrk-check.sh            # ROUNDS=3 DURATION=5 by default
#   IDEMKIT_BENCH_ONLY=memory bash bench/peers/wrk-check.sh
set -euo pipefail
cd "$(dirname "$0")"
rounds=${ROUNDS:-3}
duration=${DURATION:-5}
if ! command -v wrk >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-../../target/bench-peers}
cargo build --release --ignore-rust-version -q
bin="$CARGO_TARGET_DIR/release/idemkit-bench-peers"

coproc SERVE { "$bin" serve; }
names=() urls=()
while IFS=$'\t' read -r -u "${SERVE[0]}" kind name url; do
  [[ $kind == ready ]] && break
  [[ $kind == serve ]] || continue
  # axum-idempotent needs a session cookie per connection: the harness logs in, wrk does not.
  [[ $name == axum-idempotent* ]] && continue
  names+=("$name") urls+=("$url")
done
(( ${#names[@]} > 0 )) || { echo "no setups served" >&2; exit 1; }

results=$(mktemp)
trap 'rm -f "$results"' EXIT
n=${#names[@]}
for ((r = 0; r < rounds; r++)); do
  for ((k = 0; k < n; k++)); do
    i=$(((k + r) % n))
    line=$(wrk -t2 -c16 -d"${duration}s" --latency -s wrk/fresh.lua "${urls[$i]}" -- "wrk-r$r-s$i" | grep '^wrk-result')
    status=${line##*status=}
    if [[ $status != 201:* || $status == *,* ]] || [[ $line != *errors=0* ]]; then
      echo "${names[$i]}: not every answer was 201: $line" >&2
      exit 1
    fi
    printf '%s\t%s\t%s\n' "$r" "${names[$i]}" "$line" >>"$results"
  done
  echo "  round $((r + 1)) of $rounds done" >&2
done
exec {SERVE[1]}>&-
wait "$SERVE_PID" || true

python3 - "$results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r, name, rest = line.rstrip("\n").split("\t")
    f = dict(kv.split("=", 1) for kv in rest.split()[1:])
    rows.setdefault(name, {})[int(r)] = (float(f["rps"]), int(f["p50_us"]), int(f["p99_us"]))
def family(name):
    return "SQLite" if "SQLite" in name else "PostgreSQL" if "PostgreSQL" in name else "memory"
bare = {family(n): n for n in rows if n.startswith("bare")}
print("wrk -t2 -c16, a fresh key per request: requests/s, median of rounds; ratio = median over rounds of setup / its bare baseline in the same round")
print(f"{'setup':<36} {'req/s':>9} {'per round':>26} {'ratio':>7} {'p50 us':>7} {'p99 us':>7}")
for name, per in rows.items():
    base = rows[bare[family(name)]]
    rounds = sorted(per)
    ratio = statistics.median(per[r][0] / base[r][0] for r in rounds)
    print(f"{name:<36} {statistics.median(per[r][0] for r in rounds):>9.0f} "
          f"{' / '.join(f'{per[r][0]:.0f}' for r in rounds):>26} {ratio:>7.3f} "
          f"{statistics.median(per[r][1] for r in rounds):>7.0f} {statistics.median(per[r][2] for r in rounds):>7.0f}")
PY
