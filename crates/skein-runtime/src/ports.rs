//! The ports: what the worker loop needs from a backend (see [`skein_ports::ports`]).

pub use skein_ports::ports::*;
