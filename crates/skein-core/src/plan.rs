//! The master plan: a versioned todo list owned by one session (the orchestrator), the
//! patches sub-agents propose against it, the merge rules, and its Markdown view.
//!
//! The plan lives in its owner's log. The owner edits it with `update_plan`; a child it
//! handed tasks (`call_agent {owns_tasks}`) proposes changes with `propose_patch
//! {base_version, ops}`. Every accepted change is a `PatchApplied` event, every refused one
//! a `PatchRejected` with its [`Rejection`]; folding the log's accepted patches in order
//! rebuilds the plan exactly. Merge rules:
//!
//! - **version**: a child must name the version it read (`base_version`); anything but
//!   the current version is a conflict that tells the current one, so the child can rebase.
//!   The owner may omit it.
//! - **ownership**: a child writes only tasks it owns (handed to it, or added by it);
//!   dependency links may cross owners as long as the child owns one end; removing a link
//!   follows [`UnlinkPolicy`].
//! - **structure**: ids are unique, referenced tasks exist, `depends_on` stays acyclic.
//!
//! A patch is applied whole or not at all.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest task id, title and notes accepted.
const MAX_ID: usize = 64;
const MAX_TEXT: usize = 4000;
/// Most tasks a plan may hold.
pub const MAX_TASKS: usize = 500;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskStatus {
    #[default]
    Pending,
    InProgress,
    Completed,
    Failed,
    Blocked,
}

impl TaskStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Pending => "PENDING",
            TaskStatus::InProgress => "IN_PROGRESS",
            TaskStatus::Completed => "COMPLETED",
            TaskStatus::Failed => "FAILED",
            TaskStatus::Blocked => "BLOCKED",
        }
    }

    fn mark(self) -> &'static str {
        match self {
            TaskStatus::Pending => "[ ]",
            TaskStatus::InProgress => "[~]",
            TaskStatus::Completed => "[x]",
            TaskStatus::Failed => "[!]",
            TaskStatus::Blocked => "[-]",
        }
    }
}

/// One task of the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    pub title: String,
    #[serde(default)]
    pub status: TaskStatus,
    /// The agent responsible (the plan owner's own agent for its tasks).
    #[serde(default)]
    pub owner_agent: Option<String>,
    /// The session that may write this task, when it was handed to a sub-agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_session: Option<String>,
    #[serde(default)]
    pub depends_on: Vec<String>,
    #[serde(default)]
    pub notes: Option<String>,
    #[serde(default)]
    pub parent: Option<String>,
}

/// A task as a patch adds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTask {
    pub id: String,
    pub title: String,
    #[serde(default)]
    pub status: TaskStatus,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub depends_on: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    /// Only the plan owner may name an owner other than itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_agent: Option<String>,
}

/// The fields an `update` changes; absent fields stay as they are.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<TaskStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    /// Reassigns the task (plan owner only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_agent: Option<String>,
}

/// One operation of a patch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum PatchOp {
    Add { task: NewTask },
    AddSubtask { parent_id: String, task: NewTask },
    Update { task_id: String, fields: TaskFields },
    LinkDep { task_id: String, depends_on: String },
    UnlinkDep { task_id: String, depends_on: String },
}

impl PatchOp {
    pub fn name(&self) -> &'static str {
        match self {
            PatchOp::Add { .. } => "add",
            PatchOp::AddSubtask { .. } => "add_subtask",
            PatchOp::Update { .. } => "update",
            PatchOp::LinkDep { .. } => "link_dep",
            PatchOp::UnlinkDep { .. } => "unlink_dep",
        }
    }
}

/// A proposed change: the version it was made against, and its operations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Patch {
    #[serde(default, deserialize_with = "lenient_version")]
    pub base_version: Option<u64>,
    pub ops: Vec<PatchOp>,
}

/// A version as a number, or as a string of digits (models often quote numbers).
fn lenient_version<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    use serde::de::Error as _;
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| D::Error::custom(format!("base_version `{n}` is not a version number"))),
        Some(serde_json::Value::String(s)) => {
            s.trim().parse::<u64>().map(Some).map_err(|_| {
                D::Error::custom(format!("base_version `{s}` is not a version number"))
            })
        }
        Some(other) => Err(D::Error::custom(format!(
            "base_version must be a number, not {other}"
        ))),
    }
}

impl Patch {
    /// Reads a patch from tool arguments, with a message the model can act on.
    pub fn from_args(args: &serde_json::Value) -> Result<Patch, String> {
        serde_json::from_value(args.clone()).map_err(|e| format!("invalid patch: {e}"))
    }
}

