//! A quota-enforcing OpenAI-compatible server for tests ([`server`], run as its own
//! process by the `skein-quota-server` binary), and what the quota tests and the
//! `skein-quota-bench` benchmark share ([`harness`]): start that process, a fleet of
//! workers on the embedded store or on NATS, and a wide and a small tree run against it;
//! and the benchmark itself ([`bench`]), run by `skein-quota-bench` and `skein bench
//! --quota`.

pub mod bench;
pub mod harness;
pub mod server;
