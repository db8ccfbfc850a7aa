//! A schedule's timing: which instants are its ticks, and which of them are due.

use std::str::FromStr;

use chrono::{DateTime, Utc};

use super::{MAX_TICKS_PER_CALL, Spec};
use crate::{Error, Result, validate};

/// A parsed schedule timing: what computes the ticks.
pub(super) enum Timing {
    Cron(Box<croner::Cron>, chrono_tz::Tz),
    Every(chrono::Duration),
}

/// The ticks one [`super::tick`] fires for a due schedule, and the schedule's next tick.
pub(super) struct Due {
    pub fire: Vec<DateTime<Utc>>,
    pub next: DateTime<Utc>,
}

impl Timing {
    pub(super) fn new(spec: &Spec, zone: &str) -> Result<Timing> {
        let tz = chrono_tz::Tz::from_str(zone).map_err(|_| {
            Error::invalid("time zone", format!("{zone:?} is not an IANA time zone"))
        })?;
        match spec {
            Spec::Cron(expression) => {
                let fields = expression.split_whitespace().count();
                if !(fields == 5 || fields == 6) {
                    return Err(Error::invalid(
                        "cron expression",
                        format!(
                            "{expression:?} has {fields} fields; use 5, or 6 with seconds first"
                        ),
                    ));
                }
                let cron = croner::parser::CronParser::builder()
                    .seconds(croner::parser::Seconds::Optional)
                    .build()
                    .parse(expression)
                    .map_err(|e| {
                        Error::invalid("cron expression", format!("{expression:?}: {e}"))
                    })?;
                Ok(Timing::Cron(Box::new(cron), tz))
            }
            Spec::Every(interval) => {
                let micros = validate::ttl(*interval).map_err(|_| {
                    Error::invalid(
                        "interval",
                        format!("{interval:?} is not between 1 ms and 366 days"),
                    )
                })?;
                Ok(Timing::Every(chrono::Duration::microseconds(micros)))
            }
        }
    }

    /// The first tick strictly after `after`.
    pub(super) fn next_after(&self, after: DateTime<Utc>) -> Result<DateTime<Utc>> {
        match self {
            Timing::Every(interval) => after
                .checked_add_signed(*interval)
                .ok_or_else(|| out_of_range(after)),
            Timing::Cron(cron, tz) => {
                let next = |from: DateTime<Utc>, inclusive: bool| {
                    cron.find_next_occurrence(&from.with_timezone(tz), inclusive)
                        .map(|at| at.with_timezone(&Utc))
                };
                // The cron library gives up on a day the zone skipped (Samoa's 2011-12-30):
                // search again from the day after, where local time exists.
                let mut found = next(after, false);
                for days in 1..=SKIPPED_DAYS_SEARCHED {
                    if found.is_ok() {
                        break;
                    }
                    if let Some(later) = after.checked_add_signed(chrono::Duration::days(days)) {
                        found = next(later, true);
                    }
                }
                found.map_err(|e| Error::invalid("cron expression", format!("no next tick: {e}")))
            }
        }
    }

    /// The last tick strictly before `before`, if there is one.
    pub(super) fn previous_before(&self, before: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Timing::Every(interval) => before.checked_sub_signed(*interval),
            Timing::Cron(cron, tz) => cron
                .find_previous_occurrence(&before.with_timezone(tz), false)
                .ok()
                .map(|at| at.with_timezone(&Utc)),
        }
    }

    /// What to fire for a schedule whose tick `due` is at or before `now`: with catch-up,
    /// the ticks from `due` on, at most [`MAX_TICKS_PER_CALL`] (the next call goes on);
    /// without, only the newest tick at or before `now`, and the next is the first after
    /// `now`. Either way the work does not grow with the downtime.
    pub(super) fn due(
        &self,
        due: DateTime<Utc>,
        now: DateTime<Utc>,
        catch_up: bool,
    ) -> Result<Due> {
        if catch_up {
            let (fire, next) = self.due_ticks(due, now, MAX_TICKS_PER_CALL)?;
            return Ok(Due { fire, next });
        }
        let newest = self.newest_at_or_before(due, now)?;
        let next = match self {
            // The newest tick plus one interval is past now by construction.
            Timing::Every(_) => self.next_after(newest)?,
            Timing::Cron(..) => self.next_after(newest.max(now))?,
        };
        Ok(Due {
            fire: vec![newest],
            next,
        })
    }

    /// Ticks from `due` (a tick) up to and including `now`, at most `cap` of them, and the
    /// first tick after those.
    fn due_ticks(
        &self,
        due: DateTime<Utc>,
        now: DateTime<Utc>,
        cap: usize,
    ) -> Result<(Vec<DateTime<Utc>>, DateTime<Utc>)> {
        let mut ticks = vec![due];
        let mut next = self.next_after(due)?;
        while next <= now && ticks.len() < cap {
            ticks.push(next);
            next = self.next_after(next)?;
        }
        Ok((ticks, next))
    }

    /// The newest tick at or before `now`, counting from the tick `due` (itself when `now`
    /// is before the next): arithmetic for an interval, a backward search for cron.
    fn newest_at_or_before(&self, due: DateTime<Utc>, now: DateTime<Utc>) -> Result<DateTime<Utc>> {
        if now <= due {
            return Ok(due);
        }
        match self {
            Timing::Every(interval) => {
                let step = interval.num_microseconds().filter(|s| *s > 0);
                let elapsed = (now - due).num_microseconds();
                let (Some(step), Some(elapsed)) = (step, elapsed) else {
                    return Err(out_of_range(due));
                };
                // Whole intervals since `due`: at most `elapsed`, so it cannot overflow.
                let whole = elapsed - elapsed % step;
                due.checked_add_signed(chrono::Duration::microseconds(whole))
                    .ok_or_else(|| out_of_range(due))
            }
            Timing::Cron(cron, tz) => {
                // The last matching wall-clock time at or before now; a tick moved out of a
                // spring-forward gap is not one, hence the short forward walk after it.
                let mut newest = cron
                    .find_previous_occurrence(&now.with_timezone(tz), true)
                    .map(|at| at.with_timezone(&Utc))
                    .map_or(due, |previous| previous.max(due));
                for _ in 0..CRON_FORWARD_STEPS {
                    let next = self.next_after(newest)?;
                    if next > now {
                        break;
                    }
                    newest = next;
                }
                Ok(newest)
            }
        }
    }
}

