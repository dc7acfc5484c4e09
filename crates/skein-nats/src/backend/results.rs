//! The Announcer: each ending of a tree stored once in stream `SKEIN_RESULTS`, subject
//! `skein.ended.<root>`, which the stream republishes on `skein.results.<root>`; and the
//! reading of a tree's last result from that stream, which every reader shares.
//!
//! Why not a publish on `skein.results.<root>` itself, into a stream capturing it: a core
//! subscriber hears every publish on its subject, the ones the stream then drops as
//! duplicates included. A republish is sent by the stream's leader only for a message it
//! stored, so a worker that announces an ending another worker announced already (a job
//! delivered again, two workers after a lease ran out) sends nothing to subscribers.
//!
//! An ending is named by the root and the seq of the record that ended it. Its publish
//! carries `Nats-Msg-Id: <root>:<seq>` (a retry within the duplicate window is dropped)
//! and `Nats-Expected-Last-Subject-Sequence` (the subject's last message as the announcer
//! knows it, 0 at first): past the window, a second announcement finds the subject moved
//! on, reads its last message and stops there if that is this ending or a later one.

use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, context::PublishErrorKind};
use async_trait::async_trait;
use skein_core::SessionId;
use skein_ports::ports::{Announcer, RootResult};
use skein_ports::{Error, Result};

use super::{nats_err, trace_headers, NatsStore};

/// The stream that holds every tree's endings.
pub const RESULTS: &str = "SKEIN_RESULTS";
/// The header naming the seq of the root's record that ended it.
pub const ENDED_SEQ: &str = "Skein-Ended-Seq";
/// Where an ending is stored; the stream republishes it on [`results_subject`].
pub fn ended_subject(root: &SessionId) -> String {
    format!("skein.ended.{}", root.as_str())
}
/// Where subscribers hear a tree's result.
pub fn results_subject(root: &SessionId) -> String {
    format!("skein.results.{}", root.as_str())
}

/// A tree's last announced result, with the seq of its message in [`RESULTS`].
#[derive(Debug, Clone)]
pub struct StoredResult {
    pub result: RootResult,
    pub stream_seq: u64,
}

impl NatsStore {
    /// The last result announced for `root`, read from its stream's leader; none if the
    /// tree never ended (or its result aged out with its logs).
    pub async fn last_result(&self, root: &SessionId) -> Result<Option<StoredResult>> {
        let subject = ended_subject(root);
        match self.results.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => {
                let result: RootResult =
                    serde_json::from_slice(&m.payload).map_err(|e| Error::corrupt("result", e))?;
                Ok(Some(StoredResult {
                    result,
                    stream_seq: m.sequence,
                }))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    jetstream::stream::LastRawMessageErrorKind::NoMessageFound
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(nats_err("read result", e)),
        }
    }
}

#[async_trait]
impl Announcer for NatsStore {
    async fn root_finished(&self, notice: &RootResult) -> Result<()> {
        let root = SessionId::parse(&notice.session)?;
        let body = serde_json::to_vec(notice).map_err(|e| Error::corrupt("notice", e))?;
        let subject = ended_subject(&root);
        // Most trees end once: the subject holds nothing yet.
        let mut expected = 0;
        for _ in 0..8 {
            let mut h: HeaderMap = trace_headers();
            h.insert(NATS_MESSAGE_ID, format!("{root}:{}", notice.seq).as_str());
            h.insert(
                NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                expected.to_string().as_str(),
            );
            h.insert(ENDED_SEQ, notice.seq.to_string().as_str());
            let sent = async {
                self.js
                    .publish_with_headers(subject.clone(), h, body.clone().into())
                    .await?
                    .await
            }
            .await;
            match sent {
                // Stored, or dropped as the duplicate of an announcement stored before.
                Ok(_) => return Ok(()),
                Err(e) if matches!(e.kind(), PublishErrorKind::WrongLastSequence) => {
                    match self.last_result(&root).await? {
                        // This ending, or a later one, is announced already.
                        Some(last) if last.result.seq >= notice.seq => return Ok(()),
                        Some(last) => expected = last.stream_seq,
                        None => expected = 0,
                    }
                }
                Err(e) => return Err(nats_err("result", e)),
            }
        }
        Err(Error::unavailable_because(format!(
            "nats: the result of {root} met another announcement eight times"
        )))
    }

    async fn last_announced(&self, root: &SessionId) -> Result<Option<RootResult>> {
        Ok(self.last_result(root).await?.map(|r| r.result))
    }
}
