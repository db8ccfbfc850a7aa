//! Schedules after downtime: a missed tick fires once or is caught up, a long downtime costs
//! one tick without catch-up (counted in what `tick` allocates), and redeclaring an unchanged
//! schedule at a program's start keeps its overdue tick.

use std::time::Duration;

use chrono::Timelike;
use tenure::Backend;
use tenure::jobs::NewJob;
use tenure::schedules::{self, Schedule};

use super::{due_times, next_due_at, pretend_downtime};
use crate::common::{TestDb, conformance};

conformance!(
    after_downtime_a_schedule_fires_once_or_catches_up,
    a_long_downtime_costs_one_tick_without_catch_up,
    redeclaring_an_unchanged_schedule_keeps_its_overdue_tick,
);

fn after_downtime_a_schedule_fires_once_or_catches_up(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let interval = Duration::from_secs(10);
    schedules::upsert(
        &mut conn,
        &Schedule::every("once", interval, NewJob::new("once", "k", vec![])),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every("all", interval, NewJob::new("all", "k", vec![])).catch_up(true),
    )
    .unwrap();
    pretend_downtime(&mut conn, "once", interval, 10);
    pretend_downtime(&mut conn, "all", interval, 10);
    assert_eq!(schedules::tick(&mut conn).unwrap(), 11);
    assert_eq!(
        due_times(&mut conn, "once").len(),
        1,
        "default: once for all the missed ticks"
    );
    let all = due_times(&mut conn, "all");
    assert_eq!(all.len(), 10, "catch-up: every missed tick");
    // Nothing more is due until the next tick.
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0);
    let now = tenure::database_now(&mut conn).unwrap();
    for info in schedules::list(&mut conn).unwrap() {
        assert!(
            info.next_due_at > now && info.next_due_at <= now + chrono::Duration::seconds(10),
            "{info:?}"
        );
    }
    // The one job is the newest missed tick: one interval before the next.
    let once = schedules::list(&mut conn)
        .unwrap()
        .into_iter()
        .find(|s| s.name == "once")
        .unwrap();
    assert_eq!(
        due_times(&mut conn, "once")[0],
        once.next_due_at - chrono::Duration::seconds(10)
    );
}

/// Bytes this thread has asked the allocator for, in total (allocations and growths).
fn allocated_here() -> u64 {
    allocations::ALLOCATED.with(|n| n.get())
}

