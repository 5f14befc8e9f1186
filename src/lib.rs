//! kvroute: a KV-cache-aware router for LLM inference, as a proxy-wasm filter for Envoy.
//!
//! Everything outside `filter` is pure logic: no host calls, so it is tested natively and
//! compiled to wasm32 under wasm-bindgen-test. `filter` is the thin proxy-wasm adapter.

pub mod calibrate;
pub mod config;
pub mod events;
pub mod family;
pub mod feedback;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod ladder;
pub mod load;
pub mod lora;
pub mod picks;
pub mod precise;
pub mod prom;
pub mod replication;
pub mod request;
pub mod rng;
pub mod router;
pub mod select;
pub mod stall;
pub mod status;
pub mod steer;
pub mod tokenize;
pub mod twins;
pub mod urlpath;

#[cfg(feature = "filter")]
mod filter;
