//! kvroute-relay: subscribes to inference engines' KV cache events (vLLM's ZMQ format) and
//! serves them, re-keyed to kvroute's block hashes, as one gRPC stream per Envoy.

pub mod auth;
pub mod blocks;
pub mod cli;
pub mod clock;
pub mod counter;
pub mod decode;
pub mod engine;
pub mod grpc;
pub mod hub;
pub mod index;
pub mod metrics;
pub mod msgpack;
pub mod nats;
pub mod replay;
pub mod share;
pub mod streaming;
pub mod vllm;
pub mod zmtp;
