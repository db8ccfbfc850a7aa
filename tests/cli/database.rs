//! The command's database: files that are not databases named, missing SQLite files not created
//! by read commands, scheme typos refused, and `migrate` stating the schema version.

use std::path::Path;
use std::process::{Command, Output};

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::{json, ok, tenure};

conformance!(migrate_states_the_schema_version,);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts exit code `code` and a message holding every one of `words`.
fn fails(out: &Output, code: i32, words: &[&str]) {
    let text = stderr(out);
    assert_eq!(out.status.code(), Some(code), "{text}");
    for word in words {
        assert!(text.contains(word), "{word:?} missing from: {text}");
    }
}

/// A file that is not a database was "database error: file is not a database", exit 1,
/// without its path.
#[test]
fn a_file_that_is_not_a_database_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.db");
    std::fs::write(&path, "these are my notes, not a database\n".repeat(100)).unwrap();
    let url = path.display().to_string();
    for args in [&["stats"][..], &["migrate"], &["jobs", "list"]] {
        fails(
            &tenure(&url, args),
            3,
            &["cannot open the SQLite database", &url, "not a database"],
        );
    }
    let before = std::fs::read(&path).unwrap();
    assert!(before.starts_with(b"these are my notes"));
}

/// `tenure` run in `dir`, with `TENURE_DATABASE_URL` and `DATABASE_URL` as given (unset if not).
fn tenure_in(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tenure"));
    command
        .current_dir(dir)
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run tenure")
}

/// Asserts exit code 2 and a message holding every one of `words`.
fn refused(out: &Output, words: &[&str]) {
    let text = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    for word in words {
        assert!(text.contains(word), "{word:?} missing from: {text}");
    }
}

// From issue 17's command items, end to end (cli/issue17.rs).
fn migrate_states_the_schema_version(backend: Backend) {
    let db = TestDb::empty(backend);
    let url = db.url();
    let first = ok(url, &["migrate"]);
    let version = tenure::schema_version(&mut db.connect()).unwrap().unwrap();
    assert!(
        first.contains(&format!("schema at version {version}; applied")),
        "{first}"
    );
    let again = ok(url, &["migrate"]);
    assert_eq!(
        again.trim(),
        format!("schema at version {version}; already up to date")
    );
    assert_eq!(json(url, &["migrate"])["version"], version.as_str());
    assert!(ok(url, &["migrate", "--help"]).contains("compare versions"));
}

// From issue 17's command items, end to end (cli/issue17.rs).
/// A read command on an SQLite file that does not exist: exit 4, the file named, nothing
/// created.
#[test]
fn read_commands_do_not_create_a_missing_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["stats"][..],
        &["jobs", "list"],
        &["leases", "list"],
        &["schedules", "list"],
        &["enqueue", "--queue", "q", "--command", "true"],
        &["work", "--queue", "q"],
        &["lease", "run", "nightly", "--", "true"],
    ] {
        let out = tenure_in(dir.path(), &[], args);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", stderr(&out));
        let text = stderr(&out);
        let path = dir.path().join("tenure.db");
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(
            text.contains("tenure migrate") && text.contains("--database-url"),
            "{text}"
        );
        assert!(!path.exists(), "{args:?} created {}", path.display());
    }
    // Bad arguments are refused first (exit 2), still creating nothing.
    refused(
        &tenure_in(dir.path(), &[], &["enqueue", "--queue", "q"]),
        &["needs --command"],
    );
    let out = tenure_in(
        dir.path(),
        &[("TENURE_DATABASE_URL", "other.db")],
        &["stats"],
    );
    assert!(stderr(&out).contains("other.db") && stderr(&out).contains("TENURE_DATABASE_URL"));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // `migrate` creates it, and then the read commands work.
    assert_eq!(
        tenure_in(dir.path(), &[], &["migrate"]).status.code(),
        Some(0)
    );
    assert_eq!(
        tenure_in(dir.path(), &[], &["stats"]).status.code(),
        Some(0)
    );
}

// From issue 17's command items, end to end (cli/issue17.rs).
/// A misspelled scheme is refused (not taken as a file name) without echoing a password;
/// an SQLite file that cannot be opened is named.
#[test]
fn scheme_typos_are_refused_and_sqlite_paths_named() {
    let dir = tempfile::tempdir().unwrap();
    for (url, right) in [
        ("postgres//root:pw-9f3@host/db", "postgres://"),
        ("postgresql/db", "postgresql://"),
        ("mysql//root@host/db", "mysql://"),
        ("MySQL:/host/db", "mysql://"),
        ("mariadb//host/db", "mariadb://"),
        ("sqlite//jobs.db", "sqlite://"),
    ] {
        for command in [&["stats"][..], &["migrate"]] {
            let out = tenure_in(
                dir.path(),
                &[],
                &[&["--database-url", url][..], command].concat(),
            );
            refused(&out, &["misspelled scheme", right]);
            assert!(!stderr(&out).contains("pw-9f3"), "{}", stderr(&out));
        }
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "a file was created"
    );
    let missing = dir.path().join("no-such-folder").join("x.db");
    let missing = missing.display().to_string();
    let out = tenure_in(dir.path(), &[], &["--database-url", &missing, "migrate"]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains(&missing), "{}", stderr(&out));
}
