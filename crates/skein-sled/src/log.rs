//! The event log port on the log file (`wal.rs`): an append checks the session's last seq
//! and writes its records as one frame, and returns once an `fdatasync` covers it (an
//! append ahead, or one pipelined after a durable one, once it is written).

use async_trait::async_trait;
use skein_core::{Record, SessionId};
use skein_ports::ports::{check_numbering, Durability, EventLog};
use skein_ports::roots::{RootFilter, RootsPage};
use skein_ports::{Error, Result};

use crate::SledStore;

impl SledStore {
    /// Writes the frame without a sync: the sync of any frame written after it covers it
    /// too.
    fn write_frame(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        check_numbering(session, expected_last, records)?;
        if records.is_empty() {
            return Ok(());
        }
        // Before the frame: an index refresh that sees the frame also sees the mark.
        self.roots.touch(session);
        self.wal
            .append(session, expected_last, records)?
            .map_err(|actual| Error::Conflict {
                session: session.to_string(),
                expected: expected_last,
                actual,
            })
    }

    /// Writes the frame and waits for a sync that covers it.
    async fn write_durable(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        self.write_frame(session, expected_last, records)?;
        if records.is_empty() {
            return Ok(());
        }
        self.wal_flusher.durable().await
    }
}

#[async_trait]
impl EventLog for SledStore {
    /// [`Durability::Ahead`]: the frame is written and not synced. [`Durability::Pipelined`]:
    /// written without a sync while the session's earlier records are durable (the sync of
    /// any frame written later covers them); else appended durably, covering the batch
    /// before it too. So at most one batch of a session waits for a sync.
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()> {
        match durability {
            Durability::Now => self.write_durable(session, expected_last, records).await,
            Durability::Ahead => self.write_frame(session, expected_last, records),
            Durability::Pipelined if self.wal.last_synced(session) => {
                self.write_frame(session, expected_last, records)
            }
            Durability::Pipelined => self.write_durable(session, expected_last, records).await,
        }
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        self.wal.read(session, from_seq)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        self.wal.last(session)
    }

    /// None: a log here is read from its index in one file, as cheap one by one.
    async fn read_tree(
        &self,
        _root: &SessionId,
        _ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>> {
        Ok(None)
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for id in self.wal.sessions_from(root.as_str())? {
            let id = SessionId::parse(&id)?;
            if root.contains(&id) {
                out.push(id);
            }
        }
        Ok(out)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        self.wal
            .sessions_from("")?
            .into_iter()
            .filter(|k| !k.contains('.'))
            .map(|k| SessionId::parse(&k).map_err(Error::from))
            .collect()
    }

    /// From the index of roots (`roots.rs`), brought up to date with the roots written
    /// since the last listing.
    async fn roots_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage> {
        self.roots.page(&self.wal, filter, limit, cursor)
    }

    /// From the index of roots, brought up to date first.
    async fn open_roots(&self) -> Result<Vec<SessionId>> {
        self.roots.open_roots(&self.wal)
    }
}
