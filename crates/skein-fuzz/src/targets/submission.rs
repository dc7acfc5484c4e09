//! `submission`: a message on `skein.missions.submit` (or a `skein.api.submit` body),
//! headers included: decoded by the NATS intake, then validated and recorded by the
//! runtime on a real embedded store, as a worker does.
//!
//! Input: an optional header block in the NATS wire form (`NATS/1.0\r\n`, then
//! `Name: value\r\n` lines, then an empty line), then the payload.

use std::sync::Arc;

use rand::Rng as _;
use skein_runtime::hitl::Secret;
use skein_runtime::worker::{Runtime, RuntimeConfig};
use skein_sled::SledStore;

use super::{tokio_runtime, Spec, Target};
use crate::fixtures::{catalog, TEST_SECRET};
use crate::mutate::Dict;
use crate::structured::{reshape_json, reshape_msgpack};
use crate::{Error, Result, Rng};

pub const SPEC: Spec = Spec {
    name: "submission",
    about: "submissions, JSON or msgpack, with Nats-Msg-Id and Content-Type headers \
            (intake::parse, then Runtime::submit on a sled store)",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Submissions::new()?)),
    reshape,
    tokens: &[
        "NATS/1.0\r\n",
        "Nats-Msg-Id: ",
        "Content-Type: application/msgpack\r\n",
        "Content-Type: application/json\r\n",
        "\r\n\r\n",
        "agent",
        "mission",
        "context",
        "inputs",
        "budget",
        "tokens",
        "no_cache",
        "id",
        "orchestrator",
        "writer",
        "fuzzer",
    ],
};

const HEAD: &[u8] = b"NATS/1.0\r\n";

/// The payload and the headers the intake reads, from the input's wire form.
pub fn split(data: &[u8]) -> (Vec<(String, String)>, &[u8]) {
    let Some(rest) = data.strip_prefix(HEAD) else {
        return (vec![], data);
    };
    let end = rest
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, p + 4))
        .or_else(|| rest.starts_with(b"\r\n").then_some((0, 2)))
        .unwrap_or((rest.len(), rest.len()));
    let headers = String::from_utf8_lossy(&rest[..end.0])
        .split("\r\n")
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    (headers, &rest[end.1..])
}

/// The wire form of headers and a payload.
pub fn join(headers: &[(String, String)], payload: &[u8]) -> Vec<u8> {
    if headers.is_empty() {
        return payload.to_vec();
    }
    let mut out = HEAD.to_vec();
    for (k, v) in headers {
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(payload);
    out
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A store is made anew after this many accepted submissions, so a long run stays small.
const FRESH_STORE_EVERY: u64 = 20_000;

pub struct Submissions {
    tokio: tokio::runtime::Runtime,
    rt: Arc<Runtime>,
    dir: tempfile::TempDir,
    accepted: u64,
}

impl Submissions {
    pub fn new() -> Result<Self> {
        let tokio = tokio_runtime(SPEC.name)?;
        let (rt, dir) = fresh(&tokio)?;
        Ok(Self {
            tokio,
            rt,
            dir,
            accepted: 0,
        })
    }
}

fn fresh(tokio: &tokio::runtime::Runtime) -> Result<(Arc<Runtime>, tempfile::TempDir)> {
    let setup = |e: &dyn std::fmt::Display| Error::setup(SPEC.name, e);
    let dir = tempfile::tempdir().map_err(|e| setup(&e))?;
    let agents = catalog().map_err(|e| setup(&e))?;
    let store = {
        let _enter = tokio.enter();
        SledStore::open(&dir.path().join("data"), &dir.path().join("ws")).map_err(|e| setup(&e))?
    };
    let cfg = RuntimeConfig {
        token_secret: Secret(TEST_SECRET.to_vec()),
        ..RuntimeConfig::default()
    };
    let rt = Runtime::new(
        store.backend(),
        Arc::new(agents),
        skein_llm::Registry::new(),
        skein_tools::ToolBox::new(),
        cfg,
    );
    Ok((rt, dir))
}

impl Target for Submissions {
    fn run(&mut self, data: &[u8]) -> bool {
        let (headers, payload) = split(data);
        let parsed = skein_nats_worker::intake::parse(
            payload,
            header(&headers, "Content-Type"),
            header(&headers, "Nats-Msg-Id"),
        );
        let Ok(sub) = parsed else {
            return false;
        };
        let ok = self.tokio.block_on(self.rt.submit(sub)).is_ok();
        if ok {
            self.accepted += 1;
            if self.accepted.is_multiple_of(FRESH_STORE_EVERY) {
                if let Ok((rt, dir)) = fresh(&self.tokio) {
                    self.rt = rt;
                    self.dir = dir;
                }
            }
        }
        ok
    }
}

fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let (mut headers, payload) = split(seed);
    let msgpack = header(&headers, "Content-Type")
        .is_some_and(|c| c.eq_ignore_ascii_case("application/msgpack"));
    let mut payload = if msgpack {
        reshape_msgpack(rng, payload, dict)?
    } else {
        reshape_json(rng, payload, dict)?
    };
    match rng.gen_range(0..6) {
        0 => {
            // The same submission in the other encoding, headers to match.
            headers.retain(|(k, _)| k != "Content-Type");
            if msgpack {
                let v: serde_json::Value = rmp_serde::from_slice(&payload).ok()?;
                payload = serde_json::to_vec(&v).ok()?;
            } else {
                let v: serde_json::Value = serde_json::from_slice(&payload).ok()?;
                payload = rmp_serde::to_vec_named(&v).ok()?;
                headers.push(("Content-Type".into(), "application/msgpack".into()));
            }
        }
        1 => {
            headers.retain(|(k, _)| k != "Nats-Msg-Id");
            let id = super::id::SPEC.reshape;
            let key = id(rng, b"", dict).unwrap_or_default();
            headers.push((
                "Nats-Msg-Id".into(),
                String::from_utf8_lossy(&key).into_owned(),
            ));
        }
        2 => {
            let ct = [
                "APPLICATION/MSGPACK",
                "application/msgpack; x=1",
                "",
                "text/plain",
            ][rng.gen_range(0..4)];
            headers.retain(|(k, _)| k != "Content-Type");
            headers.push(("Content-Type".into(), ct.into()));
        }
        _ => {}
    }
    Some(join(&headers, &payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_split_and_join() {
        let h = vec![
            ("Nats-Msg-Id".to_string(), "k1".to_string()),
            (
                "Content-Type".to_string(),
                "application/msgpack".to_string(),
            ),
        ];
        let wire = join(&h, b"\x81\xa1a\x01");
        let (back, payload) = split(&wire);
        assert_eq!(back, h);
        assert_eq!(payload, b"\x81\xa1a\x01");
        assert_eq!(split(b"{}"), (vec![], &b"{}"[..]));
    }
}
