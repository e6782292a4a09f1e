#!/bin/sh
# The seed's "pilot leader election" workflow, line by line, run against a local
# `conclave dev` cluster (docs/agents.md, "Seed workflow"). Each step prints what it does
# and asserts its output with jq; the script exits non-zero at the first step that fails,
# and stops the cluster in every case.
#
#   scripts/agents-seed-workflow.sh            # uses target/release/conclave
#   CONCLAVE_BIN=conclave scripts/agents-seed-workflow.sh
#   SEED_WORKFLOW_BASE_PORT=23000 ...           # client port of node 1 (default: random)
set -eu

CONCLAVE_BIN=${CONCLAVE_BIN:-$(dirname "$0")/../target/release/conclave}
# Below Linux's ephemeral range (32768 and up): a port there can be taken as the source port
# of an outgoing connection, the nodes' own dials to each other's peer ports included, before
# the node meant to listen on it starts (seen once: "cannot listen for clients ... Address
# already in use").
BASE_PORT=${SEED_WORKFLOW_BASE_PORT:-$((20000 + $$ % 1200 * 10))}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/conclave-seed-workflow.XXXXXX")
DEV_PID=

conclave() { "$CONCLAVE_BIN" "$@"; }
step() { printf '== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }
# check DESCRIPTION JQ_FILTER: the JSON on stdin must make JQ_FILTER true.
check() {
    input=$(cat)
    printf '%s\n' "$input" | jq -e "$2" >/dev/null || fail "$1: $input"
    printf '   ok: %s\n' "$1"
}

cleanup() {
    if [ -n "$DEV_PID" ]; then
        # TERM, not INT: a background job of a script starts with SIGINT ignored. Bounded,
        # so a stuck shutdown cannot hang CI.
        kill -TERM "$DEV_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$DEV_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$DEV_PID" 2>/dev/null || true
        wait "$DEV_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

command -v jq >/dev/null || fail "jq is needed"
E1=127.0.0.1:$BASE_PORT
E2=127.0.0.1:$((BASE_PORT + 2))
E3=127.0.0.1:$((BASE_PORT + 4))
export CONCLAVE_ENDPOINTS="$E1,$E2,$E3"

step "start a 3-node dev cluster on $CONCLAVE_ENDPOINTS"
# The binary itself, not the shell function: $! must be the dev process that TERM stops.
"$CONCLAVE_BIN" dev --base-port "$BASE_PORT" --data-dir "$WORK/dev" >"$WORK/dev.log" 2>&1 &
DEV_PID=$!
i=0
until conclave --json status 2>/dev/null | jq -e '.data.leader != null and .data.healthy_members == 3' >/dev/null; do
    i=$((i + 1))
    [ "$i" -lt 150 ] || { cat "$WORK/dev.log" >&2; fail "the dev cluster did not start"; }
    kill -0 "$DEV_PID" 2>/dev/null || { cat "$WORK/dev.log" >&2; fail "conclave dev exited"; }
    sleep 0.2
done

# seed: ELECTION_GROUP="task-coordinator"
ELECTION_GROUP="task-coordinator"
TOPIC="election:$ELECTION_GROUP"

# Three agents, each talking to its own member.
agent_endpoint() { case $1 in 1) echo "$E1" ;; 2) echo "$E2" ;; 3) echo "$E3" ;; esac; }
as_agent() { n=$1; shift; CONCLAVE_ENDPOINTS=$(agent_endpoint "$n") "$CONCLAVE_BIN" "$@"; }

for n in 1 2 3; do
    # seed: AGENT_ID=$(pilotctl --json info | jq -r '.node_id')
    # `info` names the member this client talks to (the Raft leader, which clients prefer);
    # agents sharing a cluster add their own part to be unique.
    NODE_ID=$(as_agent "$n" --json info | jq -r '.data.node_id')
    conclave --json member list | check "agent $n's node_id $NODE_ID is a member" \
        "[.data.members[].id] | index(\"$NODE_ID\") != null"
    AGENT_ID="node$NODE_ID-agent$n"
    step "agent $n: AGENT_ID=$AGENT_ID"
    eval "AGENT_ID_$n=$AGENT_ID"
    # seed: PRIORITY=$(echo -n "$AGENT_ID" | cksum | cut -d' ' -f1)
    PRIORITY=$(printf '%s' "$AGENT_ID" | cksum | cut -d' ' -f1)
    eval "PRIORITY_$n=$PRIORITY"
    # Follow the election topic, so that `inbox` without a topic reads it.
    as_agent "$n" --json ack --consumer "$AGENT_ID" "$TOPIC" 0 \
        | check "agent $n follows $TOPIC" '.status == "ok"'
    # seed: pilotctl --json publish "$REGISTRY_HOST" "election:$ELECTION_GROUP" --data "{...}"
    as_agent "$n" --json publish "$TOPIC" --from "$AGENT_ID" \
        --data "{\"type\":\"election\",\"candidate\":\"$AGENT_ID\",\"priority\":$PRIORITY,\"term\":0}" \
        | check "agent $n announced its candidacy" ".status == \"ok\" and .data.seq >= 1 and .data.from == \"$AGENT_ID\""
done

# The highest priority (ties to the smallest id), computed here to check both ways below.
ranked() { for n in 1 2 3; do eval "echo \"\$PRIORITY_$n \$AGENT_ID_$n $n\""; done | LC_ALL=C sort -k1,1nr -k2,2; }
EXPECTED_N=$(ranked | sed -n 1p | cut -d' ' -f3)
SECOND_N=$(ranked | sed -n 2p | cut -d' ' -f3)
eval "EXPECTED=\$AGENT_ID_$EXPECTED_N"
eval "SECOND=\$AGENT_ID_$SECOND_N"