/// Who proposes a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Author<'a> {
    /// The session that owns the plan (its agent's name).
    Owner { agent: &'a str },
    /// A sub-agent the owner handed tasks to.
    Delegate { session: &'a str, agent: &'a str },
}

impl<'a> Author<'a> {
    /// The author a `PatchApplied` names: `from` is `"self"` for the owner.
    pub fn of(from: &'a str, agent: &'a str) -> Author<'a> {
        if from == SELF {
            Author::Owner { agent }
        } else {
            Author::Delegate {
                session: from,
                agent,
            }
        }
    }
}

/// `from` of a patch the plan owner made itself.
pub const SELF: &str = "self";

/// Whether a sub-agent may remove a dependency link (`[limits] plan_unlink`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnlinkPolicy {
    /// Only from a task it owns.
    #[default]
    Owner,
    /// Any link, like adding one.
    Any,
    /// Never: only the plan owner removes links.
    Never,
}

/// Why a patch was refused. The child's model reads it as its tool result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Rejection {
    /// `base_version` is not the current version: rebase on `current_version`.
    Conflict {
        current_version: u64,
        #[serde(default)]
        base_version: Option<u64>,
    },
    /// The author does not own the task the operation writes.
    Forbidden {
        op: String,
        task_id: String,
        #[serde(default)]
        owner: Option<String>,
    },
    UnknownTask {
        op: String,
        task_id: String,
    },
    DuplicateTask {
        task_id: String,
    },
    /// The patch would make `depends_on` cyclic; `path` is the cycle.
    Cycle {
        path: Vec<String>,
    },
    Invalid {
        reason: String,
    },
}

impl Rejection {
    /// The HTTP-like status a model may know: 409 conflict, 403 forbidden, 422 otherwise.
    pub fn code(&self) -> u16 {
        match self {
            Rejection::Conflict { .. } => 409,
            Rejection::Forbidden { .. } => 403,
            _ => 422,
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Conflict {
                current_version,
                base_version,
            } => match base_version {
                Some(b) => write!(
                    f,
                    "conflict: the patch was made against version {b}, the plan is at version \
                     {current_version}; rebase on {current_version} and propose again"
                ),
                None => write!(
                    f,
                    "conflict: base_version is required; the plan is at version {current_version}"
                ),
            },
            Rejection::Forbidden { op, task_id, owner } => write!(
                f,
                "forbidden: `{op}` writes task `{task_id}`, which belongs to {}",
                owner.as_deref().unwrap_or("the plan owner")
            ),
            Rejection::UnknownTask { op, task_id } => {
                write!(f, "`{op}`: no task `{task_id}` in the plan")
            }
            Rejection::DuplicateTask { task_id } => {
                write!(f, "`add`: task `{task_id}` already exists")
            }
            Rejection::Cycle { path } => {
                write!(
                    f,
                    "the patch makes a dependency cycle: {}",
                    path.join(" → ")
                )
            }
            Rejection::Invalid { reason } => write!(f, "invalid patch: {reason}"),
        }
    }
}

/// The plan: tasks in the order they were added, and its version (the number of accepted
/// patches).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Plan {
    pub version: u64,
    pub tasks: Vec<Task>,
}

fn check_id(id: &str) -> Result<(), Rejection> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Rejection::Invalid {
            reason: format!(
                "task id `{id}`: use 1 to {MAX_ID} characters of letters, digits, `-`, `_`, `.`"
            ),
        })
    }
}

