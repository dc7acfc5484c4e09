//! Commands that need a cluster: `skein worker`, `skein submit`, `skein watch`.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use skein_core::{Record, SessionId};
use skein_runtime::RootResult;

use crate::app::App;
use crate::render;

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Pools to take jobs from (default: config `runtime.pools`, else every pool the
    /// agents name).
    #[arg(long, value_delimiter = ',')]
    pub pools: Vec<String>,
    /// Jobs worked on at once.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Do not take submissions from `skein.missions.submit`.
    #[arg(long)]
    pub no_intake: bool,
    /// Do not serve `skein.api` and `skein.answers`.
    #[arg(long)]
    pub no_api: bool,
    /// On SIGTERM or Ctrl-C the worker stops claiming, abandons its model calls in flight
    /// and hands their jobs back at once; other steps may take this long to finish, then
    /// their jobs are handed back too and the worker exits.
    #[arg(long, default_value = "20s", value_parser = parse_drain)]
    pub drain_timeout: Duration,
    /// Serve /healthz, /readyz and /metrics (Prometheus) on this address, such as
    /// 0.0.0.0:9090 (off unless given).
    #[arg(long, env = "SKEIN_HTTP_ADDR", value_name = "ADDR")]
    pub http: Option<std::net::SocketAddr>,
}

fn parse_drain(s: &str) -> std::result::Result<Duration, String> {
    skein_core::duration::parse(s).map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct SubmitArgs {
    #[arg(long, default_value = "orchestrator")]
    pub agent: String,
    /// Root session id (and idempotency key).
    #[arg(long)]
    pub id: Option<String>,
    #[arg(long)]
    pub context: Option<String>,
    /// Structured inputs, as a JSON object.
    #[arg(long)]
    pub inputs: Option<String>,
    #[arg(long)]
    pub no_cache: bool,
    /// The tree's priority for model quotas, -100 to 100 (default 0): where a model's
    /// limits make calls wait, a higher priority goes first.
    #[arg(long, allow_negative_numbers = true, value_parser = super::run::parse_priority)]
    pub priority: Option<i32>,
    /// Continue this W3C trace (`00-<trace id>-<span id>-<flags>`): sent as the
    /// `traceparent` header; the tree's sessions become spans of that trace.
    #[arg(long, value_name = "TRACEPARENT")]
    pub traceparent: Option<String>,
    /// Wait for the tree to end and print its result; exits 3 (printing what waits) if
    /// the tree pauses for a person's answer or approval, as `skein run` does.
    #[arg(long)]
    pub wait: bool,
    /// How long to wait for a worker's intake to accept or refuse the submission.
    #[arg(long, default_value = "30s", value_parser = parse_drain, value_name = "DURATION")]
    pub verdict_timeout: Duration,
    #[arg(long)]
    pub json: bool,
    pub mission: String,
}

#[derive(Args, Debug)]
pub struct WatchArgs {
    pub id: String,
    /// Wait for a tree that has not started yet, however long it takes (without it, an
    /// id under which nothing is recorded within `--start-timeout` is an error).
    #[arg(long)]
    pub wait_for_start: bool,
    /// How long to wait for the first record of a tree not found at once.
    #[arg(long, default_value = "5s", value_parser = parse_drain, value_name = "DURATION")]
    pub start_timeout: Duration,
}

fn need_nats(app: &App) -> Result<()> {
    anyhow::ensure!(
        app.global.nats.is_some(),
        "this command needs a cluster: pass --nats URL or set SKEIN_NATS_URL"
    );
    Ok(())
}

pub(crate) async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut t) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = t.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// Keeps the worker's current definitions version the cluster's: watches the pointer and
/// reads each version it names. A version that cannot be read yet leaves the one in force
/// and is tried again; a watch that ends is started again.
async fn follow_definitions(
    rt: std::sync::Arc<skein_runtime::worker::Runtime>,
    store: std::sync::Arc<skein_nats::NatsStore>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    use skein_core::definitions::short;
    let mut failures = 0u32;
    while !*stop.borrow() {
        let watched = store.defs_watch().await;
        let mut changes = match watched {
            Ok(w) => Box::pin(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the current definitions; trying again");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.changed() => return,
                }
            }
        };
        loop {
            let next = tokio::select! {
                n = changes.next() => n,
                _ = stop.changed() => return,
            };
            let digest = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "watching the current definitions failed");
                    break;
                }
                None => break,
            };
            let now = rt.current_version().digest.clone();
            if now == digest {
                continue;
            }
            match rt.set_current_version(digest.as_deref()).await {
                Ok(v) => {
                    failures = 0;
                    tracing::info!(
                        defs = digest.as_deref().map(short).unwrap_or("local files"),
                        agents = v.agents.agents.len(),
                        "definitions version current; new trees run on it"
                    );
                }
                Err(e) => {
                    // Watched again in a moment, which reads the pointer as it is then
                    // (a later push is not missed while this one cannot be read).
                    failures += 1;
                    if failures.is_multiple_of(10) {
                        tracing::error!(defs = ?digest, error = %e.report(),
                            "cannot use the current definitions; new trees keep the version in force");
                    } else {
                        tracing::warn!(defs = ?digest, error = %e.report(),
                            "cannot use the current definitions yet; trying again");
                    }
                    break;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    }
}

