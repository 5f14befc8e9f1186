#![no_main]

// Each target uses one body of the shared file.
#[allow(dead_code)]
#[path = "../src/relay.rs"]
mod relay;

libfuzzer_sys::fuzz_target!(|data: &[u8]| relay::relay_watch(data));
