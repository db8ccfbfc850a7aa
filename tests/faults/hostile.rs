//! Hostile input: property tests over the public API's inputs. Everything is stored and
//! returned verbatim, or refused with a typed error that writes nothing; never a panic.
//! Case counts are bounded (CI runs them on every backend).

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseResult, TestRunner};
use tenure::jobs::{self, NewJob};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count};

conformance!(
    job_fields_round_trip_or_are_refused,
    lease_names_and_ttls_round_trip_or_are_refused,
    a_batch_with_one_bad_job_writes_nothing,
);

fn runner(backend: Backend) -> TestRunner {
    let cases = if backend == Backend::Sqlite { 256 } else { 64 };
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Strings an attacker or a careless caller would try: SQL, quotes, NULs, wide characters,
/// empty, at and past the 255-byte limit, and arbitrary text.
fn nasty_string() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => prop::sample::select(vec![
            "'; DROP TABLE tenure_jobs; --".to_string(),
            "\" OR 1=1 --".to_string(),
            "\\".to_string(),
            "\\'".to_string(),
            "a\0b".to_string(),
            "\0".to_string(),
            String::new(),
            " ".to_string(),
            "Job".to_string(),
            "job ".to_string(),
            "ü€😀".to_string(),
            "%_".to_string(),
            "x".repeat(255),
            "x".repeat(256),
            "é".repeat(128),
            "😀".repeat(64),
        ]),
        3 => prop::collection::vec(any::<char>(), 1..80).prop_map(|c| c.into_iter().collect()),
    ]
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 255 && !name.contains('\0')
}

fn jobs_count(conn: &mut AnyConnection) -> i64 {
    count(conn, "SELECT COUNT(*) AS n FROM tenure_jobs")
}

fn job_fields_round_trip_or_are_refused(backend: Backend) {
    let db = TestDb::migrated(backend);
    let cell = std::cell::RefCell::new(db.connect());
    let tally = std::cell::Cell::new((0usize, 0usize));
    let fields = (
        nasty_string(),
        nasty_string(),
        prop::collection::vec(any::<u8>(), 0..2048),
        any::<i32>(),
        prop_oneof![4 => 0u64..10_000, 1 => any::<u64>()],
        prop_oneof![8 => 1u32..30, 1 => Just(0u32), 1 => any::<u32>()],
    );
    runner(backend)
        .run(
            &fields,
            |(queue, kind, payload, priority, delay_ms, attempts)| {
                let mut held = cell.borrow_mut();
                let conn: &mut AnyConnection = &mut held;
                let before = jobs_count(conn);
                let delay = Duration::from_millis(delay_ms);
                let job = NewJob::new(queue.as_str(), kind.as_str(), payload.clone())
                    .priority(priority)
                    .delay(delay)
                    .max_attempts(attempts);
                let should_work = valid_name(&queue)
                    && valid_name(&kind)
                    && (1..=jobs::MAX_ATTEMPTS).contains(&attempts)
                    && delay <= Duration::from_secs(366 * 86400);
                match jobs::enqueue(conn, &job) {
                    Ok(enqueued) => {
                        tally.set((tally.get().0 + 1, tally.get().1));
                        prop_assert!(
                            should_work,
                            "accepted {queue:?} {kind:?} {attempts} {delay:?}"
                        );
                        let stored = jobs::get(conn, enqueued.id).unwrap().unwrap();
                        prop_assert_eq!(&stored.queue, &queue);
                        prop_assert_eq!(&stored.kind, &kind);
                        prop_assert_eq!(&stored.payload, &payload);
                        prop_assert_eq!(stored.priority, priority);
                        prop_assert_eq!(stored.max_attempts, attempts);
                        prop_assert_eq!(jobs_count(conn), before + 1);
                    }
                    Err(e) => {
                        tally.set((tally.get().0, tally.get().1 + 1));
                        prop_assert!(e.is_invalid_input(), "not a typed refusal: {e:?}");
                        prop_assert!(!should_work, "refused valid input: {e}");
                        prop_assert_eq!(jobs_count(conn), before);
                    }
                }
                Ok(())
            },
        )
        .unwrap();
    let (accepted, refused) = tally.get();
    println!(
        "{backend} job_fields_round_trip_or_are_refused: {accepted} accepted and verified, {refused} refused with a typed error, 0 partial writes"
    );
    assert!(
        accepted > 0 && refused > 0,
        "both outcomes exercised: {accepted} / {refused}"
    );
}

