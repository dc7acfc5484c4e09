use std::process::ExitCode;

use anyhow::Result;

use crate::app::App;
use crate::{Cli, Command};

pub mod agents;
pub mod audit;
pub mod bench;
pub mod bench_hops;
pub mod bench_nats;
pub mod cancel;
pub mod cluster;
pub mod hitl;
pub mod replay;
pub mod run;
pub mod show;
pub mod ui;

pub async fn dispatch(cli: Cli) -> Result<ExitCode> {
    let app = App::new(cli.global)?;
    if app.global.dump_config {
        crate::out!("{}", crate::config::dump(&app.cfg)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    match cli.cmd {
        Command::Run(a) => run::run(&app, a).await,
        Command::Resume(a) => run::resume(&app, a).await,
        Command::Sessions(a) => show::sessions(&app, a).await,
        Command::Tree(a) => show::tree(&app, a).await,
        Command::Events(a) => show::events(&app, a).await,
        Command::Plan(a) => show::plan(&app, a).await,
        Command::Agents(a) => agents::run(&app, a).await,
        Command::Bench(a) => bench::run(&app, a).await,
        Command::Replay(a) => replay::replay(&app, a).await,
        Command::Fork(a) => replay::fork_cmd(&app, a).await,
        Command::Audit(a) => audit::run(&app, a).await,
        Command::Inbox(a) => hitl::inbox(&app, a).await,
        Command::Worker(a) => cluster::worker(&app, a).await,
        Command::Submit(a) => cluster::submit(&app, a).await,
        Command::Watch(a) => cluster::watch(&app, a).await,
        Command::Answer(a) => hitl::answer(&app, a).await,
        Command::Approve(a) => hitl::approve(&app, a, true).await,
        Command::Deny(a) => hitl::approve(&app, a, false).await,
        Command::Cancel(a) => cancel::cancel(&app, a).await,
        Command::Ui(a) => ui::ui(&app, a).await,
    }
}