fn check_text(what: &str, s: &str) -> Result<(), Rejection> {
    if s.len() > MAX_TEXT {
        return Err(Rejection::Invalid {
            reason: format!("{what} is longer than {MAX_TEXT} bytes"),
        });
    }
    Ok(())
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    pub fn get(&self, id: &str) -> Option<&Task> {
        self.tasks.iter().find(|t| t.id == id)
    }

    fn get_mut(&mut self, id: &str) -> Option<&mut Task> {
        self.tasks.iter_mut().find(|t| t.id == id)
    }

    /// Tasks `session` may write.
    pub fn owned_by(&self, session: &str) -> Vec<&Task> {
        self.tasks
            .iter()
            .filter(|t| t.owner_session.as_deref() == Some(session))
            .collect()
    }

    /// Hands tasks to a sub-agent (recorded with the delegation; the version is unchanged,
    /// so children started together share a base). Unknown ids are ignored: the decide
    /// step refuses them before a delegation is recorded.
    pub fn grant(&mut self, ids: &[String], agent: &str, session: &str) {
        for id in ids {
            if let Some(t) = self.get_mut(id) {
                t.owner_agent = Some(agent.to_string());
                t.owner_session = Some(session.to_string());
            }
        }
    }

    /// Checks `patch` by every rule and returns the plan it makes (version + 1), or why
    /// it is refused. `self` is untouched either way.
    pub fn merge(
        &self,
        author: Author<'_>,
        patch: &Patch,
        policy: UnlinkPolicy,
    ) -> Result<Plan, Rejection> {
        match (author, patch.base_version) {
            (_, Some(b)) if b != self.version => {
                return Err(Rejection::Conflict {
                    current_version: self.version,
                    base_version: Some(b),
                })
            }
            (Author::Delegate { .. }, None) => {
                return Err(Rejection::Conflict {
                    current_version: self.version,
                    base_version: None,
                })
            }
            _ => {}
        }
        if patch.ops.is_empty() {
            return Err(Rejection::Invalid {
                reason: "a patch needs at least one op".into(),
            });
        }
        let mut next = self.clone();
        for op in &patch.ops {
            next.apply_op(author, op, Some(policy))?;
        }
        if next.tasks.len() > MAX_TASKS {
            return Err(Rejection::Invalid {
                reason: format!("a plan holds at most {MAX_TASKS} tasks"),
            });
        }
        if let Some(path) = next.find_cycle() {
            return Err(Rejection::Cycle { path });
        }
        next.version = self.version.saturating_add(1);
        Ok(next)
    }

    /// Applies an accepted patch as recorded (folding a log): the same operations without
    /// the permission checks, which were made when it was accepted. An operation that
    /// does not fit is skipped, so a fold never fails.
    pub fn apply_accepted(&mut self, author: Author<'_>, ops: &[PatchOp], version: u64) {
        let mut next = self.clone();
        let mut ok = true;
        for op in ops {
            ok &= next.apply_op(author, op, None).is_ok();
        }
        if ok {
            *self = next;
        } else {
            // Keep the ops that fit, one by one, as a fold of a hand-edited log would.
            for op in ops {
                let _ = self.apply_op(author, op, None);
            }
        }
        self.version = version;
    }

    /// One operation. `policy` is `None` when applying a recorded patch (no permission
    /// checks).
    fn apply_op(
        &mut self,
        author: Author<'_>,
        op: &PatchOp,
        policy: Option<UnlinkPolicy>,
    ) -> Result<(), Rejection> {
        let enforce = policy.is_some();
        let name = op.name();
        let unknown = |id: &str| Rejection::UnknownTask {
            op: name.into(),
            task_id: id.to_string(),
        };
        match op {
            PatchOp::Add { task } => self.add(author, task, None, enforce),
            PatchOp::AddSubtask { parent_id, task } => {
                let parent = self.get(parent_id).ok_or_else(|| unknown(parent_id))?;
                if enforce {
                    self.guard(author, name, parent)?;
                }
                let inherited = (parent.owner_agent.clone(), parent.owner_session.clone());
                self.add(author, task, Some((parent_id.clone(), inherited)), enforce)
            }
            PatchOp::Update { task_id, fields } => {
                let t = self.get(task_id).ok_or_else(|| unknown(task_id))?;
                if enforce {
                    self.guard(author, name, t)?;
                    if fields.owner_agent.is_some() && matches!(author, Author::Delegate { .. }) {
                        return Err(Rejection::Forbidden {
                            op: "update.owner_agent".into(),
                            task_id: task_id.clone(),
                            owner: t.owner_agent.clone(),
                        });
                    }
                }
                if let Some(title) = &fields.title {
                    check_text("title", title)?;
                }
                if let Some(n) = &fields.notes {
                    check_text("notes", n)?;
                }
                let t = self.get_mut(task_id).ok_or_else(|| unknown(task_id))?;
                if let Some(title) = &fields.title {
                    t.title = title.clone();
                }
                if let Some(s) = fields.status {
                    t.status = s;
                }
                if let Some(n) = &fields.notes {
                    t.notes = Some(n.clone());
                }
                if let Some(o) = &fields.owner_agent {
                    t.owner_agent = Some(o.clone());
                    t.owner_session = None;
                }
                Ok(())
            }
            PatchOp::LinkDep {
                task_id,
                depends_on,
            } => {
                let t = self.get(task_id).ok_or_else(|| unknown(task_id))?;
                let d = self.get(depends_on).ok_or_else(|| unknown(depends_on))?;
                if enforce && self.guard(author, name, t).is_err() {
                    // A link may cross owners when the author owns either end.
                    self.guard(author, name, d)
                        .map_err(|_| Rejection::Forbidden {
                            op: name.into(),
                            task_id: task_id.clone(),
                            owner: t.owner_agent.clone(),
                        })?;
                }
                if task_id == depends_on {
                    return Err(Rejection::Cycle {
                        path: vec![task_id.clone(), task_id.clone()],
                    });
                }
                let t = self.get_mut(task_id).ok_or_else(|| unknown(task_id))?;
                if !t.depends_on.contains(depends_on) {
                    t.depends_on.push(depends_on.clone());
                }
                Ok(())
            }
            PatchOp::UnlinkDep {
                task_id,
                depends_on,
            } => {
                let t = self.get(task_id).ok_or_else(|| unknown(task_id))?;
                if !t.depends_on.contains(depends_on) {
                    return Err(Rejection::Invalid {
                        reason: format!(
                            "`unlink_dep`: `{task_id}` does not depend on `{depends_on}`"
                        ),
                    });
                }
                if let (Some(p), Author::Delegate { .. }) = (policy, author) {
                    let refused = match p {
                        UnlinkPolicy::Any => false,
                        UnlinkPolicy::Never => true,
                        UnlinkPolicy::Owner => self.guard(author, name, t).is_err(),
                    };
                    if refused {
                        return Err(Rejection::Forbidden {
                            op: name.into(),
                            task_id: task_id.clone(),
                            owner: t.owner_agent.clone(),
                        });
                    }
                }
                let t = self.get_mut(task_id).ok_or_else(|| unknown(task_id))?;
                t.depends_on.retain(|d| d != depends_on);
                Ok(())
            }
        }
    }

    /// The ownership guard: the owner writes anything, a sub-agent only its own tasks.
    fn guard(&self, author: Author<'_>, op: &str, t: &Task) -> Result<(), Rejection> {
        match author {
            Author::Owner { .. } => Ok(()),
            Author::Delegate { session, .. } if t.owner_session.as_deref() == Some(session) => {
                Ok(())
            }
            Author::Delegate { .. } => Err(Rejection::Forbidden {
                op: op.into(),
                task_id: t.id.clone(),
                owner: t.owner_agent.clone(),
            }),
        }
    }

    #[allow(clippy::type_complexity)]
    fn add(
        &mut self,
        author: Author<'_>,
        task: &NewTask,
        parent: Option<(String, (Option<String>, Option<String>))>,
        enforce: bool,
    ) -> Result<(), Rejection> {
        check_id(&task.id)?;
        check_text("title", &task.title)?;
        if let Some(n) = &task.notes {
            check_text("notes", n)?;
        }
        if task.title.trim().is_empty() {
            return Err(Rejection::Invalid {
                reason: format!("task `{}` needs a title", task.id),
            });
        }
        if self.get(&task.id).is_some() {
            return Err(Rejection::DuplicateTask {
                task_id: task.id.clone(),
            });
        }
        for d in &task.depends_on {
            if self.get(d).is_none() {
                return Err(Rejection::UnknownTask {
                    op: if parent.is_some() {
                        "add_subtask"
                    } else {
                        "add"
                    }
                    .into(),
                    task_id: d.clone(),
                });
            }
        }
        let (owner_agent, owner_session) = match author {
            Author::Delegate { session, agent } => {
                if enforce && task.owner_agent.as_deref().is_some_and(|o| o != agent) {
                    return Err(Rejection::Forbidden {
                        op: "add.owner_agent".into(),
                        task_id: task.id.clone(),
                        owner: task.owner_agent.clone(),
                    });
                }
                (Some(agent.to_string()), Some(session.to_string()))
            }
            Author::Owner { agent } => match (&task.owner_agent, &parent) {
                (Some(o), _) => (Some(o.clone()), None),
                (None, Some((_, inherited))) => inherited.clone(),
                (None, None) => (Some(agent.to_string()), None),
            },
        };
        let mut depends_on = vec![];
        for d in &task.depends_on {
            if !depends_on.contains(d) {
                depends_on.push(d.clone());
            }
        }
        self.tasks.push(Task {
            id: task.id.clone(),
            title: task.title.clone(),
            status: task.status,
            owner_agent,
            owner_session,
            depends_on,
            notes: task.notes.clone(),
            parent: parent.map(|(p, _)| p),
        });
        Ok(())
    }

    /// A cycle in `depends_on`, as the path that closes it (first task repeated last).
    pub fn find_cycle(&self) -> Option<Vec<String>> {
        let edges: BTreeMap<&str, &[String]> = self
            .tasks
            .iter()
            .map(|t| (t.id.as_str(), t.depends_on.as_slice()))
            .collect();
        // 0 new, 1 on the stack, 2 done.
        let mut mark: BTreeMap<&str, u8> = BTreeMap::new();
        for t in &self.tasks {
            let mut stack: Vec<(&str, usize)> = vec![(t.id.as_str(), 0)];
            if mark.get(t.id.as_str()).copied().unwrap_or(0) != 0 {
                continue;
            }
            mark.insert(t.id.as_str(), 1);
            while let Some((node, i)) = stack.pop() {
                let deps = edges.get(node).copied().unwrap_or(&[]);
                if i < deps.len() {
                    stack.push((node, i + 1));
                    let d = deps[i].as_str();
                    match mark.get(d).copied().unwrap_or(0) {
                        0 => {
                            mark.insert(d, 1);
                            stack.push((d, 0));
                        }
                        1 => {
                            let start = stack.iter().position(|(n, _)| *n == d).unwrap_or(0);
                            let mut path: Vec<String> =
                                stack[start..].iter().map(|(n, _)| n.to_string()).collect();
                            path.push(d.to_string());
                            return Some(path);
                        }
                        _ => {}
                    }
                } else {
                    mark.insert(node, 2);
                }
            }
        }
        None
    }

    /// The plan as Markdown: grouped by owner (groups in name order), tasks in the order
    /// they were added, subtasks under their parent. The same plan always renders to the
    /// same bytes.
    pub fn render_markdown(&self) -> String {
        let mut out = format!("# Plan (version {})\n", self.version);
        if self.tasks.is_empty() {
            out.push_str("\n_No tasks._\n");
            return out;
        }
        let owner = |t: &Task| {
            t.owner_agent
                .clone()
                .unwrap_or_else(|| "unassigned".to_string())
        };
        let groups: BTreeSet<String> = self.tasks.iter().map(owner).collect();
        for g in groups {
            out.push_str(&format!("\n## {g}\n\n"));
            let in_group: Vec<&Task> = self.tasks.iter().filter(|t| owner(t) == g).collect();
            let ids: BTreeSet<&str> = in_group.iter().map(|t| t.id.as_str()).collect();
            // Roots of the group: no parent, or a parent in another group.
            for t in in_group
                .iter()
                .filter(|t| t.parent.as_deref().is_none_or(|p| !ids.contains(p)))
            {
                self.render_task(&mut out, t, &in_group, 0);
            }
        }
        out
    }

    fn render_task(&self, out: &mut String, t: &Task, group: &[&Task], depth: usize) {
        let pad = "  ".repeat(depth);
        out.push_str(&format!(
            "{pad}- {} **{}** {} ({})",
            t.status.mark(),
            t.id,
            one_line(&t.title),
            t.status.as_str()
        ));
        if let (Some(p), 0) = (&t.parent, depth) {
            out.push_str(&format!(" — subtask of {p}"));
        }
        out.push('\n');
        if !t.depends_on.is_empty() {
            out.push_str(&format!(
                "{pad}  - depends on: {}\n",
                t.depends_on.join(", ")
            ));
        }
        if let Some(n) = t.notes.as_deref().filter(|n| !n.is_empty()) {
            out.push_str(&format!("{pad}  - notes: {}\n", one_line(n)));
        }
        if depth < 16 {
            for c in group.iter().filter(|c| c.parent.as_deref() == Some(&t.id)) {
                self.render_task(out, c, group, depth + 1);
            }
        }
    }
}