fn lease_names_and_ttls_round_trip_or_are_refused(backend: Backend) {
    let db = TestDb::migrated(backend);
    let cell = std::cell::RefCell::new(db.connect());
    let tally = std::cell::Cell::new((0usize, 0usize));
    let inputs = (
        nasty_string(),
        nasty_string(),
        prop_oneof![1 => 0u64..5, 8 => 1_000u64..100_000_000, 1 => any::<u64>()],
    );
    runner(backend)
        .run(&inputs, |(name, holder, ttl_micros)| {
            let mut held = cell.borrow_mut();
            let conn: &mut AnyConnection = &mut held;
            let ttl = Duration::from_micros(ttl_micros);
            let should_work = valid_name(&name)
                && holder.len() <= 255
                && !holder.contains('\0')
                && ttl >= Duration::from_millis(1)
                && ttl <= Duration::from_secs(366 * 86400);
            let rows = count(conn, "SELECT COUNT(*) AS n FROM tenure_leases");
            match tenure::lease::try_take(conn, &name, ttl, &holder) {
                Ok(Some(mut lease)) => {
                    tally.set((tally.get().0 + 1, tally.get().1));
                    prop_assert!(should_work, "accepted {name:?} {holder:?} {ttl:?}");
                    let info = tenure::lease::inspect(conn, &name).unwrap().unwrap();
                    prop_assert_eq!(&info.name, &name);
                    prop_assert_eq!(&info.holder, &holder);
                    prop_assert!(lease.release(conn).unwrap());
                }
                Ok(None) => prop_assert!(false, "{name:?} was taken by nobody else"),
                Err(e) => {
                    tally.set((tally.get().0, tally.get().1 + 1));
                    prop_assert!(e.is_invalid_input(), "not a typed refusal: {e:?}");
                    prop_assert!(!should_work, "refused valid input: {e}");
                    prop_assert_eq!(count(conn, "SELECT COUNT(*) AS n FROM tenure_leases"), rows);
                }
            }
            Ok(())
        })
        .unwrap();
    let (accepted, refused) = tally.get();
    println!(
        "{backend} lease_names_and_ttls_round_trip_or_are_refused: {accepted} accepted and verified, {refused} refused with a typed error, 0 partial writes"
    );
    assert!(
        accepted > 0 && refused > 0,
        "both outcomes exercised: {accepted} / {refused}"
    );
}

fn a_batch_with_one_bad_job_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let cell = std::cell::RefCell::new(db.connect());
    let tally = std::cell::Cell::new((0usize, 0usize));
    let cases = (
        1usize..1500,
        prop::option::weighted(0.5, (0usize..1500, nasty_string())),
    );
    let cases_run = if backend == Backend::Sqlite { 32 } else { 16 };
    let mut runner_small = TestRunner::new(Config {
        cases: cases_run,
        failure_persistence: None,
        ..Config::default()
    });
    let case = |(size, bad): (usize, Option<(usize, String)>)| -> TestCaseResult {
        let mut held = cell.borrow_mut();
        let conn: &mut AnyConnection = &mut held;
        let before = jobs_count(conn);
        let mut batch: Vec<NewJob> = (0..size)
            .map(|i| NewJob::new("bulk", "k", i.to_le_bytes().to_vec()))
            .collect();
        let mut all_valid = size > 0;
        if let Some((at, queue)) = bad
            && size > 0
        {
            all_valid = valid_name(&queue);
            batch[at % size] = NewJob::new(queue.as_str(), "k", vec![]);
        }
        match jobs::enqueue_many(conn, &batch) {
            Ok(enqueued) => {
                tally.set((tally.get().0 + 1, tally.get().1));
                prop_assert!(all_valid);
                prop_assert_eq!(enqueued.len(), size);
                prop_assert_eq!(jobs_count(conn), before + size as i64);
            }
            Err(e) => {
                tally.set((tally.get().0, tally.get().1 + 1));
                prop_assert!(e.is_invalid_input(), "not a typed refusal: {e:?}");
                prop_assert!(!all_valid, "refused a valid batch: {e}");
                prop_assert_eq!(jobs_count(conn), before);
            }
        }
        Ok(())
    };
    // Both outcomes, whatever the random cases turn out to be (16 of them can all be valid).
    case((3, None)).unwrap();
    case((3, Some((1, String::new())))).unwrap();
    runner_small.run(&cases, case).unwrap();
    let (accepted, refused) = tally.get();
    println!(
        "{backend} a_batch_with_one_bad_job_writes_nothing: {accepted} accepted and verified, {refused} refused with a typed error, 0 partial writes"
    );
    assert!(
        accepted > 0 && refused > 0,
        "both outcomes exercised: {accepted} / {refused}"
    );
}

