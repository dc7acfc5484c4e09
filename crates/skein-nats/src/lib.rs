//! skein-nats: the JetStream backend of skein's ports, plus what only a cluster has —
//! results on `skein.results.<root>`, the streams and buckets a cluster needs, and the
//! connection's health. Nothing here decides anything: the worker loop of `skein-runtime`
//! runs unchanged on top of it. This crate depends on the ports (`skein-ports`) alone, not on
//! the runtime with its model clients and templates; what drives a runtime over NATS
//! (intake from `skein.missions.submit`, the `skein.api` micro service, streamed text) is
//! in `skein-nats-worker`.

pub mod backend;
pub mod config;
pub mod deadline;
pub mod frame;
pub mod health;

pub use backend::{
    ensure_topology, NatsStore, Topology, ROOTS, ROOT_BLOCKS, ROOT_OPEN, ROOT_STATE,
};
pub use config::{NatsConfig, StorageType};
