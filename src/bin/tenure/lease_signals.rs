//! `tenure lease run`'s signals: SIGINT, SIGTERM and SIGHUP are caught (to be forwarded to
//! the command), and before the command runs a signal the main thread does not pick up ends
//! the process.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::Failure;
use crate::lease_run::warn;

/// Set once the command runs: until then a signal the main thread does not pick up (it is
/// stuck connecting or asking for the lease on an unreachable database) ends the process.
pub static COMMAND_STARTED: AtomicBool = AtomicBool::new(false);

/// Signals received and not yet handled, one bit per signal number.
static PENDING: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Async-signal-safe: one lock-free atomic operation.
    PENDING.fetch_or(1 << signal, Ordering::SeqCst);
}

const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

pub fn catch_signals() -> Result<(), Failure> {
    for signal in FORWARDED {
        // SAFETY: a zeroed sigaction with a handler that only does an atomic fetch_or.
        let failed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) != 0
        };
        if failed {
            return Err(Failure::new(
                1,
                format!(
                    "cannot catch {}: {}",
                    signal_name(signal),
                    std::io::Error::last_os_error()
                ),
            ));
        }
    }
    Ok(())
}

/// Before the command runs, a signal left unhandled for a second means the main thread is
/// stuck (connecting, or asking for the lease, on a database that does not answer): end the
/// process with 128 + the signal, as if it had not been caught. No command runs yet; a lease
/// a stuck request may still grant expires after its ttl.
pub fn watch_signals_until_the_command_starts() {
    std::thread::spawn(|| {
        let mut seen_since: Option<Instant> = None;
        while !COMMAND_STARTED.load(Ordering::SeqCst) {
            let pending = PENDING.load(Ordering::SeqCst);
            match (pending, seen_since) {
                (0, _) => seen_since = None,
                (_, None) => seen_since = Some(Instant::now()),
                (bits, Some(since)) if since.elapsed() >= Duration::from_secs(1) => {
                    let signal = FORWARDED
                        .into_iter()
                        .find(|s| bits & (1 << s) != 0)
                        .unwrap_or(libc::SIGTERM);
                    warn(&format!(
                        "{} while the database did not answer: the command did not run",
                        signal_name(signal)
                    ));
                    std::process::exit(128 + signal);
                }
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

/// Whether a signal arrived that [`take_signals`] has not taken yet.
pub fn signals_pending() -> bool {
    PENDING.load(Ordering::SeqCst) != 0
}

/// The signals received since the last call.
pub fn take_signals() -> Vec<libc::c_int> {
    let bits = PENDING.swap(0, Ordering::SeqCst);
    FORWARDED
        .into_iter()
        .filter(|s| bits & (1 << s) != 0)
        .collect()
}

pub fn signal_name(signal: libc::c_int) -> String {
    match signal {
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGTERM => "SIGTERM".into(),
        other => format!("signal {other}"),
    }
}
