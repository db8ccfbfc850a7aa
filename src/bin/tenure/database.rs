//! Which database a command uses, and opening it with errors that say what to do.

use std::path::PathBuf;

use tenure::{Backend, Error, Pool};

use crate::Failure;

/// The database URL and where it came from (said in errors about it).
pub struct Target {
    pub url: String,
    pub source: &'static str,
}

/// `--database-url`, else TENURE_DATABASE_URL, else DATABASE_URL, else the file tenure.db here.
pub fn target(flag: Option<&str>) -> Target {
    let env = |name: &'static str| std::env::var(name).ok().map(|url| (url, name));
    let (url, source) = flag
        .map(|url| (url.to_string(), "--database-url"))
        .or_else(|| env("TENURE_DATABASE_URL"))
        .or_else(|| env("DATABASE_URL"))
        .unwrap_or_else(|| ("tenure.db".to_string(), "the default"));
    Target { url, source }
}

/// Schemes tenure knows, for spotting a typo after one.
const SCHEMES: [&str; 5] = ["postgresql", "postgres", "mariadb", "mysql", "sqlite"];

/// Refuses a URL whose scheme is misspelled (`postgres//host`, `mysql:/host`,
/// `postgresql/db`), which would otherwise be taken as an SQLite file name. The URL is not
/// repeated: it may hold a password.
///
/// The library's `Backend::from_url` takes any text without `://` as a file path; it could
/// refuse these itself.
pub fn check_url(url: &str) -> Result<(), Failure> {
    if looks_like_server_without_scheme(url) {
        return Err(Failure::new(
            2,
            "the database URL looks like USER:PASSWORD@HOST without its scheme: write \
             postgres://USER:PASSWORD@HOST:5432/DATABASE or mysql://USER:PASSWORD@HOST:3306/DATABASE; \
             for an SQLite file really named so, write ./ before it",
        ));
    }
    if let Ok((Backend::Sqlite, target)) = Backend::from_url(url) {
        if target == ":memory:" || target.contains("mode=memory") {
            return Err(Failure::new(
                2,
                "the database URL names an SQLite database in memory, which lives only as \
                 long as one connection: a command would start empty and leave nothing behind. \
                 Give an SQLite file's path (e.g. --database-url app.db) or a server's URL",
            ));
        }
    }
    let lower = url.to_ascii_lowercase();
    for scheme in SCHEMES {
        let Some(rest) = lower.strip_prefix(scheme) else {
            continue;
        };
        if rest.starts_with("://") {
            return Ok(());
        }
        if rest.starts_with([':', '/', '\\']) {
            let typed: String = url
                .chars()
                .take(scheme.len())
                .chain(rest.chars().take_while(|c| matches!(c, ':' | '/' | '\\')))
                .collect();
            let example = match scheme {
                "sqlite" => "sqlite://PATH (or just the file's path)".to_string(),
                "mysql" | "mariadb" => format!("{scheme}://USER:PASSWORD@HOST:3306/DATABASE"),
                _ => format!("{scheme}://USER:PASSWORD@HOST:5432/DATABASE"),
            };
            return Err(Failure::new(
                2,
                format!(
                    "the database URL starts with {typed:?}, a misspelled scheme: write \
                     {example}; for an SQLite file really named so, write ./ before it"
                ),
            ));
        }
    }
    Ok(())
}

/// `user:password@host...` with no `://`: a server URL that lost its scheme, which would be
/// taken as an SQLite file and named, password included, in every error about that file.
fn looks_like_server_without_scheme(url: &str) -> bool {
    if url.contains("://") || url.starts_with(['.', '/']) || url.starts_with("file:") {
        return false;
    }
    let Some((userinfo, _)) = url.split_once('@') else {
        return false;
    };
    userinfo
        .split_once(':')
        .is_some_and(|(user, _)| !user.is_empty() && !user.contains(['/', '\\']))
}

/// The file an SQLite URL names, or `None` (a server, or a database in memory).
pub fn sqlite_path(url: &str) -> Option<PathBuf> {
    let (backend, target) = Backend::from_url(url).ok()?;
    if backend != Backend::Sqlite || target == ":memory:" || target.contains("mode=memory") {
        return None;
    }
    let path = match target.strip_prefix("file:") {
        Some(uri) => {
            let path = uri.split(['?', '#']).next().unwrap_or_default();
            path.strip_prefix("//").unwrap_or(path).to_string()
        }
        None => target,
    };
    (!path.is_empty()).then(|| PathBuf::from(path))
}

/// A path as the user should read it: absolute when it can be.
fn shown(path: &std::path::Path) -> String {
    std::path::absolute(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

/// For commands that read or change tenure's tables: an SQLite file that does not exist is
/// not created (opening it would), and the user is told which file was looked for.
pub fn require_existing(target: &Target) -> Result<(), Failure> {
    let Some(path) = sqlite_path(&target.url) else {
        return Ok(());
    };
    if path.exists() {
        return Ok(());
    }
    Err(Failure::new(
        4,
        format!(
            "no SQLite database at {} (from {}): run `tenure migrate` to create it there, or \
             give the database with --database-url URL (or TENURE_DATABASE_URL)",
            shown(&path),
            target.source
        ),
    ))
}

/// Opens a pool of `max_size` connections; an SQLite file that cannot be opened is named.
pub fn pool(url: &str, max_size: u32) -> Result<Pool, Failure> {
    check_url(url)?;
    Pool::options()
        .max_size(max_size)
        .open(url)
        .map_err(|error| open_failure(url, error))
}

/// Opens the pool; every command but `migrate` and `demo` needs tenure's tables (and so an
/// SQLite file that exists: it is not created). Commands check their arguments first.
pub fn open(target: &Target, max_size: u32, need_tables: bool) -> Result<Pool, Failure> {
    if need_tables {
        require_existing(target)?;
    }
    let pool = pool(&target.url, max_size)?;
    if need_tables && tenure::schema_version(&mut pool.get()?)?.is_none() {
        return Err(Failure::new(
            4,
            "the database has no tenure tables yet: run `tenure migrate` first",
        ));
    }
    Ok(pool)
}

fn open_failure(url: &str, error: Error) -> Failure {
    match (&error, sqlite_path(url)) {
        // Anything else that goes wrong opening an SQLite file (it is not a database, it is
        // locked, ...) names the file too.
        (Error::Connect { .. }, _) | (_, None) => {}
        (e, Some(_)) if e.is_invalid_input() => {}
        (_, Some(path)) => {
            return Failure::new(
                3,
                format!("cannot open the SQLite database {}: {error}", shown(&path)),
            );
        }
    }
    match (&error, sqlite_path(url)) {
        (
            Error::Connect {
                backend: Backend::Sqlite,
                source,
            },
            Some(path),
        ) => Failure::new(
            3,
            format!(
                "cannot open the SQLite database {}: {source}; check that its folder exists \
                 and that you may read and write there",
                shown(&path)
            ),
        ),
        _ => error.into(),
    }
}

/// Says (through `warn`) when the database streams to standbys that do not confirm commits:
/// a failover may lose the grant of `fence` and give the same fence to another runner.
pub fn warn_if_fences_may_repeat(pool: &Pool, fence: i64, warn: fn(&str)) {
    let replication = pool
        .get()
        .and_then(|mut conn| tenure::replication(&mut conn));
    if let Ok(tenure::Replication::Asynchronous { standbys }) = replication {
        warn(&format!(
            "the database streams to {standbys} standby(s) without confirming commits: a \
             failover may lose this grant and give fence {fence} to another runner \
             (synchronous replication keeps it)"
        ));
    }
}
