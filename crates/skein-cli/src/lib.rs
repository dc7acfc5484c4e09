//! skein-cli: the `skein` command line as a library (the binary in the root package
//! calls [`main`]). One binary, the same verbs on both backends: without `--nats` a
//! command works on the embedded store under `--data`; with it, on the cluster.
//!
//! Output goes through [`outln!`] / [`errln!`] (see [`out`]), never `println!`, so a
//! closed pipe ends a command quietly instead of panicking; text from models and
//! submitters goes through [`render::safe`] before it reaches a terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

pub mod app;
pub mod builtin;
pub mod commands;
pub mod config;
pub mod http;
pub mod otel;
pub mod out;
pub mod render;
pub mod streamed;

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

#[derive(Args, Clone)]
pub struct GlobalArgs {
    /// Embedded store directory.
    #[arg(long, global = true, env = "SKEIN_DATA", default_value = ".skein")]
    pub data: PathBuf,
    /// Config file (default: config/skein.toml when it exists).
    #[arg(long, global = true, env = "SKEIN_CONFIG")]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated: work on the cluster instead of the embedded store.
    #[arg(long, global = true, env = "SKEIN_NATS_URL", hide_env_values = true)]
    pub nats: Option<String>,
    /// NATS user name (`[nats] user`), with --nats-password.
    #[arg(long, global = true, env = "SKEIN_NATS_USER", value_name = "USER")]
    pub nats_user: Option<String>,
    /// NATS password (`[nats] password`); prefer the environment variable, since a flag
    /// shows in the process list.
    #[arg(
        long,
        global = true,
        env = "SKEIN_NATS_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub nats_password: Option<String>,
    /// NATS auth token (`[nats] token`); prefer the environment variable.
    #[arg(
        long,
        global = true,
        env = "SKEIN_NATS_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub nats_token: Option<String>,
    /// NATS credentials file, JWT and nkey seed (`[nats] credentials_file`).
    #[arg(
        long = "nats-creds",
        global = true,
        env = "SKEIN_NATS_CREDS",
        value_name = "FILE"
    )]
    pub nats_credentials_file: Option<PathBuf>,
    /// CA certificate to trust for TLS to NATS (`[nats] tls_ca`).
    #[arg(
        long,
        global = true,
        env = "SKEIN_NATS_TLS_CA",
        value_name = "FILE",
        alias = "nats-ca"
    )]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate for mutual TLS to NATS (`[nats] tls_cert`), with --nats-tls-key.
    #[arg(
        long,
        global = true,
        env = "SKEIN_NATS_TLS_CERT",
        value_name = "FILE",
        alias = "nats-cert"
    )]
    pub nats_tls_cert: Option<PathBuf>,
    /// Client key for mutual TLS to NATS (`[nats] tls_key`).
    #[arg(
        long,
        global = true,
        env = "SKEIN_NATS_TLS_KEY",
        value_name = "FILE",
        alias = "nats-key"
    )]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse a NATS connection without TLS (`[nats] tls_required`).
    #[arg(long, global = true, env = "SKEIN_NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
    /// Print the configuration in force (secrets redacted) and exit.
    #[arg(long, global = true)]
    pub dump_config: bool,
    /// Log level filter for diagnostics on stderr (e.g. `info`, `skein_runtime=debug`).
    #[arg(long, global = true, env = "SKEIN_LOG", default_value = "warn")]
    pub log: String,
    /// Diagnostics as `text` (colours only on a terminal, unless NO_COLOR is set) or `json`
    /// (one JSON object per line).
    #[arg(
        long,
        global = true,
        env = "SKEIN_LOG_FORMAT",
        default_value = "text",
        value_parser = ["text", "json"]
    )]
    pub log_format: String,
}

impl GlobalArgs {
    /// The secret values given on the command line or in its environment variables.
    pub fn secrets(&self) -> Vec<String> {
        let mut out: Vec<String> = [self.nats_password.clone(), self.nats_token.clone()]
            .into_iter()
            .flatten()
            .collect();
        let cfg = skein_nats::NatsConfig {
            urls: self.nats_urls().unwrap_or_default(),
            ..skein_nats::NatsConfig::default()
        };
        out.extend(cfg.secrets());
        out
    }

