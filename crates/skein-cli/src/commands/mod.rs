use std::process::ExitCode;

use anyhow::Result;

use crate::app::App;
use crate::{Cli, Command, Deferred};

pub mod agents;
pub mod audit;
pub mod bench;
pub mod bench_history;
pub mod bench_history_nats;
pub mod bench_hops;
pub mod bench_nats;
pub mod bench_quota;
pub mod bench_reuse;
pub mod cancel;
pub mod cluster;
pub mod docs;
pub mod gc;
pub mod gc_nats;
pub mod hitl;
pub mod init;
pub mod mcp;
pub mod replay;
pub mod run;
pub mod show;
pub mod store;
pub mod ui;

pub async fn dispatch(cli: Cli) -> Result<ExitCode> {
    // What needs no configuration runs without it.
    match cli.cmd {
        Command::Init(Deferred(a)) => init::init(a),
        Command::Completions(Deferred(a)) => docs::completions(a),
        Command::Man(Deferred(a)) => docs::man(a),
        cmd => with_config(cli.global, cmd).await,
    }
}

async fn with_config(global: crate::GlobalArgs, cmd: Command) -> Result<ExitCode> {
    let app = App::new(global)?;
    if app.global.dump_config {
        crate::out!("{}", crate::config::dump(&app.cfg)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    match cmd {
        Command::Run(Deferred(a)) => run::run(&app, a).await,
        Command::Resume(Deferred(a)) => run::resume(&app, a).await,
        Command::Sessions(Deferred(a)) => show::sessions(&app, a).await,
        Command::Tree(Deferred(a)) => show::tree(&app, a).await,
        Command::Events(Deferred(a)) => show::events(&app, a).await,
        Command::Plan(Deferred(a)) => show::plan(&app, a).await,
        Command::Agents(a) => agents::run(&app, a).await,
        Command::Bench(Deferred(a)) => bench::run(&app, a).await,
        Command::Replay(Deferred(a)) => replay::replay(&app, a).await,
        Command::Fork(Deferred(a)) => replay::fork_cmd(&app, a).await,
        Command::Audit(a) => audit::run(&app, a).await,
        Command::Inbox(Deferred(a)) => hitl::inbox(&app, a).await,
        Command::Worker(Deferred(a)) => cluster::worker(&app, a).await,
        Command::Submit(Deferred(a)) => cluster::submit(&app, a).await,
        Command::Watch(Deferred(a)) => cluster::watch(&app, a).await,
        Command::Answer(Deferred(a)) => hitl::answer(&app, a).await,
        Command::Approve(Deferred(a)) => hitl::approve(&app, a, true).await,
        Command::Deny(Deferred(a)) => hitl::approve(&app, a, false).await,
        Command::Cancel(Deferred(a)) => cancel::cancel(&app, a).await,
        Command::Store(a) => store::run(&app, a).await,
        Command::Gc(Deferred(a)) => gc::gc(&app, a).await,
        Command::Ui(Deferred(a)) => ui::ui(&app, a).await,
        Command::Mcp(Deferred(a)) => mcp::mcp(&app, a).await,
        Command::Init(Deferred(a)) => init::init(a),
        Command::Completions(Deferred(a)) => docs::completions(a),
        Command::Man(Deferred(a)) => docs::man(a),
    }
}
