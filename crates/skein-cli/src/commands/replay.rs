//! `skein replay` and `skein fork`.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use skein_core::state::SlotState;
use skein_core::{Message, Record, SessionId};
use skein_runtime::inspect::fold_records;
use skein_runtime::replay::{fork, verify_tree, ForkSpec};

use crate::app::App;
use crate::render;

#[derive(Args, Debug)]
pub struct ReplayArgs {
    pub id: String,
    /// The whole tree under ID, children nested, in time order.
    #[arg(long)]
    pub tree: bool,
    /// Show the folded state at this seq instead of the timeline.
    #[arg(long)]
    pub at: Option<u64>,
    /// Re-fold every log and re-derive every decision; check the hash chains.
    #[arg(long)]
    pub verify: bool,
    /// Do not shorten texts.
    #[arg(long)]
    pub full: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ForkArgs {
    pub id: String,
    /// The last event of the source kept in the fork.
    #[arg(long)]
    pub at: u64,
    /// Continue with another model (`provider:model`).
    #[arg(long)]
    pub model: Option<String>,
    /// Continue with this agent definition file (same agent name).
    #[arg(long)]
    pub agent_file: Option<std::path::PathBuf>,
    /// Id of the new root session.
    #[arg(long)]
    pub new_id: Option<String>,
    /// Run the fork on the definitions current now (on a cluster, the version last
    /// pushed or rolled back to; on one machine, the agent files) rather than on the
    /// version its source is pinned to.
    #[arg(long)]
    pub current: bool,
    /// Only create the fork; do not run it.
    #[arg(long)]
    pub no_run: bool,
    #[arg(long)]
    pub json: bool,
}

/// At most 160 characters unless `full`, escaped for the terminal (lines kept).
fn clip(s: &str, full: bool) -> String {
    let s = render::safe(s);
    if full || s.chars().count() <= 160 {
        s.into_owned()
    } else {
        format!(
            "{}… [{} chars, --full to expand]",
            s.chars().take(160).collect::<String>(),
            s.chars().count()
        )
    }
}

pub async fn replay(app: &App, a: ReplayArgs) -> Result<ExitCode> {
    let (_store, b) = app.backend().await?;
    let id = SessionId::parse(&a.id)?;
    if a.verify {
        let agents = app.agents()?;
        let verdicts = verify_tree(&b, &id, &agents, &app.decision_limits()?).await?;
        let verdicts: Vec<_> = if a.tree {
            verdicts
        } else {
            verdicts
                .into_iter()
                .filter(|v| v.session == id.display())
                .collect()
        };
        let ok = verdicts.iter().all(|v| v.ok);
        if a.json {
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({"ok": ok, "sessions": verdicts}))?
            )?;
        } else {
            for v in &verdicts {
                match &v.problem {
                    None => crate::outln!(
                        "ok    {} ({} events: chain intact, every decision reproduced)",
                        v.session,
                        v.events
                    )?,
                    Some(p) => crate::outln!(
                        "FAIL  {} at seq {}: {}",
                        v.session,
                        v.seq.unwrap_or(0),
                        render::safe(p)
                    )?,
                }
            }
        }
        return Ok(if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let records = b.log.read(&id, 1).await?;
    if records.is_empty() {
        anyhow::bail!("no session {id}");
    }
    if let Some(at) = a.at {
        anyhow::ensure!(
            at >= 1 && at <= records.len() as u64,
            "--at {at}: the log has seqs 1..={}",
            records.len()
        );
        let f = fold_records(&id, &records[..at as usize])?;
        if a.json {
            crate::outln!("{}", serde_json::to_string_pretty(&f.state)?)?;
        } else {
            print_state(&f.state, at, a.full)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut all: Vec<Record> = vec![];
    if a.tree {
        let ids: Vec<SessionId> = b
            .log
            .tree(&id.root_id())
            .await?
            .into_iter()
            .filter(|s| id.contains(s))
            .collect();
        for log in skein_runtime::inspect::tree_logs(&b, &id.root_id(), &ids).await? {
            all.extend(log);
        }
        all.sort_by(|x, y| {
            (x.env.at, x.env.session.depth(), x.env.seq).cmp(&(
                y.env.at,
                y.env.session.depth(),
                y.env.seq,
            ))
        });
    } else {
        all = records;
    }
    let t0 = all.iter().map(|r| r.env.at).min().unwrap_or(0);
    for r in &all {
        if a.json {
            crate::outln!("{}", skein_runtime::audit::line_of(r))?;
            continue;
        }
        let indent = "  ".repeat(r.env.session.depth().saturating_sub(id.depth()) as usize);
        let who = if a.tree {
            format!("{} ", r.env.session.display())
        } else {
            String::new()
        };
        crate::outln!("{indent}{who}{}", clip(&render::event_line(r, t0), a.full))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_state(s: &skein_core::SessionState, at: u64, full: bool) -> std::io::Result<()> {
    let agent = s
        .submitted
        .as_ref()
        .map(|x| x.agent.as_str())
        .unwrap_or("?");
    crate::outln!(
        "state of {} ({agent}) at seq {at}",
        s.id.as_ref().map(|i| i.display()).unwrap_or_default()
    )?;
    crate::outln!(
        "  status {} · model turns {} · usage {} tokens (own {}, children {}) · cost {}",
        s.status.as_str(),
        s.steps,
        s.usage_total().total_tokens(),
        s.accounting.usage_own.total_tokens(),
        s.accounting.usage_children.total_tokens(),
        render::cost(&s.usage_total())
    )?;
    if let Some(sub) = &s.submitted {
        crate::outln!("  mission: {}", clip(&sub.mission, full))?;
    }
    crate::outln!("transcript:")?;
    for m in &s.transcript {
        let line = match m {
            Message::System { content } => format!("system: {content}"),
            Message::User { content } => format!("user: {content}"),
            Message::Assistant {
                content,
                tool_calls,
            } => {
                let calls: Vec<String> = tool_calls
                    .iter()
                    .map(|c| format!("{}#{}({})", c.name, c.id, c.args))
                    .collect();
                format!(
                    "assistant: {}{}",
                    content.as_deref().unwrap_or(""),
                    if calls.is_empty() {
                        String::new()
                    } else {
                        format!(" calls {}", calls.join(", "))
                    }
                )
            }
            Message::Tool {
                call_id,
                name,
                content,
                is_error,
            } => {
                format!(
                    "tool {name}#{call_id}{}: {content}",
                    if *is_error { " ERROR" } else { "" }
                )
            }
        };
        crate::outln!("  {}", clip(&line, full))?;
    }
    if !s.turn.is_empty() {
        crate::outln!("pending calls of the current turn:")?;
        for slot in &s.turn {
            let st = match &slot.state {
                SlotState::Pending => "pending".to_string(),
                SlotState::Running => "running (ToolCalled, no result yet)".to_string(),
                SlotState::Delegated { child, .. } => format!("waiting for {}", child.display()),
                SlotState::Asked { .. } => "waiting for an answer".to_string(),
                SlotState::AwaitingApproval { .. } => "waiting for approval".to_string(),
                SlotState::Approved => "approved, not yet run".to_string(),
                SlotState::Done { error, .. } => {
                    if *error {
                        "done (error)".into()
                    } else {
                        "done".into()
                    }
                }
            };
            crate::outln!(
                "  {}#{}: {st}",
                render::safe_line(&slot.call.name),
                render::safe_line(&slot.call.id)
            )?;
        }
    }
    if !s.children.is_empty() {
        crate::outln!("children:")?;
        for c in s.children.values() {
            crate::outln!(
                "  #{} {} ({}) {}{}",
                render::safe_line(&c.call),
                c.child.display(),
                render::safe_line(&c.agent),
                c.outcome.map_or("running", |o| o.as_str()),
                if c.cached { " [cache]" } else { "" }
            )?;
        }
    }
    if let Some(a) = &s.ending.answer {
        crate::outln!("answer: {}", clip(a, full))?;
    }
    if let Some(e) = &s.ending.error {
        crate::outln!("error: {}", render::safe(e))?;
    }
    Ok(())
}

pub async fn fork_cmd(app: &App, a: ForkArgs) -> Result<ExitCode> {
    let (store, backend) = app.backend().await?;
    let rt = app.runtime(backend)?;
    if a.current && app.global.nats.is_some() {
        let cluster = app.nats().await?;
        if let Some(c) = cluster.defs_current().await? {
            rt.set_current_version(Some(&c.digest)).await?;
        }
    }
    let agent_text = match &a.agent_file {
        Some(p) => Some(crate::app::read_agent_file(p)?),
        None => None,
    };
    let source = SessionId::parse(&a.id)?;
    let id = fork(
        &rt,
        &source,
        a.at,
        ForkSpec {
            model: a.model.clone(),
            agent_text,
            id: a.new_id.clone(),
            current: a.current,
        },
    )
    .await?;
    // On a cluster the workers run it.
    let Some(store) = store.filter(|_| !a.no_run) else {
        crate::outln!("{id}")?;
        return Ok(ExitCode::SUCCESS);
    };
    if !a.json {
        crate::errln!("fork {id} of {} at seq {}", source.display(), a.at);
    }
    let conc = app.cfg.runtime.concurrency;
    let code = super::run::drive(&rt, &id, conc, a.json).await;
    store.flush().await?;
    code
}
