//! How long a try may wait for its worker's first answer before Envoy gives up on it.
//!
//! A worker that accepts a request and never answers holds it until something cuts it off.
//! Envoy's per-try timeout does that and retries elsewhere, and it stops counting once
//! response headers went to the client: it bounds only the wait for the headers, never a
//! generation already streaming. When the headers come depends on the request, so the
//! bound is per request (`x-envoy-upstream-rq-per-try-timeout-ms`, which Envoy only takes
//! from a filter: the edge drops a client's x-envoy-* headers):
//!
//! - a stream's headers come when the engine accepts it (vLLM and the mock worker send
//!   them before prefill), at worst after the queued prefill ahead of it and its own;
//! - a non-streaming answer's headers come with the whole answer: prefill plus up to
//!   `max_tokens` tokens of generation. Without `max_tokens` the engine may generate up to
//!   its context length, so no bound short of the stream idle timeout is safe: none is set.
//!
//! Each bound is generous (a floor of seconds, slack on the load model's prefill speed, a
//! slow per-token rate): a cut legitimate answer costs a recomputation elsewhere, a hung
//! worker only holds a request that long once, then it is cooled down.

use crate::config::Config;

/// The request header Envoy's router reads the per-try bound from (milliseconds).
pub const PER_TRY_TIMEOUT: &str = "x-envoy-upstream-rq-per-try-timeout-ms";

/// What the bound depends on, as the router knows it when it decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Wait {
    /// Prefill tokens the worker has queued, this request's uncached ones included.
    pub prefill_tokens: f64,
    /// Requests waiting for prefill there (each pays the fixed overhead).
    pub prefilling: u32,
    pub stream: bool,
    pub max_tokens: Option<u32>,
    /// The worker's `workers[].speed`: its prefill takes 1 / speed of the time.
    pub speed: f64,
}

/// Milliseconds a try may wait for response headers, or `None` for no bound.
pub fn first_byte_timeout_ms(cfg: &Config, w: &Wait) -> Option<u64> {
    let h = &cfg.health;
    if h.first_byte_timeout_ms == 0 {
        return None;
    }
    let output_ms = if w.stream {
        0.0
    } else {
        f64::from(w.max_tokens?) * h.output_token_ms as f64
    };
    let speed = if w.speed.is_finite() && w.speed > 0.0 {
        w.speed
    } else {
        1.0
    };
    let prefill_ms = (w.prefill_tokens.max(0.0) / cfg.load.prefill_tokens_per_s * 1000.0
        + f64::from(w.prefilling) * cfg.load.prefill_overhead_ms as f64)
        / speed;
    let ms = h.first_byte_timeout_ms as f64 + h.prefill_slack * prefill_ms + output_ms;
    // Envoy reads the header as a u64; past a day it is no bound anyway.
    Some(ms.clamp(1.0, 86_400_000.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn wait(prefill_tokens: f64, stream: bool, max_tokens: Option<u32>) -> Wait {
        Wait {
            prefill_tokens,
            prefilling: 1,
            stream,
            max_tokens,
            speed: 1.0,
        }
    }

    #[test]
    fn a_slower_worker_gets_longer_for_its_prefill() {
        let c = Config::default();
        let at = |speed| {
            first_byte_timeout_ms(
                &c,
                &Wait {
                    speed,
                    ..wait(100_000.0, true, None)
                },
            )
            .unwrap()
        };
        // 30 s + 4 x (10 s + 20 ms) at speed 1.
        assert_eq!(at(1.0), 70_080);
        assert_eq!(at(0.5), 110_160);
        assert_eq!(at(0.0), at(1.0));
    }

    #[test]
    fn streams_wait_for_prefill_only() {
        let c = Config::default();
        // 30 s floor + 4 x (1,000 tokens at 10,000/s + 20 ms overhead) = 30.48 s.
        assert_eq!(
            first_byte_timeout_ms(&c, &wait(1000.0, true, Some(4000))),
            Some(30_480)
        );
        // A 200k-token queue ahead: 4 x 20.02 s on top of the floor.
        assert_eq!(
            first_byte_timeout_ms(&c, &wait(200_000.0, true, None)),
            Some(110_080)
        );
    }

    #[test]
    fn non_streaming_answers_wait_for_their_generation() {
        let c = Config::default();
        // + 500 tokens x 250 ms.
        assert_eq!(
            first_byte_timeout_ms(&c, &wait(1000.0, false, Some(500))),
            Some(155_480)
        );
        // No max_tokens: the engine may generate to its context length; no bound.
        assert_eq!(first_byte_timeout_ms(&c, &wait(1000.0, false, None)), None);
    }

    #[test]
    fn off_and_extremes() {
        let mut c = Config::default();
        let huge = wait(f64::MAX, false, Some(u32::MAX));
        assert_eq!(first_byte_timeout_ms(&c, &huge), Some(86_400_000));
        assert_eq!(
            first_byte_timeout_ms(&c, &wait(-5.0, true, None)),
            Some(30_080)
        );
        c.health.first_byte_timeout_ms = 0;
        assert_eq!(first_byte_timeout_ms(&c, &wait(1.0, true, None)), None);
    }
}
