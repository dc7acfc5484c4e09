//! Workspaces in the object store `skein_workspace`, objects `<root>/<path>`.

use std::sync::{Arc, Mutex};

use async_nats::jetstream::object_store::{self, ObjectInfo};
use async_nats::jetstream::stream;
use async_trait::async_trait;
use base64::engine::general_purpose::URL_SAFE;
use base64::Engine;
use sha2::{Digest, Sha256};
use skein_core::SessionId;
use skein_ports::ports::Workspaces;
use skein_tools::workspace::DirEntry;
use skein_tools::{ToolError, Usage, Workspace};

use futures::{StreamExt, TryStreamExt};
use tokio::sync::oneshot;

use super::read::read_subject;
use super::NatsStore;

/// The object store of the workspaces.
const WORKSPACE: &str = "skein_workspace";

impl Workspaces for NatsStore {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace> {
        if let Some(dir) = &self.cfg.workspace_dir {
            let local = *self
                .workspace_local
                .get_or_init(|| skein_tools::workspace::on_local_disk(dir));
            return Arc::new(
                skein_tools::workspace::LocalWorkspace::new(dir.join(root.as_str())).quick(local),
            );
        }
        Arc::new(ObjectWorkspace {
            store: self.workspace.clone(),
            meta: self.workspace_stream.clone(),
            names: self.workspace_names.clone(),
            root: root.to_string(),
        })
    }
}

impl NatsStore {
    /// Removes a tree's workspace (its directory under `workspace_dir`, or its objects);
    /// how many objects went (0 for a directory).
    pub(crate) async fn remove_workspace(&self, root: &SessionId) -> skein_ports::Result<u64> {
        if let Some(dir) = &self.cfg.workspace_dir {
            let dir = dir.join(root.as_str());
            if dir.is_dir() {
                std::fs::remove_dir_all(&dir).map_err(|e| {
                    skein_ports::Error::unavailable(
                        format!("removing the workspace {}", dir.display()),
                        e,
                    )
                })?;
            }
            return Ok(0);
        }
        let ws = ObjectWorkspace {
            store: self.workspace.clone(),
            meta: self.workspace_stream.clone(),
            names: self.workspace_names.clone(),
            root: root.to_string(),
        };
        ws.remove_all()
            .await
            .map_err(|e| skein_ports::Error::unavailable_because(e.to_string()))
    }
}

/// A tree's workspace in the object store: objects named `<root>/<path>`, so a file one
/// worker writes is there for every other.
pub struct ObjectWorkspace {
    // Shared, not copied: a tree's workspace is made for every tool call, and a handle
    // carries the stream's whole configuration.
    store: Arc<object_store::ObjectStore>,
    meta: Arc<stream::Stream>,
    names: Arc<Names>,
    root: String,
}

/// The names of every object of the store, all trees together, for one process: read by
/// one request at a time, which the listings of every tree share. A caller is answered by
/// a request sent after it asked, so it sees every write acknowledged before that (the
/// request goes to the stream's leader); callers that ask while a request is under way are
/// answered together by the next one. A wide tree's sessions list the workspace at the
/// same moments (their turns run in step), and each asked the server on its own, one
/// request waiting behind another.
///
/// The request asks for the last description message of the whole store, a small answer.
/// The names are listed again (a stream-info request naming every description subject,
/// which the server answers with the stream's whole description) unless that message is
/// the very one seen before the last listing, by its stream sequence and its time: every
/// write or delete of an object writes a description, whose sequence is higher than any
/// before it, so the same last message means no name was added since. A name whose object
/// went since (purged with its tree) is still listed, and its description, read next,
/// says it is gone. Any other last message (a newer one, or an older one after a purge or
/// a bucket made again) lists the names again.
pub(crate) struct Names {
    meta: stream::Stream,
    queue: Mutex<Queue>,
    /// The last listing, and the last description message (sequence and time) read
    /// before it.
    listed: Mutex<Option<(LastDescription, Arc<Vec<String>>)>>,
}

/// A description message, by its stream sequence and the time it was stored.
type LastDescription = (u64, async_nats::datetime::DateTime);

type Answer = std::result::Result<Arc<Vec<String>>, String>;

#[derive(Default)]
struct Queue {
    /// A task is sending requests (and answering what it took from `waiting`).
    running: bool,
    waiting: Vec<oneshot::Sender<Answer>>,
}