step "the seed's inbox scan for the highest priority"
# seed: HIGHEST=$(pilotctl --json inbox | jq -r '[.messages[] | select(.topic == ... and
#       .payload.type == "election")] | sort_by(.payload.priority) | last | .payload.candidate')
HIGHEST=$(as_agent 1 --json inbox --consumer "$AGENT_ID_1" \
    | jq -r '[.data.messages[] | select(.topic == "election:'$ELECTION_GROUP'" and .data.type == "election")] | sort_by(.data.priority) | last | .data.candidate')
[ "$HIGHEST" = "$EXPECTED" ] || fail "the inbox scan found $HIGHEST, expected $EXPECTED"
printf '   ok: HIGHEST=%s\n' "$HIGHEST"
# Every announcement carries its sender: the message's `from` is the candidate it names.
as_agent 1 --json inbox --consumer "$AGENT_ID_1" \
    | check "each election message's from is its sender" \
        '[.data.messages[] | select(.data.type == "election")] | length >= 3 and all(.from == .data.candidate)'

step "the same election decided by the server: a settle window instead of sleep 10"
conclave --json elect configure "$ELECTION_GROUP" --settle 2s \
    | check "group configured with a 2 s settle window" '.data.settle_ms == 2000'
for n in 3 1 2; do
    LEASE=$(as_agent "$n" --json lease grant 30 | jq -r '.data.id')
    eval "LEASE_$n=$LEASE"
    eval "PRIORITY=\$PRIORITY_$n"
    eval "AGENT_ID=\$AGENT_ID_$n"
    as_agent "$n" --json elect campaign "$ELECTION_GROUP" --id "$AGENT_ID" --priority "$PRIORITY" \
        --value "agent-$n" --lease "$LEASE" --no-wait \
        | check "agent $n registered" '.status == "ok"'
done
i=0
until conclave --json elect leader "$ELECTION_GROUP" 2>/dev/null | jq -e '.status == "ok"' >/dev/null; do
    i=$((i + 1)); [ "$i" -lt 100 ] || fail "no leader after the settle window"; sleep 0.1
done
# seed: if [ "$HIGHEST" = "$AGENT_ID" ]; then publish {"type":"leader",...,"elected_at":...}
conclave --json elect leader "$ELECTION_GROUP" \
    | check "the highest priority leads, with elected_at and a fence" \
        ".data.leader == \"$EXPECTED\" and (.data.elected_at | test(\"Z$\")) and .data.fence > 0"
TERM_NOW=$(conclave --json elect leader "$ELECTION_GROUP" | jq -r '.data.term')
ELECTED_AT=$(conclave --json elect leader "$ELECTION_GROUP" | jq -r '.data.elected_at')
as_agent "$EXPECTED_N" --json publish "$TOPIC" \
    --data "{\"type\":\"leader\",\"leader\":\"$EXPECTED\",\"term\":$TERM_NOW,\"elected_at\":\"$ELECTED_AT\"}" \
    | check "the leader announced itself" '.status == "ok"'

step "heartbeats"
# seed: pilotctl --json publish ... --data "{\"type\":\"heartbeat\",...,\"timestamp\":\"$(date -u +%s)\"}"
eval "LEASE=\$LEASE_$EXPECTED_N"
printf '{"type":"heartbeat","leader":"%s","term":%s,"timestamp":"%s"}\n' "$EXPECTED" "$TERM_NOW" "$(date -u +%s)" \
    | as_agent "$EXPECTED_N" --json publish "$TOPIC" --from "$EXPECTED" \
    | check "a heartbeat message published from stdin" '.status == "ok"'
as_agent "$EXPECTED_N" --json lease keepalive "$LEASE" --once \
    | check "the leader's real heartbeat: its lease keepalive" '.data.ttl == 30'

step "detect leader failure"
# seed: LAST_HEARTBEAT=$(pilotctl --json inbox | jq -r '[.messages[] | select(.topic == ... and
#       .payload.type == "heartbeat")] | sort_by(.payload.timestamp) | last | .payload.timestamp')
LAST_HEARTBEAT=$(as_agent 2 --json inbox --consumer "$AGENT_ID_2" \
    | jq -r '[.data.messages[] | select(.topic == "election:'$ELECTION_GROUP'" and .data.type == "heartbeat")] | sort_by(.data.timestamp) | last | .data.timestamp')
ELAPSED=$(( $(date -u +%s) - LAST_HEARTBEAT ))
[ "$ELAPSED" -le 10 ] || fail "the last heartbeat message is $ELAPSED s old"
printf '   ok: the last heartbeat message is %s s old\n' "$ELAPSED"
# The server's own view, no clocks compared: the leader's last keepalive, as an age in ms.
conclave --json elect candidates "$ELECTION_GROUP" \
    | check "the leader's keepalive is fresh" \
        '[.data.candidates[] | select(.leader)][0].keepalive_age_ms < 10000'

step "the leader dies; the next priority takes over at once with a higher fence"
FENCE=$(conclave --json elect leader "$ELECTION_GROUP" | jq -r '.data.fence')
as_agent "$EXPECTED_N" --json lease revoke "$LEASE" | check "the leader's lease is gone" '.data.revoked'
conclave --json elect leader "$ELECTION_GROUP" \
    | check "$SECOND leads with a higher fence" \
        ".data.leader == \"$SECOND\" and .data.fence > $FENCE"

step "the seed workflow ran as written"
