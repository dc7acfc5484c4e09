//! skein-nats-worker: what a cluster worker serves over NATS on top of its runtime —
//! intake from `skein.missions.submit`, the `skein.api` micro service (and answers on
//! `skein.answers`), and model text streamed on `skein.stream.<session>`. The backend
//! itself, the ports over JetStream, is `skein-nats`, which does not link the runtime;
//! this crate is where the two meet.

pub mod intake;
pub mod peers;
pub mod service;
pub mod text;
