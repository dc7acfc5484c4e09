//! The two hops of a delegation, measured one at a time: a `relay` agent delegates to a
//! one-turn `quick` agent, waits for it, and does so again, `HOPS` times in a row, so no
//! hop queues behind another. With a zero-latency model every millisecond between the
//! events is the runtime's own:
//!
//! - *delegate*: the parent's `Delegated` → the child's first model call starting;
//! - *settle*: the child's `Completed` → the parent's next model call starting.
//!
//! The records carry millisecond times, so each hop is read to the millisecond; the
//! whole relay's wall time over its hops gives the mean cycle (both hops and the two
//! model turns) to the microsecond.

use std::path::Path;

use anyhow::Result;
use skein_core::{Event, SessionId};
use skein_runtime::ports::Backend;

/// Delegations in one relay.
pub(crate) const HOPS: usize = 100;

/// Writes the `relay` and `quick` agents (into the bench's agents and scripts folders).
pub(crate) fn write_relay(dir: &Path, pool_line: &str) -> Result<()> {
    std::fs::write(
        dir.join("agents/relay.md"),
        format!(
            "---\nname: relay\nmodel: scripted:relay\nagents: [quick]\ncache: false\n{pool_line}\
             limits: {{max_steps: {}}}\n---\nRelay.\n",
            HOPS + 1
        ),
    )?;
    std::fs::write(
        dir.join("agents/quick.md"),
        format!("---\nname: quick\nmodel: scripted:quick\ncache: false\n{pool_line}---\nAnswer.\n"),
    )?;
    let mut relay = String::from("turns:\n");
    for i in 0..HOPS {
        relay.push_str(&format!(
            "  - tool_calls:\n      - tool: call_agent\n        args: {{agent: quick, mission: \"hop {i}\"}}\n"
        ));
    }
    relay.push_str("  - answer: \"relayed\"\n");
    std::fs::write(dir.join("scripts/relay.yaml"), relay)?;
    std::fs::write(
        dir.join("scripts/quick.yaml"),
        "turns:\n  - answer: \"ok\"\n",
    )?;
    Ok(())
}

/// The hops of a finished relay: (delegate ms, settle ms), each sorted.
pub(crate) async fn hops(b: &Backend, relay: &SessionId) -> Result<(Vec<f64>, Vec<f64>)> {
    let log = b.log.read(relay, 1).await?;
    let (mut delegate, mut settle) = (vec![], vec![]);
    // When the child of the last delegation ended, until the parent's next model call.
    let mut child_ended: Option<u64> = None;
    for r in &log {
        match &r.env.body {
            Event::Delegated(d) => {
                let child = b.log.read(&d.child, 1).await?;
                let first_call = child.iter().find_map(|c| match &c.env.body {
                    Event::ModelCalled(m) => Some(c.env.at.saturating_sub(m.latency_ms)),
                    _ => None,
                });
                if let Some(started) = first_call {
                    delegate.push(started.saturating_sub(r.env.at) as f64);
                }
                child_ended = child
                    .iter()
                    .find_map(|c| matches!(c.env.body, Event::Completed(_)).then_some(c.env.at));
            }
            Event::ModelCalled(m) => {
                if let Some(at) = child_ended.take() {
                    let started = r.env.at.saturating_sub(m.latency_ms);
                    settle.push(started.saturating_sub(at) as f64);
                }
            }
            _ => {}
        }
    }
    delegate.sort_by(f64::total_cmp);
    settle.sort_by(f64::total_cmp);
    Ok((delegate, settle))
}

/// The hops of a relay that took `wall_ms`: as JSON, and printed under `title` unless
/// `json` (then only the JSON is returned).
pub(crate) fn report(
    title: &str,
    wall_ms: f64,
    delegate: &[f64],
    settle: &[f64],
    json: bool,
) -> Result<serde_json::Value> {
    let cycle = wall_ms / HOPS as f64;
    if !json {
        crate::outln!("{title}")?;
        crate::outln!(
            "  Delegated → child's first model call: p50 {:.0} ms, p99 {:.0} ms",
            pct(delegate, 0.5),
            pct(delegate, 0.99)
        )?;
        crate::outln!(
            "  child Completed → parent's next model call: p50 {:.0} ms, p99 {:.0} ms",
            pct(settle, 0.5),
            pct(settle, 0.99)
        )?;
        crate::outln!("  whole cycle (both hops and both model turns): {cycle:.2} ms mean")?;
    }
    Ok(serde_json::json!({"delegations": HOPS, "cycle_ms": cycle,
        "delegate_ms": {"p50": pct(delegate, 0.5), "p99": pct(delegate, 0.99)},
        "settle_ms": {"p50": pct(settle, 0.5), "p99": pct(settle, 0.99)}}))
}

/// The `p` quantile of sorted figures (0 when there are none).
pub(crate) fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
