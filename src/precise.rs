//! Precise mode: the engines' own KV cache events, re-keyed by kvroute-relay to kvroute's
//! block hashes and streamed to the filter, replace predictions of what each worker holds;
//! the same stream carries other gateways' decisions (`peers`).

pub mod feed;
pub mod peers;
pub mod wire;

pub use feed::{Applied, Feed, FeedError};
