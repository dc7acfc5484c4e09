//! The given/when/then kit, as the crate publishes it (`skein_core::testing`).

pub use skein_core::testing::*;