/// What a model is shown for a merge: `{status: "accepted", version}` or
/// `{status: "conflict" | "forbidden" | "rejected", code, reason, current_version?, detail}`,
/// and whether it is an error.
pub fn verdict_json(verdict: &Result<u64, Rejection>) -> (serde_json::Value, bool) {
    match verdict {
        Ok(v) => (
            serde_json::json!({"status": "accepted", "version": v}),
            false,
        ),
        Err(r) => {
            let status = match r {
                Rejection::Conflict { .. } => "conflict",
                Rejection::Forbidden { .. } => "forbidden",
                _ => "rejected",
            };
            let mut j = serde_json::json!({
                "status": status,
                "code": r.code(),
                "reason": r.to_string(),
                "detail": r,
            });
            if let Rejection::Conflict {
                current_version, ..
            } = r
            {
                j["current_version"] = serde_json::Value::from(*current_version);
            }
            (j, true)
        }
    }
}

/// The patch a sub-agent's final answer carries: a fenced block with the info string
/// `patch` holding `{base_version, ops}`. None when the answer has no such block; the
/// error says why a block could not be read.
pub fn patch_in_answer(answer: &str) -> Option<Result<Patch, String>> {
    let start = answer.find("```patch")?;
    let body = &answer[start + "```patch".len()..];
    let body = body.strip_prefix('\r').unwrap_or(body);
    let Some(body) = body.strip_prefix('\n') else {
        return Some(Err("the ```patch fence must end its line".into()));
    };
    let Some(end) = body.find("```") else {
        return Some(Err("the ```patch block is not closed".into()));
    };
    Some(
        serde_json::from_str::<serde_json::Value>(&body[..end])
            .map_err(|e| format!("the patch block is not JSON: {e}"))
            .and_then(|v| Patch::from_args(&v)),
    )
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ME: Author<'static> = Author::Owner {
        agent: "orchestrator",
    };
    const A: Author<'static> = Author::Delegate {
        session: "s-a",
        agent: "analyst",
    };
    const B: Author<'static> = Author::Delegate {
        session: "s-b",
        agent: "analyst",
    };

    fn patch(base: Option<u64>, ops: serde_json::Value) -> Patch {
        Patch::from_args(&json!({"base_version": base, "ops": ops})).expect("patch")
    }

    /// Given a plan of t1, t2, t3 by the owner, t1 handed to A and t2 to B.
    fn given() -> Plan {
        let p = Plan::default()
            .merge(
                ME,
                &patch(
                    None,
                    json!([
                        {"op": "add", "task": {"id": "t1", "title": "Collect"}},
                        {"op": "add", "task": {"id": "t2", "title": "Analyse"}},
                        {"op": "add", "task": {"id": "t3", "title": "Write", "depends_on": ["t1", "t2"]}},
                    ]),
                ),
                UnlinkPolicy::Owner,
            )
            .expect("owner adds");
        let mut p = p;
        p.grant(&["t1".into()], "analyst", "s-a");
        p.grant(&["t2".into()], "analyst", "s-b");
        p
    }

    fn merge(
        p: &Plan,
        who: Author<'_>,
        base: Option<u64>,
        ops: serde_json::Value,
    ) -> Result<Plan, Rejection> {
        p.merge(who, &patch(base, ops), UnlinkPolicy::Owner)
    }

    #[test]
    fn owner_edits_bump_the_version_and_grants_do_not() {
        let p = given();
        assert_eq!(p.version, 1);
        assert_eq!(
            p.get("t1").and_then(|t| t.owner_session.as_deref()),
            Some("s-a")
        );
        assert_eq!(
            p.get("t3").and_then(|t| t.owner_agent.as_deref()),
            Some("orchestrator")
        );
    }

    #[test]
    fn a_child_updates_its_own_task() {
        let p = given();
        let q = merge(&p, A, Some(1), json!([{"op": "update", "task_id": "t1", "fields": {"status": "COMPLETED", "notes": "done"}}])).expect("accepted");
        assert_eq!(q.version, 2);
        assert_eq!(q.get("t1").map(|t| t.status), Some(TaskStatus::Completed));
        assert_eq!(p.version, 1, "the old plan is untouched");
    }

    #[test]
    fn a_child_may_not_write_another_owners_task() {
        let p = given();
        let e = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "update", "task_id": "t2", "fields": {"status": "FAILED"}}]),
        )
        .unwrap_err();
        assert_eq!(
            e,
            Rejection::Forbidden {
                op: "update".into(),
                task_id: "t2".into(),
                owner: Some("analyst".into())
            }
        );
        assert_eq!(e.code(), 403);
        let e = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "update", "task_id": "t3", "fields": {"notes": "x"}}]),
        )
        .unwrap_err();
        assert!(matches!(e, Rejection::Forbidden { ref task_id, .. } if task_id == "t3"));
    }

    #[test]
    fn a_stale_base_version_is_a_conflict_naming_the_current_one() {
        let p = given();
        let q = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "update", "task_id": "t1", "fields": {"status": "IN_PROGRESS"}}]),
        )
        .expect("first");
        let e = merge(
            &q,
            B,
            Some(1),
            json!([{"op": "update", "task_id": "t2", "fields": {"status": "IN_PROGRESS"}}]),
        )
        .unwrap_err();
        assert_eq!(
            e,
            Rejection::Conflict {
                current_version: 2,
                base_version: Some(1)
            }
        );
        assert_eq!(e.code(), 409);
        // Rebased, it goes through.
        let r = merge(
            &q,
            B,
            Some(2),
            json!([{"op": "update", "task_id": "t2", "fields": {"status": "IN_PROGRESS"}}]),
        )
        .expect("rebased");
        assert_eq!(r.version, 3);
    }

    #[test]
    fn a_child_must_name_its_base_version() {
        let e = merge(
            &given(),
            A,
            None,
            json!([{"op": "update", "task_id": "t1", "fields": {"status": "COMPLETED"}}]),
        )
        .unwrap_err();
        assert_eq!(
            e,
            Rejection::Conflict {
                current_version: 1,
                base_version: None
            }
        );
    }

    #[test]
    fn unknown_task_ids_are_refused() {
        let p = given();
        for ops in [
            json!([{"op": "update", "task_id": "nope", "fields": {"status": "COMPLETED"}}]),
            json!([{"op": "add_subtask", "parent_id": "nope", "task": {"id": "x", "title": "X"}}]),
            json!([{"op": "link_dep", "task_id": "t1", "depends_on": "nope"}]),
            json!([{"op": "add", "task": {"id": "x", "title": "X", "depends_on": ["nope"]}}]),
        ] {
            let e = merge(&p, ME, None, ops.clone()).unwrap_err();
            assert!(
                matches!(e, Rejection::UnknownTask { ref task_id, .. } if task_id == "nope"),
                "{ops}: {e:?}"
            );
        }
    }

    #[test]
    fn duplicate_ids_and_bad_ids_are_refused() {
        let p = given();
        let e = merge(
            &p,
            ME,
            None,
            json!([{"op": "add", "task": {"id": "t1", "title": "again"}}]),
        )
        .unwrap_err();
        assert_eq!(
            e,
            Rejection::DuplicateTask {
                task_id: "t1".into()
            }
        );
        let e = merge(
            &p,
            ME,
            None,
            json!([{"op": "add", "task": {"id": "a b", "title": "x"}}]),
        )
        .unwrap_err();
        assert!(matches!(e, Rejection::Invalid { .. }));
        let e = merge(&p, ME, None, json!([])).unwrap_err();
        assert!(matches!(e, Rejection::Invalid { .. }));
    }

    #[test]
    fn cycles_are_refused_with_their_path() {
        let p = given();
        // t3 depends on t1; making t1 depend on t3 closes a cycle.
        let e = merge(
            &p,
            ME,
            None,
            json!([{"op": "link_dep", "task_id": "t1", "depends_on": "t3"}]),
        )
        .unwrap_err();
        match e {
            Rejection::Cycle { path } => {
                assert_eq!(path.first(), path.last());
                assert!(
                    path.contains(&"t1".to_string()) && path.contains(&"t3".to_string()),
                    "{path:?}"
                );
            }
            other => panic!("expected a cycle, got {other:?}"),
        }
        let e = merge(
            &p,
            ME,
            None,
            json!([{"op": "link_dep", "task_id": "t1", "depends_on": "t1"}]),
        )
        .unwrap_err();
        assert!(matches!(e, Rejection::Cycle { .. }));
    }

    #[test]
    fn links_may_cross_owners_when_the_child_owns_one_end() {
        let p = given();
        let q = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "link_dep", "task_id": "t1", "depends_on": "t2"}]),
        )
        .expect("own → other");
        assert_eq!(
            q.get("t1").map(|t| t.depends_on.clone()),
            Some(vec!["t2".to_string()])
        );
        let q = merge(&p, A, Some(1), json!([{"op": "add", "task": {"id": "t4", "title": "Extra"}}, {"op": "link_dep", "task_id": "t4", "depends_on": "t2"}])).expect("new own task");
        assert_eq!(
            q.get("t4").and_then(|t| t.owner_session.as_deref()),
            Some("s-a")
        );
        // Neither end is A's.
        let e = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "link_dep", "task_id": "t2", "depends_on": "t3"}]),
        )
        .unwrap_err();
        assert!(matches!(e, Rejection::Forbidden { .. }));
    }

    #[test]
    fn unlinking_follows_the_policy() {
        let mut p = given();
        p.grant(&["t3".into()], "analyst", "s-a");
        let ops = json!([{"op": "unlink_dep", "task_id": "t3", "depends_on": "t2"}]);
        let pt = patch(Some(1), ops);
        assert!(p.merge(A, &pt, UnlinkPolicy::Owner).is_ok(), "A owns t3");
        assert!(
            matches!(
                p.merge(B, &pt, UnlinkPolicy::Owner),
                Err(Rejection::Forbidden { .. })
            ),
            "B does not"
        );
        assert!(p.merge(B, &pt, UnlinkPolicy::Any).is_ok());
        assert!(matches!(
            p.merge(A, &pt, UnlinkPolicy::Never),
            Err(Rejection::Forbidden { .. })
        ));
        assert!(
            p.merge(ME, &pt, UnlinkPolicy::Never).is_ok(),
            "the owner always may"
        );
        let missing = patch(
            Some(1),
            json!([{"op": "unlink_dep", "task_id": "t1", "depends_on": "t2"}]),
        );
        assert!(matches!(
            p.merge(ME, &missing, UnlinkPolicy::Any),
            Err(Rejection::Invalid { .. })
        ));
    }

    #[test]
    fn subtasks_of_own_tasks_only_and_owner_cannot_be_changed_by_a_child() {
        let p = given();
        let q = merge(&p, A, Some(1), json!([{"op": "add_subtask", "parent_id": "t1", "task": {"id": "t1.a", "title": "Sources"}}])).expect("own parent");
        let t = q.get("t1.a").expect("added");
        assert_eq!(
            (t.parent.as_deref(), t.owner_session.as_deref()),
            (Some("t1"), Some("s-a"))
        );
        let e = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "add_subtask", "parent_id": "t2", "task": {"id": "t2.a", "title": "x"}}]),
        )
        .unwrap_err();
        assert!(matches!(e, Rejection::Forbidden { .. }));
        let e = merge(
            &p,
            A,
            Some(1),
            json!([{"op": "update", "task_id": "t1", "fields": {"owner_agent": "writer"}}]),
        )
        .unwrap_err();
        assert!(matches!(e, Rejection::Forbidden { ref op, .. } if op == "update.owner_agent"));
    }

    #[test]
    fn a_patch_is_all_or_nothing() {
        let p = given();
        let e = merge(
            &p,
            A,
            Some(1),
            json!([
                {"op": "update", "task_id": "t1", "fields": {"status": "COMPLETED"}},
                {"op": "update", "task_id": "t2", "fields": {"status": "COMPLETED"}},
            ]),
        );
        assert!(e.is_err());
        assert_eq!(p.get("t1").map(|t| t.status), Some(TaskStatus::Pending));
    }

    #[test]
    fn malformed_ops_are_refused_when_read() {
        assert!(Patch::from_args(
            &json!({"base_version": 1, "ops": [{"op": "delete", "task_id": "t1"}]})
        )
        .is_err());
        assert!(Patch::from_args(&json!({"base_version": 1, "ops": [{"op": "update", "task_id": "t1", "fields": {"colour": "red"}}]})).is_err());
        assert!(Patch::from_args(
            &json!({"ops": [{"op": "update", "task_id": "t1", "fields": {"status": "DONE"}}]})
        )
        .is_err());
    }

    #[test]
    fn a_final_answer_may_carry_a_patch_block() {
        let a = "Done.\n```patch\n{\"base_version\": 3, \"ops\": [{\"op\": \"update\", \"task_id\": \"t1\", \"fields\": {\"status\": \"COMPLETED\"}}]}\n```\n";
        let p = patch_in_answer(a).expect("a block").expect("a patch");
        assert_eq!(p.base_version, Some(3));
        assert_eq!(p.ops.len(), 1);
        assert!(patch_in_answer("no block here").is_none());
        assert!(patch_in_answer("```patch\n{not json}\n```")
            .expect("block")
            .is_err());
        assert!(patch_in_answer("```patch\n{\"ops\": []}")
            .expect("block")
            .is_err());
    }

    #[test]
    fn markdown_groups_by_owner_and_nests_subtasks() {
        let p = given();
        let q = merge(&p, A, Some(1), json!([
            {"op": "add_subtask", "parent_id": "t1", "task": {"id": "t1.a", "title": "Sources", "status": "COMPLETED"}},
            {"op": "update", "task_id": "t1", "fields": {"status": "IN_PROGRESS", "notes": "two of three\nsources"}},
        ])).expect("accepted");
        let md = q.render_markdown();
        let expected = "# Plan (version 2)\n\n## analyst\n\n- [~] **t1** Collect (IN_PROGRESS)\n  - notes: two of three sources\n  - [x] **t1.a** Sources (COMPLETED)\n- [ ] **t2** Analyse (PENDING)\n\n## orchestrator\n\n- [ ] **t3** Write (PENDING)\n  - depends on: t1, t2\n";
        assert_eq!(md, expected);
        assert_eq!(q.render_markdown(), md);
    }
}
