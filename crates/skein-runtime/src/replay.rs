//! Replay over any backend: verify a tree's logs, and fork a session from a prefix.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use skein_core::decide::Catalog;
use skein_core::event::{verify_chain, Provenance};
use skein_core::{AgentDef, AgentSet, Event, Limits, Record, SessionId};

use crate::ports::Backend;
use crate::worker::{Folded, Runtime};
use crate::{new_root_id, Error, Result};

/// The definitions a tree actually ran with (from its `Submitted` events), falling back
/// to the current catalogue for agents the tree never started.
pub struct RecordedCatalog<'a> {
    pub recorded: BTreeMap<String, AgentDef>,
    pub current: &'a AgentSet,
}

impl Catalog for RecordedCatalog<'_> {
    fn agent(&self, name: &str) -> Option<&AgentDef> {
        self.recorded.get(name).or_else(|| self.current.get(name))
    }
}

/// The verdict on one session's log.
#[derive(Debug, Clone, Serialize)]
pub struct SessionVerdict {
    pub session: String,
    pub events: u64,
    pub ok: bool,
    /// The first problem: a broken chain or a diverging decision, with its seq.
    pub problem: Option<String>,
    pub seq: Option<u64>,
}

/// The definition a log was submitted with, read once per digest.
async fn def_cached(
    b: &Backend,
    records: &[Record],
    seen: &mut BTreeMap<String, AgentDef>,
) -> Result<Option<AgentDef>> {
    let Some(Event::Submitted(s)) = records.first().map(|r| &r.env.body) else {
        return Ok(None);
    };
    if let Some(d) = seen.get(&s.def_digest) {
        return Ok(Some(d.clone()));
    }
    let text = b.def_text(&s.def_digest).await?;
    let d = AgentDef::parse(&format!("stored definition {}", s.def_digest), &text)?;
    seen.insert(s.def_digest.clone(), d.clone());
    Ok(Some(d))
}

/// The agents of the pushed definitions version `digest`, and its `[limits]` if it holds
/// them.
async fn pinned_set(b: &Backend, digest: &str) -> Result<(AgentSet, Option<Limits>)> {
    let bytes = b.blobs.get(digest).await?.ok_or_else(|| {
        Error::NotFound(format!(
            "definitions version {digest}, which the tree is pinned to, is not in the blob store"
        ))
    })?;
    let d = skein_core::Definitions::decode(&bytes)?;
    Ok((d.agent_set(&[])?, d.limits))
}

