#!/usr/bin/env bash
# run.sh LAYOUT HOLD_SECONDS: the MariaDB prototype (see setup.sql): 30 s clean, HOLD s with a
# consistent-snapshot transaction held open, 30 s released. Needs a database `storage_exp`
# (mariadb -e "CREATE DATABASE storage_exp"); MARIADB_ARGS says how to reach the server.
set -u
cd "$(dirname "$0")"
L=$1; HOLD=$2; CLEAN=30; AFTER=30; TOTAL=$((CLEAN+HOLD+AFTER))
M="mariadb ${MARIADB_ARGS:--h 127.0.0.1 -u root} storage_exp"
$M < setup.sql
$M -e "SET GLOBAL innodb_monitor_enable = 'trx_rseg_history_len'" 2>/dev/null
start=$($M -N -e "SELECT NOW(6)")
$M -e "CALL produce('$L', $TOTAL)" & P=$!
$M -e "CALL consume('$L', $TOTAL)" & C1=$!
$M -e "CALL consume('$L', $TOTAL)" & C2=$!
$M -e "CALL maintain('$L', $TOTAL)" & W=$!
sleep $CLEAN
$M -e "CREATE TABLE IF NOT EXISTS other (x INT) ENGINE=InnoDB; START TRANSACTION WITH CONSISTENT SNAPSHOT; SELECT COUNT(*) FROM other; DO SLEEP($HOLD); COMMIT" >/dev/null & H=$!
wait $P $C1 $C2 $W $H
$M -e "SELECT DISTINCT t, COUNT(*) OVER (PARTITION BY t) AS claims,
  ROUND(PERCENTILE_DISC(0.5) WITHIN GROUP (ORDER BY us) OVER (PARTITION BY t) / 1000, 2) AS p50_ms,
  ROUND(PERCENTILE_DISC(0.99) WITHIN GROUP (ORDER BY us) OVER (PARTITION BY t) / 1000, 1) AS p99_ms
  FROM (SELECT FLOOR(TIMESTAMPDIFF(SECOND, '$start', at) / 10) * 10 AS t, us FROM lat) l
  ORDER BY t;
  SELECT DISTINCT phase, COUNT(*) OVER (PARTITION BY phase) AS claims,
  ROUND(PERCENTILE_DISC(0.5) WITHIN GROUP (ORDER BY us) OVER (PARTITION BY phase) / 1000, 2) AS p50_ms,
  ROUND(PERCENTILE_DISC(0.99) WITHIN GROUP (ORDER BY us) OVER (PARTITION BY phase) / 1000, 1) AS p99_ms
  FROM (SELECT CASE WHEN TIMESTAMPDIFF(SECOND, '$start', at) < $CLEAN THEN '1 clean'
    WHEN TIMESTAMPDIFF(SECOND, '$start', at) < $CLEAN + $HOLD THEN '2 held' ELSE '3 released' END AS phase, us FROM lat) l
  ORDER BY phase;
  SELECT TIMESTAMPDIFF(SECOND, '$start', at) AS t, ROUND(claim_bytes / 1e6, 1) AS claim_mb,
  ROUND(record_bytes / 1e6, 1) AS records_mb, history FROM sizes
  WHERE MOD(TIMESTAMPDIFF(SECOND, '$start', at), 10) = 0 ORDER BY t;
  SELECT COUNT(*) AS waiting_at_end FROM a_jobs WHERE state = 'waiting';
  SELECT COUNT(*) AS ready_at_end FROM b_ready;
  SELECT GREATEST(COALESCE((SELECT MAX(id) FROM a_jobs), 0), COALESCE((SELECT MAX(id) FROM b_jobs), 0)) AS last_job_id;"
