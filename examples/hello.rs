//! Migrates each database named on the command line (an embedded SQLite file by default) and
//! shows tenure's schema version and the database's clock.
//!
//! ```text
//! cargo run --example hello
//! cargo run --example hello --all-features -- tenure.db postgres://root@127.0.0.1/test mysql://root@127.0.0.1/test
//! ```

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut urls: Vec<String> = std::env::args().skip(1).collect();
    if urls.is_empty() {
        urls.push("tenure-hello.db".to_string());
    }
    let mut failed = false;
    for url in &urls {
        match show(url) {
            Ok(()) => {}
            Err(e) => {
                // The URL may hold a password: name only its backend.
                let backend = tenure::Backend::from_url(url)
                    .map(|(b, _)| b.to_string())
                    .unwrap_or_else(|_| "?".to_string());
                eprintln!("{backend}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn show(url: &str) -> Result<(), tenure::Error> {
    let pool = tenure::Pool::open(url)?;
    let mut conn = pool.get()?;
    let applied = tenure::run_migrations(&mut conn)?;
    let version = tenure::schema_version(&mut conn)?.unwrap_or_default();
    let now = tenure::database_now(&mut conn)?;
    let skew = chrono::Utc::now() - now;
    println!(
        "{:<14} schema {version} ({} applied now)  database clock {}  (this host's clock - database's: {} ms)",
        pool.backend().to_string(),
        applied.len(),
        now.format("%Y-%m-%d %H:%M:%S%.6f UTC"),
        skew.num_milliseconds()
    );
    Ok(())
}
