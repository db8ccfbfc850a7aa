//! tenure's conformance suite: every test is written once and runs against SQLite, PostgreSQL
//! and MySQL/MariaDB (each backend whose cargo feature is on).
//!
//! Each file (or folder of files) covers one subject and says so in its header; tests found by
//! a review round keep a comment saying which round found them. The harness is
//! `tests/common/` (shared with the `cli` and `faults` binaries). A test `m::t` runs as
//! `m::sqlite::t`, `m::postgres::t` and `m::mysql::t`.
//!
//! ## Guarantee map
//!
//! Each guarantee of the crate root's "Guarantees" (`src/lib.rs`) and the tests that prove
//! it. Paths are module paths in the binary named first (`conformance` unless `cli` or
//! `faults` is said); `m::*` is every test of module `m`.
//!
//! | Guarantee | Proved by |
//! |---|---|
//! | The database's clock decides | `foundation::clock_is_utc_in_a_non_utc_session`, `leases::expiry_follows_the_clock_inside_long_transactions`, `contention::a_take_that_waited_for_the_row_is_stamped_when_it_won`, `kinds::a_claim_reports_when_the_job_was_enqueued_and_claimed`, `flow_control::a_rate_limit_holds_in_every_window_while_unlimited_jobs_drain`, `schedules::catch_up::*` |
//! | Names are bytes | `foundation::names_are_byte_exact`, `leases::names_that_differ_in_case_or_spaces_are_different_leases`, `kinds::odd_kind_names_match_exactly`, `statements::shapes::names_and_values_that_look_like_sql_are_only_values`, `jobs::payloads_round_trip_byte_for_byte`; `faults`: `hostile::lease_names_and_ttls_round_trip_or_are_refused`, `hostile::job_fields_round_trip_or_are_refused` |
//! | A lease has one holder | `leases::races::race_over_an_absent_row_has_one_winner`, `leases::races::race_over_a_released_row_has_one_winner`, `leases::races::race_over_an_expired_row_has_one_winner` (with the negative control `leases::races::naive_read_then_update_lets_several_win`), `leases::verify_commits_work_only_under_a_held_lease`, `leases::renewal_after_lapse_is_lost_and_repeated_renewal_succeeds`, `leases::release_is_idempotent_and_a_late_release_changes_nothing`, `leases::a_stalled_holder_is_taken_over_and_refused_everything`, `leases::holders::*`, `leases::releases::*`, `clusters::galera::galera_contenders_on_three_nodes_never_share_a_lease` (`scripts/test-clusters`); `faults`: `processes::processes_take_turns_under_a_lease`, `processes::a_paused_lease_holder_is_fenced_out`; `cli`: `lease_run::lease_run_two_runner_loops_never_overlap`, `lease_run::lost::lease_run_force_release_stops_the_command_and_the_next_runner_takes_over`, `lease_run::stopped::lease_run_stopped_supervisor_stops_its_command_at_the_deadline` |
//! | A dead lease holder is taken over within seconds; a living one knows it lost first | `leases::takeover::*` (a holder cut off by a proxy says lost before the taker is granted; one whose connections are killed keeps its lease), `clusters::galera::galera_a_holder_on_one_node_is_not_taken_over_from_another` (`scripts/test-clusters`); `faults`: `takeover::a_killed_holders_lease_is_taken_over_within_seconds`, `takeover::a_stopped_holder_keeps_its_lease_until_its_ttl` |
//! | A job has one worker at a time | `claim_races::eight_claimers_never_share_a_job`, `claim_races::enqueue_while_claiming_completes_every_job_once`, `claim_races::a_lapsed_worker_is_refused_after_a_rescue`, `claim_races::heartbeats_and_rescues_race_without_errors`, `jobs::complete_in_a_rolled_back_transaction_changes_nothing`, `jobs::give_back_and_stalls_keep_the_attempt`, `kinds::overlapping_kind_sets_race_without_double_claims_or_strangers`, `snooze::a_snooze_is_fenced_by_the_claim_token`, `worker::four_threads_process_two_thousand_jobs_once`, `worker::three_batching_workers_run_each_job_once`, `worker::runs::a_lapsed_claim_uses_no_attempt`, `worker::runs::a_job_whose_claims_keep_lapsing_ends_dead` (`MAX_LAPSES`); a crashing job dies alone: `faults` `poison::a_poison_job_dies_alone`, `poison::a_claim_outside_a_worker_that_crashes_charges_only_the_job_it_was_running`, `poison::suspects_waiting_their_turn_leave_the_workers_other_threads_to_fresh_jobs`; `worker::claims::a_lost_claim_reclaimed_by_the_same_worker_runs_and_counts_once_each`, `worker::retries::two_workers_with_retries_due_at_once_run_each_attempt_once`, `statements::shapes::a_rescue_of_a_thousand_lapsed_claims_lists_each_once`, `clusters::galera::galera_claimers_on_three_nodes_claim_each_job_once`, `clusters::galera_across_nodes::*` (limits of one with claimers on three nodes, dependents released once, cancels beside claims on other nodes) (`scripts/test-clusters`); `faults`: `processes::killed_workers_lose_no_job` |
//! | A claim never waits for a job another transaction holds (a cancel, a fold, a caller's lock): it takes the others, and the held job once let go | `claims_pass_over_held_jobs::*` (servers: a job locked by a caller; a cancel that waits for the claim's ring entry while the claim waits for a limit key: no deadlock, the cancel wins on PostgreSQL); `claims_pass_over_held_jobs::next_jobs::*` (a claim of one takes the next job when the first is held, by a lock or a caller's open fold; a capped key's room goes to the job nobody holds; rate starts only for jobs claimed); `claims_pass_over_held_jobs::limits::*` (the claim's rounds: a queue limit, a key's smallest cap and a rate hold, jobs come back in claim order, many held jobs never fail a claim); `claims_pass_over_held_jobs::limit_races::*` (servers: four claimers of a limited queue racing holders of its head jobs and a canceller); `claims_pass_over_held_jobs::races::*` (all backends: claimers of batches 1, 3 and 7 racing cancels, folds, a caller's open fold, the ager, rotations, a capped key, a rate and fair tenants, 12 rounds: no job twice, none lost, cap and starts exact, no deadlock on PostgreSQL) |
//! | A dead worker is recognised by its process ending | `worker::liveness::*` (`a_worker_whose_lock_is_held_is_never_rescued`, `a_worker_whose_session_ended_is_rescued`, `two_rescuers_take_a_dead_workers_claims_back_once`, `*_heartbeats::a_worker_with_a_fresh_heartbeat_is_not_rescued_without_its_lock`); `faults`: `recovery::a_killed_workers_jobs_run_again_within_seconds`, `recovery::a_stopped_worker_is_never_taken_for_dead`, `recovery::*_sessions::a_worker_whose_lock_connection_is_killed_keeps_its_jobs`, `workflows::killed_workers_leave_a_batchs_callbacks_firing_once` |
//! | A worker runs only kinds it has handlers for | `typed::a_worker_never_claims_kinds_it_has_no_handler_for`, `typed::eight_workers_of_one_kind_leave_the_other_kind_untouched`, `kinds::a_kinds_claimer_never_claims_or_changes_other_kinds`, `kinds::claims_of_several_kinds_follow_the_queue_order`, `kinds::overlapping_kind_sets_race_without_double_claims_or_strangers`; `cli`: `work_logs::work_logs_each_job_and_leaves_other_kinds_alone` |
//! | A snooze uses no attempt, within a bound | `snooze::snoozes_use_no_attempt`, `snooze::past_the_free_snoozes_attempts_are_used_then_the_job_dies`, `snooze::a_snooze_that_uses_the_last_attempt_is_reported_dead`, `snooze::a_snooze_too_long_is_refused_and_changes_nothing`, `events::snoozes_use_no_attempt_and_are_counted` |
//! | A run ends when its handler returns | `worker::runs::a_timed_out_run_holds_its_limit_until_the_handler_returns`, `worker::runs::a_cancelled_run_holds_its_limit_until_the_handler_returns`, `worker::heartbeats::a_handler_past_its_timeout_is_failed_without_extra_concurrency`, `worker::heartbeats::a_long_handler_keeps_its_job_through_heartbeats`, `worker::shutdown::shutdown_past_grace_keeps_the_limit_until_the_handler_returns`, `worker::shutdown::shutdown_past_grace_never_runs_a_job_twice_at_once`, `worker::claims::limits_hold_across_two_workers_with_timeouts`, `typed::a_timeout_too_long_for_an_instant_does_not_stop_the_heartbeat` |
//! | The jobs of a sequence run one at a time, in enqueue order | `sequences::*`, `sequences::edges::*` (a blocked job cancelled mid-sequence is taken out of it; batches lock their keys sorted; eight threads on one key make one chain; a rolled-back enqueue; a caller's REPEATABLE READ; enqueues racing completions and deaths) (eight claimers with retries keep every key's order, with the negative control `sequences::negative_control_a_limit_of_one_lets_a_job_overtake_one_that_retries`; a dead or cancelled job holds the rest until retried or skipped; `Continue`; bulk order; retention keeps a holding job); `faults`: `sequences::a_sequence_keeps_its_order_through_sigkilled_workers` (8 claimers over 3 processes, SIGKILLs, failures: runs never overlap and start in id order, by the database's clock); `cli`: `sequences::*`, `serve::sequences::*` |
//! | Priorities starve no job whose queue ages them | `priority_aging::*`, `priority_aging::bounds::*` (a limited call ages the jobs due first; refused inside a caller's transaction; aging racing claims, retries, cancels, dedup replaces and rotations keeps the ring exact) (with the negative control `priority_aging::a_steady_stream_of_urgent_jobs_starves_a_low_priority_job_without_aging`: 600 claims, four claimers, the low job never claimed; with aging, of the claims begun after the aging, fewer than the claimers take another job first) |
//! | A dependent job runs once, when its dependencies allow | `workflows::*` (policies, callbacks, results, retention), `workflows::races::dependencies_finishing_at_the_same_instant_release_their_dependent_exactly_once` (with the negative control `workflows::races::negative_control_a_plain_count_of_pending_dependencies_loses_releases`), `workflows::races::*`, `workflows::deadlocks::*`, `workflows::deadlock_victims::a_completion_retried_after_a_deadlock_releases_each_dependent_exactly_once`, `workflows::retry_cancel_prune::*`, `workflows::transactions::*`, `workflows::edges::*`, `workflows::worker::*`; `faults`: `workflows::killed_workers_leave_a_batchs_callbacks_firing_once`; `cli`: `workflows::cancel_stops_a_whole_workflow` |
//! | A step runs once per job: its result commits with its writes, under the run's claim | `steps::*`, `steps_races::*` (a run asked to cancel or that lost its claim gets `ClaimLost`, also for a stored step; two threads on one name commit once, in a worker and in a test context; prunes racing revivals and steps; steps before a park), `steps_values::*` (the first run gets what a retry reads back; a NaN is refused, not stored; odd names at the bound) (`steps::a_step_racing_a_reclaim_commits_before_it_or_not_at_all`: without the job row's lock in the step's claim check it failed on PostgreSQL and MariaDB); `faults`: `steps::killed_workers_run_each_step_once` (with the negative control `steps::negative_control_killed_workers_without_steps_run_writes_again`) |
//! | Waiting for a job's end gets its true outcome once, holding no connection asleep | `waiting::*` (with the negative control run by hand: a waiter holding its connection times out `hundreds_of_waiters_hold_no_connection_while_they_sleep`; a workflow's wait: `waiting::a_workflow_wait_ends_only_when_every_job_and_callback_ended`); `cli`: `enqueue_wait::*` |
//! | A parked job is answered once by its token; a wrong, guessed, used or stale token changes nothing | `parked::*` (two threads with one token, an answer racing the deadline, an answer before the handler returned); `faults`: `parked::a_worker_killed_after_parking_leaves_the_job_parked_for_its_token`; `cli`: `parked::*` |
//! | Once `ctx.park` returned a token the job waits for it (a lapsed or dead worker's claim, a shutdown past grace, a timeout), unless the handler ends the run another way; a pending answer is applied once or never read | `parked_runs::*` (a lapsed claim rescued into a park, past grace, past the timeout, a second park refused, a dropped resume never read); `faults`: `parked::a_worker_killed_between_park_and_its_record_leaves_the_jobs_parked_for_their_tokens` |
//! | Claims read storage that sheds its dead entries whatever snapshot is held (the servers' ready ring), listing exactly the waiting jobs | `ready_ring::*` (every change of a job's state, in bulk too; rotations racing 4 claimers, 2 enqueuers and cancels; a backlog moved forward, never dropped or copied; the ring emptied to no pages under a held snapshot; a cancel or a replacing duplicate in a REPEATABLE READ transaction after rotations moved the entry, and a rotation under an old snapshot: refused, never an entry left or lost; a caller's open transaction across rotations; rotations racing claims of kinds and of limited jobs, give-backs, snoozes and cancels; a rotation killed before its commit; parked jobs, workflows, schedules and retries by kind; replacing duplicates racing rotations and claims, no job claimed before its due time); MariaDB's `ready_ring::mariadb::*` (entries written under old read views, the migration racing a rotation, time zones, a missing ring row, an id changed; `kills::*`: a rotation killed or interrupted at any point, or failing under its lock, leaves the ring exact and nothing locked; `read_views::*`: REPEATABLE READ callers racing rotations; `stalls::*`: a stalled rotation holds claims at most seconds; `purge::*`: with a nonzero interval MariaDB rotates only while purge lags) |
//! | Finished jobs' space is reclaimed by truncating whole slots, never a job still there (PostgreSQL's job slots) | `job_slots::rotation::*`, `job_slots::rotation_races::*`, `job_slots::rotation_locks::*` (COPY bulks, open transactions, keyed paths, a killed rotation: nothing lost) (a slot truncated only once it holds no job, a running job across twelve rotations still finishes; an open transaction keeps its slot, nobody waits; rotations racing four claimers, an enqueuer and a pruner: each job once, none lost; a live database moves in with ids, states, keys and claims), `ready_ring::postgres_a_live_database_migrates_into_the_ring` |
//! | A slot whose jobs retention would all delete goes whole, with the rows beside its jobs; one job the policies keep holds it (PostgreSQL's retention by slot) | `job_slots::reclaim::*`, `job_slots::reclaim_races::*`, `job_slots::reclaim_deadlocks::*` (finishes, row locks and callers' transactions racing the reclaim: no deadlock, no lost finish) (waiting, running, another queue's, a kept state, a policy's age or newest N, a dependent: each holds the slot; reclaims racing claims, finishes and dependents' enqueues: each job once, no finish lost, no dependent left blocked) |
//! | Bad input changes nothing | `jobs::bad_input_is_refused_and_writes_nothing`, `leases::bad_input_is_refused_and_writes_nothing`, `queue_ops::bad_input_is_refused_and_writes_nothing`, `kinds::bad_kinds_are_refused_and_change_nothing`, `schedules::bad_schedules_are_refused_and_write_nothing`, `schedules::refusals_and_races::crons_that_never_fire_are_refused_and_write_nothing`, `dedup_windows::bad_windows_and_modes_are_refused_and_write_nothing`, `flow_control::bad_flow_control_input_is_refused_and_writes_nothing`, `flow_control::limits::bad_limits_are_refused`, `workflows::bad_workflow_input_is_refused_and_writes_nothing`, `workflows::edges::odd_dependency_lists_are_refused_or_normalised`, `depth::depth_refuses_bad_input`, `typed::bad_typed_consts_are_typed_errors_and_change_nothing`, `inputs::instants_outside_years_1_to_9999_are_refused_before_any_statement`, `inputs::instants::*`; `faults`: `hostile::*`; `cli`: `enqueue::*`, `serve::bad_input_gets_a_clear_error_and_changes_nothing`, `serve::pages::nul_and_oversized_names_are_bad_input_everywhere_else`, `lease_run::arguments::*` |
//! | Errors are never "nothing there" | `foundation::errors::lock_conflicts_are_retryable`, `foundation::errors::other_errors_are_not_retryable`, `foundation::errors::*_only::lost_connection_is_outcome_unknown`, `foundation::errors::unreachable_server_is_a_fast_typed_error`, `errors::*`, `inputs::a_connection_killed_while_waiting_for_a_row_lock_is_outcome_unknown`, `statements::reuse::a_changed_column_type_costs_one_retryable_error`, `write_turns::a_write_on_a_second_connection_inside_a_transaction_fails_retryably_in_time`; `faults`: `serial::*` (connections cut, servers restarted); `cli`: `serve::pages::a_database_error_is_a_500_and_the_server_serves_on` |
//! | What was acknowledged survives a failover that can keep it, and tenure says when one cannot | `clusters::patroni::*`, `clusters::patroni_lag::*` (a switchover and a killed primary under load, synchronous and asynchronous; a crash while the standbys lag: 20 of 20 enqueues lost and a fence repeated when asynchronous, nothing acknowledged when synchronous), `clusters::galera::galera_a_node_killed_under_load_loses_no_job`, `clusters::galera::galera_every_node_reports_synchronous_replication` (all by `scripts/test-clusters`), `foundation::replication::*`, `foundation::reconnects::*` (a pool connects again within seconds of an outage's end) |

// The harness shared by the three test binaries (see tests/common/mod.rs).
#[path = "../common/mod.rs"]
mod common;

mod bulk;
mod claim_races;
mod claims_pass_over_held_jobs;
mod clusters;
mod contention;
mod dedup_windows;
mod depth;
mod errors;
mod events;
mod fair_claiming;
mod flow_control;
mod foundation;
mod inputs;
// PostgreSQL's partitions of tenure_jobs.
#[cfg(feature = "postgres")]
mod job_slots;
mod jobs;
mod kinds;
mod leases;
mod migrations;
mod parked;
mod parked_runs;
mod priority_aging;
// Users and grants exist on the servers only.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod privileges;
mod queue_ops;
mod ready_ring;
mod schedules;
mod schema_contract;
mod schema_models;
mod sequences;
mod session_settings;
mod snooze;
mod statements;
mod steps;
mod steps_races;
mod steps_values;
mod testing_helpers;
mod typed;
mod waiting;
// NOTIFY is PostgreSQL's.
#[cfg(feature = "postgres")]
mod wakeups;
mod worker;
mod workflows;
mod write_turns;