pub async fn worker(app: &App, a: WorkerArgs) -> Result<ExitCode> {
    need_nats(app)?;
    // Installed first, so that everything the worker does is counted.
    let prometheus = a
        .http
        .map(|_| crate::http::install_recorder())
        .transpose()?;
    let store = app.nats_patient().await?;
    let rt = app.runtime(store.backend())?;
    // The cluster's current definitions, before any submission is taken: a tree is
    // pinned to the version current when it is submitted.
    if let Some(c) = store.defs_current().await? {
        let v = rt
            .set_current_version(Some(&c.digest))
            .await
            .with_context(|| {
                format!("cannot use the cluster's current definitions {}", c.digest)
            })?;
        crate::errln!(
            "definitions {} ({} agents)",
            skein_core::definitions::short(&c.digest),
            v.agents.agents.len()
        );
    }
    let pools = if !a.pools.is_empty() {
        a.pools.clone()
    } else if !app.cfg.runtime.pools.is_empty() {
        app.cfg.runtime.pools.clone()
    } else {
        rt.pools()
    };
    let conc = a.concurrency.unwrap_or(app.cfg.runtime.concurrency);
    // What this worker has and reads, for the others; and theirs, so that work this one
    // cannot do goes to one that can. Advertised before any job is taken.
    if let Err(e) = store
        .advertise(&skein_nats_worker::peers::info(&rt, &pools))
        .await
    {
        tracing::warn!(error = %e.report(), "cannot advertise the worker yet");
    }
    let peers = std::sync::Arc::new(skein_nats_worker::peers::NatsPeers::new(
        store.clone(),
        rt.cfg.worker_id.clone(),
    ));
    rt.set_peers(peers.clone());
    let (stop, loops) = rt.spawn_workers(pools.clone(), conc);
    tokio::spawn(skein_nats_worker::peers::advertise(
        rt.clone(),
        store.clone(),
        pools.clone(),
        stop.subscribe(),
    ));
    // Retention (`nats.retain_finished`): nothing to do unless it is set.
    tokio::spawn(super::gc_nats::policy(
        store.clone(),
        store.backend(),
        rt.cfg.worker_id.clone(),
        stop.subscribe(),
    ));
    // Pushes and rollbacks take effect here without a restart.
    tokio::spawn(follow_definitions(
        rt.clone(),
        store.clone(),
        stop.subscribe(),
    ));
    // Tasks that must run as long as the worker does: the work loops, intake, the API.
    // One that ends before a stop was asked for (a panic, say) leaves the worker half
    // alive, so the worker exits non-zero and its supervisor starts it again.
    let mut tasks: Vec<(&str, tokio::task::JoinHandle<()>)> =
        loops.into_iter().map(|h| ("work loop", h)).collect();
    if !a.no_intake {
        tasks.push((
            "intake",
            tokio::spawn(skein_nats_worker::intake::run(
                rt.clone(),
                store.clone(),
                stop.subscribe(),
            )),
        ));
    }
    // Answers' text while it arrives, on skein.stream.<session> (best-effort, not waited
    // for at exit).
    let text = tokio::spawn(skein_nats_worker::text::forward(
        rt.clone(),
        store.client.clone(),
        stop.subscribe(),
    ));
    if !a.no_api {
        // Started before "ready" is printed: a request sent after it finds the service.
        let serving =
            skein_nats_worker::service::start(rt.clone(), store.clone(), stop.subscribe())
                .await
                .context("cannot start the skein.api service (pass --no-api to run without it)")?;
        tasks.push(("api", serving));
    }
    // The listener is not waited for when the worker drains: it serves on until the exit.
    let mut http: Option<tokio::task::JoinHandle<()>> = None;
    if let (Some(addr), Some(prometheus)) = (a.http, prometheus) {
        let ops = std::sync::Arc::new(crate::http::Ops {
            prometheus,
            rt: rt.clone(),
            store: store.clone(),
            pools: pools.clone(),
            mcp: app.mcp_tools()?.clone(),
        });
        let (bound, serving) = crate::http::serve(addr, ops).await?;
        crate::errln!("health and metrics on http://{bound} (/healthz, /readyz, /metrics)");
        http = Some(serving);
    }
    crate::errln!(
        "worker {} ready: pools {}, concurrency {conc}",
        rt.cfg.worker_id,
        pools.join(",")
    );
    // A replica that stays behind (one that cannot catch up after a restart, say) is
    // reported at error level while it lasts; a moment's lag during an election is not.
    let replicas = tokio::spawn(watch_replicas(rt.clone(), store.clone(), stop.subscribe()));
    let (names, handles): (Vec<&str>, Vec<_>) = tasks.into_iter().unzip();
    let mut running = futures::future::select_all(handles);
    let http_ended = async {
        match http.as_mut() {
            Some(h) => h.await,
            None => std::future::pending().await,
        }
    };
    let ended = tokio::select! {
        _ = terminated() => None,
        (res, i, _rest) = &mut running => Some((names[i], res)),
        res = http_ended => Some(("http", res)),
    };
    if let Some((name, res)) = ended {
        let why = match res {
            Err(e) if e.is_panic() => "panicked",
            Err(_) => "was cancelled",
            Ok(()) => "ended",
        };
        tracing::error!(
            task = name,
            "a worker task {why}; exiting so the worker is restarted"
        );
        crate::errln!("error: the {name} task {why}; the worker exits");
        let _ = stop.send(true);
        return Ok(ExitCode::from(70));
    }
    replicas.abort();
    text.abort();
    crate::errln!(
        "stopping: model calls in flight are handed back; other steps may finish (at most {:?})",
        a.drain_timeout
    );
    rt.start_draining();
    let _ = stop.send(true);
    // The others stop counting on this worker at once (its record format, its agents).
    let mut gone = skein_nats_worker::peers::info(&rt, &pools);
    gone.stopped = true;
    if let Err(e) = store.advertise(&gone).await {
        tracing::warn!(error = %e.report(), "cannot tell the others this worker stops");
    }
    let drained = tokio::select! {
        r = tokio::time::timeout(a.drain_timeout, futures::future::join_all(running.into_inner())) => r.is_ok(),
        // A second signal: stop now.
        _ = terminated() => false,
    };
    if !drained {
        let n = tokio::time::timeout(Duration::from_secs(5), rt.hand_back_held())
            .await
            .unwrap_or(0);
        crate::errln!("stopping: {n} job(s) still in flight handed back to be delivered again");
    }
    // Hand-backs and acks are written to the connection, not yet sent: send them before
    // the process ends, or a handed-back job waits for its lease.
    let _ = tokio::time::timeout(Duration::from_secs(5), store.client.flush()).await;
    Ok(ExitCode::SUCCESS)
}