impl Names {
    pub(crate) fn new(meta: stream::Stream) -> Arc<Self> {
        Arc::new(Self {
            meta,
            queue: Mutex::new(Queue::default()),
            listed: Mutex::new(None),
        })
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every object's name, from a request sent after this call began.
    async fn all(self: &Arc<Self>) -> Answer {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut q = self.queue();
            q.waiting.push(tx);
            !std::mem::replace(&mut q.running, true)
        };
        if start {
            tokio::spawn(self.clone().serve());
        }
        rx.await
            .map_err(|_| "the listing stopped before it answered".to_string())?
    }

    /// Sends requests while callers wait: each answers everyone who asked before it was
    /// sent.
    async fn serve(self: Arc<Self>) {
        // Should this task end any other way than below (a panic), the callers it holds
        // are told so, and the next caller starts another. Below, the task says it has
        // stopped in the same hold of the lock in which it finds no caller, so that a
        // caller who comes just after starts a task of its own and is not dropped.
        struct Stop(Option<Arc<Names>>);
        impl Drop for Stop {
            fn drop(&mut self) {
                if let Some(names) = self.0.take() {
                    let mut q = names.queue();
                    q.running = false;
                    q.waiting.clear();
                }
            }
        }
        let mut stop = Stop(Some(self.clone()));
        loop {
            let batch = {
                let mut q = self.queue();
                if q.waiting.is_empty() {
                    q.running = false;
                    stop.0 = None;
                    return;
                }
                std::mem::take(&mut q.waiting)
            };
            let answer = tokio::time::timeout(crate::deadline::OPERATION_LIMIT, self.list())
                .await
                .unwrap_or_else(|_| Err("the object store did not answer in time".into()));
            for tx in batch {
                let _ = tx.send(answer.clone());
            }
        }
    }

    /// Every object's name: the last listing when the last description message is still
    /// the one it was read after, else a new listing.
    async fn list(&self) -> Answer {
        let last = match self
            .meta
            .get_last_raw_message_by_subject(&format!("$O.{WORKSPACE}.M.>"))
            .await
        {
            Ok(m) => (m.sequence, m.time),
            // No description at all: no object.
            Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => {
                return Ok(Arc::new(vec![]))
            }
            Err(e) => return Err(e.to_string()),
        };
        let listed = self
            .listed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some((seen, names)) = listed {
            if last == seen {
                return Ok(names);
            }
        }
        let names = Arc::new(self.list_subjects().await?);
        *self.listed.lock().unwrap_or_else(|p| p.into_inner()) = Some((last, names.clone()));
        Ok(names)
    }

    /// One stream-info request naming every description subject. The object store keeps
    /// one description per object on a subject of its own, named by the object's encoded
    /// name, so a tree's objects cannot be picked by a subject filter; the stream's subject
    /// index names them all (the server answers from memory, reading no message).
    async fn list_subjects(&self) -> std::result::Result<Vec<String>, String> {
        let meta = format!("$O.{WORKSPACE}.M.");
        let mut subjects = self
            .meta
            .info_with_subjects(format!("{meta}>"))
            .await
            .map_err(|e| e.to_string())?;
        let mut names = vec![];
        while let Some((subject, _)) = subjects.try_next().await.map_err(|e| e.to_string())? {
            let name = subject
                .strip_prefix(&meta)
                .and_then(|encoded| URL_SAFE.decode(encoded).ok())
                .and_then(|bytes| String::from_utf8(bytes).ok());
            names.extend(name);
        }
        Ok(names)
    }
}

impl ObjectWorkspace {
    /// Deletes every object of this tree; how many.
    pub(crate) async fn remove_all(&self) -> std::result::Result<u64, ToolError> {
        let mut n = 0;
        for info in self.objects().await? {
            self.store
                .delete(&info.name)
                .await
                .map_err(|e| ToolError::Failed(format!("removing `{}`: {e}", info.name)))?;
            n += 1;
        }
        Ok(n)
    }

    /// The description of every object of this tree that is not deleted: the names of
    /// every tree's objects (see [`Names`]), then the descriptions of this tree's, by
    /// direct gets. An earlier version read every tree's descriptions through a consumer
    /// made and deleted for each listing, which was most of the server's work in a run of
    /// `list_dir` calls.
    async fn objects(&self) -> std::result::Result<Vec<ObjectInfo>, ToolError> {
        tokio::time::timeout(crate::deadline::OPERATION_LIMIT, self.objects_now())
            .await
            .map_err(|_| {
                ToolError::Failed(
                    "listing the workspace: the object store did not answer in time".into(),
                )
            })?
    }

