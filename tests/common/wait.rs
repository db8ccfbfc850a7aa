//! The one deadline-bounded wait of the test suite: poll, sleep a little, and fail naming what
//! was awaited and for how long once the deadline is past. Bounds are generous (a loaded
//! machine): they bound a latency, never measure it.

use std::time::{Duration, Instant};

/// How long `wait_until` sleeps between probes.
pub const POLL: Duration = Duration::from_millis(10);

/// Calls `probe` until it gives `Some`, sleeping [`POLL`] between calls, and returns that
/// value. Panics, naming `what` and the bound, once `within` has passed (the probe is always
/// called at least once, and once more at the deadline).
#[track_caller]
pub fn wait_until<T>(what: &str, within: Duration, probe: impl FnMut() -> Option<T>) -> T {
    poll_until(within, POLL, probe)
        .unwrap_or_else(|| panic!("waited {within:?} for {what}, in vain"))
}

/// Like [`wait_until`] with a sleep of `every` between probes, and `None` (no panic) when
/// `within` passes: for tests that assert on the outcome themselves.
pub fn poll_until<T>(
    within: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = probe() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(every.min(deadline.saturating_duration_since(Instant::now())));
    }
}
