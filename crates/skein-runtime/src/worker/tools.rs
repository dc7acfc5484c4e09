//! `RunTools`: tool calls recorded before they run (or with their results, when all of the
//! turn's calls may run again), run in parallel where the tool allows, large outputs kept as
//! blobs with a preview in the log.

use std::collections::HashMap;

use futures::future::join_all;
use serde_json::Value;
use skein_core::decide::ToolRun;
use skein_core::event::{BlobRef, ToolCalled, ToolReturned};
use skein_core::{AgentDef, Event, Step};
use skein_tools::ToolContext;

use crate::ports::Job;
use crate::runtime::{Progress, Runtime, TOOL_PROGRESS};
use crate::session::{Folded, Staged, Written};
use crate::Result;

impl Runtime {
    /// Where the tools of `f`'s step tell how far they have got, when someone watches:
    /// a [`Progress`] line of kind [`TOOL_PROGRESS`] each time, never recorded.
    fn tool_progress(&self, f: &Folded) -> Option<skein_tools::ProgressSink> {
        let tx = self.progress.sender()?;
        let (session, seq, status, steps) = (
            f.id.clone(),
            f.state.last_seq,
            f.state.status,
            f.state.steps,
        );
        Some(std::sync::Arc::new(move |tool: &str, line: &str| {
            let _ = tx.send(Progress {
                session: session.clone(),
                seq,
                kind: TOOL_PROGRESS.to_string(),
                status,
                steps,
                detail: Some(format!("{tool} {line}")),
            });
        }))
    }

    pub(crate) async fn run_tools(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        runs: Vec<ToolRun>,
        job: &Job,
    ) -> Result<()> {
        self.run_tools_after(f, def, runs, job, Staged::default())
            .await
    }

    /// Runs `runs` as [`Runtime::run_tools`] does, with `turn` (the model turn that asked
    /// for them, staged but not yet written) recorded first, in the same append as the
    /// calls.
    pub(crate) async fn run_tools_after(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        runs: Vec<ToolRun>,
        job: &Job,
        turn: Staged,
    ) -> Result<()> {
        let ctx = ToolContext {
            session: f.id.clone(),
            workspace: self.backend.workspaces.for_tree(&f.id.root_id()),
            blobs: Some(self.backend.blobs.clone()),
            progress: self.tool_progress(f),
        };
        let (resumed, fresh): (Vec<ToolRun>, Vec<ToolRun>) =
            runs.into_iter().partition(|r| r.resumed);
        let mut to_run = vec![];
        let mut pending = turn;
        let mut refused = false;
        for r in resumed {
            if self.may_run_again(def, &r.tool) {
                to_run.push(r);
            } else {
                refused = true;
                let body = Event::tool_error(
                    r.call,
                    format!(
                        "the outcome of this `{}` call is unknown: the worker running it \
                         stopped before it returned. It was not run again because the tool \
                         is not idempotent; check its effects before calling it again.",
                        r.tool
                    ),
                );
                self.stage(f, body, &mut pending)?;
            }
        }
        if refused {
            self.commit(f, std::mem::take(&mut pending)).await?;
        }
        // A call of a tool that may not run twice is recorded before it runs (write-ahead),
        // so a crash in between is reported, not repeated. When every call of the turn may
        // run again, the calls are recorded with their results in one append: a crash
        // before it leaves the step undone, and it runs again whole.
        let write_ahead = fresh.iter().any(|r| !self.may_run_again(def, &r.tool));
        for r in &fresh {
            let body = Event::ToolCalled(ToolCalled {
                call: r.call.clone(),
                tool: r.tool.clone(),
                args: r.args.clone(),
                worker: self.cfg.worker_id.clone(),
            });
            self.stage(f, body, &mut pending)?;
        }
        if write_ahead {
            self.commit(f, std::mem::take(&mut pending)).await?;
        }
        to_run.extend(fresh);
        if to_run.is_empty() {
            return self.commit(f, pending).await;
        }
        let tools: HashMap<String, String> = to_run
            .iter()
            .map(|r| (r.call.clone(), r.tool.clone()))
            .collect();
        let (parallel, serial): (Vec<ToolRun>, Vec<ToolRun>) = to_run
            .into_iter()
            .partition(|r| self.tools.parallel(&r.tool));
        let work = async {
            let mut outs = join_all(parallel.iter().map(|r| self.run_one(&ctx, r))).await;
            for r in &serial {
                outs.push(self.run_one(&ctx, r).await);
            }
            outs
        };
        // An MCP server's call may take long and act outside the tree: one cancelled
        // from outside while it runs is stopped (the server is sent
        // `notifications/cancelled`), and the step ends as a lost race would, its records
        // read again.
        let outs = if tools
            .values()
            .any(|t| skein_core::agent::mcp_server_of(t).is_some())
        {
            tokio::select! {
                outs = self.with_heartbeat(job, work) => outs,
                seq = self.cancelled_after(&f.id, f.state.last_seq) => {
                    self.sessions.forget(&f.id);
                    return Err(crate::Error::Conflict {
                        session: f.id.to_string(),
                        expected: f.state.last_seq + 1,
                        actual: seq,
                    });
                }
            }
        } else {
            self.with_heartbeat(job, work).await
        };
        for o in outs {
            let o = o?;
            let tool = tools.get(&o.call).map_or("", String::as_str);
            crate::spans::tool_call(&f.id, &f.state, tool, &o.call, o.ms, o.error);
            self.stage(f, Event::ToolReturned(o), &mut pending)?;
        }
        // Calls that may run again, whose results the model is asked about next: nothing
        // acts on their records before that call's own append, which makes sure of them
        // first (`Durability::Pipelined`), so the model call need not wait
        // for them. A crash before then runs the step again whole, as above.
        let how = if !write_ahead
            && !refused
            && matches!(
                f.state.next(
                    def,
                    &self.version_known(&f.state).limits,
                    &*self.version_known(&f.state).agents
                ),
                Step::CallModel { .. }
            ) {
            Written::Pipelined
        } else {
            Written::Durable
        };
        self.commit_as(f, pending, how).await
    }