mod allocations {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        pub static ALLOCATED: Cell<u64> = const { Cell::new(0) };
    }

    fn count(bytes: usize) {
        let _ = ALLOCATED.try_with(|n| n.set(n.get() + bytes as u64));
    }

    /// The system allocator, counting per thread what each thread asks for: a deterministic
    /// measure of how much work a call does.
    struct Counting;

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            count(layout.size());
            unsafe { System.alloc(layout) }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            count(layout.size());
            unsafe { System.alloc_zeroed(layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            count(new_size);
            unsafe { System.realloc(ptr, layout, new_size) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;
}

/// Without catch-up, a schedule down for a long time costs one tick: the next tick is
/// computed from now, not walked to through every missed one. Measured by what `tick`
/// allocates (walking an hour of a 1 ms schedule holds 3.6 million ticks, about 43 MB;
/// walking a week of a every-second cron, about 7 MB), by the jobs it writes and by where it
/// leaves the schedule; never by elapsed time.
fn a_long_downtime_costs_one_tick_without_catch_up(backend: Backend) {
    const BOUND: u64 = 2 << 20;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let every_ms = Duration::from_millis(1);
    schedules::upsert(
        &mut conn,
        &Schedule::every("every-ms", every_ms, NewJob::new("every-ms", "k", vec![])),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::cron(
            "every-second",
            "* * * * * *",
            NewJob::new("every-second", "k", vec![]),
        ),
    )
    .unwrap();
    assert!(schedules::pause(&mut conn, "every-second").unwrap());
    pretend_downtime(&mut conn, "every-ms", every_ms, 3_600_000);
    let before = tenure::database_now(&mut conn).unwrap();
    let start = allocated_here();
    let fired = schedules::tick(&mut conn).unwrap();
    let spent = allocated_here() - start;
    let after = tenure::database_now(&mut conn).unwrap();
    assert_eq!(fired, 1, "once for all the missed ticks");
    assert_eq!(due_times(&mut conn, "every-ms").len(), 1);
    let next = next_due_at(&mut conn, "every-ms");
    assert!(
        next > before && next <= after + chrono::Duration::milliseconds(1),
        "the next tick is the first after the tick's now: {before} < {next} <= {after} + 1 ms"
    );
    assert!(
        spent < BOUND,
        "one tick after an hour's downtime of a 1 ms schedule allocated {spent} bytes"
    );
    // A cron schedule (every second), down a week.
    assert!(schedules::pause(&mut conn, "every-ms").unwrap());
    assert!(schedules::resume(&mut conn, "every-second").unwrap());
    pretend_downtime(&mut conn, "every-second", Duration::from_secs(1), 7 * 86400);
    let before = tenure::database_now(&mut conn).unwrap();
    let start = allocated_here();
    let fired = schedules::tick(&mut conn).unwrap();
    let spent = allocated_here() - start;
    let after = tenure::database_now(&mut conn).unwrap();
    assert_eq!(fired, 1, "once for all the missed ticks");
    let due = due_times(&mut conn, "every-second");
    assert_eq!(due.len(), 1);
    let next = next_due_at(&mut conn, "every-second");
    assert!(
        next > before && next <= after + chrono::Duration::seconds(1),
        "{before} < {next} <= {after} + 1 s"
    );
    // The job is the newest missed tick: a whole second, at most a second before the next.
    assert_eq!(due[0], next - chrono::Duration::seconds(1));
    assert!(
        spent < BOUND,
        "one tick after a week's downtime of an every-second cron allocated {spent} bytes"
    );
}

/// Declaring the same schedule again, as a program does at every start, keeps its next
/// tick, so the tick missed while the program was down still fires; a changed timing
/// (interval, cron expression, time zone) starts afresh from now.
fn redeclaring_an_unchanged_schedule_keeps_its_overdue_tick(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let interval = Duration::from_secs(10);
    let steady = |job: NewJob| Schedule::every("steady", interval, job);
    // A daily tick about 6 hours after the database's now (so 18 hours before it): the
    // pretended downtime below (the last half day) then never spans one of its ticks,
    // whatever the time of day and Lisbon's offset (0 or +1), so exactly the one overdue tick
    // fires. (At 03:00 it failed every morning between 03:00 and 15:00 UTC: a second tick
    // fell in the window.)
    let hour = (tenure::database_now(&mut conn).unwrap().hour() + 6) % 24;
    let expression = format!("0 {hour} * * *");
    let nightly = |job: NewJob| Schedule::cron("nightly", expression.as_str(), job);
    schedules::upsert(&mut conn, &steady(NewJob::new("steady", "k", vec![]))).unwrap();
    schedules::upsert(
        &mut conn,
        &nightly(NewJob::new("nightly", "k", vec![])).time_zone("Europe/Lisbon"),
    )
    .unwrap();
    pretend_downtime(&mut conn, "steady", interval, 3);
    pretend_downtime(&mut conn, "nightly", Duration::from_secs(86400), 1);
    let overdue = [
        next_due_at(&mut conn, "steady"),
        next_due_at(&mut conn, "nightly"),
    ];
    // Start-up: the same timing, the job's details changed or not.
    schedules::upsert(&mut conn, &steady(NewJob::new("steady", "k", vec![]))).unwrap();
    schedules::upsert(
        &mut conn,
        &nightly(NewJob::new("nightly", "k", b"v2".to_vec()).priority(3))
            .time_zone("Europe/Lisbon")
            .catch_up(true),
    )
    .unwrap();
    assert_eq!(
        [
            next_due_at(&mut conn, "steady"),
            next_due_at(&mut conn, "nightly")
        ],
        overdue
    );
    assert_eq!(
        schedules::tick(&mut conn).unwrap(),
        2,
        "the overdue ticks fire"
    );
    assert_eq!(due_times(&mut conn, "steady").len(), 1);
    assert_eq!(due_times(&mut conn, "nightly").len(), 1);
    // A changed timing starts afresh: nothing is overdue.
    pretend_downtime(&mut conn, "steady", interval, 3);
    pretend_downtime(&mut conn, "nightly", Duration::from_secs(86400), 1);
    let now = tenure::database_now(&mut conn).unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every("steady", interval * 2, NewJob::new("steady", "k", vec![])),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &nightly(NewJob::new("nightly", "k", vec![])).time_zone("Asia/Tokyo"),
    )
    .unwrap();
    assert!(next_due_at(&mut conn, "steady") > now);
    assert!(next_due_at(&mut conn, "nightly") > now);
    pretend_downtime(&mut conn, "nightly", Duration::from_secs(86400), 1);
    schedules::upsert(
        &mut conn,
        &Schedule::cron(
            "nightly",
            format!("0 {} * * *", (hour + 1) % 24),
            NewJob::new("nightly", "k", vec![]),
        )
        .time_zone("Asia/Tokyo"),
    )
    .unwrap();
    assert!(next_due_at(&mut conn, "nightly") > now);
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0);
}
