//! The finisher: records finished runs as they come, in groups, on a connection of its own.
//! While one group is written the next gathers, so a busy worker commits once for many jobs
//! and an idle one adds no delay. Each run is still fenced by its own claim token.
//!
//! One record the database refuses never holds up the others: a group that fails is written
//! again one run at a time; a failure whose retry instant is refused is recorded with the
//! kind's backoff instead; a record that keeps failing with an error that retrying cannot
//! fix is given up after [`GIVE_UP_AFTER`] tries (its claim lapses and the job is rescued:
//! never lost). Errors that may pass (the database restarting) are retried with backoff
//! for as long as they last; meanwhile the runs stay held and renewed.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::connection::Connection;
use super::runs::{Settle, Shared, claim_groups};
use crate::events::{Event, RunOutcome};
use crate::jobs::{self, JobClaim, JobResult, Outcome, Retry};
use crate::{Error, PooledConnection};

/// Tries of one record that fails with an error retrying cannot fix, before it is given up.
const GIVE_UP_AFTER: u32 = 3;

pub(super) fn finisher(shared: &Shared) {
    let mut conn = Connection::new(&shared.config.pool);
    let mut pause = Duration::from_millis(100);
    let mut tries: HashMap<JobClaim, u32> = HashMap::new();
    loop {
        let group: Vec<Settle> = {
            let mut state = shared.lock();
            while state.settle.is_empty() {
                if state.closing {
                    return;
                }
                state = shared.wait(state, shared.config.poll_interval);
            }
            let n = state.settle.len().min(jobs::MAX_BATCH);
            let group: Vec<Settle> = state.settle.drain(..n).collect();
            state.settling = group.len();
            group
        };
        let (unrecorded, events) = record(shared, &mut conn, &group);
        for event in events {
            shared.emit(event);
        }
        let pending: HashSet<JobClaim> = unrecorded.iter().map(|(s, _)| s.claim()).collect();
        let mut state = shared.lock();
        let recorded: Vec<JobClaim> = group
            .iter()
            .map(Settle::claim)
            .filter(|claim| !pending.contains(claim))
            .collect();
        for claim in &recorded {
            tries.remove(claim);
        }
        state.recorded(recorded);
        state.settling = 0;
        let mut again = Vec::new();
        for (settle, error) in unrecorded {
            let claim = settle.claim();
            let n = tries.entry(claim).or_insert(0);
            *n += 1;
            if state.closing || (!may_pass(&error) && *n >= GIVE_UP_AFTER) {
                tracing::error!(job.id = claim.id, %error, tries = *n, "recording a finished run failed; giving up: its claim will lapse and the job be rescued");
                tries.remove(&claim);
                state.recorded([claim]);
            } else {
                tracing::warn!(job.id = claim.id, %error, ?pause, "recording a finished run failed; retrying");
                again.push(settle);
            }
        }
        if again.is_empty() {
            pause = Duration::from_millis(100);
            drop(state);
            shared.changed.notify_all();
            continue;
        }
        // Tried first next time, after a pause.
        again.append(&mut state.settle);
        state.settle = again;
        drop(shared.wait(state, pause));
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Whether an error may go away on its own (a lost connection, a restart, a deadlock, a
/// busy database), so a record is worth retrying for as long as it lasts.
fn may_pass(error: &Error) -> bool {
    // Lost connections and a full pool are already outcome-unknown or retryable.
    error.is_retryable() || error.is_outcome_unknown() || matches!(error, Error::Connect { .. })
}

/// Records runs: completions together (one transaction per group), give-backs together,
/// failures, snoozes and parks one by one; counts the outcomes. Returns the runs not recorded, with
/// why, and the events of those recorded, for the caller to emit ([`Shared::emit`]) once it
/// can spare the connection (a drain on a pool of one: a hook may use the pool).
pub(super) fn record(
    shared: &Shared,
    conn: &mut Connection<'_>,
    runs: &[Settle],
) -> (Vec<(Settle, Error)>, Vec<Event>) {
    // Per recorded run: its claim, the call's answer, and what the run asked for.
    let mut outcomes: Vec<(JobClaim, Outcome, RunOutcome)> = Vec::with_capacity(runs.len());
    let mut unrecorded = Vec::new();
    // The errors of snoozes that left their job dead (out of attempts).
    let mut snooze_deaths: HashMap<JobClaim, String> = HashMap::new();
    let by_claim: HashMap<JobClaim, &Settle> = runs.iter().map(|s| (s.claim(), s)).collect();
    // Results go with their completions, in the same transaction.
    let results: HashMap<JobClaim, &JobResult> = runs
        .iter()
        .filter_map(|s| match s {
            Settle::Complete(claim, Some(result), _) => Some((*claim, result)),
            _ => None,
        })
        .collect();
    // The last progress a completed run set, if the heartbeat has not written it yet (a
    // failure to write it holds up nothing).
    for run in runs {
        if let Settle::Complete(claim, _, Some((value, message))) = run {
            if let Err(e) = conn.with(|c| jobs::record_progress(c, *claim, *value, message)) {
                tracing::warn!(job.id = claim.id, error = %e, "writing a run's last progress failed");
            }
        }
    }
    let complete = |c: &mut PooledConnection, claims: &[JobClaim]| {
        let kept: Vec<(i64, &JobResult)> = claims
            .iter()
            .filter_map(|claim| results.get(claim).map(|r| (claim.id, *r)))
            .collect();
        jobs::complete_with_results(c, claims, &kept)
    };
    type Call<'a> = &'a dyn Fn(&mut PooledConnection, &[JobClaim]) -> crate::Result<Vec<Outcome>>;
    let grouped: [(Call, RunOutcome, Vec<JobClaim>); 2] = [
        (
            &complete,
            RunOutcome::Completed,
            runs.iter()
                .filter(|s| matches!(s, Settle::Complete(..)))
                .map(Settle::claim)
                .collect(),
        ),
        (
            &jobs::give_back,
            RunOutcome::GivenBack,
            runs.iter()
                .filter(|s| matches!(s, Settle::GiveBack(_)))
                .map(Settle::claim)
                .collect(),
        ),
    ];
    for (call, asked, claims) in grouped {
        for group in claim_groups(&claims) {
            match conn.with(|c| call(c, &group)) {
                Ok(done) => outcomes.extend(group.iter().zip(done).map(|(c, o)| (*c, o, asked))),
                // One by one, so one record the database refuses cannot hold up the others.
                Err(_) if group.len() > 1 => {
                    for claim in group {
                        match conn.with(|c| call(c, &[claim])) {
                            Ok(done) => {
                                outcomes.extend(done.into_iter().map(|o| (claim, o, asked)))
                            }
                            Err(e) => unrecorded.push((by_claim[&claim].clone(), e)),
                        }
                    }
                }
                Err(e) => unrecorded.push((by_claim[&group[0]].clone(), e)),
            }
        }
    }
    for run in runs {
        match run {
            Settle::Fail {
                claim,
                message,
                retry,
                exhausted,
                backoff,
            } => {
                let asked = if *exhausted {
                    RunOutcome::Dead
                } else {
                    RunOutcome::Retried
                };
                match conn.with(|c| jobs::fail(c, *claim, message, *retry)) {
                    Ok(outcome) => outcomes.push((*claim, outcome, asked)),
                    // The retry it asked for cannot be stored (an instant out of range):
                    // retried per the kind's policy instead, and the message says so.
                    Err(refused) if !may_pass(&refused) && !matches!(retry, Retry::Backoff(_)) => {
                        let message = format!(
                            "{message} (the retry it asked for was refused: {refused}; retried per policy instead)"
                        );
                        let retry = Retry::Backoff(*backoff);
                        match conn.with(|c| jobs::fail(c, *claim, &message, retry)) {
                            Ok(outcome) => outcomes.push((*claim, outcome, asked)),
                            Err(e) => unrecorded.push((run.clone(), e)),
                        }
                    }
                    Err(e) => unrecorded.push((run.clone(), e)),
                }
            }
            Settle::Snooze { claim, delay } => {
                match conn.with(|c| jobs::snooze_noting_death(c, *claim, *delay)) {
                    Ok((outcome, None)) => outcomes.push((*claim, outcome, RunOutcome::Snoozed)),
                    // Past the free snoozes with no attempt left: the database says dead.
                    Ok((outcome, Some(error))) => {
                        snooze_deaths.insert(*claim, error);
                        outcomes.push((*claim, outcome, RunOutcome::Dead));
                    }
                    Err(e) => unrecorded.push((run.clone(), e)),
                }
            }
            Settle::Park(claim) => match conn.with(|c| jobs::record_parked_run(c, *claim)) {
                Ok(outcome) => outcomes.push((*claim, outcome, RunOutcome::Parked)),
                Err(e) => unrecorded.push((run.clone(), e)),
            },
            Settle::Complete(..) | Settle::GiveBack(_) => {}
        }
    }
    let mut events = Vec::with_capacity(outcomes.len());
    {
        let mut state = shared.lock();
        for (claim, outcome, asked) in outcomes {
            let recorded = match outcome {
                Outcome::Done | Outcome::AlreadyDone => asked,
                Outcome::Lost => RunOutcome::Lost,
                Outcome::Cancelled => RunOutcome::Cancelled,
            };
            let report = &mut state.report;
            match recorded {
                RunOutcome::Completed => report.completed += 1,
                RunOutcome::Retried => report.retried += 1,
                RunOutcome::Dead => report.dead += 1,
                RunOutcome::Snoozed => report.snoozed += 1,
                RunOutcome::GivenBack => report.given_back += 1,
                RunOutcome::Parked => report.parked += 1,
                RunOutcome::Lost => report.lost += 1,
                RunOutcome::Cancelled => report.cancelled += 1,
            }
            let error = match by_claim.get(&claim) {
                Some(Settle::Fail { message, .. }) => Some(message.clone()),
                _ => snooze_deaths.remove(&claim),
            };
            if let Some(run) = state.runs.get(&claim).filter(|_| shared.wants_events()) {
                events.push(run.event(recorded, error));
            }
        }
    }
    (unrecorded, events)
}
