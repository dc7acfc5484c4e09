//! The ports: what the worker loop needs from a backend (see [`skein_ports::ports`]).

pub use skein_ports::ports::*;

/// Root summaries, their filter and pages (see [`skein_ports::roots`]).
pub use skein_ports::roots;