/// Checks skein's streams every 15 s; a replica (or a whole stream) found behind in two
/// checks in a row is logged at error level, naming the stream and the replica.
async fn watch_replicas(
    rt: std::sync::Arc<skein_runtime::worker::Runtime>,
    store: std::sync::Arc<skein_nats::NatsStore>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut seen: std::collections::BTreeSet<(String, String)> = Default::default();
    let mut reported: std::collections::BTreeSet<(String, String)> = Default::default();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(15)) => {}
            _ = stop.changed() => return,
        }
        let now = store.lagging_replicas().await;
        let mut next = std::collections::BTreeSet::new();
        for (stream, replica, why) in now {
            let key = (stream.clone(), replica.clone());
            if seen.contains(&key) {
                reported.insert(key.clone());
                tracing::error!(stream, replica, why,
                    "a stream replica is not catching up; the stream runs on fewer copies until it does");
            }
            next.insert(key);
        }
        reported.retain(|(stream, replica)| {
            let back = !next.contains(&(stream.clone(), replica.clone()));
            if back {
                tracing::warn!(stream, replica, "stream replica current again");
            }
            !back
        });
        if next != seen {
            // A replica that resets may take pending jobs with it: the open trees are
            // swept after every change in what lags.
            rt.loops.health.trouble();
        }
        seen = next;
    }
}

