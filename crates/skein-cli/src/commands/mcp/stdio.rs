//! The stdio transport: one JSON-RPC message a line on stdin, answers and notifications
//! a line on stdout (nothing else is written there), diagnostics on stderr. Requests are
//! answered concurrently, so a long `start_tree` does not hold up a `ping` or a
//! cancellation. The server stops when stdin closes.

use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

use super::wire::{self, code, Incoming, RpcError};
use super::{Host, Session};

/// The longest message read; a longer line is refused whole (and skipped).
pub const MAX_LINE: usize = 16 << 20;

pub async fn serve(host: Arc<Host>) -> Result<()> {
    crate::errln!("skein mcp on stdio ({})", host.kind);
    let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
    let writer = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        while let Some(v) = rx.recv().await {
            let mut line = v.to_string();
            line.push('\n');
            if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
                break;
            }
        }
    });
    let session = Arc::new(Session::default());
    let mut reader = BufReader::new(tokio::io::stdin());
    let mut line: Vec<u8> = vec![];
    let mut too_long = false;
    let stop = super::super::cluster::terminated();
    tokio::pin!(stop);
    loop {
        let buf = tokio::select! {
            b = reader.fill_buf() => b.context("reading stdin")?,
            _ = &mut stop => break,
        };
        if buf.is_empty() {
            break;
        }
        let (piece, end) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if !too_long && line.len() + piece.len() <= MAX_LINE {
            line.extend_from_slice(piece);
        } else {
            too_long = true;
            line.clear();
        }
        let used = end.unwrap_or(buf.len());
        reader.consume(used);
        if end.is_none() {
            continue;
        }
        if too_long {
            too_long = false;
            let e = RpcError::new(
                code::INVALID_REQUEST,
                format!("a message longer than {MAX_LINE} bytes was refused"),
            );
            let _ = tx.send(wire::error(None, &e));
            continue;
        }
        let text = std::mem::take(&mut line);
        take(&host, &session, &text, &tx);
    }
    session.stop_all();
    drop(tx);
    let _ = writer.await;
    Ok(())
}

/// Handles one line: a request is answered on its own task.
fn take(host: &Arc<Host>, session: &Arc<Session>, line: &[u8], tx: &mpsc::UnboundedSender<Value>) {
    let line = String::from_utf8_lossy(line);
    let line = line.trim();
    if line.is_empty() {
        return;
    }
    let v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            let e = RpcError::new(code::PARSE_ERROR, format!("not JSON: {e}"));
            let _ = tx.send(wire::error(None, &e));
            return;
        }
    };
    match Incoming::from_value(v) {
        Err(m) => {
            let _ = tx.send(wire::error(m.id.as_ref(), &m.error));
        }
        Ok(Incoming::Notification { method, params }) => session.notified(&method, &params),
        // This server sends no requests, so a response answers nothing.
        Ok(Incoming::Response { .. }) => {}
        Ok(Incoming::Request { id, method, params }) => {
            let (host, session, tx) = (host.clone(), session.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some(r) = session.request(&host, id, method, params, tx.clone()).await {
                    let _ = tx.send(r);
                }
            });
        }
    }
}
