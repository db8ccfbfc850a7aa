#!/usr/bin/env bash
# The storage prototype of docs/storage-design.md: layout `a` (today's: one row per job,
# claimed and finished in place, pruned by DELETE) or `b` (a ring of ready entries reclaimed
# by TRUNCATE, records beside it), driven by pgbench: 500 enqueues/s, 100 claims/s of up to
# 10 jobs, maintenance each second; 30 s clean, HOLD s with a REPEATABLE READ snapshot held
# open in the same database, 30 s released. Then: python3 report.py out_LAYOUT_HOLD HOLD.
# Usage: PGDATABASE_URL_ARGS="-h 127.0.0.1 -U root" ./run.sh a 90   (needs a database
# `storage_exp`: createdb storage_exp). It drops and creates its own tables there.
set -u
cd "$(dirname "$0")"
L=$1; HOLD=$2; CLEAN=30; AFTER=30; TOTAL=$((CLEAN+HOLD+AFTER))
DB="${PGDATABASE_URL_ARGS:--h 127.0.0.1 -U root} storage_exp"
psql $DB -q -f setup.sql 2>/dev/null
psql $DB -qc "VACUUM ANALYZE" 
out=out_${L}_${HOLD}; rm -rf $out; mkdir -p $out
# producer 500 jobs/s; consumer 100 claims/s of up to 10 (capacity 1,000/s)
pgbench $DB -n -c 2 -j 1 -R 500 -T $TOTAL -f ${L}_enqueue.sql > $out/producer.txt 2>&1 &
P=$!
(cd $out && pgbench $DB -n -c 2 -j 1 -R 100 -T $TOTAL -f ../${L}_claim.sql -l > consumer.txt 2>&1) &
C=$!
start=$(date +%s)
# maintenance each second: A prunes completed jobs; B rotates the ready ring and truncates
# the generation two behind when it is empty, and prunes finished records.
(
  while [ $(( $(date +%s) - start )) -lt $TOTAL ]; do
    if [ $L = a ]; then
      psql $DB -qc "DELETE FROM a_jobs WHERE state = 'completed' AND finished_at < now() - interval '1 second'" >/dev/null
    else
      psql $DB -q >/dev/null 2>&1 <<SQL
UPDATE b_gen SET cur = (cur + 1) % 3 WHERE one = 1;
SET lock_timeout = '100ms';
DO \$\$ DECLARE old int; n int; BEGIN
  SELECT (cur + 1) % 3 INTO old FROM b_gen WHERE one = 1;
  EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM b_ready_%s LIMIT 1) x', old) INTO n;
  IF n = 0 THEN EXECUTE format('TRUNCATE b_ready_%s', old); END IF;
END \$\$;
DELETE FROM b_jobs WHERE state = 'completed' AND finished_at < now() - interval '1 second';
SQL
    fi
    sleep 1
  done
) &
M=$!
# sampler every 5 s: sizes and dead tuples
(
  while [ $(( $(date +%s) - start )) -lt $TOTAL ]; do
    t=$(( $(date +%s) - start ))
    psql $DB -Atc "SELECT $t, coalesce(sum(pg_total_relation_size(relid)) FILTER (WHERE relname LIKE 'a_jobs' OR relname LIKE 'b_ready%'),0), coalesce(sum(n_dead_tup) FILTER (WHERE relname LIKE 'a_jobs' OR relname LIKE 'b_ready%'),0), coalesce(sum(pg_total_relation_size(relid)) FILTER (WHERE relname = 'b_jobs'),0), coalesce(sum(n_dead_tup) FILTER (WHERE relname = 'b_jobs'),0) FROM pg_stat_user_tables WHERE relname LIKE '${L}_%'" >> $out/sizes.txt
    sleep 5
  done
) &
S=$!
sleep $CLEAN
psql $DB -qc "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class; SELECT pg_sleep($HOLD); COMMIT" >/dev/null &
H=$!
wait $P $C $M $S $H
echo "$start" > $out/start.txt
