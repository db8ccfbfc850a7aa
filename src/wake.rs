//! Wake-ups inside this process: an enqueue wakes the idle workers of its queues at once, on
//! every backend (PostgreSQL's NOTIFY also reaches other processes). The queue layer calls
//! [`wake`]; workers [`register`] themselves. Neither knows the other.

use std::sync::{Arc, Mutex, PoisonError, Weak};

/// Something that wants to hear of new jobs: a running worker.
pub(crate) trait Waker: Send + Sync {
    /// A job of `queue` may be due now. A wake-up for a job not committed yet only costs an
    /// empty claim.
    fn wake(&self, queue: &str);
}

static WAKERS: Mutex<Vec<Weak<dyn Waker>>> = Mutex::new(Vec::new());

/// Adds a waker for as long as it lives.
pub(crate) fn register(waker: Weak<dyn Waker>) {
    let mut wakers = WAKERS.lock().unwrap_or_else(PoisonError::into_inner);
    wakers.retain(|w| w.strong_count() > 0);
    wakers.push(waker);
}

/// Wakes this process's wakers for `queues` (called after an enqueue).
pub(crate) fn wake<'q>(queues: impl IntoIterator<Item = &'q str>) {
    let wakers: Vec<Arc<dyn Waker>> = {
        let wakers = WAKERS.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.iter().filter_map(Weak::upgrade).collect()
    };
    if wakers.is_empty() {
        return;
    }
    let queues: Vec<&str> = queues.into_iter().collect();
    for waker in wakers {
        for queue in &queues {
            waker.wake(queue);
        }
    }
}
