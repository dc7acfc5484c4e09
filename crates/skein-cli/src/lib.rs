//! skein-cli: the `skein` command line as a library (the binary in the root package
//! calls [`main`]). One binary, the same verbs on both backends: without `--nats` a
//! command works on the embedded store under `--data`; with it, on the cluster.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

pub mod app;
pub mod commands;
pub mod config;
pub mod render;

#[derive(Parser, Debug)]
#[command(
    name = "skein",
    version,
    about = "Distributed, event-sourced runtime for multi-agent LLM work"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Embedded store directory.
    #[arg(long, global = true, env = "SKEIN_DATA", default_value = ".skein")]
    pub data: PathBuf,
    /// Config file (default: config/skein.toml when it exists).
    #[arg(long, global = true, env = "SKEIN_CONFIG")]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated: work on the cluster instead of the embedded store.
    #[arg(long, global = true, env = "SKEIN_NATS_URL")]
    pub nats: Option<String>,
    /// Print the configuration in force (secrets redacted) and exit.
    #[arg(long, global = true)]
    pub dump_config: bool,
    /// Log level filter for diagnostics on stderr (e.g. `info`, `skein_runtime=debug`).
    #[arg(long, global = true, env = "SKEIN_LOG", default_value = "warn")]
    pub log: String,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a tree to its end (or first pause) on the embedded store, with live progress.
    Run(commands::run::RunArgs),
    /// Continue an unfinished tree (after a crash or Ctrl-C).
    Resume(commands::run::ResumeArgs),
    /// Recent root sessions and their status.
    Sessions(commands::show::SessionsArgs),
    /// A tree: agent, status, steps, tokens, cost, cache hits, times.
    Tree(commands::show::TreeArgs),
    /// One session's log, readable.
    Events(commands::show::EventsArgs),
    /// The plan a session owns, as Markdown (or JSON), now or at any seq.
    Plan(commands::show::PlanArgs),
    /// Agent definitions.
    #[command(subcommand)]
    Agents(commands::agents::AgentsCmd),
    /// Measure the runtime (prints a table).
    Bench(commands::bench::BenchArgs),
    /// A session's timeline, its state at a seq, or a check that it replays exactly.
    Replay(commands::replay::ReplayArgs),
    /// A new root session from a prefix of another, continued live.
    Fork(commands::replay::ForkArgs),
    /// A stateless worker: claims jobs, takes submissions, serves skein.api (needs --nats).
    Worker(commands::cluster::WorkerArgs),
    /// Submit a mission through NATS, like `nats pub skein.missions.submit`.
    Submit(commands::cluster::SubmitArgs),
    /// Follow a tree live (needs --nats).
    Watch(commands::cluster::WatchArgs),
    /// Every pending question and approval, with its token.
    Inbox(commands::hitl::InboxArgs),
    /// Answer a paused root's question, then run the tree on.
    Answer(commands::hitl::AnswerArgs),
    /// Approve a tool call waiting for approval, then run the tree on.
    Approve(commands::hitl::ApproveArgs),
    /// Deny a tool call waiting for approval (the model reads the denial).
    Deny(commands::hitl::ApproveArgs),
    /// Export a tree for auditors, or verify an export.
    #[command(subcommand)]
    Audit(commands::audit::AuditCmd),
}

/// Parses the command line and runs the command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.global.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(commands::dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