    /// Returns (the seq of the event) once the session's log has a `Cancelled` after
    /// `seq`; looks twice a second.
    async fn cancelled_after(&self, id: &skein_core::SessionId, seq: u64) -> u64 {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
        loop {
            tick.tick().await;
            if let Ok(records) = self.backend.log.read(id, seq + 1).await {
                if let Some(r) = records
                    .iter()
                    .find(|r| matches!(r.env.body, Event::Cancelled(_)))
                {
                    return r.env.seq;
                }
            }
        }
    }

    /// Whether a call of `tool` may run again after a crash: the tool says it is
    /// idempotent, or the agent lists it in `idempotent_tools`.
    pub(crate) fn may_run_again(&self, def: &AgentDef, tool: &str) -> bool {
        self.tools.idempotent(tool) || def.front.idempotent_tools.iter().any(|t| t == tool)
    }

    pub(crate) async fn run_one(&self, ctx: &ToolContext, r: &ToolRun) -> Result<ToolReturned> {
        let mut out = if self.tools.get(&r.tool).is_some() {
            self.tools.run(ctx, &r.tool, &r.args).await
        } else {
            skein_tools::ToolOutcome {
                output: format!("tool `{}` is not available on this worker", r.tool),
                error: true,
                ms: 0,
            }
        };
        self.scrubber.text(&mut out.output);
        let (output, blob) = if out.output.len() > self.cfg.blob_threshold {
            let hash = self.backend.blobs.put(out.output.as_bytes()).await?;
            let shown = skein_core::text::clip(&out.output, self.cfg.blob_threshold);
            let cut = shown.len();
            // A file read as text maps shown bytes to file bytes one to one, unless invalid
            // bytes were replaced: then only the way on is named, not the number.
            let read_on = if r.tool != "read_file" || out.error {
                String::new()
            } else if shown.contains('\u{FFFD}') {
                "; read_file reads on from a later `offset`".to_string()
            } else {
                let from = r.args.get("offset").and_then(Value::as_u64).unwrap_or(0);
                format!("; read on with offset {}", from.saturating_add(cut as u64))
            };
            let preview = format!(
                "{shown}\n… [{} bytes in all, only the first {cut} shown here; the rest is not \
                 shown (stored as blob {hash}){read_on}]",
                out.output.len()
            );
            (
                preview,
                Some(BlobRef {
                    hash,
                    size: out.output.len() as u64,
                }),
            )
        } else {
            (out.output, None)
        };
        Ok(ToolReturned {
            call: r.call.clone(),
            output,
            error: out.error,
            ms: out.ms,
            blob,
            refused: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use skein_tools::ToolBox;

    #[test]
    fn every_built_in_tool_called_free_of_side_effects_is_declared_idempotent() {
        let cfg = skein_tools::ToolsConfig::default();
        let tools = ToolBox::builtin(&cfg);
        let mut checked = 0;
        for name in skein_core::agent::SIDE_EFFECT_FREE_TOOLS {
            if tools.get(name).is_some() {
                assert!(tools.idempotent(name), "{name}");
                checked += 1;
            }
        }
        assert_eq!(
            checked, 5,
            "read_file, list_dir, list_directory, get_file_info and search_files"
        );
        for name in tools.names() {
            if !tools.idempotent(&name) {
                assert!(
                    !skein_core::agent::SIDE_EFFECT_FREE_TOOLS.contains(&name.as_str()),
                    "{name}"
                );
            }
        }
    }
}
