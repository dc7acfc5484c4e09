//! `skein run` and `skein resume`: run a tree in this process on the embedded store.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use skein_core::{AgentDef, AgentSet, SessionId, Status};
use skein_llm::Registry;
use skein_runtime::hitl::{waiting_in, InboxItem, InboxKind};
use skein_runtime::inspect::{rows_of_folds, summarize};
use skein_runtime::worker::{Folded, Progress, Runtime, Submission, TextDelta, TOOL_PROGRESS};
use skein_sled::SledStore;
use tokio::sync::broadcast;

use crate::app::App;
use crate::render;
use crate::streamed::Lines;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The root agent (default: `orchestrator`, or the only agent of a catalogue of one).
    #[arg(long)]
    pub agent: Option<String>,
    /// Root session id (a token: a-z, 0-9, `-`, `_`); running the same id again is a no-op.
    #[arg(long)]
    pub id: Option<String>,
    /// Background for the root agent.
    #[arg(long)]
    pub context: Option<String>,
    /// Structured inputs, as a JSON object.
    #[arg(long)]
    pub inputs: Option<String>,
    /// Do not answer delegations from the cache, nor cache this tree's answers.
    #[arg(long)]
    pub no_cache: bool,
    /// The tree's priority for model quotas, -100 to 100 (default 0): where a model's
    /// limits make calls wait, a higher priority goes first.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_priority)]
    pub priority: Option<i32>,
    /// Jobs worked on at once (default from config).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Run every agent of the catalogue (and its `summarize` step) on this model instead
    /// of the one its definition names, e.g. `local:qwen2.5:7b`.
    #[arg(long, value_name = "PROVIDER:MODEL")]
    pub model: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// What the root agent must do.
    pub mission: String,
}

/// A `--priority`: a whole number from -100 to 100.
pub fn parse_priority(s: &str) -> std::result::Result<i32, String> {
    let p: i32 = s.trim().parse().map_err(|_| {
        format!("`{s}` is not a priority: a priority is a whole number from -100 to 100")
    })?;
    skein_core::agent::validate_priority(p)?;
    Ok(p)
}

#[derive(Args, Debug)]
pub struct ResumeArgs {
    /// Root session id.
    pub id: String,
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// The `--model` the tree was started with, so the children it has yet to start
    /// run on it too (sessions already started keep their recorded definitions).
    #[arg(long, value_name = "PROVIDER:MODEL")]
    pub model: Option<String>,
    #[arg(long)]
    pub json: bool,
}

pub async fn run(app: &App, a: RunArgs) -> Result<ExitCode> {
    let (store, rt) = open_runtime(app, a.model.as_deref())?;
    let inputs = match &a.inputs {
        Some(s) => serde_json::from_str(s).context("--inputs must be a JSON object")?,
        None => serde_json::Value::Null,
    };
    let agent = root_agent(&rt.agents, a.agent.as_deref())?;
    let id = rt
        .submit(Submission {
            agent,
            mission: a.mission.clone(),
            id: a.id.clone(),
            context: a.context.clone(),
            inputs,
            budget: None,
            no_cache: a.no_cache,
            priority: a.priority,
            ..Default::default()
        })
        .await?;
    if !a.json {
        crate::errln!("root {id}");
    }
    let conc = a.concurrency.unwrap_or(app.cfg.runtime.concurrency);
    let code = until_store_fails(&store, drive(&rt, &id, conc, a.json)).await;
    let left = store.leave().await;
    let code = code?;
    left?;
    Ok(code)
}

/// The agent a run starts: the one named, else `orchestrator`, else the only agent there is.
fn root_agent(agents: &AgentSet, named: Option<&str>) -> Result<String> {
    if let Some(a) = named {
        return Ok(a.to_string());
    }
    if agents.agents.contains_key("orchestrator") || agents.agents.len() != 1 {
        return Ok("orchestrator".into());
    }
    Ok(agents.agents.keys().next().cloned().unwrap_or_default())
}

