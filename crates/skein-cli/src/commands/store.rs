//! `skein store verify|repair`: check the embedded store's event log, and set its damaged
//! part aside when asked (see `skein_sled::verify`).

use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Subcommand};
use skein_sled::verify::{self, Finding, Report};

use crate::app::App;
use crate::render;

#[derive(Subcommand, Debug)]
pub enum StoreCmd {
    /// Read the event log of the data directory and report what is damaged or torn, and
    /// what lies past it; changes nothing. Exits 0 when the store opens as it is, 2 when
    /// opening refuses (run `skein store repair`).
    Verify(StoreArgs),
    /// Set the damaged (or torn) part of the event log aside as
    /// `events.log.damaged-<offset>` and cut the log there, so the store opens again; says
    /// which trees lost which records. No other skein process may have the store open.
    Repair(StoreArgs),
}

#[derive(Args, Debug)]
pub struct StoreArgs {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(app: &App, cmd: StoreCmd) -> Result<ExitCode> {
    if app.global.nats.is_some() {
        anyhow::bail!(
            "`skein store` checks the embedded store's files under --data; a JetStream \
             store's files are nats-server's to check: drop --nats"
        );
    }
    let dir = &app.global.data;
    match cmd {
        StoreCmd::Verify(a) => {
            let report = verify::verify(dir)?;
            if a.json {
                crate::outln!("{}", serde_json::to_string_pretty(&report)?)?;
            } else {
                print_report(&report)?;
            }
            Ok(if report.finding.refuses() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            })
        }
        StoreCmd::Repair(a) => {
            let repaired = verify::repair(dir)?;
            if a.json {
                crate::outln!("{}", serde_json::to_string_pretty(&repaired)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            print_report(&repaired.report)?;
            if repaired.header_rewritten {
                crate::outln!(
                    "repaired: the header frame or the synced mark was damaged and is written anew"
                )?;
            }
            match (&repaired.aside, repaired.report.finding.offset()) {
                (_, None) if repaired.header_rewritten => {}
                (_, None) => crate::outln!("nothing to repair")?,
                (Some(aside), Some(at)) => crate::outln!(
                    "repaired: the log is cut at {at}; the bytes from there on are kept in {}",
                    aside.display()
                )?,
                (None, Some(at)) => {
                    crate::outln!("repaired: the mark is lowered to {at}, where the file ends")?
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_report(r: &Report) -> Result<()> {
    let mark = if r.format < 2 {
        "no synced mark (written before the header)".to_string()
    } else {
        format!("synced mark at {}", r.mark)
    };
    crate::outln!(
        "{}: format {}, {} bytes, frames end at {}, {mark}",
        r.log.display(),
        r.format,
        r.len,
        r.frames_end,
    )?;
    crate::outln!(
        "whole frames: {} ({} sessions, {} records, {} blobs)",
        r.frames,
        r.sessions,
        r.records,
        r.blobs
    )?;
    match &r.finding {
        Finding::Whole => crate::outln!("whole: every frame reads back")?,
        Finding::Torn { offset, what } => crate::outln!(
            "torn tail at offset {offset} ({what}), past the synced mark: as a crash leaves \
             it; opening cuts it and keeps it aside"
        )?,
        Finding::Damaged { offset, what } => crate::outln!(
            "DAMAGED at offset {offset}: {what}; opening refuses until `skein store repair`"
        )?,
        Finding::Short { len, mark } => crate::outln!(
            "DAMAGED: the file ends at {len}, before the synced mark at {mark}; opening \
             refuses until `skein store repair`"
        )?,
    }
    if r.beyond.is_empty() && r.beyond_blobs == 0 {
        return Ok(());
    }
    crate::outln!("from there on, the log holds (lost if it is cut there):")?;
    for l in &r.beyond {
        crate::outln!(
            "  tree {}: {} seq {}–{} ({} records{})",
            render::safe_line(&l.tree),
            render::safe_line(&l.session),
            l.first_seq,
            l.last_seq,
            l.records,
            if l.damaged {
                ", the first in the damaged frame"
            } else {
                ""
            }
        )?;
    }
    if r.beyond_blobs > 0 {
        crate::outln!("  {} blobs", r.beyond_blobs)?;
    }
    Ok(())
}