/// How many days past `after` a cron search starts again when the cron library gives up on a
/// day its zone skipped.
const SKIPPED_DAYS_SEARCHED: i64 = 2;

/// How far [`Timing::newest_at_or_before`] walks forward from the backward search's answer
/// (a DST gap moves at most a tick or two past it).
const CRON_FORWARD_STEPS: usize = 8;

fn out_of_range(at: DateTime<Utc>) -> Error {
    Error::invalid("schedule", format!("its ticks after {at} are out of range"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    fn cron(expression: &str, zone: &str) -> Timing {
        Timing::new(&Spec::Cron(expression.to_string()), zone).unwrap()
    }

    #[test]
    fn five_and_six_field_expressions() {
        let daily = cron("30 4 * * *", "UTC");
        assert_eq!(
            daily.next_after(at("2026-11-30T04:30:00Z")).unwrap(),
            at("2026-12-01T04:30:00Z")
        );
        let seconds = cron("*/15 * * * * *", "UTC");
        assert_eq!(
            seconds.next_after(at("2026-11-30T04:30:01Z")).unwrap(),
            at("2026-11-30T04:30:15Z")
        );
        let weekdays = cron("0 9 * * MON-FRI", "UTC");
        // 2026-11-28 is a Saturday.
        assert_eq!(
            weekdays.next_after(at("2026-11-28T10:00:00Z")).unwrap(),
            at("2026-11-30T09:00:00Z")
        );
    }

    #[test]
    fn time_zones_and_dst() {
        let nine = cron("0 9 * * *", "America/New_York");
        // EDT (UTC-4) in October, EST (UTC-5) in December.
        assert_eq!(
            nine.next_after(at("2026-10-01T00:00:00Z")).unwrap(),
            at("2026-10-01T13:00:00Z")
        );
        assert_eq!(
            nine.next_after(at("2026-12-01T00:00:00Z")).unwrap(),
            at("2026-12-01T14:00:00Z")
        );
        // Spring forward, 2026-03-08: 02:30 does not exist; it fires at the first instant
        // after the gap (03:00 EDT = 07:00 UTC).
        let gap = cron("30 2 * * *", "America/New_York");
        assert_eq!(
            gap.next_after(at("2026-03-08T05:00:00Z")).unwrap(),
            at("2026-03-08T07:00:00Z")
        );
        // Fall back, 2026-11-01: 01:30 happens twice; it fires once, at the first (EDT).
        let overlap = cron("30 1 * * *", "America/New_York");
        let first = overlap.next_after(at("2026-11-01T04:00:00Z")).unwrap();
        assert_eq!(first, at("2026-11-01T05:30:00Z"));
        assert_eq!(
            overlap.next_after(first).unwrap(),
            at("2026-11-02T06:30:00Z")
        );
    }

    #[test]
    fn invalid_expressions_and_zones_are_typed_errors() {
        for bad in [
            "",
            "* * *",
            "61 * * * *",
            "* * * * * * * *",
            "every day",
            "0 9 * * FUNDAY",
        ] {
            let err = Timing::new(&Spec::Cron(bad.to_string()), "UTC")
                .err()
                .expect(bad);
            assert!(err.is_invalid_input(), "{bad:?}: {err:?}");
        }
        assert!(
            Timing::new(&Spec::Cron("0 9 * * *".into()), "Mars/Olympus")
                .err()
                .unwrap()
                .is_invalid_input()
        );
        assert!(
            Timing::new(&Spec::Every(Duration::ZERO), "UTC")
                .err()
                .unwrap()
                .is_invalid_input()
        );
    }

    #[test]
    fn missed_ticks_are_counted() {
        let every = Timing::Every(chrono::Duration::seconds(10));
        let (ticks, next) = every
            .due_ticks(
                at("2026-01-01T00:00:00Z"),
                at("2026-01-01T00:01:35Z"),
                usize::MAX,
            )
            .unwrap();
        assert_eq!(ticks.len(), 10);
        assert_eq!(next, at("2026-01-01T00:01:40Z"));
        let (capped, next) = every
            .due_ticks(at("2026-01-01T00:00:00Z"), at("2026-01-01T00:01:35Z"), 3)
            .unwrap();
        assert_eq!((capped.len(), next), (3, at("2026-01-01T00:00:30Z")));
    }

    #[test]
    fn without_catch_up_the_newest_missed_tick_is_computed_not_walked() {
        let every = Timing::Every(chrono::Duration::milliseconds(1));
        let start = at("2016-01-01T00:00:00.0005Z");
        let now = at("2026-01-01T00:00:00.0003Z");
        let due = every.due(start, now, false).unwrap();
        assert_eq!(due.fire, vec![at("2025-12-31T23:59:59.9995Z")]);
        assert_eq!(due.next, at("2026-01-01T00:00:00.0005Z"));
        // A tick exactly now is due.
        let due = every
            .due(start, at("2016-01-01T00:00:10.0005Z"), false)
            .unwrap();
        assert_eq!(due.fire, vec![at("2016-01-01T00:00:10.0005Z")]);
        assert_eq!(due.next, at("2016-01-01T00:00:10.0015Z"));

        let seconds = cron("* * * * * *", "UTC");
        let due = seconds
            .due(
                at("2016-01-01T00:00:00Z"),
                at("2026-01-01T10:20:30.4Z"),
                false,
            )
            .unwrap();
        assert_eq!(due.fire, vec![at("2026-01-01T10:20:30Z")]);
        assert_eq!(due.next, at("2026-01-01T10:20:31Z"));
        let nightly = cron("0 3 * * *", "Europe/Lisbon");
        let due = nightly
            .due(
                at("2020-06-01T02:00:00Z"),
                at("2026-07-10T12:00:00Z"),
                false,
            )
            .unwrap();
        assert_eq!(due.fire, vec![at("2026-07-10T02:00:00Z")]);
        assert_eq!(due.next, at("2026-07-11T02:00:00Z"));
        // With catch-up: the first MAX_TICKS_PER_CALL ticks, then the next call goes on.
        let due = seconds
            .due(at("2016-01-01T00:00:00Z"), at("2026-01-01T00:00:00Z"), true)
            .unwrap();
        assert_eq!(due.fire.len(), MAX_TICKS_PER_CALL);
        assert_eq!(due.next, at("2016-01-01T00:16:40Z"));
    }

    #[test]
    fn the_newest_missed_tick_across_dst() {
        // Spring forward: 02:30 does not exist on 2026-03-08; that day's tick is 07:00 UTC.
        let gap = cron("30 2 * * *", "America/New_York");
        let due = gap
            .due(
                at("2026-03-01T07:30:00Z"),
                at("2026-03-08T08:00:00Z"),
                false,
            )
            .unwrap();
        assert_eq!(due.fire, vec![at("2026-03-08T07:00:00Z")]);
        assert_eq!(due.next, at("2026-03-09T06:30:00Z"));
        // Due at the gap's tick, now just after it: that tick itself.
        let due = gap
            .due(
                at("2026-03-08T07:00:00Z"),
                at("2026-03-08T07:00:01Z"),
                false,
            )
            .unwrap();
        assert_eq!(due.fire, vec![at("2026-03-08T07:00:00Z")]);
        assert_eq!(due.next, at("2026-03-09T06:30:00Z"));
        // Fall back: 01:30 happens twice on 2026-11-01; the next tick after now is the day
        // after.
        let overlap = cron("30 1 * * *", "America/New_York");
        let due = overlap
            .due(
                at("2026-10-20T05:30:00Z"),
                at("2026-11-01T07:00:00Z"),
                false,
            )
            .unwrap();
        assert_eq!(due.fire.len(), 1);
        assert!(due.fire[0] <= at("2026-11-01T07:00:00Z"));
        assert!(due.fire[0] >= at("2026-11-01T05:30:00Z"));
        assert_eq!(due.next, at("2026-11-02T06:30:00Z"));
    }
}
