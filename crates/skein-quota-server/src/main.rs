//! `skein-quota-server --limit N --window-ms W [--latency-ms L] [--port P]`: serves OpenAI
//! chat completions on 127.0.0.1 with a quota of N requests per W ms for each API key (see
//! `skein_quota_server::server`), each admitted one answered after L ms (0), and prints `listening on http://127.0.0.1:PORT` once it
//! listens. It stops when its standard input closes or it is killed.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use skein_quota_server::server::{router, Quota};

fn arg(args: &[String], name: &str) -> Result<Option<u64>> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => {
            let v = args
                .get(i + 1)
                .with_context(|| format!("{name} needs a value"))?;
            Ok(Some(v.parse().with_context(|| {
                format!("{name} `{v}` is not a whole number")
            })?))
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for a in args.iter().filter(|a| a.starts_with("--")) {
        if !["--limit", "--window-ms", "--latency-ms", "--port"].contains(&a.as_str()) {
            bail!(
                "unknown option {a}; usage: skein-quota-server --limit N --window-ms W \
                 [--latency-ms L] [--port P]"
            );
        }
    }
    let limit = arg(&args, "--limit")?.unwrap_or(10);
    let window = arg(&args, "--window-ms")?.unwrap_or(1000);
    if limit == 0 || window == 0 {
        bail!("--limit and --window-ms must be at least 1");
    }
    let port = arg(&args, "--port")?.unwrap_or(0);
    let port = u16::try_from(port).context("--port is more than 65535")?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    let quota = Quota {
        limit: limit as usize,
        window: Duration::from_millis(window),
        latency: Duration::from_millis(arg(&args, "--latency-ms")?.unwrap_or(0)),
    };
    // Stops when the standard input closes (its parent went away).
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    });
    tokio::select! {
        r = axum::serve(listener, router(quota)) => r?,
        _ = stdin_closed => {}
    }
    Ok(())
}
