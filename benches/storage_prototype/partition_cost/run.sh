#!/usr/bin/env bash
# What a partitioned tenure_jobs costs each statement by id, on PostgreSQL with prepared
# (generic) plans as tenure runs them: one claim and one finish of four jobs, each two
# statements in a transaction (lock, then update), against
#   plain   one table;
#   parent  the partitioned table, by id (what job_slots.patch does);
#   slot    the partitioned table, by id and `slot = $n` (the slot carried with the id);
#   mark    claim's lock and finish's lock through the parent, both updates naming the slot's
#           partition (what a claim record carrying the slot gives the updates alone);
#   direct  every statement naming the slot's partition;
#   bound   the partitioned table, by id and `slot = $s`, the slot a bound parameter;
#   cparent, cbound  parent and bound with `plan_cache_mode = force_custom_plan` (a plan per
#           execution, so the bound slot prunes at planning, before partitions are locked).
# Rounds alternate the variants; prints each variant's transactions/s, median of ROUNDS.
# Usage: ./run.sh [database URL] [rounds] [seconds per run]   (creates tables `plain`,
# `parted` and its partitions in that database; default postgres://root@127.0.0.1:5432/test)
set -euo pipefail
cd "$(dirname "$0")"
URL=${1:-postgres://root@127.0.0.1:5432/test}; ROUNDS=${2:-5}; SECS=${3:-5}
psql -q "$URL" -f setup.sql
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cycle() { # name, claim lock table, finish lock table, update table, extra predicate
    cat > "$tmp/$1.sql" <<SQL
\set id 6 * random(1, 9990)
\set s 0
BEGIN;
SELECT id, state FROM $2 WHERE id IN (:id, :id+6, :id+12, :id+18)$5 FOR UPDATE SKIP LOCKED;
UPDATE $4 SET claim_expires_at = now(), attempt = attempt + 1 WHERE id IN (:id, :id+6, :id+12, :id+18)$5 RETURNING id, queue, kind, payload;
COMMIT;
BEGIN;
SELECT id, state FROM $3 WHERE id IN (:id, :id+6, :id+12, :id+18)$5 FOR UPDATE;
UPDATE $4 SET claim_expires_at = now() WHERE id IN (:id, :id+6, :id+12, :id+18)$5;
COMMIT;
SQL
}
cycle plain plain plain plain ""
cycle parent parted parted parted ""
cycle slot parted parted parted " AND slot = 0"
cycle mark parted parted parted_0 ""
cycle direct parted_0 parted_0 parted_0 ""
cycle bound parted parted parted " AND slot = :s"
cp "$tmp/parent.sql" "$tmp/cparent.sql"; cp "$tmp/bound.sql" "$tmp/cbound.sql"
variants=${VARIANTS:-plain parent slot mark direct bound cparent cbound}
for r in $(seq 1 "$ROUNDS"); do
    for v in $variants; do
        opts="-c synchronous_commit=off"
        case $v in c*) opts="$opts -c plan_cache_mode=force_custom_plan" ;; esac
        tps=$(PGOPTIONS="$opts" pgbench -n -M prepared -c 2 -T "$SECS" -f "$tmp/$v.sql" "$URL" 2>&1 \
            | sed -n 's/^tps = \([0-9]*\).*/\1/p')
        echo "$tps" >> "$tmp/$v.out"
    done
done
for v in $variants; do
    printf '%-7s %s tx/s (runs: %s)\n' "$v" "$(sort -n "$tmp/$v.out" | sed -n "$(( (ROUNDS + 1) / 2 ))p")" \
        "$(tr '\n' ' ' < "$tmp/$v.out")"
done
