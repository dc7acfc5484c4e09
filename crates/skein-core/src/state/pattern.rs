//! The orchestration patterns in the fold: a pattern event opens a turn of pattern calls
//! (one per child it starts); when every one has its outcome the turn closes into what
//! the pattern means: the advice of the first prompt, or the answer the session hands up.

use serde::Serialize;
use serde_json::{json, Value};

use super::{SessionState, Slot, SlotState, Status};
use crate::event::PatternCall;
use crate::message::ToolCall;

/// The pattern whose calls make up the current turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PatternKind {
    Handoff,
    Route,
    Advisors,
    Team,
}

impl PatternKind {
    /// The name a pattern call goes by in the turn (never a tool the model calls: the
    /// turn is the pattern's alone).
    pub fn call_name(self) -> &'static str {
        match self {
            PatternKind::Handoff => "handoff",
            PatternKind::Route => "route",
            PatternKind::Advisors => "advisor",
            PatternKind::Team => MEMBER,
        }
    }

    /// The pattern a call id of a pattern turn stands for: those ids are the pattern's
    /// call name, a dot, and the child's number (`handoff.3`, `route.2`, `advisor.1`).
    pub fn of_call(call: &str) -> Option<PatternKind> {
        let (name, _) = split_call(call)?;
        if name == SUPERVISOR {
            return Some(PatternKind::Team);
        }
        [
            PatternKind::Handoff,
            PatternKind::Route,
            PatternKind::Advisors,
            PatternKind::Team,
        ]
        .into_iter()
        .find(|k| k.call_name() == name)
    }
}

/// The call name of a team's members and of its supervisor.
pub const MEMBER: &str = "member";
pub const SUPERVISOR: &str = "supervisor";

/// A pattern call id's name and child number (`member.3` → `("member", 3)`).
pub fn split_call(call: &str) -> Option<(&str, u32)> {
    let (name, n) = call.split_once('.')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((name, n.parse().ok()?))
}

/// How a teammate's broadcast reads in the receiving model's conversation.
pub fn broadcast_text(b: &crate::event::TeamBroadcast) -> String {
    let turns = b
        .turns
        .map(|t| format!(", after {t} turn{}", if t == 1 { "" } else { "s" }))
        .unwrap_or_default();
    format!(
        "## Team broadcast from `{}` ({}{turns})\n\n{}",
        b.agent,
        b.kind.as_str(),
        b.message
    )
}

/// What one advisor contributed: its answer, or the report of its failure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdviceNote {
    pub agent: String,
    pub text: String,
    pub failed: bool,
}

/// The advisors' notes, which enter the agent's first prompt in tagged blocks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Advice {
    pub notes: Vec<AdviceNote>,
}

/// Twelve hex digits that tag the blocks of one composed prompt. They are the digest of
/// everything the blocks hold, so no text inside a block can close it (a model would have
/// to write the digest of its own text), and the same request composed twice reads the
/// same, which keeps pattern children answerable from the cache.
pub fn block_nonce(parts: &[&str]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"skein pattern blocks v1");
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    h.finalize().to_hex()[..12].to_string()
}

/// `<tag__N attrs>\ntext\n</tag__N>`: a block of a composed prompt.
fn block(tag: &str, nonce: &str, agent: Option<&str>, text: &str) -> String {
    let attr = agent.map(|a| format!(" agent=\"{a}\"")).unwrap_or_default();
    format!("<{tag}__{nonce}{attr}>\n{text}\n</{tag}__{nonce}>")
}

/// The request and one agent's answer, as a handoff target reads them.
pub fn handoff_mission(request: &str, from: &str, response: &str) -> String {
    let n = block_nonce(&["handoff", request, from, response]);
    format!(
        "{}\n{}",
        block("original_user_request", &n, None, request),
        block("response", &n, Some(from), response)
    )
}

/// The request and a router's optional note, as the chosen destination reads them.
pub fn route_mission(request: &str, router: &str, message: Option<&str>) -> String {
    let note = message.filter(|m| !m.trim().is_empty());
    let n = block_nonce(&["route", request, router, note.unwrap_or("")]);
    let mut m = block("original_user_request", &n, None, request);
    if let Some(note) = note {
        m.push('\n');
        m.push_str(&block("advisory", &n, Some(router), note));
    }
    m
}

impl Advice {
    /// The first prompt's request with the advisors' notes after it.
    pub fn compose(&self, request: &str) -> String {
        let mut parts: Vec<&str> = vec!["advisors", request];
        for n in &self.notes {
            parts.push(&n.agent);
            parts.push(&n.text);
        }
        let nonce = block_nonce(&parts);
        let mut m = block("original_user_request", &nonce, None, request);
        for n in &self.notes {
            m.push('\n');
            m.push_str(&block("advisory", &nonce, Some(&n.agent), &n.text));
        }
        m
    }
}

