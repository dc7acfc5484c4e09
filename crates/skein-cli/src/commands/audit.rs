//! `skein audit export|verify`.

use std::io::{BufReader, Write};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Subcommand;
use skein_core::SessionId;

use crate::app::App;

#[derive(Subcommand, Debug)]
pub enum AuditCmd {
    /// Write a tree as JSON lines (one event per line, then a manifest).
    Export {
        id: String,
        #[arg(short = 'o', long)]
        output: Option<std::path::PathBuf>,
    },
    /// Check an export: every line against its raw record, every chain, the manifest.
    Verify {
        file: std::path::PathBuf,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(app: &App, cmd: AuditCmd) -> Result<ExitCode> {
    match cmd {
        AuditCmd::Export { id, output } => {
            let (_store, b) = app.backend().await?;
            let id = SessionId::parse(&id)?;
            let n = match &output {
                Some(p) => {
                    let mut f = std::io::BufWriter::new(
                        std::fs::File::create(p)
                            .with_context(|| format!("cannot create {}", p.display()))?,
                    );
                    let n = skein_runtime::audit::export(&b, &id, &mut f).await?;
                    f.flush()?;
                    n
                }
                None => {
                    let mut out = crate::out::stdout();
                    skein_runtime::audit::export(&b, &id, &mut out).await?
                }
            };
            crate::errln!("exported {n} events of {}", id.display());
            Ok(ExitCode::SUCCESS)
        }
        AuditCmd::Verify { file, json } => {
            let f = std::fs::File::open(&file)
                .with_context(|| format!("cannot open {}", file.display()))?;
            let rep = skein_runtime::audit::verify(&mut BufReader::new(f))?;
            if json {
                crate::outln!("{}", serde_json::to_string_pretty(&rep)?)?;
            } else if rep.findings.is_empty() {
                crate::outln!(
                    "ok: {} sessions, {} lines; every record matches, every chain is whole",
                    rep.sessions,
                    rep.lines
                )?;
            } else {
                for f in &rep.findings {
                    crate::outln!(
                        "line {}: {} {}",
                        f.line,
                        crate::render::safe_line(&f.session),
                        crate::render::safe(&f.problem)
                    )?;
                }
            }
            Ok(if rep.findings.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}