pub async fn submit(app: &App, a: SubmitArgs) -> Result<ExitCode> {
    need_nats(app)?;
    let store = app.nats().await?;
    let id = match &a.id {
        Some(i) => SessionId::root(i)?,
        None => skein_runtime::new_root_id(),
    };
    let inputs: serde_json::Value = match &a.inputs {
        Some(s) => serde_json::from_str(s).context("--inputs must be a JSON object")?,
        None => serde_json::Value::Null,
    };
    let payload = serde_json::json!({
        "agent": a.agent, "mission": a.mission, "id": id.to_string(),
        "context": a.context, "inputs": inputs, "no_cache": a.no_cache,
        "priority": a.priority,
    });
    let client = store.client.clone();
    // Everything listened to is subscribed before the submission is published.
    let mut results = client
        .subscribe(skein_nats::backend::results_subject(&id))
        .await?;
    let mut verdicts = futures::stream::select(
        client
            .subscribe(skein_nats_worker::intake::REJECTED)
            .await?,
        client
            .subscribe(skein_nats_worker::intake::ACCEPTED)
            .await?,
    );
    let mut events = futures::stream::select(
        client.subscribe(format!("skein.events.{id}")).await?,
        client.subscribe(format!("skein.events.{id}.>")).await?,
    );
    // No `Nats-Msg-Id`: the stream would drop a second message under the same id in its
    // duplicate window without a word, and a different mission under a taken id must be
    // refused by name. The intake makes the same submission again a no-op itself.
    let mut headers = async_nats::HeaderMap::new();
    if let Some(tp) = &a.traceparent {
        anyhow::ensure!(
            skein_runtime::trace::parse(tp).is_some(),
            "--traceparent `{tp}` is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)"
        );
        headers.insert("traceparent", tp.as_str());
    }
    // A stream electing a leader answers no publish for a moment: the submission is sent
    // again meanwhile, for as long as a command waits for an election at its connect.
    let publish = skein_nats::backend::publish_patiently(
        &store.js,
        "skein.missions.submit",
        headers,
        Bytes::from(payload.to_string()),
        crate::app::ELECTION_LIMIT,
    );
    tokio::pin!(publish);
    let ack = tokio::select! {
        sent = &mut publish => sent,
        _ = tokio::time::sleep(Duration::from_secs(2)) => {
            crate::errln!(
                "the missions stream has not taken submission {id} yet (a leader being \
                 elected?): trying for up to {}s",
                crate::app::ELECTION_LIMIT.as_secs()
            );
            publish.await
        }
    }
    .context("the missions stream did not take the submission")?;
    // The intake's verdict on this very message (named by its place in the stream).
    let verdict = tokio::time::timeout(a.verdict_timeout, async {
        while let Some(m) = verdicts.next().await {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&m.payload) else {
                continue;
            };
            if v["stream_seq"].as_u64() == Some(ack.sequence) {
                return Some((m.subject.to_string(), v));
            }
        }
        None
    })
    .await;
    match verdict {
        Ok(Some((subject, v))) if subject == skein_nats_worker::intake::REJECTED => {
            crate::errln!(
                "rejected: {}",
                render::safe(v["reason"].as_str().unwrap_or(""))
            );
            return Ok(ExitCode::FAILURE);
        }
        Ok(Some(_)) => {}
        _ => {
            crate::errln!(
                "error: no worker judged submission {id} within {:?}: is a worker with intake \
                 running? The submission stays in the missions stream and is judged when one \
                 takes it (see `skein watch {id} --wait-for-start`)",
                a.verdict_timeout
            );
            return Ok(ExitCode::FAILURE);
        }
    }
    if !a.wait {
        crate::outln!("{id}")?;
        return Ok(ExitCode::SUCCESS);
    }
    crate::errln!("submitted {id}; waiting for its result");
    // A pause for a person is looked for when the tree records a question or an approval
    // request (and once now: a tree submitted again may be paused already). A record
    // heard live may still be on its way to the stream: what is found empty then is looked
    // at again a few times. Only then: the look reads the whole tree, which for a wide
    // tree costs more than the tree's own last steps.
    let mut look_again = 1u32;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut ticks = 0u64;
    loop {
        let mut heard = None;
        tokio::select! {
            Some(m) = results.next() => heard = serde_json::from_slice::<RootResult>(&m.payload).ok(),
            Some(m) = events.next() => {
                let Ok(records) = skein_nats::frame::decode(&m.payload) else { continue };
                if records.iter().any(|r| matches!(r.env.body,
                    skein_core::Event::InputRequested(_) | skein_core::Event::ApprovalRequested(_)))
                {
                    look_again = 3;
                }
                continue;
            }
            _ = tick.tick() => {
                ticks += 1;
                if look_again > 0 {
                    look_again -= 1;
                    if let Some(code) = paused(app, &store, &id, a.json).await? {
                        return Ok(code);
                    }
                }
                // Every few seconds, and at once: the stream's last result, should its
                // republish have been missed (or the tree have ended before).
                if ticks % 10 == 1 {
                    heard = current_result(&store, &id).await?;
                }
            }
        }
        if let Some(r) = heard {
            return print_result(&r, a.json);
        }
    }
}

