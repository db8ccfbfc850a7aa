//! Writers of one process take turns on an SQLite file, first come first served.
//!
//! SQLite has one writer per file, and a connection that finds the write lock taken sleeps in
//! growing steps (up to 100 ms) until its busy timeout. Between two of its looks, the other
//! writers of the process can take the lock again and again, so under load a writer can lose
//! every time and fail with "database is locked" after its whole timeout while the others
//! make progress. tenure therefore queues the writers of one process per database file: each
//! takes a [`Turn`] (a FIFO ticket lock) before it asks SQLite for the write lock and gives
//! it back after its commit or rollback. SQLite's busy timeout still applies between
//! processes, where no such queue exists.
//!
//! A writer waits for its turn at most its connection's busy timeout, and then fails as SQLite
//! would ("database is locked", retryable), so a connection that waits on another one of the
//! same thread (a write inside another connection's transaction) cannot hang.

#![cfg_attr(not(feature = "sqlite"), allow(dead_code))]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// A FIFO lock: turns are granted in the order they were asked for. (`std::sync::Mutex` is
/// not fair: a thread that releases it and asks again at once usually wins again.)
#[derive(Default)]
pub(crate) struct FairLock {
    queue: Mutex<Queue>,
    changed: Condvar,
}

#[derive(Default)]
struct Queue {
    next_ticket: u64,
    /// Tickets of the waiting writers, oldest first.
    waiting: VecDeque<u64>,
    held: bool,
}

/// One writer's turn; dropping it lets the next writer in the queue go.
pub(crate) struct Turn {
    lock: Arc<FairLock>,
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Turn")
    }
}

/// The queue's state is a few integers, always consistent between statements: a panic
/// elsewhere while holding the mutex cannot leave it half-changed, so poisoning is ignored.
fn lock_queue(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl FairLock {
    /// Waits for this caller's turn, at most `timeout`; `None` if it did not come in time.
    pub(crate) fn acquire(self: &Arc<Self>, timeout: Duration) -> Option<Turn> {
        let mut queue = lock_queue(&self.queue);
        if !queue.held && queue.waiting.is_empty() {
            queue.held = true;
            return Some(Turn { lock: self.clone() });
        }
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue.waiting.push_back(ticket);
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if !queue.held && queue.waiting.front() == Some(&ticket) {
                queue.waiting.pop_front();
                queue.held = true;
                // The next in line may have to see that it is now first.
                self.changed.notify_all();
                return Some(Turn { lock: self.clone() });
            }
            let now = Instant::now();
            let left = match deadline {
                Some(deadline) if deadline > now => deadline - now,
                Some(_) => {
                    queue.waiting.retain(|t| *t != ticket);
                    // If this ticket was first, the one behind it is first now.
                    self.changed.notify_all();
                    return None;
                }
                // A timeout too long to represent: wait in long steps.
                None => Duration::from_secs(3600),
            };
            queue = match self.changed.wait_timeout(queue, left) {
                Ok((queue, _)) => queue,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut queue = lock_queue(&self.lock.queue);
        queue.held = false;
        drop(queue);
        self.lock.changed.notify_all();
    }
}

/// The lock of one database file (by the path SQLite reports), shared by the whole process.
/// The registry keeps weak references: a lock lives while someone holds or waits for it.
pub(crate) fn for_file(path: &str) -> Arc<FairLock> {
    static LOCKS: OnceLock<Mutex<HashMap<String, Weak<FairLock>>>> = OnceLock::new();
    let mut locks = LOCKS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(lock) = locks.get(path).and_then(Weak::upgrade) {
        return lock;
    }
    locks.retain(|_, lock| lock.strong_count() > 0);
    let lock = Arc::new(FairLock::default());
    locks.insert(path.to_string(), Arc::downgrade(&lock));
    lock
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_are_granted_in_the_order_asked() {
        let lock = Arc::new(FairLock::default());
        let first = lock.acquire(Duration::ZERO).expect("free");
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for i in 0..5 {
            let (shared, order) = (lock.clone(), order.clone());
            threads.push(std::thread::spawn(move || {
                let turn = shared.acquire(Duration::from_secs(60)).expect("a turn");
                order.lock().unwrap().push(i);
                drop(turn);
            }));
            // Each thread is in the queue before the next one asks.
            while lock_queue(&lock.queue).waiting.len() < i + 1 {
                std::thread::yield_now();
            }
        }
        drop(first);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_timed_out_waiter_leaves_the_queue() {
        let lock = Arc::new(FairLock::default());
        let held = lock.acquire(Duration::ZERO).expect("free");
        assert!(lock.acquire(Duration::from_millis(20)).is_none());
        assert!(lock_queue(&lock.queue).waiting.is_empty());
        drop(held);
        assert!(lock.acquire(Duration::ZERO).is_some());
    }
}