    /// `--nats` as a list of URLs.
    pub fn nats_urls(&self) -> Option<Vec<String>> {
        self.nats.as_ref().map(|urls| {
            urls.split(',')
                .map(|u| u.trim().to_string())
                .filter(|u| !u.is_empty())
                .collect()
        })
    }
}

impl std::fmt::Debug for GlobalArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        let urls = self.nats_urls().map(|u| {
            u.iter()
                .map(|x| skein_nats::config::redact_url(x))
                .collect::<Vec<_>>()
        });
        f.debug_struct("GlobalArgs")
            .field("data", &self.data)
            .field("config", &self.config)
            .field("nats", &urls)
            .field("nats_user", &self.nats_user)
            .field("nats_password", &hidden(&self.nats_password))
            .field("nats_token", &hidden(&self.nats_token))
            .field("nats_credentials_file", &self.nats_credentials_file)
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("nats_tls_required", &self.nats_tls_required)
            .field("dump_config", &self.dump_config)
            .field("log", &self.log)
            .field("log_format", &self.log_format)
            .finish()
    }
}

/// Diagnostics go to stderr with every known secret value replaced by `***`, whichever
/// crate wrote the line (the NATS client logs server addresses with their user info).
struct ScrubbedStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ScrubbedStderr {
    type Writer = ScrubbedStderr;
    fn make_writer(&'a self) -> Self::Writer {
        ScrubbedStderr
    }
}

impl std::io::Write for ScrubbedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // A formatted event arrives in one piece, so a secret is never split across calls.
        // A diagnostic that cannot be written (stderr closed) is dropped: reporting the
        // failure would only write to stderr again.
        let text = String::from_utf8_lossy(buf);
        let _ = std::io::stderr().write_all(config::scrub(&text).as_bytes());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a tree to its end (or first pause) on the embedded store, with live progress.
    Run(Deferred<commands::run::RunArgs>),
    /// Continue an unfinished tree (after a crash or Ctrl-C).
    Resume(Deferred<commands::run::ResumeArgs>),
    /// Recent root sessions and their status.
    Sessions(Deferred<commands::show::SessionsArgs>),
    /// A tree: agent, status, steps, tokens, cost, cache hits, times.
    Tree(Deferred<commands::show::TreeArgs>),
    /// One session's log, readable.
    Events(Deferred<commands::show::EventsArgs>),
    /// The plan a session owns, as Markdown (or JSON), now or at any seq.
    Plan(Deferred<commands::show::PlanArgs>),
    /// Agent definitions.
    #[command(subcommand)]
    Agents(commands::agents::AgentsCmd),
    /// Measure the runtime (prints a table).
    Bench(Deferred<commands::bench::BenchArgs>),
    /// A session's timeline, its state at a seq, or a check that it replays exactly.
    Replay(Deferred<commands::replay::ReplayArgs>),
    /// A new root session from a prefix of another, continued live.
    Fork(Deferred<commands::replay::ForkArgs>),
    /// A stateless worker: claims jobs, takes submissions, serves skein.api (needs --nats).
    Worker(Deferred<commands::cluster::WorkerArgs>),
    /// Submit a mission through NATS, like `nats pub skein.missions.submit`.
    Submit(Deferred<commands::cluster::SubmitArgs>),
    /// Follow a tree live (needs --nats).
    Watch(Deferred<commands::cluster::WatchArgs>),
    /// Every pending question and approval, with its token.
    Inbox(Deferred<commands::hitl::InboxArgs>),
    /// Answer a question of the inbox (a root's, a pattern child's), then run the tree on.
    Answer(Deferred<commands::hitl::AnswerArgs>),
    /// Approve a tool call waiting for approval, then run the tree on.
    Approve(Deferred<commands::hitl::ApproveArgs>),
    /// Deny a tool call waiting for approval (the model reads the denial).
    Deny(Deferred<commands::hitl::ApproveArgs>),
    /// Cancel a session and every session under it (embedded store or cluster).
    Cancel(Deferred<commands::cancel::CancelArgs>),
    /// Export a tree for auditors, or verify an export.
    #[command(subcommand)]
    Audit(commands::audit::AuditCmd),
    /// Check the embedded store's event log, or set its damaged part aside.
    #[command(subcommand)]
    Store(commands::store::StoreCmd),
    /// Remove finished trees older than an age (the embedded store, or the cluster with --nats), archiving them first.
    Gc(Deferred<commands::gc::GcArgs>),
    /// Serve a web view of the trees: live, replayable, answerable (see docs/ui.md).
    Ui(Deferred<commands::ui::UiArgs>),
    /// Serve skein to MCP clients: start trees, read them, answer the inbox (stdio, or
    /// Streamable HTTP with --http; see docs/mcp.md).
    Mcp(Deferred<commands::mcp::McpArgs>),
    /// Write a starting project (config, an agent, a script, a README) into DIR.
    Init(Deferred<commands::init::InitArgs>),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(Deferred<commands::docs::CompletionsArgs>),
    /// Print the manual page, or write one per subcommand with --dir.
    Man(Deferred<commands::docs::ManArgs>),
}

