//! SQLite: a worker's lock file. Every process that shares an SQLite file runs on one host
//! (WAL needs shared memory), so the kernel can say whether a worker's process lives: the
//! worker holds an exclusive `flock` on `<database>-workers/<id>` for its life, and the
//! kernel releases it when the process ends, however it ends.
//!
//! Why `flock` and not a pid with its start time: a pid means nothing in another pid
//! namespace (two containers sharing the database's volume), while a `flock` is on the file
//! itself, for every process of the kernel. Why not `fcntl` locks: those belong to the
//! process, so a second open of the file in the same process would not conflict (a rescuer
//! thread would take a live worker of its own process for dead) and closing any descriptor
//! of the file would drop the lock. The descriptor is opened close-on-exec (Rust's default),
//! so a command the worker runs does not inherit the lock and keep it past the worker's death.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use super::LockSpace;
use crate::{Error, Result};

/// An exclusive lock on a worker's lock file, held until dropped.
#[derive(Debug)]
pub(crate) struct FileLock {
    /// Holds the lock: closing it releases it.
    _file: File,
    path: PathBuf,
}

/// Lock file `id` of `space`, for the database at `database`: `<database>-workers/<id>` or
/// `<database>-lease-holders/<id>`.
pub(crate) fn path_of(database: &str, space: LockSpace, id: i64) -> PathBuf {
    let dir = match space {
        LockSpace::Worker => "workers",
        LockSpace::LeaseHolder => "lease-holders",
    };
    PathBuf::from(format!("{database}-{dir}")).join(id.to_string())
}

fn failed(path: &Path, source: io::Error) -> Error {
    Error::LockFile {
        path: path.to_path_buf(),
        source,
    }
}

impl FileLock {
    /// Creates worker `id`'s lock file (and its directory) if needed and locks it: `None`
    /// if another holds it.
    pub fn create(database: &str, space: LockSpace, id: i64) -> Result<Option<FileLock>> {
        let path = path_of(database, space, id);
        let open = || {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
        };
        // Once more if the directory went between its making and the open (the last worker
        // leaving removes it when it is empty).
        let file = match open() {
            Err(e) if e.kind() == io::ErrorKind::NotFound => open(),
            opened => opened,
        }
        .map_err(|e| failed(&path, e))?;
        match try_lock(&file) {
            Ok(true) => Ok(Some(FileLock { _file: file, path })),
            Ok(false) => Ok(None),
            Err(e) => Err(failed(&path, e)),
        }
    }

    /// Locks worker `id`'s existing lock file: `Some` when its worker's process is gone,
    /// `None` while it lives; an error of kind `NotFound` when there is no such file (then
    /// nothing can be told: its worker may live, on a path that names the database
    /// differently).
    pub fn existing(database: &str, space: LockSpace, id: i64) -> io::Result<Option<FileLock>> {
        let path = path_of(database, space, id);
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        Ok(try_lock(&file)?.then_some(FileLock { _file: file, path }))
    }

    /// Removes the file, still locked (no one else can take it meanwhile), then unlocks it.
    /// A process that opened it before finds it locked, or, once unlocked, locks a file no
    /// longer there: for a worker that is gone either way.
    pub fn remove(self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::debug!(path = %self.path.display(), error = %e, "removing a worker's lock file failed");
        }
        // The directory too, once empty (it fails harmlessly while other workers' files are in
        // it), so that no worker leaves anything beside the database.
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// An exclusive, non-blocking `flock`: true when taken, false when another holds it.
#[cfg(unix)]
fn try_lock(file: &File) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock on a descriptor this File owns for the call's duration.
        let done = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if done == 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(code) if code == libc::EWOULDBLOCK => return Ok(false),
            _ => return Err(error),
        }
    }
}

/// Without `flock` no worker's death can be told: the lock is never taken, and its claims are
/// protected by their ttl alone (see `Liveness for SqliteConnection`).
#[cfg(not(unix))]
fn try_lock(_file: &File) -> io::Result<bool> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "file locks are not supported here",
    ))
}