impl SessionState {
    /// A pattern event: its calls become the turn.
    pub(super) fn open_pattern(&mut self, kind: PatternKind, calls: &[PatternCall]) {
        if !self.turn.is_empty() {
            // Only a log that was not decided here would open a pattern mid-turn; it
            // changes nothing (replay verification names it).
            return;
        }
        self.ending.pending_answer = None;
        self.pattern.kind = Some(kind);
        if kind == PatternKind::Team {
            self.team.ran = true;
        }
        self.replace_turn(
            calls
                .iter()
                .map(|c| Slot {
                    call: ToolCall {
                        id: c.call.clone(),
                        name: split_call(&c.call)
                            .map_or(kind.call_name(), |(name, _)| name)
                            .into(),
                        args: json!({"agent": c.agent, "mission": c.mission}),
                    },
                    state: SlotState::Pending,
                })
                .collect(),
        );
    }

    /// Every pattern call has its outcome: the turn closes into what the pattern means.
    /// The transcript is not touched: the model never made these calls.
    pub(super) fn close_pattern(&mut self, kind: PatternKind, slots: Vec<Slot>) {
        // A team's answer is its supervisor's; the members' ends are only theirs.
        let slots = slots
            .into_iter()
            .filter(|s| kind != PatternKind::Team || s.call.name == SUPERVISOR);
        let outcomes = slots.filter_map(|s| {
            let agent = s
                .call
                .args
                .get("agent")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            match s.state {
                SlotState::Done { output, error } => Some((agent, output, error)),
                _ => None,
            }
        });
        match kind {
            PatternKind::Advisors => {
                let notes = outcomes
                    .map(|(agent, text, failed)| AdviceNote {
                        text: if failed {
                            format!("advisor `{agent}` failed and gave no advice: {text}")
                        } else {
                            text
                        },
                        agent,
                        failed,
                    })
                    .collect();
                self.pattern.advice = Some(Advice { notes });
            }
            PatternKind::Handoff | PatternKind::Route | PatternKind::Team => {
                let Some((agent, output, error)) = outcomes.into_iter().next() else {
                    return;
                };
                if error {
                    let what = match kind {
                        PatternKind::Handoff => "the handoff to",
                        PatternKind::Route => "the route to",
                        _ => "the team's supervisor",
                    };
                    self.pattern.error = Some(format!("{what} `{agent}` failed: {output}"));
                    return;
                }
                if kind == PatternKind::Handoff {
                    self.pattern.handed_off = true;
                }
                // The answer is the chain's: it is neither handed on again by a handoff
                // already made nor summarised a second time.
                self.ending.summary = Some(output.clone());
                self.ending.full_answer = None;
                self.ending.pending_answer = Some(output);
                self.pattern.answer_from = Some(agent);
                self.status = Status::Running;
            }
        }
    }
}

impl SessionState {
    /// A teammate's broadcast, received: the model reads it before its next turn (at
    /// once between turns, else when the current turn's results are in).
    pub(super) fn hear(&mut self, b: &crate::event::TeamBroadcast) {
        if !self.team.seen.insert(b.key()) {
            return;
        }
        self.team.unread += 1;
        if b.is_leaving() {
            self.team.exits += 1;
        }
        let text = broadcast_text(b);
        if self.turn.is_empty() {
            self.transcript
                .push(crate::message::Message::User { content: text });
        } else {
            self.team.queue.push(text);
        }
    }

    /// A supervisor with nothing new to read while members still work waits for them.
    pub fn team_gated(&self) -> bool {
        let Some(seat) = self.submitted.as_ref().and_then(|s| s.team.as_ref()) else {
            return false;
        };
        seat.role == crate::event::TeamRole::Supervisor
            && self.turn.is_empty()
            && self.ending.pending_answer.is_none()
            && self.team.unread == 0
            && self.team.exits < seat.members
    }

    /// The members of this session's team still running once its supervisor has ended:
    /// the team is over, and they are to be cancelled.
    pub fn team_leftovers(&self) -> Vec<crate::id::SessionId> {
        if self.pattern.kind != Some(PatternKind::Team) {
            return vec![];
        }
        let supervisor_done = self
            .turn
            .iter()
            .any(|s| s.call.name == SUPERVISOR && matches!(s.state, SlotState::Done { .. }));
        if !supervisor_done {
            return vec![];
        }
        self.turn
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Delegated { child, .. } if s.call.name == MEMBER => Some(child.clone()),
                _ => None,
            })
            .collect()
    }
}
