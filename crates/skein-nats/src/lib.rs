//! skein-nats: the JetStream backend of skein's ports, plus what only a cluster has —
//! intake from `skein.missions.submit`, results on `skein.results.<root>`, answers on
//! `skein.answers`, and the `skein.api` micro service. Nothing here decides anything: the
//! worker loop of `skein-runtime` runs unchanged on top of it.

pub mod backend;
pub mod config;
pub mod deadline;
pub mod frame;
pub mod health;

pub use backend::{ensure_topology, NatsStore};
pub use config::{NatsConfig, StorageType};
pub mod intake;
pub mod service;
pub mod text;