    async fn objects_now(&self) -> std::result::Result<Vec<ObjectInfo>, ToolError> {
        let failed =
            |e: &dyn std::fmt::Display| ToolError::Failed(format!("listing the workspace: {e}"));
        let prefix = format!("{}/", self.root);
        let all = self.names.all().await.map_err(|e| failed(&e))?;
        let names: Vec<String> = all
            .iter()
            .filter(|n| n.starts_with(&prefix))
            .cloned()
            .collect();
        let infos: Vec<_> = futures::stream::iter(names)
            .map(|name| async move { (self.store.info(&name).await, name) })
            .buffer_unordered(16)
            .collect()
            .await;
        let mut out = vec![];
        for (info, name) in infos {
            match info {
                Ok(info) if !info.deleted => out.push(info),
                Ok(_) => {}
                // Purged between the two reads.
                Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => {}
                Err(e) => return Err(failed(&format!("`{name}`: {e}"))),
            }
        }
        Ok(out)
    }
}

/// Normalises a workspace path, refusing anything that could name another tree's files.
pub fn clean_path(path: &str) -> std::result::Result<String, ToolError> {
    skein_tools::workspace::check_path_chars(path)?;
    if path.starts_with('/') || path.contains('\\') {
        return Err(ToolError::Refused(format!(
            "`{path}`: absolute paths are refused"
        )));
    }
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(ToolError::Refused(format!("`{path}`: `..` is refused"))),
            s => parts.push(s),
        }
    }
    Ok(parts.join("/"))
}

#[async_trait]
impl Workspace for ObjectWorkspace {
    /// The object's description by a direct get, then its chunks as any subject is read
    /// (direct gets, or a consumer deleted after a long read), checked against the size
    /// and digest the description gives. The store's own reader left a consumer on the
    /// server for 30 s after every read.
    async fn read(&self, path: &str) -> std::result::Result<Vec<u8>, ToolError> {
        let p = clean_path(path)?;
        let failed = |e: &dyn std::fmt::Display| ToolError::Failed(format!("`{path}`: {e}"));
        let info = self
            .store
            .info(format!("{}/{p}", self.root))
            .await
            .map_err(|e| failed(&e))?;
        if info.deleted {
            return Err(failed(&"not found"));
        }
        let chunks = read_subject(&self.meta, &format!("$O.{WORKSPACE}.C.{}", info.nuid), 0)
            .await
            .map_err(|e| failed(&e))?;
        let mut out = Vec::with_capacity(info.size);
        for (_, chunk) in chunks {
            out.extend_from_slice(&chunk);
        }
        let digest = format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(&out)));
        if out.len() != info.size || info.digest.as_ref().is_some_and(|d| *d != digest) {
            return Err(failed(&format!(
                "the stored object does not match its description ({} of {} bytes read)",
                out.len(),
                info.size
            )));
        }
        Ok(out)
    }

    async fn write(&self, path: &str, data: &[u8]) -> std::result::Result<(), ToolError> {
        let p = clean_path(path)?;
        if p.is_empty() {
            return Err(ToolError::Refused("a file needs a name".into()));
        }
        let mut r = data;
        self.store
            .put(format!("{}/{p}", self.root).as_str(), &mut r)
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        Ok(())
    }

    async fn list(&self, path: &str) -> std::result::Result<Vec<DirEntry>, ToolError> {
        let p = clean_path(path)?;
        let prefix = if p.is_empty() {
            format!("{}/", self.root)
        } else {
            format!("{}/{p}/", self.root)
        };
        let mut out: Vec<DirEntry> = vec![];
        for info in self.objects().await? {
            let Some(rest) = info.name.strip_prefix(&prefix) else {
                continue;
            };
            let (name, is_dir) = match rest.split_once('/') {
                Some((d, _)) => (d.to_string(), true),
                None => (rest.to_string(), false),
            };
            if !out.iter().any(|e| e.name == name) {
                out.push(DirEntry {
                    name,
                    is_dir,
                    size: if is_dir { 0 } else { info.size as u64 },
                });
            }
        }
        out.sort();
        Ok(out)
    }

    /// One pass over the object list (the default lists directory by directory).
    async fn usage(&self, path: &str) -> std::result::Result<Usage, ToolError> {
        let target = format!("{}/{}", self.root, clean_path(path)?);
        let mut u = Usage::default();
        for info in self.objects().await? {
            u.total = u.total.saturating_add(info.size as u64);
            if info.name == target {
                u.of_path = info.size as u64;
            }
        }
        Ok(u)
    }
}