/// The parsers of external text: cron expressions and time zones (through
/// `schedules::upsert`), and database URLs. Typed errors, never a panic.
#[cfg(feature = "sqlite")]
#[test]
fn cron_expressions_zones_and_urls_never_panic() {
    let db = TestDb::migrated(Backend::Sqlite);
    let cell = std::cell::RefCell::new(db.connect());
    let token = prop::sample::select(vec![
        "*",
        "*/0",
        "*/5",
        "0",
        "59",
        "60",
        "-1",
        "1-5",
        "5-1",
        "1,2,3",
        "L",
        "?",
        "W",
        "#",
        "MON",
        "mon-fri",
        "JAN",
        "99999999999999999999",
        "",
        " ",
        "*/",
        "1/0",
        "0-0/0",
    ]);
    let expression = prop_oneof![
        prop::collection::vec(token, 0..9).prop_map(|t| t.join(" ")),
        prop::collection::vec(any::<char>(), 0..40).prop_map(|c| c.into_iter().collect::<String>()),
    ];
    let zone = prop_oneof![
        prop::sample::select(vec![
            "UTC",
            "Europe/Lisbon",
            "America/New_York",
            "Mars/Olympus",
            "",
            "\0",
            "+05:00"
        ])
        .prop_map(str::to_string),
        prop::collection::vec(any::<char>(), 0..20).prop_map(|c| c.into_iter().collect::<String>()),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 512,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&(expression, zone), |(expression, zone)| {
            let mut held = cell.borrow_mut();
            let conn: &mut AnyConnection = &mut held;
            let schedule = tenure::schedules::Schedule::cron(
                "hostile",
                expression.as_str(),
                NewJob::new("q", "k", vec![]),
            )
            .time_zone(zone.as_str());
            let before = count(conn, "SELECT COUNT(*) AS n FROM tenure_schedules");
            match tenure::schedules::upsert(conn, &schedule) {
                Ok(()) => {
                    tenure::schedules::remove(conn, "hostile").unwrap();
                }
                Err(e) => {
                    prop_assert!(e.is_invalid_input(), "{expression:?} in {zone:?}: {e:?}");
                    prop_assert_eq!(
                        count(conn, "SELECT COUNT(*) AS n FROM tenure_schedules"),
                        before
                    );
                }
            }
            Ok(())
        })
        .unwrap();
    let url = prop_oneof![
        prop::collection::vec(any::<char>(), 0..60).prop_map(|c| c.into_iter().collect::<String>()),
        (
            prop::sample::select(vec![
                "postgres://",
                "postgresql://",
                "mysql://",
                "mariadb://",
                "sqlite://",
                "file:",
                "http://",
                ""
            ]),
            prop::collection::vec(any::<char>(), 0..40)
        )
            .prop_map(|(scheme, rest)| format!("{scheme}{}", rest.into_iter().collect::<String>())),
    ];
    runner
        .run(&url, |url| {
            // Parsing only: connecting to arbitrary hosts is not this test's business.
            let _ = Backend::from_url(&url);
            Ok(())
        })
        .unwrap();
}
