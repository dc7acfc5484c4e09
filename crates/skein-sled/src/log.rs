//! The event log: `events` holds `session \0 seq` → record bytes, `sessions` the last seq
//! of each session; an append checks and bumps `sessions` and inserts its records in one
//! transaction, and returns once a flush covers it.

use async_trait::async_trait;
use skein_core::{Record, SessionId};
use skein_runtime::ports::EventLog;
use skein_runtime::{Error, Result};
use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::Transactional;

use crate::{backend_err, event_key, u64_of, SledStore};

#[async_trait]
impl EventLog for SledStore {
    async fn append(&self, session: &SessionId, expected_last: u64, record: &Record) -> Result<()> {
        self.append_batch(session, expected_last, std::slice::from_ref(record))
            .await
    }

    async fn append_batch(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        for (i, r) in records.iter().enumerate() {
            let seq = expected_last + 1 + i as u64;
            if r.env.seq != seq || &r.env.session != session {
                return Err(Error::corrupt_because(format!(
                    "record {}#{} appended as {session}#{seq}",
                    r.env.session, r.env.seq
                )));
            }
        }
        if records.is_empty() {
            return Ok(());
        }
        let skey = session.as_str().as_bytes();
        let last_seq = expected_last + records.len() as u64;
        let res = (&self.sessions, &self.events).transaction(|(sessions, events)| {
            let last = sessions.get(skey)?.map(|v| u64_of(&v)).unwrap_or(0);
            if last != expected_last {
                return Err(ConflictableTransactionError::Abort(last));
            }
            sessions.insert(skey, &last_seq.to_be_bytes())?;
            for r in records {
                events.insert(event_key(session, r.env.seq), r.bytes.as_slice())?;
            }
            Ok(())
        });
        match res {
            Ok(()) => self.flusher.durable().await,
            Err(TransactionError::Abort(actual)) => Err(Error::Conflict {
                session: session.to_string(),
                expected: expected_last,
                actual,
            }),
            Err(TransactionError::Storage(e)) => Err(backend_err(e)),
        }
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        let start = event_key(session, from_seq.max(1));
        let end = event_key(session, u64::MAX);
        let mut out = vec![];
        for item in self.events.range(start..=end) {
            let (_, v) = item.map_err(backend_err)?;
            out.push(
                Record::decode(v.to_vec())
                    .map_err(|e| Error::corrupt(format!("record of {session}"), e))?,
            );
        }
        Ok(out)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        let start = event_key(session, 1);
        let end = event_key(session, u64::MAX);
        match self.events.range(start..=end).next_back() {
            None => Ok(None),
            Some(item) => {
                let (_, v) = item.map_err(backend_err)?;
                Ok(Some(Record::decode(v.to_vec()).map_err(|e| {
                    Error::corrupt(format!("record of {session}"), e)
                })?))
            }
        }
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for item in self.sessions.scan_prefix(root.as_str().as_bytes()) {
            let (k, _) = item.map_err(backend_err)?;
            let id = std::str::from_utf8(&k).map_err(|e| Error::corrupt("session key", e))?;
            let id = SessionId::parse(id)?;
            if root.contains(&id) {
                out.push(id);
            }
        }
        Ok(out)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for item in self.sessions.iter() {
            let (k, _) = item.map_err(backend_err)?;
            if !k.contains(&b'.') {
                let id = std::str::from_utf8(&k).map_err(|e| Error::corrupt("session key", e))?;
                out.push(SessionId::parse(id)?);
            }
        }
        Ok(out)
    }
}
