//! mock-worker: a vLLM-like inference engine simulator. See README.md.

pub mod api;
pub mod config;
pub mod engine;
pub mod kv;
pub mod kv_events;
pub mod metrics;
pub mod orca;
pub mod server;
pub mod tokenizer;

pub use config::Config;
pub use server::{start, Handle};