/// The embedded store and a runtime on it; with `model`, every agent runs on that model
/// (see [`catalogue_on_model`]).
fn open_runtime(app: &App, model: Option<&str>) -> Result<(Arc<SledStore>, Arc<Runtime>)> {
    // Checked before the store is opened, so a mistyped model leaves nothing behind.
    let on_model = match model {
        Some(m) => {
            let models = app.models()?;
            Some((catalogue_on_model(&app.agents()?, &models, m)?, models))
        }
        None => None,
    };
    let (store, backend) = app.open_embedded()?;
    let rt = match on_model {
        Some((agents, models)) => Runtime::new(
            backend,
            Arc::new(agents),
            models,
            app.tools()?,
            app.runtime_config()?,
        ),
        None => app.runtime(backend)?,
    };
    Ok((store, rt))
}

/// `agents` with every definition's model (and `summarize` model, where one is named) set
/// to `model`. The texts are rewritten, so the digests sessions record are those of the
/// definitions that actually ran and `replay --verify` checks against them.
pub fn catalogue_on_model(agents: &AgentSet, models: &Registry, model: &str) -> Result<AgentSet> {
    let (provider, _) = skein_llm::split_model(model).map_err(|_| {
        anyhow::anyhow!(
            "--model `{model}` is not of the form `provider:model` (e.g. `local:qwen2.5:7b`)"
        )
    })?;
    anyhow::ensure!(
        models.has(provider),
        "--model `{model}`: no model provider `{provider}`; configured: {} (add \
         [models.providers.{provider}] to skein.toml)",
        models.names().join(", ")
    );
    let mut files = Vec::with_capacity(agents.agents.len());
    for (name, def) in &agents.agents {
        let mut front = def.front.clone();
        front.model = model.to_string();
        if let Some(s) = &mut front.summarize {
            if s.model.is_some() {
                s.model = Some(model.to_string());
            }
        }
        let origin = agents
            .origins
            .get(name)
            .cloned()
            .unwrap_or_else(|| name.clone());
        files.push((origin, AgentDef::render(&front, &def.prompt)?));
    }
    AgentSet::load(&files, &[]).context("agent definitions rewritten for --model")
}

pub async fn resume(app: &App, a: ResumeArgs) -> Result<ExitCode> {
    let (store, rt) = open_runtime(app, a.model.as_deref())?;
    let id = SessionId::parse(&a.id)?;
    if rt.backend.log.last(&id).await?.is_none() {
        anyhow::bail!("no session {id} in {}", app.global.data.display());
    }
    let n = rt.requeue_tree(&id).await?;
    if !a.json {
        crate::errln!("resuming {id}: {n} session(s) to advance");
    }
    let conc = a.concurrency.unwrap_or(app.cfg.runtime.concurrency);
    let code = until_store_fails(&store, drive(&rt, &id, conc, a.json)).await;
    let left = store.leave().await;
    let code = code?;
    left?;
    Ok(code)
}

/// `run`, unless the store stops taking writes first (a sync or flush to disk failed):
/// then the store's error, so that the process exits with it rather than retrying
/// appends that cannot succeed until the store is opened again.
async fn until_store_fails(
    store: &SledStore,
    run: impl std::future::Future<Output = Result<ExitCode>>,
) -> Result<ExitCode> {
    tokio::select! {
        r = run => r,
        e = store.failed() => Err(anyhow::Error::new(e).context(
            "the store stopped: a write to disk failed, and nothing after it is \
             acknowledged; once the disk is sound, continue with `skein resume`",
        )),
    }
}

pub async fn drive(
    rt: &Arc<Runtime>,
    id: &SessionId,
    concurrency: usize,
    json: bool,
) -> Result<ExitCode> {
    let started = Instant::now();
    let live = (!json).then(|| {
        tokio::spawn(show_progress(
            rt.subscribe(),
            rt.subscribe_text(),
            id.clone(),
        ))
    });
    let outcome = tokio::select! {
        r = rt.run_tree(id, concurrency) => Some(r?),
        _ = tokio::signal::ctrl_c() => None,
    };
    if let Some(h) = live {
        h.abort();
    }
    let Some(root) = outcome else {
        crate::errln!("\ninterrupted; continue with: skein resume {id}");
        return Ok(ExitCode::from(130));
    };
    report(rt, &root, started, json).await
}

