//! proxy-wasm adapter
