//! Durable steps' values and names (`jobs::run_step`, `JobContext::step`): the value a step
//! returns to the run that commits it is the value every later run reads back (a value JSON
//! cannot carry is refused before anything commits, not stored to fail every retry), and
//! step names are compared byte for byte at every length up to the bound, and steps are
//! listed in the order they committed. (Steps in general:
//! `steps`; races: `steps_races`.) Found by the steps attack round.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tenure::jobs::{self, JobClaim, NewJob, StepError};
use tenure::worker::JobError;
use tenure::{AnyConnection, Backend, Error, testing};

use crate::common::{TestDb, claim_one, conformance, count};
use crate::steps::{create_writes, write};

conformance!(
    the_first_run_gets_what_a_retry_reads_back,
    a_value_json_cannot_carry_is_refused_and_commits_nothing,
    odd_step_names_are_distinct_and_exact,
    a_test_context_gives_what_it_keeps,
    steps_are_listed_in_the_order_they_committed,
);

fn writes(conn: &mut AnyConnection, job: i64) -> i64 {
    count(
        conn,
        &format!("SELECT COUNT(*) AS n FROM step_writes WHERE job_id = {job}"),
    )
}

fn claimed(conn: &mut AnyConnection) -> JobClaim {
    jobs::enqueue(conn, &NewJob::new("q", "k", vec![])).unwrap();
    claim_one(conn, "q", "k").claim()
}

/// A struct with a field serde leaves out: the first run's value has it, the stored JSON
/// does not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Fetched {
    rows: u32,
    #[serde(skip)]
    cursor: Option<String>,
}

/// Step values JSON changes on the way (`Some(None)` and `Some(())` are both `null`, a
/// skipped field comes back as its default): the run that commits the step gets the value
/// a retry reads back, not the one its closure returned. Before the fix the first run got
/// `Some(None)` and the retry `None` (on all three backends).
fn the_first_run_gets_what_a_retry_reads_back(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let claim = claimed(&mut conn);
    let run = |conn: &mut AnyConnection| {
        let nested: Option<Option<u32>> =
            jobs::run_step(conn, claim, "nested", |_| Ok::<_, JobError>(Some(None))).unwrap();
        let unit: Option<()> =
            jobs::run_step(conn, claim, "unit", |_| Ok::<_, JobError>(Some(()))).unwrap();
        let fetched: Fetched = jobs::run_step(conn, claim, "fetched", |_| {
            Ok::<_, JobError>(Fetched {
                rows: 3,
                cursor: Some("page-2".into()),
            })
        })
        .unwrap();
        let big: (u64, i64, i128) = jobs::run_step(conn, claim, "big", |_| {
            Ok::<_, JobError>((u64::MAX, i64::MIN, i128::MIN))
        })
        .unwrap();
        let text: String = jobs::run_step(conn, claim, "text", |_| {
            Ok::<_, JobError>("nul \0, quote \", ü, 🦀, \u{FEFF}".to_string())
        })
        .unwrap();
        (nested, unit, fetched, big, text)
    };
    let first = run(&mut conn);
    let retry = run(&mut conn);
    assert_eq!(first, retry, "the first run and a retry");
    assert_eq!(retry.2.rows, 3);
    assert_eq!(jobs::steps(&mut conn, claim.id).unwrap().len(), 5);
}

/// A value JSON cannot carry (a NaN or an infinity is written as `null`, which no `f64` reads
/// back; a map with non-string keys is not written at all): `Error::InvalidInput`, the
/// closure's write rolled back, nothing stored, the claim untouched (a step of another name
/// then commits). Before the fix the NaN was stored as `null` and its step returned it to the
/// first run, then failed every retry with a decode error (all three backends): a job that
/// could never complete.
fn a_value_json_cannot_carry_is_refused_and_commits_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let claim = claimed(&mut conn);
    let id = claim.id;
    let refused = |result: Result<(), StepError<JobError>>, what: &str| match result {
        Err(StepError::Tenure(Error::InvalidInput {
            field: "step result",
            ..
        })) => {}
        other => panic!("{what}: expected a refused step result, got {other:?}"),
    };
    refused(
        jobs::run_step(&mut conn, claim, "nan", |conn| {
            write(conn, id, "nan")?;
            Ok::<_, JobError>(f64::NAN)
        })
        .map(|_: f64| ()),
        "NaN",
    );
    refused(
        jobs::run_step(&mut conn, claim, "inf", |conn| {
            write(conn, id, "inf")?;
            Ok::<_, JobError>(vec![1.5, f64::INFINITY])
        })
        .map(|_: Vec<f64>| ()),
        "infinity",
    );
    refused(
        jobs::run_step(&mut conn, claim, "map", |conn| {
            write(conn, id, "map")?;
            Ok::<_, JobError>(HashMap::from([((1u8, 2u8), 3u8)]))
        })
        .map(|_: HashMap<(u8, u8), u8>| ()),
        "tuple keys",
    );
    assert_eq!(
        writes(&mut conn, id),
        0,
        "every refused step's write rolled back"
    );
    assert!(jobs::steps(&mut conn, id).unwrap().is_empty());
    // Refused, not stored: the same name with a value JSON carries commits.
    let ok: f64 = jobs::run_step(&mut conn, claim, "nan", |conn| {
        write(conn, id, "nan")?;
        Ok::<_, JobError>(0.5)
    })
    .unwrap();
    assert_eq!(ok, 0.5);
    let again: f64 =
        jobs::run_step(&mut conn, claim, "nan", |_| Ok::<_, JobError>(f64::NAN)).unwrap();
    assert_eq!(again, 0.5);
    assert_eq!(writes(&mut conn, id), 1);
}