async fn report(rt: &Runtime, root: &Folded, started: Instant, json: bool) -> Result<ExitCode> {
    // The folds the run kept of its sessions (a log is read again only past its fold, or
    // whole where no fold was kept), for the rows and for what waits for a person.
    let read = rt.tree_folds_held(&root.id).await?;
    let rows = rows_of_folds(&read);
    let summary = summarize(&rows);
    let st = &root.state;
    let mut items: Vec<InboxItem> = read
        .iter()
        .flat_map(|f| waiting_in(&rt.cfg.token_secret, f))
        .collect();
    if items.is_empty() && !st.status.is_terminal() {
        // It may wait on a child it shares with another tree (single-flight), and that
        // child on a person.
        items = skein_runtime::hitl::inbox(rt, std::slice::from_ref(&root.id)).await?;
    }
    let waiting = || items.clone();
    // A tree that is neither ended nor waiting for a person, once nothing is left to run,
    // can never move on: a fault of skein's, reported as such rather than as a pause.
    let stalled = !st.status.is_terminal() && items.is_empty();
    if json {
        let inbox = waiting();
        let mut v = serde_json::json!({
            "session": root.id.to_string(),
            "status": st.status.as_str(),
            "answer": st.ending.answer,
            "error": st.ending.error,
            "summary": summary,
            "tree": rows,
            "waiting": inbox,
        });
        if stalled {
            v["stalled"] = serde_json::Value::Bool(true);
        }
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        match st.status {
            Status::Completed => crate::outln!(
                "{}",
                render::safe(st.ending.answer.as_deref().unwrap_or(""))
            )?,
            Status::Failed | Status::Cancelled => crate::outln!(
                "failed: {}",
                render::safe(st.ending.error.as_deref().unwrap_or("unknown error"))
            )?,
            _ if stalled => {
                crate::outln!(
                    "stalled: no session of this tree can move on (nothing waits for you, \
                     no job is queued); this is a fault in skein, please report it with \
                     `skein audit export {}`. Open sessions:",
                    root.id
                )?;
                for r in rows.iter().filter(|r| !is_ended(&r.status)) {
                    crate::outln!("  {} ({}): {}", r.session, r.agent, r.status)?;
                }
            }
            other => print_waiting(other.as_str(), &waiting())?,
        }
        crate::errln!();
        crate::errln!("{}", render::summary_line(&summary));
        crate::errln!(
            "elapsed {} · root {}",
            render::ms(started.elapsed().as_millis() as u64),
            root.id
        );
    }
    Ok(match st.status {
        Status::Completed => ExitCode::SUCCESS,
        Status::Failed | Status::Cancelled => ExitCode::FAILURE,
        _ if stalled => ExitCode::from(4),
        _ => ExitCode::from(3),
    })
}

fn is_ended(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "cancelled")
}

/// What a paused tree waits for, with the commands that answer it (`run` and
/// `submit --wait` exit 3 after printing it).
pub(crate) fn print_waiting(status: &str, items: &[InboxItem]) -> std::io::Result<()> {
    crate::outln!("paused ({status}): waiting for you:")?;
    for it in items {
        match it.kind {
            InboxKind::Question => {
                for q in &it.questions {
                    crate::outln!(
                        "  {}: {}",
                        render::safe_line(q["key"].as_str().unwrap_or("")),
                        render::safe(q["question"].as_str().unwrap_or(""))
                    )?;
                }
                crate::outln!("  → skein answer {} --set KEY=VALUE …", it.token)?;
            }
            _ => {
                // Every byte of the arguments that would run.
                crate::outln!(
                    "  approve `{}` in {}: {}",
                    render::safe_line(it.tool.as_deref().unwrap_or("?")),
                    it.session,
                    render::safe_line(it.preview.as_deref().unwrap_or(""))
                )?;
                crate::outln!(
                    "  → skein approve {}   or   skein deny {} --reason …",
                    it.token,
                    it.token
                )?;
            }
        }
    }
    Ok(())
}

/// The last `n` characters of `s`.
fn tail(s: &str, n: usize) -> &str {
    let count = s.chars().count();
    match s.char_indices().nth(count.saturating_sub(n)) {
        Some((i, _)) if count > n => &s[i..],
        _ => s,
    }
}

fn label(id: &SessionId) -> String {
    if id.is_root() {
        "root".into()
    } else {
        id.display()
            .split_once('/')
            .map(|(_, rest)| rest.to_string())
            .unwrap_or_default()
    }
}

