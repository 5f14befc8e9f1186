//! Command-line flags. Hand-written parsing keeps the dependency tree small.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Both,
    Prefill,
    Decode,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub host: String,
    pub port: u16,
    pub name: String,
    pub model: String,
    pub accept_any_model: bool,
    pub max_model_len: usize,
    pub block_size: usize,
    pub kv_blocks: usize,
    pub max_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub speedup: f64,
    pub role: Role,
    pub decode_endpoint_header: String,
    pub kv_bytes_per_token: f64,
    pub kv_transfer_bandwidth: f64,
    pub threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host: "127.0.0.1".into(),
            port: 8000,
            name: String::new(),
            model: "mock-model".into(),
            accept_any_model: false,
            max_model_len: 131072,
            block_size: 16,
            kv_blocks: 16384,
            max_batched_tokens: 8192,
            max_num_seqs: 256,
            speedup: 1.0,
            role: Role::Both,
            decode_endpoint_header: "x-kvroute-decode-endpoint".into(),
            kv_bytes_per_token: 131072.0,
            kv_transfer_bandwidth: 25e9,
            threads: 1,
        }
    }
}

pub const HELP: &str = "\
mock-worker: a vLLM-like inference engine simulator (no GPU, no model).

Serves the OpenAI API with its own tokenizer, a paged prefix-caching KV cache, a
continuous-batching scheduler and Dynamo's mocker timing model, so routers can be
tested and benchmarked against realistic cache hits, queueing and latency.

USAGE: mock-worker [FLAGS]

Server:
  --host ADDR                  Listen address [default: 127.0.0.1]
  --port N                     Listen port; 0 picks a free one [default: 8000]
  --name NAME                  Worker id sent in the x-worker-id header [default: mock-<port>]
  --model NAME                 Model served and listed by /v1/models [default: mock-model]
  --accept-any-model           Serve any `model` value instead of answering 404 model_not_found
  --threads N                  Tokio threads serving HTTP; the engine loop has its own thread [default: 1]

Engine (vLLM-like defaults):
  --max-model-len N            Longest prompt + max_tokens accepted, in tokens [default: 131072]
  --block-size N               Tokens per KV block [default: 16]
  --kv-blocks N                KV cache capacity in blocks (vLLM num_gpu_blocks) [default: 16384]
  --max-batched-tokens N       Token budget of one scheduler pass [default: 8192]
  --max-num-seqs N             Most requests running at once [default: 256]
  --speedup F                  Divide every simulated duration by F (tests use 10-100) [default: 1]

Disaggregation:
  --role both|prefill|decode   prefill: compute the prompt, then hand the request to the decode
                               worker named by the decode-endpoint header [default: both]
  --decode-endpoint-header H   Request header naming the decode worker as host:port
                               [default: x-kvroute-decode-endpoint]
  --kv-bytes-per-token N       KV size of one token, for the transfer delay [default: 131072]
  --kv-transfer-bandwidth F    Prefill-to-decode bandwidth in bytes/s [default: 25e9]

  -h, --help                   Print this help

Timing per scheduler pass (ms, then divided by --speedup):
  prefill = 4.21e-7 t^2 + 0.01518 t + 16.5   (t new prompt tokens in the pass; 0 if none)
  decode  = max(1, -25.74 p^2 + 54.01 p + 5.74)   (p KV usage; 0 if nothing decodes)
";

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
}

impl Config {
    /// Parses flags (without the program name). `Ok(None)` means help was asked for.
    pub fn from_args<I: IntoIterator<Item = String>>(args: I) -> Result<Option<Config>, String> {
        let mut c = Config::default();
        let mut it = args.into_iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (arg.clone(), None),
            };
            let mut val = || -> Result<String, String> {
                inline
                    .clone()
                    .or_else(|| it.next())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag.as_str() {
                "-h" | "--help" => return Ok(None),
                "--host" => c.host = val()?,
                "--port" => c.port = num(&flag, &val()?)?,
                "--name" => c.name = val()?,
                "--model" => c.model = val()?,
                "--accept-any-model" => c.accept_any_model = true,
                "--threads" => c.threads = num(&flag, &val()?)?,
                "--max-model-len" => c.max_model_len = num(&flag, &val()?)?,
                "--block-size" => c.block_size = num(&flag, &val()?)?,
                "--kv-blocks" => c.kv_blocks = num(&flag, &val()?)?,
                "--max-batched-tokens" => c.max_batched_tokens = num(&flag, &val()?)?,
                "--max-num-seqs" => c.max_num_seqs = num(&flag, &val()?)?,
                "--speedup" => c.speedup = num(&flag, &val()?)?,
                "--role" => {
                    c.role = match val()?.as_str() {
                        "both" => Role::Both,
                        "prefill" => Role::Prefill,
                        "decode" => Role::Decode,
                        other => {
                            return Err(format!(
                                "--role: expected both|prefill|decode, got {other:?}"
                            ))
                        }
                    }
                }
                "--decode-endpoint-header" => {
                    c.decode_endpoint_header = val()?.to_ascii_lowercase()
                }
                "--kv-bytes-per-token" => c.kv_bytes_per_token = num(&flag, &val()?)?,
                "--kv-transfer-bandwidth" => c.kv_transfer_bandwidth = num(&flag, &val()?)?,
                _ => return Err(format!("unknown flag {arg:?} (see --help)")),
            }
        }
        c.validate()?;
        Ok(Some(c))
    }

    pub fn validate(&self) -> Result<(), String> {
        let pos = [
            ("--block-size", self.block_size),
            ("--kv-blocks", self.kv_blocks),
            ("--max-batched-tokens", self.max_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
            ("--threads", self.threads),
        ];
        for (f, v) in pos {
            if v == 0 {
                return Err(format!("{f} must be positive"));
            }
        }
        if self.block_size > 64 * 1024 || self.kv_blocks >= u32::MAX as usize {
            return Err("--block-size or --kv-blocks out of range".into());
        }
        if !(self.speedup > 0.0 && self.speedup.is_finite()) {
            return Err("--speedup must be a positive number".into());
        }
        if !(self.kv_transfer_bandwidth > 0.0) || self.kv_bytes_per_token < 0.0 {
            return Err(
                "--kv-transfer-bandwidth must be positive and --kv-bytes-per-token non-negative"
                    .into(),
            );
        }
        Ok(())
    }

    /// The id in `x-worker-id`; defaults to `mock-<port>` with the port actually bound.
    pub fn worker_name(&self, bound_port: u16) -> String {
        if self.name.is_empty() {
            format!("mock-{bound_port}")
        } else {
            self.name.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Option<Config>, String> {
        Config::from_args(s.split_whitespace().map(String::from))
    }

    #[test]
    fn flags() {
        let c = parse("--port 9 --speedup=50 --role prefill --kv-blocks 8")
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.port, c.speedup, c.role, c.kv_blocks),
            (9, 50.0, Role::Prefill, 8)
        );
        assert!(parse("--help").unwrap().is_none());
        assert!(parse("--nope").is_err());
        assert!(parse("--port").is_err());
        assert!(parse("--speedup 0").is_err());
        assert_eq!(parse("").unwrap().unwrap().worker_name(8001), "mock-8001");
    }
}