/// Names that differ only in case, trailing spaces, Unicode normalisation, or that look like
/// SQL patterns, each at most 255 bytes (multi-byte characters up to the bound): each is its
/// own step, read back under its own name with its own value; the bound is in bytes.
fn odd_step_names_are_distinct_and_exact(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let claim = claimed(&mut conn);
    let names: Vec<String> = vec![
        "fetch".into(),
        "Fetch".into(),
        "FETCH".into(),
        "fetch ".into(),
        " fetch".into(),
        "fetch\t".into(),
        "café".into(),        // NFC
        "cafe\u{301}".into(), // NFD
        "🦀".into(),
        "%".into(),
        "_".into(),
        "f%".into(),
        "'; DROP TABLE tenure_steps; --".into(),
        "\\".into(),
        format!("{}x", "é".repeat(127)), // 255 bytes
        format!("{}y", "é".repeat(127)),
        "🦀".repeat(63) + "abc", // 255 bytes
        "n".repeat(255),
    ];
    for (i, name) in names.iter().enumerate() {
        assert!(name.len() <= 255, "{name:?}");
        let got: usize = jobs::run_step(&mut conn, claim, name, |_| Ok::<_, JobError>(i)).unwrap();
        assert_eq!(got, i, "{name:?}");
    }
    for (i, name) in names.iter().enumerate() {
        let got: usize =
            jobs::run_step(&mut conn, claim, name, |_| Ok::<_, JobError>(usize::MAX)).unwrap();
        assert_eq!(got, i, "{name:?} read back");
    }
    let mut stored: Vec<(String, usize)> = jobs::steps(&mut conn, claim.id)
        .unwrap()
        .into_iter()
        .map(|s| {
            let v = s.decode::<usize>().unwrap();
            (s.name, v)
        })
        .collect();
    stored.sort_by_key(|(_, v)| *v);
    let expected: Vec<(String, usize)> = names.iter().cloned().zip(0..).collect();
    assert_eq!(stored, expected);
    // One byte over, in a multi-byte character: refused before the closure.
    let over = format!("{}xy", "é".repeat(127));
    let refused = jobs::run_step(&mut conn, claim, &over, |_| -> Result<(), JobError> {
        panic!("must not run")
    });
    assert!(
        matches!(
            refused,
            Err(StepError::Tenure(Error::InvalidInput {
                field: "step name",
                ..
            }))
        ),
        "{refused:?}"
    );
}

/// A context made for a unit test keeps its steps itself: it too gives the first call the
/// value a second call reads back, and refuses a value JSON cannot carry.
fn a_test_context_gives_what_it_keeps(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    let ctx = testing::with_pool(testing::context("q", "k"), &pool);
    let first: Option<Option<u8>> = ctx.step("s", |_| Ok::<_, JobError>(Some(None))).unwrap();
    let again: Option<Option<u8>> = ctx.step("s", |_| Ok::<_, JobError>(Some(Some(1)))).unwrap();
    assert_eq!(first, again);
    let nan = ctx.step("nan", |_| Ok::<_, JobError>(f64::NAN));
    assert!(
        matches!(
            nan,
            Err(StepError::Tenure(Error::InvalidInput {
                field: "step result",
                ..
            }))
        ),
        "{nan:?}"
    );
    let ok: f64 = ctx.step("nan", |_| Ok::<_, JobError>(2.0)).unwrap();
    assert_eq!(ok, 2.0);
}

/// Forty quick steps, named in descending order, commit within a few of SQLite's
/// millisecond clock ticks: `jobs::steps` lists them as they committed, not by name among
/// those of one tick (which CI once showed as `<b>upload</b>` before `fetch`).
fn steps_are_listed_in_the_order_they_committed(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let claim = claimed(&mut conn);
    let names: Vec<String> = (0..40).rev().map(|i| format!("step {i:02}")).collect();
    for name in &names {
        jobs::run_step(&mut conn, claim, name, |_| Ok::<_, JobError>(1)).unwrap();
    }
    let listed: Vec<String> = jobs::steps(&mut conn, claim.id)
        .unwrap()
        .into_iter()
        .map(|step| step.name)
        .collect();
    assert_eq!(listed, names);
}