/// Lets a running tool's progress through at most once per `every` for each session and
/// tool, so a server that sends progress without pause cannot flood the terminal.
struct Throttle {
    every: std::time::Duration,
    last: HashMap<(SessionId, String), Instant>,
}

impl Throttle {
    fn new(every: std::time::Duration) -> Self {
        Self {
            every,
            last: HashMap::new(),
        }
    }

    /// Whether a line about `tool` of `session` is shown at `now`.
    fn pass(&mut self, session: &SessionId, tool: &str, now: Instant) -> bool {
        let key = (session.clone(), tool.to_string());
        match self.last.get(&key) {
            Some(t) if now.saturating_duration_since(*t) < self.every => false,
            _ => {
                self.last.insert(key, now);
                true
            }
        }
    }
}

/// Live progress: a spinner per session on a terminal, plain lines otherwise. Model
/// answers show while they arrive: on a terminal as the tail of the spinner's line, else
/// a line of text at a time, marked `│`.
async fn show_progress(
    mut rx: broadcast::Receiver<Progress>,
    mut text_rx: broadcast::Receiver<TextDelta>,
    root: SessionId,
) {
    let tty = std::io::stderr().is_terminal();
    let multi = MultiProgress::new();
    let style = ProgressStyle::with_template("{spinner} {prefix:<32} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let mut bars: HashMap<SessionId, ProgressBar> = HashMap::new();
    let mut lines = Lines::default();
    let mut throttle = Throttle::new(std::time::Duration::from_secs(1));
    let t0 = Instant::now();
    // Plain lines are gathered and written when nothing more is queued (or a good deal
    // is gathered): one write per line was a system call per record of a wide tree.
    let mut plain = String::new();
    let text_line = |plain: &mut String, t0: &Instant, session: &SessionId, line: &str| {
        use std::fmt::Write as _;
        let _ = writeln!(
            plain,
            "[{:>7}] {:<32} │ {}",
            render::ms(t0.elapsed().as_millis() as u64),
            label(session),
            render::safe_line(line)
        );
    };
    let flush = |plain: &mut String,
                 rx: &broadcast::Receiver<Progress>,
                 text_rx: &broadcast::Receiver<TextDelta>| {
        if !plain.is_empty() && ((rx.is_empty() && text_rx.is_empty()) || plain.len() >= 1 << 16) {
            crate::out::err(format_args!("{plain}"));
            plain.clear();
        }
    };
    loop {
        flush(&mut plain, &rx, &text_rx);
        // Text first: a turn's pieces are all sent before its event, so draining them
        // first keeps them ahead of it.
        let p = tokio::select! {
            biased;
            d = text_rx.recv() => {
                let Ok(d) = d else { continue };
                if !root.contains(&d.session) {
                    continue;
                }
                let done = lines.push(&d);
                if tty {
                    if let Some(bar) = bars.get(&d.session) {
                        bar.set_message(format!("✎ {}", tail(&render::safe_line(lines.partial(&d.session)), 60)));
                    }
                } else {
                    for l in done {
                        text_line(&mut plain, &t0, &d.session, &l);
                    }
                }
                continue;
            }
            p = rx.recv() => match p {
                Ok(p) => p,
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => break,
            },
        };
        if !root.contains(&p.session) {
            continue;
        }
        if p.kind == TOOL_PROGRESS {
            let detail = p.detail.as_deref().unwrap_or_default();
            let tool = detail.split(' ').next().unwrap_or_default();
            if !throttle.pass(&p.session, tool, Instant::now()) {
                continue;
            }
        }
        match p.kind.as_str() {
            "ModelCalled" => {
                if let Some(rest) = lines.recorded(&p.session) {
                    if !tty {
                        text_line(&mut plain, &t0, &p.session, &rest);
                    }
                }
            }
            "ModelFailed" => lines.failed(&p.session),
            _ => {}
        }
        // An event kind this build does not know is shown as the log names it.
        let kind = match p.kind.as_str() {
            "WaitingForRoom" => {
                "waiting: no room in the store; runs on once there is room".to_string()
            }
            "RoomAgain" => "the store has room again".to_string(),
            TOOL_PROGRESS => format!(
                "⋯ {}",
                render::safe_line(p.detail.as_deref().unwrap_or_default())
            ),
            k => render::safe_line(k).into_owned(),
        };
        let msg = format!("{:<15} step {:<3} {}", p.status.as_str(), p.steps, kind);
        if tty {
            let bar = bars.entry(p.session.clone()).or_insert_with(|| {
                let b = multi.add(ProgressBar::new_spinner());
                b.set_style(style.clone());
                b.set_prefix(label(&p.session));
                b.enable_steady_tick(std::time::Duration::from_millis(120));
                b
            });
            if p.status.is_terminal() {
                bar.finish_with_message(msg);
            } else {
                bar.set_message(msg);
            }
        } else {
            use std::fmt::Write as _;
            let _ = writeln!(
                plain,
                "[{:>7}] {:<32} {}",
                render::ms(t0.elapsed().as_millis() as u64),
                label(&p.session),
                msg
            );
        }
    }
    if !plain.is_empty() {
        crate::out::err(format_args!("{plain}"));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use skein_core::event::{genesis_hash, Cancelled};
    use skein_core::{Envelope, Event, Record, SessionId};
    use skein_sled::{LogFile, SledStore};

    /// A disk whose `fdatasync` fails once `bad` is set.
    struct FailingSync {
        file: std::fs::File,
        bad: Arc<AtomicBool>,
    }

    impl LogFile for FailingSync {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            LogFile::read_at(&self.file, buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<usize> {
            LogFile::write_at(&self.file, buf, offset)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            if self.bad.load(Ordering::SeqCst) {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            LogFile::sync_data(&self.file)
        }
        fn len(&self) -> std::io::Result<u64> {
            LogFile::len(&self.file)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            LogFile::set_len(&self.file, len)
        }
    }

    #[test]
    fn a_tools_progress_shows_at_most_once_a_second_per_session_and_tool() {
        let mut t = super::Throttle::new(std::time::Duration::from_secs(1));
        let (a, b) = (
            SessionId::parse("t-a").unwrap(),
            SessionId::parse("t-b").unwrap(),
        );
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        assert!(t.pass(&a, "ev__long", at(0)), "the first line shows");
        for ms in [1, 200, 999] {
            assert!(!t.pass(&a, "ev__long", at(ms)), "at {ms} ms");
        }
        assert!(
            t.pass(&a, "ev__other", at(10)),
            "another tool has its own pace"
        );
        assert!(
            t.pass(&b, "ev__long", at(10)),
            "another session has its own pace"
        );
        assert!(
            t.pass(&a, "ev__long", at(1000)),
            "a second later it shows again"
        );
        assert!(!t.pass(&a, "ev__long", at(1500)));
        assert!(t.pass(&a, "ev__long", at(2100)));
    }

    #[tokio::test]
    async fn a_run_ends_with_the_stores_error_when_a_sync_fails() {
        // Given a run on a store whose disk fails its next fdatasync.
        let dir = tempfile::tempdir().unwrap();
        let bad = Arc::new(AtomicBool::new(false));
        let b = bad.clone();
        let store = SledStore::open_with_log_file(
            &dir.path().join("data"),
            &dir.path().join("ws"),
            skein_sled::DEFAULT_LEASE,
            &move |file| {
                Box::new(FailingSync {
                    file,
                    bad: b.clone(),
                })
            },
        )
        .unwrap();
        let id = SessionId::parse("t-run-eio").unwrap();
        let env = Envelope::new(
            id.clone(),
            1,
            1_700_000_000_000,
            genesis_hash(&id),
            Event::Cancelled(Cancelled { reason: "r".into() }),
        );
        let rec = Record::decode(env.encode().unwrap()).unwrap();
        bad.store(true, Ordering::SeqCst);

        // When an append of the run fails its sync (the run itself would go on for ever).
        let log = store.backend().log;
        let _ = log
            .append(
                &id,
                0,
                std::slice::from_ref(&rec),
                skein_runtime::ports::Durability::Now,
            )
            .await;
        let res = super::until_store_fails(&store, std::future::pending()).await;

        // Then the run ends with the store's error, naming the disk's.
        let e = res.expect_err("the run went on");
        let text = format!("{e:#}");
        assert!(text.contains("the store stopped"), "{text}");
        assert!(text.contains("Input/output error"), "{text}");
    }
}
