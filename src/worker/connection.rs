//! A pooled connection that each of the worker's threads keeps, replaced after an error.

use crate::{Pool, PooledConnection};

pub(super) struct Connection<'a> {
    pool: &'a Pool,
    conn: Option<PooledConnection>,
}

impl<'a> Connection<'a> {
    pub fn new(pool: &'a Pool) -> Self {
        Connection { pool, conn: None }
    }

    pub fn with<T>(
        &mut self,
        f: impl FnOnce(&mut PooledConnection) -> crate::Result<T>,
    ) -> crate::Result<T> {
        let conn = match self.conn.as_mut() {
            Some(conn) => conn,
            None => self.conn.insert(self.pool.get()?),
        };
        let outcome = f(conn);
        if outcome.is_err() {
            // It may be broken (the database restarted): take a fresh one next time.
            self.conn = None;
        }
        outcome
    }
}
