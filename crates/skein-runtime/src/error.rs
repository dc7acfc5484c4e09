//! The runtime's errors: those of the ports (see [`skein_ports::error`]).

pub use skein_ports::error::*;
