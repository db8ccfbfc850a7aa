//! Migrations raced by raw connections and by version reads inside transactions.

use tenure::Backend;

use crate::common::{TestDb, conformance};

conformance!(migrations_race_raw_connections_and_version_reads_in_transactions,);

/// Many threads race run_migrations (on connections without session settings) against
/// schema_version read inside a caller's transaction, on fresh databases.
fn migrations_race_raw_connections_and_version_reads_in_transactions(backend: Backend) {
    const ROUNDS: usize = 6;
    const THREADS: usize = 6;
    let mut errors = Vec::new();
    for round in 0..ROUNDS {
        let db = TestDb::empty(backend);
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                // SQLite's raw connections have no busy timeout: they fail at once by design.
                let mut conn = if backend == Backend::Sqlite {
                    db.connect()
                } else {
                    db.connect_raw()
                };
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    if i % 3 == 2 {
                        tenure::transaction(&mut conn, |c| tenure::schema_version(c).map(|_| ()))
                    } else {
                        tenure::run_migrations(&mut conn).map(|_| ())
                    }
                })
            })
            .collect();
        for h in handles {
            if let Err(e) = h.join().expect("a racing thread panicked") {
                errors.push(format!("round {round}: {e:?}"));
            }
        }
        if errors.is_empty() {
            assert!(tenure::schema_version(&mut db.connect()).unwrap().is_some());
            assert!(
                tenure::run_migrations(&mut db.connect())
                    .unwrap()
                    .is_empty()
            );
        }
    }
    assert!(errors.is_empty(), "{errors:#?}");
}
