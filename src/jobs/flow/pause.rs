//! Pausing a queue (`tenure_queue_pauses`): a paused queue's jobs stay waiting, never
//! claimed, until it is resumed (the claim's pick reads the pause in the same statement).

use diesel::prelude::*;
use diesel::sql_types::Text;

use crate::backend::statement::statement;
use crate::backend::transaction::write_turn;
use crate::backend::{Dialect, Upsert, dispatch};
use crate::{Result, TenureConnection, validate};

const PAUSE_ON_CONFLICT: &str = "\
    INSERT INTO tenure_queue_pauses (queue, paused_at) VALUES (?, {now}) \
    ON CONFLICT (queue) DO NOTHING";
const PAUSE_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_queue_pauses (queue, paused_at) VALUES (?, {now}) \
    ON DUPLICATE KEY UPDATE queue = queue";

/// Pauses a queue: claims skip it (enqueues still work) until [`resume`]. Idempotent.
pub fn pause<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<()> {
    validate::name("queue", queue)?;
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    dispatch!(conn, c => {
        let syntax = c.syntax();
        let sql = match syntax.upsert {
            Upsert::OnConflictWhere => PAUSE_ON_CONFLICT,
            Upsert::OnDuplicateKey => PAUSE_ON_DUPLICATE_KEY,
        };
        statement(syntax.render(sql)).bind::<Text, _>(queue).execute(c)
    })?;
    Ok(())
}

/// Resumes a paused queue. Idempotent.
pub fn resume<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<()> {
    validate::name("queue", queue)?;
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    use crate::schema::tenure_queue_pauses;
    dispatch!(conn, c => diesel::delete(tenure_queue_pauses::table.find(queue)).execute(c))?;
    Ok(())
}

/// Whether a queue is paused.
pub fn is_paused<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<bool> {
    validate::name("queue", queue)?;
    use crate::schema::tenure_queue_pauses;
    let paused: i64 = dispatch!(conn, c => {
        tenure_queue_pauses::table
            .filter(tenure_queue_pauses::queue.eq(queue))
            .count()
            .get_result(c)
    })?;
    Ok(paused > 0)
}