/// Re-folds every log under `id` (the session and its descendants), checks each hash
/// chain, and re-derives every decision with the recorded outputs.
pub async fn verify_tree(
    b: &Backend,
    id: &SessionId,
    current: &AgentSet,
    limits: &Limits,
) -> Result<Vec<SessionVerdict>> {
    let ids = b.subtree(id).await?;
    let mut logs = vec![];
    let mut recorded = BTreeMap::new();
    let mut defs = BTreeMap::new();
    for s in &ids {
        let records = b.log.read(s, 1).await?;
        if records.is_empty() {
            // Named in the tree, never written (see `EventLog::tree`).
            continue;
        }
        if let Some(def) = def_cached(b, &records, &mut defs).await? {
            recorded.entry(def.name().to_string()).or_insert(def);
        }
        logs.push((s.clone(), records));
    }
    // A tree pinned to a pushed version decided with that version's agents, whatever the
    // caller's files say now.
    let pinned = match logs
        .first()
        .and_then(|(_, r)| r.first())
        .map(|r| &r.env.body)
    {
        Some(Event::Submitted(s)) => match &s.defs {
            Some(d) => Some(pinned_set(b, d).await?),
            None => None,
        },
        _ => None,
    };
    // ... and under its `[limits]` when the version holds them (with the approvals the
    // caller's tools ask for themselves, as a worker adds them).
    let pinned_limits = pinned.as_ref().and_then(|(_, l)| l.clone()).map(|mut l| {
        for t in &limits.approval_required {
            if !l.approval_required.contains(t) {
                l.approval_required.push(t.clone());
            }
        }
        l
    });
    let limits = pinned_limits.as_ref().unwrap_or(limits);
    let current = pinned.as_ref().map(|(set, _)| set).unwrap_or(current);
    let catalog = RecordedCatalog { recorded, current };
    let mut out = vec![];
    for (s, records) in logs {
        let mut v = SessionVerdict {
            session: s.display(),
            events: records.len() as u64,
            ok: true,
            problem: None,
            seq: None,
        };
        if let Err(brk) = verify_chain(&s, &records) {
            v.ok = false;
            v.problem = Some(format!("hash chain: {}", brk.reason));
            v.seq = Some(brk.seq);
        } else if let Some(def) = def_cached(b, &records, &mut defs).await? {
            let envs: Vec<_> = records.iter().map(|r| r.env.clone()).collect();
            // A fork's prefix was decided by its source's definition.
            let prefix = match records.first().map(|r| &r.env.body) {
                Some(Event::Submitted(sub)) => match &sub.forked_from {
                    Some(p) => {
                        let src = b.log.read(&p.session, 1).await?;
                        def_cached(b, &src, &mut defs).await?.map(|d| (p.at_seq, d))
                    }
                    None => None,
                },
                _ => None,
            };
            let verdict = skein_core::replay::verify_with(&envs, |st| match &prefix {
                Some((at, src)) if st.last_seq < *at => st.next(src, limits, &catalog),
                _ => st.next(&def, limits, &catalog),
            });
            if let Err(d) = verdict {
                v.ok = false;
                v.problem = Some(format!(
                    "decision: expected {}, found {}",
                    d.expected, d.found
                ));
                v.seq = Some(d.seq);
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// How a fork differs from its source.
#[derive(Debug, Clone, Default)]
pub struct ForkSpec {
    /// A new `provider:model` for the forked session's agent.
    pub model: Option<String>,
    /// A whole new agent definition text.
    pub agent_text: Option<String>,
    pub id: Option<String>,
    /// Run on the definitions version current now (its definition of the agent, under
    /// `model` and `agent_text` when given) rather than on the source's pinned one.
    pub current: bool,
}

/// The current version's definition of `agent`, for a fork that moves to it.
fn current_def(rt: &Runtime, agent: &str) -> Result<AgentDef> {
    let v = rt.current_version();
    v.agents.get(agent).cloned().ok_or_else(|| {
        Error::refused(
            crate::RefusalKind::UnknownAgent,
            format!(
                "the current definitions{} have no agent `{agent}`: fork without --current, \
                 or push definitions that define it",
                v.digest
                    .as_deref()
                    .map(|d| format!(" ({})", skein_core::definitions::short(d)))
                    .unwrap_or_default()
            ),
        )
    })
}

/// Starts a new root session whose log is the prefix `1..=at` of `source` (re-chained
/// under the new id, the `Submitted` carrying the provenance) and enqueues it, so it
/// continues live. A prefix that ends while children of a turn are outstanding is
/// refused: those children belong to the source's tree.
pub async fn fork(
    rt: &Arc<Runtime>,
    source: &SessionId,
    at: u64,
    spec: ForkSpec,
) -> Result<SessionId> {
    let b = &rt.backend;
    let records = b.log.read(source, 1).await?;
    if records.is_empty() {
        return Err(Error::NotFound(format!("no session {source}")));
    }
    if at == 0 || at > records.len() as u64 {
        return Err(Error::invalid(format!(
            "--at {at} is outside the log of {source} (1..={})",
            records.len()
        )));
    }
    let prefix = &records[..at as usize];
    let mut probe = Folded::new(source.clone());
    probe.absorb(prefix)?;
    if probe.state.status.is_terminal() {
        return Err(Error::invalid(format!(
            "the session has ended at seq {at}; fork at an earlier seq"
        )));
    }
    if !probe.state.outstanding_children().is_empty() {
        let ok: Vec<u64> = (1..=records.len() as u64)
            .filter(|&s| {
                let mut f = Folded::new(source.clone());
                f.absorb(&records[..s as usize]).is_ok()
                    && f.state.outstanding_children().is_empty()
                    && !f.state.status.is_terminal()
            })
            .collect();
        return Err(Error::invalid(format!(
            "at seq {at} children of the turn are still outstanding; fork where none are \
             (e.g. seq {})",
            ok.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
        )));
    }
    let Some(Event::Submitted(mut sub)) = prefix.first().map(|r| r.env.body.clone()) else {
        return Err(Error::corrupt_because(format!(
            "{source} does not start with Submitted"
        )));
    };
    let text = match (&spec.agent_text, &spec.model) {
        (Some(t), _) => {
            let d = AgentDef::parse("--agent-file", t)?;
            if d.name() != sub.agent {
                return Err(Error::invalid(format!(
                    "--agent-file defines `{}`, the session runs `{}`",
                    d.name(),
                    sub.agent
                )));
            }
            Some(t.clone())
        }
        (None, Some(m)) if spec.current => {
            let mut d = current_def(rt, &sub.agent)?;
            d.front.model = m.clone();
            Some(AgentDef::render(&d.front, &d.prompt)?)
        }
        (None, None) if spec.current => Some(current_def(rt, &sub.agent)?.text),
        (None, Some(m)) => {
            let old = b.def_text(&sub.def_digest).await?;
            let mut d = AgentDef::parse("stored definition", &old)?;
            d.front.model = m.clone();
            Some(AgentDef::render(&d.front, &d.prompt)?)
        }
        (None, None) => None,
    };
    if let Some(t) = text {
        AgentDef::parse("fork definition", &t)?;
        sub.def_digest = b.blobs.put(t.as_bytes()).await?;
    }
    if spec.current {
        sub.defs = rt.current_version().digest.clone();
    }
    let id = match &spec.id {
        Some(t) => SessionId::root(t).map_err(|e| Error::invalid(format!("id: {e}")))?,
        None => new_root_id(),
    };
    sub.forked_from = Some(Box::new(Provenance {
        session: source.clone(),
        at_seq: at,
    }));
    sub.parent = None;
    sub.depth = 0;
    sub.ancestry = vec![];
    let mut bodies = vec![Event::Submitted(sub.clone())];
    bodies.extend(prefix[1..].iter().map(|r| r.env.body.clone()));
    let mut f = Folded::new(id.clone());
    rt.append_all(&mut f, bodies).await?;
    let pool = sub.pool();
    crate::worker::wake(&*b.jobs, &pool, &id).await?;
    Ok(id)
}