/// A subcommand's arguments, added to the definition of the command line only when that
/// subcommand is the one parsed (or its help shown). Building every subcommand's
/// arguments up front would cost every command's start for arguments it never reads
/// (docs/perf.md has the figure).
#[derive(Debug)]
pub struct Deferred<T>(pub T);

impl<T: clap::Args> clap::Args for Deferred<T> {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        cmd.defer(T::augment_args)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        cmd.defer(T::augment_args_for_update)
    }
}

impl<T: clap::FromArgMatches> clap::FromArgMatches for Deferred<T> {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        T::from_arg_matches(m).map(Self)
    }

    fn from_arg_matches_mut(m: &mut clap::ArgMatches) -> Result<Self, clap::Error> {
        T::from_arg_matches_mut(m).map(Self)
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        self.0.update_from_arg_matches(m)
    }

    fn update_from_arg_matches_mut(&mut self, m: &mut clap::ArgMatches) -> Result<(), clap::Error> {
        self.0.update_from_arg_matches_mut(m)
    }
}

/// Parses the command line and runs the command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The rolling-upgrade suites run the next release's record format with this binary.
    if std::env::var_os("SKEIN_TEST_NEXT_FORMAT").is_some_and(|v| !v.is_empty()) {
        skein_core::event::act_as_next_format();
    }
    config::register_secrets(cli.global.secrets());
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.global.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(ScrubbedStderr);
    if cli.global.log_format == "json" {
        fmt.json().with_ansi(false).init();
    } else {
        use std::io::IsTerminal;
        let colour = std::io::stderr().is_terminal()
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        fmt.with_ansi(colour).init();
    }
    let traces = match otel::install() {
        Ok(t) => t,
        Err(e) => {
            errln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            errln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let res = rt.block_on(commands::dispatch(cli));
    // Work still in flight (a worker's abandoned step, a blocking tool) does not hold the
    // process: the command has decided its exit.
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    otel::shutdown(traces);
    match res {
        // The reader of our output has gone (`skein events ID | head -1`): that is how a
        // pipeline ends, not a failure.
        Ok(code) => code,
        Err(_) if out::stdout_closed() => ExitCode::SUCCESS,
        Err(e) => {
            // An error may quote what a model or a submitter sent.
            errln!("error: {}", render::safe(&config::scrub(&format!("{e:#}"))));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// A subcommand's arguments join the definition only when it is parsed, so clap's
    /// checks of a definition would run for the one in use alone: this builds them all.
    #[test]
    fn every_subcommand_definition_passes_clap_checks() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_deferred_subcommand_reads_its_own_and_the_global_arguments() {
        let cli = Cli::try_parse_from([
            "skein",
            "run",
            "--agent",
            "lead",
            "--json",
            "find it",
            "--data",
            "/tmp/elsewhere",
        ])
        .expect("parses");
        assert_eq!(cli.global.data, std::path::PathBuf::from("/tmp/elsewhere"));
        let Command::Run(Deferred(a)) = cli.cmd else {
            panic!("not `run`: {:?}", cli.cmd);
        };
        assert_eq!(
            (a.agent.as_deref(), a.json, a.mission.as_str()),
            (Some("lead"), true, "find it")
        );
        let e = Cli::try_parse_from(["skein", "resume", "--agent", "x"]).expect_err("refused");
        assert!(e.to_string().contains("--agent"), "{e}");
    }
}
