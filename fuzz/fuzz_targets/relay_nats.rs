#![no_main]

#[path = "../src/relay.rs"]
mod relay;

libfuzzer_sys::fuzz_target!(|data: &[u8]| relay::relay_nats(data));