/// The tree's last announced result, if it is that of the root's current end (a root
/// whose log went on past an earlier end is not done with it).
async fn current_result(
    store: &std::sync::Arc<skein_nats::NatsStore>,
    root: &SessionId,
) -> Result<Option<RootResult>> {
    let Some(stored) = store.last_result(root).await? else {
        return Ok(None);
    };
    let head = store.backend().log.last(root).await?;
    Ok(match head {
        Some(r) if r.env.seq > stored.result.seq => None,
        _ => Some(stored.result),
    })
}

fn print_result(r: &RootResult, json: bool) -> Result<ExitCode> {
    if json {
        crate::outln!("{}", serde_json::to_value(r)?)?;
    } else if r.status == skein_core::Status::Completed {
        crate::outln!("{}", render::safe(r.answer.as_deref().unwrap_or("")))?;
    } else {
        crate::outln!(
            "{}: {}",
            r.status,
            render::safe(r.error.as_deref().unwrap_or(""))
        )?;
    }
    Ok(if r.status == skein_core::Status::Completed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Exit code 3, having printed what the tree waits for, if it waits for a person.
async fn paused(
    app: &App,
    store: &std::sync::Arc<skein_nats::NatsStore>,
    root: &SessionId,
    json: bool,
) -> Result<Option<ExitCode>> {
    let b = store.backend();
    let read = skein_runtime::inspect::tree_folds(&b, root).await?;
    let Some((_, top)) = read.iter().find(|(_, f)| f.id == *root) else {
        return Ok(None);
    };
    if top.state.status.is_terminal() {
        return Ok(None);
    }
    // What waits for a person: the root's questions and any session's approvals (as the
    // inbox lists them), looked at before the token secret is needed.
    let waits = read.iter().any(|(_, f)| {
        !f.state.status.is_terminal()
            && (!f.state.pauses.pending_approvals.is_empty()
                || (f.id.is_root() && !f.state.pauses.pending_inputs.is_empty()))
    });
    if !waits {
        return Ok(None);
    }
    let status = top.state.status.as_str();
    // Only the token secret is needed to name what waits: no catalogue, no models.
    let secret = match app.runtime_config() {
        Ok(rc) => rc.token_secret,
        Err(e) => {
            crate::outln!("paused ({status}): waiting for you")?;
            crate::errln!(
                "cannot show the tokens that answer it: {e:#}; `skein inbox {root}` with \
                 the workers' SKEIN_TOKEN_SECRET lists them"
            );
            return Ok(Some(ExitCode::from(3)));
        }
    };
    let items: Vec<_> = read
        .iter()
        .flat_map(|(_, f)| skein_runtime::hitl::waiting_in(&secret, f))
        .collect();
    if items.is_empty() {
        return Ok(None);
    }
    if json {
        let v =
            serde_json::json!({"session": root.to_string(), "status": status, "waiting": items});
        crate::outln!("{v}")?;
    } else {
        super::run::print_waiting(status, &items)?;
    }
    Ok(Some(ExitCode::from(3)))
}

/// One streamed piece of text: the lines it completes are printed.
fn text_piece(
    root: &SessionId,
    lines: &mut crate::streamed::Lines,
    payload: &[u8],
    print: &dyn Fn(&SessionId, &str) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let Ok(d) = serde_json::from_slice::<skein_runtime::worker::TextDelta>(payload) else {
        return Ok(());
    };
    // Anyone may publish here: a piece that does not name a valid session of this tree
    // is not shown.
    if SessionId::parse(d.session.as_str()).is_err() || !root.contains(&d.session) {
        return Ok(());
    }
    for l in lines.push(&d) {
        print(&d.session, &l)?;
    }
    Ok(())
}

pub async fn watch(app: &App, a: WatchArgs) -> Result<ExitCode> {
    need_nats(app)?;
    let store = app.nats().await?;
    let id = SessionId::parse(&a.id)?;
    let root = id.root_id();
    let client = store.client.clone();
    let mut own = client.subscribe(format!("skein.events.{root}")).await?;
    let mut desc = client.subscribe(format!("skein.events.{root}.>")).await?;
    // Answers' text while it arrives, shown a line at a time (marked `│`).
    let prefix = skein_nats_worker::text::PREFIX;
    let mut text_own = client.subscribe(format!("{prefix}.{root}")).await?;
    let mut text_desc = client.subscribe(format!("{prefix}.{root}.>")).await?;
    let mut lines = crate::streamed::Lines::default();
    let text_line = |session: &SessionId, line: &str| {
        crate::outln!("{:<40} │ {}", session.display(), render::safe_line(line))
    };
    let b = store.backend();
    // Subscribed before reading the history, so nothing falls between the two; an event
    // appended in between arrives both ways and is printed once: per session, only seqs
    // past the last one printed are new (a session's events arrive in order).
    let mut printed: HashMap<SessionId, u64> = HashMap::new();
    let mut t0 = None;
    let mut show = |r: &Record| -> std::io::Result<()> {
        let last = printed.entry(r.env.session.clone()).or_insert(0);
        if r.env.seq <= *last {
            return Ok(());
        }
        *last = r.env.seq;
        let start = *t0.get_or_insert(r.env.at);
        crate::outln!(
            "{:<40} {}",
            r.env.session.display(),
            render::event_line(r, start)
        )
    };
    // Whether the root has ended is judged from what was printed: an end appended after
    // the history was read still arrives live.
    let mut ended = false;
    let tree = b.log.tree(&root).await?;
    for log in skein_runtime::inspect::tree_logs(&b, &root, &tree).await? {
        for r in log {
            show(&r)?;
            if r.env.session == root {
                ended = r.env.body.is_terminal();
            }
        }
    }
    if ended {
        return Ok(ExitCode::SUCCESS);
    }
    // Nothing recorded under the id: a tree submitted a moment ago starts soon; a wrong id
    // never does, and is said so after a short while, unless asked to wait for it.
    let mut started = !tree.is_empty();
    let give_up = tokio::time::sleep(if started || a.wait_for_start {
        Duration::from_secs(365 * 86_400)
    } else {
        a.start_timeout
    });
    tokio::pin!(give_up);
    loop {
        let m = tokio::select! {
            Some(m) = own.next() => m,
            Some(m) = desc.next() => m,
            Some(t) = text_own.next() => {
                text_piece(&root, &mut lines, &t.payload, &text_line)?;
                continue;
            }
            Some(t) = text_desc.next() => {
                text_piece(&root, &mut lines, &t.payload, &text_line)?;
                continue;
            }
            _ = &mut give_up, if !started => {
                // The log may have begun between the read and the subscriptions.
                if b.log.tree(&root).await?.is_empty() {
                    anyhow::bail!(
                        "no tree {root}: nothing was recorded under it within {:?} (pass \
                         --wait-for-start to wait for a tree that has not started yet)",
                        a.start_timeout
                    );
                }
                started = true;
                let tree = b.log.tree(&root).await?;
                for log in skein_runtime::inspect::tree_logs(&b, &root, &tree).await? {
                    for r in log {
                        show(&r)?;
                        if r.env.session == root && r.env.body.is_terminal() {
                            return Ok(ExitCode::SUCCESS);
                        }
                    }
                }
                continue;
            }
        };
        started = true;
        // A message may hold several records of one session.
        let Ok(records) = skein_nats::frame::decode(&m.payload) else {
            continue;
        };
        for r in records {
            match &r.env.body {
                skein_core::Event::ModelCalled(m) => {
                    let content = m.response.content.as_deref().unwrap_or("");
                    for rest in lines.recorded_as(&r.env.session, r.env.seq, content) {
                        text_line(&r.env.session, &rest)?;
                    }
                }
                skein_core::Event::ModelFailed(_) => lines.failed(&r.env.session),
                _ => {}
            }
            show(&r)?;
            if r.env.session == root && r.env.body.is_terminal() {
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}
