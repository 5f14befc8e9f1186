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
    /// Decode endpoints (`host:port`) a prefill worker may hand a request to; any other is
    /// refused with 400, so a client cannot make it POST to an address of its choosing.
    /// Empty: any endpoint (warned at startup for a prefill worker).
    pub allowed_decode_endpoints: Vec<String>,
    pub kv_bytes_per_token: f64,
    pub kv_transfer_bandwidth: f64,
    pub threads: usize,
    /// The deployment whose capacity the defaults describe (`--preset`).
    pub preset: &'static str,
    /// Old mock behaviour: ORCA reports on every response, streams included, with
    /// `num_requests_running` too. vLLM reports only on non-streaming responses.
    pub orca_on_stream: bool,
    /// vLLM's `--enable-prompt-tokens-details`: `usage.prompt_tokens_details.cached_tokens`.
    pub enable_prompt_tokens_details: bool,
    /// Charge prefill attention for the tokens already in context (see `engine::pass_ms`).
    pub context_attention: bool,
    /// Old mock behaviour: blocks become prefix hits only when the pass that computes them
    /// ends. vLLM registers full blocks when it allocates them (schedule time).
    pub cache_at_pass_end: bool,
    /// Report the engine's own timing (`x-mock-engine-timing`), the mock's one addition to
    /// vLLM's responses.
    pub engine_timing: bool,
    /// vLLM keeps one of its `num_gpu_blocks` as the null block (never allocated), so
    /// `--kv-blocks N` holds N - 1 blocks of KV and usage is over N - 1. `--no-null-block`:
    /// the old mock's N.
    pub null_block: bool,
    /// vLLM 0.32 caches a recomputed block equal to a cached one as a second copy (see
    /// `kv.rs`); `--no-duplicate-blocks`: the old mock, which left it uncached.
    pub duplicate_blocks: bool,
    /// `--kv-events`: bind a ZeroMQ PUB socket there and publish vLLM's KV cache events.
    pub kv_events: Option<String>,
    /// `--kv-events-replay`: bind vLLM's ROUTER replay socket there.
    pub kv_events_replay: Option<String>,
    /// Topic frame of every event message (vLLM's default is empty).
    pub kv_events_topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub kv_events_buffer: usize,
    pub kv_events_format: crate::kv_events::Format,
    /// `--lora-modules`: adapter names served besides the base model (their paths are
    /// ignored: an adapter here changes no weights, only which cache and slot it uses).
    pub lora_modules: Vec<String>,
    /// vLLM's `--max-loras`: adapters held in the engine at once (default 1, as vLLM).
    pub max_loras: usize,
    /// Time to load an adapter into a slot; the pass that needs it waits (vLLM loads
    /// adapters inside the engine step), ms before `--speedup`.
    pub lora_load_ms: f64,
}

/// A real deployment's capacity: what vLLM would size on that hardware.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub kv_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    pub max_model_len: usize,
    pub kv_bytes_per_token: f64,
}

/// KV bytes per token = 2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16).
/// Memory for KV on one GPU = 0.9 (vLLM's --gpu-memory-utilization) x 79.1 GiB (an H100
/// 80 GB as CUDA reports it) = 71.2 GiB, minus the weights on that GPU, minus about 4 GiB
/// for activations, CUDA graphs and non-torch memory. Blocks = that / (bytes per token on
/// one GPU x 16). max_num_seqs 1024 and max_num_batched_tokens 8192 are vLLM's own
/// defaults for the OpenAI server on a GPU with at least 70 GiB that is not an A100.
pub const PRESETS: [Preset; 3] = [
    // Llama-3.1-8B, 1 x H100: 2 x 32 x 8 x 128 x 2 B = 128 KiB/token; weights 15.0 GiB;
    // 71.2 - 15.0 - 4.2 = 52 GiB of KV = 425,984 tokens = 26,624 blocks.
    Preset {
        name: "llama3-8b-h100",
        kv_blocks: 26_624,
        block_size: 16,
        max_num_seqs: 1024,
        max_batched_tokens: 8192,
        max_model_len: 131_072,
        kv_bytes_per_token: 131_072.0,
    },
    // Llama-3.1-70B, 8 x H100 (tensor parallel 8): 2 x 80 x 8 x 128 x 2 B = 320 KiB/token,
    // 40 KiB on each GPU (one KV head each); weights 131.5 GiB / 8 = 16.4 GiB per GPU;
    // 71.2 - 16.4 - 4.8 = 50 GiB of KV per GPU = 1,310,720 tokens = 81,920 blocks.
    Preset {
        name: "llama3-70b-8xh100",
        kv_blocks: 81_920,
        block_size: 16,
        max_num_seqs: 1024,
        max_batched_tokens: 8192,
        max_model_len: 131_072,
        kv_bytes_per_token: 327_680.0,
    },
    // The mock's capacity before presets existed (no real deployment).
    Preset {
        name: "legacy",
        kv_blocks: 16_384,
        block_size: 16,
        max_num_seqs: 256,
        max_batched_tokens: 8192,
        max_model_len: 131_072,
        kv_bytes_per_token: 131_072.0,
    },
];

/// Loading a rank-16 adapter of Llama-3.1-8B on every linear layer: 16 x (in + out) per
/// projection, q 8192 + k 5120 + v 5120 + o 8192 + gate 18432 + up 18432 + down 18432 =
/// 81,920 x 16 = 1.31 M parameters a layer, x 32 layers = 42 M, 84 MB in bf16; read from the
/// page cache and converted to tensors at about 1.5 GB/s that is ~56 ms (the copy to the GPU
/// slot, ~4 ms at 20 GB/s, is small). vLLM's default `--max-cpu-loras` equals `--max-loras`,
/// so an adapter that lost its slot is read from disk again.
pub const DEFAULT_LORA_LOAD_MS: f64 = 50.0;

pub const DEFAULT_PRESET: &str = "llama3-8b-h100";

pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

impl Config {
    fn apply_preset(&mut self, p: &Preset) {
        self.preset = p.name;
        self.kv_blocks = p.kv_blocks;
        self.block_size = p.block_size;
        self.max_num_seqs = p.max_num_seqs;
        self.max_batched_tokens = p.max_batched_tokens;
        self.max_model_len = p.max_model_len;
        self.kv_bytes_per_token = p.kv_bytes_per_token;
    }
}

impl Default for Config {
    fn default() -> Self {
        let mut c = Config {
            host: "127.0.0.1".into(),
            port: 8000,
            name: String::new(),
            model: "mock-model".into(),
            accept_any_model: false,
            max_model_len: 0,
            block_size: 0,
            kv_blocks: 0,
            max_batched_tokens: 0,
            max_num_seqs: 0,
            speedup: 1.0,
            role: Role::Both,
            decode_endpoint_header: "x-kvroute-decode-endpoint".into(),
            allowed_decode_endpoints: Vec::new(),
            kv_bytes_per_token: 0.0,
            kv_transfer_bandwidth: 25e9,
            threads: 1,
            preset: DEFAULT_PRESET,
            orca_on_stream: false,
            enable_prompt_tokens_details: false,
            context_attention: true,
            cache_at_pass_end: false,
            engine_timing: true,
            null_block: true,
            duplicate_blocks: true,
            kv_events: None,
            kv_events_replay: None,
            kv_events_topic: String::new(),
            kv_events_buffer: 10_000,
            kv_events_format: crate::kv_events::Format::Vllm032,
            lora_modules: Vec::new(),
            max_loras: 1,
            lora_load_ms: DEFAULT_LORA_LOAD_MS,
        };
        c.apply_preset(&PRESETS[0]);
        c
    }
}

pub const HELP: &str = "\
mock-worker: a vLLM-like inference engine simulator (no GPU, no model).

Serves the OpenAI API with its own tokenizer, a paged prefix-caching KV cache, a
continuous-batching scheduler and Dynamo's mocker timing model, so routers can be
tested and benchmarked against realistic cache hits, queueing and latency. By default
it answers like a real vLLM server (see README.md for the version imitated); the
flags under 'Old mock behaviour' bring back signals real vLLM does not send.

USAGE: mock-worker [FLAGS]

Server:
  --host ADDR                  Listen address [default: 127.0.0.1]
  --port N                     Listen port; 0 picks a free one [default: 8000]
  --name NAME                  Worker id sent in the x-worker-id header [default: mock-<port>]
  --model NAME                 Model served and listed by /v1/models [default: mock-model]
  --accept-any-model           Serve any `model` value instead of answering 404
  --threads N                  Tokio threads serving HTTP; the engine loop has its own thread [default: 1]
  --enable-prompt-tokens-details
                               vLLM's flag: report usage.prompt_tokens_details.cached_tokens
                               (prefix-cache hits); off by default, as in vLLM

Capacity (a preset sets all of these; explicit flags override it):
  --preset NAME                llama3-8b-h100 | llama3-70b-8xh100 | legacy [default: llama3-8b-h100]
  --max-model-len N            Longest prompt + max_tokens accepted, in tokens [preset: 131072]
  --block-size N               Tokens per KV block [preset: 16]
  --kv-blocks N                KV cache capacity in blocks (vLLM num_gpu_blocks) [preset]
  --max-batched-tokens N       Token budget of one scheduler pass [preset: 8192]
  --max-num-seqs N             Most requests running at once [preset]
  --speedup F                  Divide every simulated duration by F (tests use 10-100) [default: 1]

  Presets (KV bytes/token = 2 x layers x KV heads x head dim x 2 B; KV memory per GPU =
  0.9 x 79.1 GiB - weights on that GPU - ~4 GiB activations/CUDA graphs; blocks of 16):
    llama3-8b-h100     Llama-3.1-8B on 1 x H100 80GB: 128 KiB/token, 71.2 - 15.0 - 4.2
                       = 52 GiB -> 425,984 tokens = 26,624 blocks; max-num-seqs 1024
    llama3-70b-8xh100  Llama-3.1-70B on 8 x H100 (TP 8): 320 KiB/token, 40 KiB per GPU,
                       71.2 - 16.4 - 4.8 = 50 GiB -> 1,310,720 tokens = 81,920 blocks;
                       max-num-seqs 1024; --kv-bytes-per-token 327680
    legacy             The mock's old capacity: 16,384 blocks, max-num-seqs 256
  max-num-seqs 1024 and max-batched-tokens 8192 are vLLM's defaults for its OpenAI server
  on a >= 70 GiB GPU that is not an A100. Timing is Dynamo's model for every preset.

Engine model:
  --no-context-attention       Prefill cost ignores tokens already in context (old mock)
  --cache-at-pass-end          Blocks become prefix hits when their pass ends (old mock);
                               by default, as in vLLM, when they are allocated

LoRA adapters (vLLM's flags; a request names an adapter in `model`):
  --enable-lora                Accepted for vLLM compatibility (adapters are on when listed)
  --lora-modules NAME=PATH ... Adapters served besides the base model, listed by /v1/models
                               with the base model as parent; the path is ignored. Each
                               adapter has its own prefix cache (vLLM hashes the adapter into
                               every block hash). vLLM's JSON form {\"name\":..,\"path\":..} works
  --max-loras N                Adapters in the engine at once [default: 1, as vLLM]. A waiting
                               request whose adapter would need a slot held by running requests
                               waits (later requests may pass it), else the least recently
                               used idle adapter is replaced
  --lora-load-ms F             Loading an adapter into a slot stalls that engine pass
                               [default: 50: a rank-16 Llama-3.1-8B adapter, 84 MB, at ~1.5 GB/s]
  /metrics adds vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}
  (value: when that label set was last current, as vLLM; old sets stay) and
  mock:lora_loads_total.

Engine timing:
  --no-engine-timing           Omit the x-mock-engine-timing report (header on JSON responses,
                               SSE comment before [DONE]): ttft and e2e in seconds on the
                               engine's own schedule, immune to CPU contention

KV cache events (vLLM's --kv-events-config with the zmq publisher; off by default):
  --kv-events tcp://HOST:PORT  Bind a ZeroMQ PUB socket there and publish a KVEventBatch
                               (BlockStored, BlockRemoved, AllBlocksCleared) per engine step:
                               frames [topic, 8-byte big-endian seq from 0, msgpack]
  --kv-events-replay tcp://HOST:PORT
                               Bind vLLM's ROUTER replay socket: a request [\"\", start seq]
                               gets every buffered [\"\", seq, payload] from start on, then
                               [\"\", -1, \"\"]
  --kv-events-topic T          Topic frame [default: empty, as vLLM]
  --kv-events-buffer N         Batches kept for replay (vLLM buffer_steps) [default: 10000]
  --kv-events-format F         vllm-0.32: what vLLM 0.32 sends (maps tagged \"type\" with
                               extra_keys, group_idx, kv_cache_spec_kind; replay answers with
                               the topic frame); map: the mock's older maps (vLLM after PR
                               #42892); array: positional events (vLLM before PR #42892).
                               map and array also keep the old mock's AllBlocksCleared at
                               start-up and at once on a reset [default: vllm-0.32]
  POST /reset_prefix_cache clears the prefix cache and publishes AllBlocksCleared (with
  vllm-0.32, as vLLM, at the engine's next step).

Old mock behaviour:
  --orca-on-stream             ORCA report on every response, streams included (taken when
                               the headers leave), with num_requests_running too
  --no-null-block              --kv-blocks N holds N blocks (vLLM keeps one as its null
                               block: N - 1)
  --no-duplicate-blocks        A recomputed block equal to a cached one stays uncached (vLLM
                               0.32 caches it as a second copy)

Disaggregation:
  --role both|prefill|decode   prefill: compute the prompt, then hand the request to the decode
                               worker named by the decode-endpoint header [default: both]
  --decode-endpoint-header H   Request header naming the decode worker as host:port
                               [default: x-kvroute-decode-endpoint]
  --allowed-decode-endpoints L Comma-separated host:port list: the only decode workers a
                               prefill worker hands off to (others get 400) [default: any]
  --kv-bytes-per-token N       KV size of one token, for the transfer delay [preset: 131072]
  --kv-transfer-bandwidth F    Prefill-to-decode bandwidth in bytes/s [default: 25e9]

  -h, --help                   Print this help

Timing per scheduler pass (ms, then divided by --speedup):
  prefill = 4.21e-7 t^2 + 0.01518 t + 16.5 + 8.42e-7 t c   (t new prompt tokens in the pass,
            c tokens already in context of those requests; 0 if no prefill)
  decode  = max(1, -25.74 p^2 + 54.01 p + 5.74)   (p KV usage; 0 if nothing decodes)
";

/// One `--lora-modules` value: `name=path` or vLLM's JSON `{"name": .., "path": ..}`.
fn lora_module(v: &str) -> Result<String, String> {
    let name = if v.trim_start().starts_with('{') {
        serde_json::from_str::<serde_json::Value>(v)
            .ok()
            .and_then(|j| j.get("name")?.as_str().map(String::from))
    } else {
        v.split_once('=').map(|(n, _)| n.to_string())
    };
    match name {
        Some(n) if !n.is_empty() => Ok(n),
        _ => Err(format!(
            "--lora-modules: expected NAME=PATH or {{\"name\": .., \"path\": ..}}, got {v:?}"
        )),
    }
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
}

impl Config {
    /// Parses flags (without the program name). `Ok(None)` means help was asked for.
    pub fn from_args<I: IntoIterator<Item = String>>(args: I) -> Result<Option<Config>, String> {
        let args: Vec<String> = args.into_iter().collect();
        let mut c = Config::default();
        // The preset is applied first, whatever its position, so explicit flags override it.
        for (i, a) in args.iter().enumerate() {
            let name = match a.strip_prefix("--preset") {
                Some("") => args.get(i + 1).map(String::as_str),
                Some(v) => v.strip_prefix('='),
                None => None,
            };
            if let Some(name) = name {
                let p = preset(name).ok_or_else(|| {
                    let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
                    format!("--preset: unknown {name:?}; one of {}", names.join(", "))
                })?;
                c.apply_preset(p);
            }
        }
        let mut it = args.into_iter().peekable();
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
                "--preset" => {
                    val()?;
                }
                "--enable-prompt-tokens-details" => c.enable_prompt_tokens_details = true,
                "--orca-on-stream" => c.orca_on_stream = true,
                "--no-context-attention" => c.context_attention = false,
                "--cache-at-pass-end" => c.cache_at_pass_end = true,
                "--no-engine-timing" => c.engine_timing = false,
                "--no-null-block" => c.null_block = false,
                "--no-duplicate-blocks" => c.duplicate_blocks = false,
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
                "--allowed-decode-endpoints" => {
                    c.allowed_decode_endpoints = val()?
                        .split(',')
                        .map(str::trim)
                        .filter(|e| !e.is_empty())
                        .map(String::from)
                        .collect()
                }
                "--kv-events" => c.kv_events = Some(val()?),
                "--kv-events-replay" => c.kv_events_replay = Some(val()?),
                "--kv-events-topic" => c.kv_events_topic = val()?,
                "--kv-events-buffer" => c.kv_events_buffer = num(&flag, &val()?)?,
                "--kv-events-format" => {
                    let v = val()?;
                    c.kv_events_format = crate::kv_events::Format::parse(&v).ok_or_else(|| {
                        format!("--kv-events-format: vllm-0.32, map or array, not {v:?}")
                    })?;
                }
                "--enable-lora" => {}
                "--lora-modules" => {
                    c.lora_modules.push(lora_module(&val()?)?);
                    while let Some(v) = it.next_if(|a| !a.starts_with('-')) {
                        c.lora_modules.push(lora_module(&v)?);
                    }
                }
                "--max-loras" => c.max_loras = num(&flag, &val()?)?,
                "--lora-load-ms" => c.lora_load_ms = num(&flag, &val()?)?,
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
            ("--max-loras", self.max_loras),
        ];
        for (f, v) in pos {
            if v == 0 {
                return Err(format!("{f} must be positive"));
            }
        }
        if self.block_size > 64 * 1024 || self.kv_blocks >= u32::MAX as usize {
            return Err("--block-size or --kv-blocks out of range".into());
        }
        if self.kv_events.is_none() && self.kv_events_replay.is_some() {
            return Err("--kv-events-replay needs --kv-events".into());
        }
        for ep in [&self.kv_events, &self.kv_events_replay]
            .into_iter()
            .flatten()
        {
            if !ep.starts_with("tcp://") {
                return Err(format!(
                    "KV events endpoint {ep:?}: expected tcp://HOST:PORT"
                ));
            }
        }
        if !(self.lora_load_ms >= 0.0 && self.lora_load_ms.is_finite()) {
            return Err("--lora-load-ms must be a non-negative number".into());
        }
        for (i, m) in self.lora_modules.iter().enumerate() {
            if m == &self.model || self.lora_modules[..i].contains(m) {
                return Err(format!(
                    "--lora-modules: {m:?} is listed twice or names the base model"
                ));
            }
        }
        if !(self.speedup > 0.0 && self.speedup.is_finite()) {
            return Err("--speedup must be a positive number".into());
        }
        if self.kv_transfer_bandwidth.is_nan()
            || self.kv_transfer_bandwidth <= 0.0
            || self.kv_bytes_per_token < 0.0
        {
            return Err(
                "--kv-transfer-bandwidth must be positive and --kv-bytes-per-token non-negative"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether a prefill worker may hand a request to `endpoint`.
    pub fn decode_allowed(&self, endpoint: &str) -> bool {
        self.allowed_decode_endpoints.is_empty()
            || self.allowed_decode_endpoints.iter().any(|e| e == endpoint)
    }

    /// vLLM refuses to start when `max_model_len` exceeds what the KV cache can hold; the
    /// mock shrinks it to the capacity instead (tests run with small caches) and says so.
    pub fn fit_context_to_kv(&mut self) -> Option<String> {
        let cap = self.kv_blocks.saturating_mul(self.block_size);
        (self.max_model_len > cap).then(|| {
            let msg = format!(
                "--max-model-len {} exceeds the KV cache ({} blocks x {} = {cap} tokens), where vLLM would refuse to start; using {cap}",
                self.max_model_len, self.kv_blocks, self.block_size
            );
            self.max_model_len = cap;
            msg
        })
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
        let c = parse("--kv-events tcp://127.0.0.1:5557 --kv-events-replay=tcp://*:5558 --kv-events-topic kv --kv-events-buffer 5 --kv-events-format map")
            .unwrap()
            .unwrap();
        assert_eq!(c.kv_events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(c.kv_events_replay.as_deref(), Some("tcp://*:5558"));
        assert_eq!((c.kv_events_topic.as_str(), c.kv_events_buffer), ("kv", 5));
        assert_eq!(c.kv_events_format, crate::kv_events::Format::Map);
        let d = parse("").unwrap().unwrap();
        assert_eq!(
            (
                d.kv_events.is_none(),
                d.kv_events_topic.as_str(),
                d.kv_events_buffer
            ),
            (true, "", 10_000)
        );
        assert!(parse("--kv-events-replay tcp://127.0.0.1:1").is_err());
        assert!(parse("--kv-events 127.0.0.1:1").is_err());
        assert!(parse("--kv-events-format json").is_err());
    }

    #[test]
    fn lora_flags_as_vllm_takes_them() {
        let d = parse("").unwrap().unwrap();
        assert!(d.lora_modules.is_empty());
        assert_eq!((d.max_loras, d.lora_load_ms), (1, 50.0));
        let c = parse(r#"--enable-lora --lora-modules a=/x b=/y --max-loras 2 --lora-modules {"name":"c","path":"/z"} --lora-load-ms=10 --port 3"#)
            .unwrap()
            .unwrap();
        assert_eq!(c.lora_modules, ["a", "b", "c"]);
        assert_eq!((c.max_loras, c.lora_load_ms, c.port), (2, 10.0, 3));
        assert!(parse("--lora-modules a").is_err());
        assert!(parse("--lora-modules a=1 a=2").is_err());
        assert!(parse("--lora-modules mock-model=/p").is_err());
        assert!(parse("--max-loras 0").is_err());
        assert!(parse("--lora-load-ms -1").is_err());
    }

    #[test]
    fn allowed_decode_endpoints_restrict_the_handoff() {
        let any = parse("--role prefill").unwrap().unwrap();
        assert!(any.decode_allowed("10.9.9.9:1"));
        let c = parse("--role prefill --allowed-decode-endpoints 127.0.0.1:8001,,127.0.0.1:8002")
            .unwrap()
            .unwrap();
        assert_eq!(
            c.allowed_decode_endpoints,
            ["127.0.0.1:8001", "127.0.0.1:8002"]
        );
        assert!(c.decode_allowed("127.0.0.1:8002"));
        assert!(!c.decode_allowed("127.0.0.1:8003"));
        assert!(!c.decode_allowed("169.254.169.254:80"));
    }

    #[test]
    fn presets_set_capacity_and_explicit_flags_win() {
        let d = parse("").unwrap().unwrap();
        assert_eq!(
            (d.preset, d.kv_blocks, d.block_size, d.max_num_seqs),
            ("llama3-8b-h100", 26_624, 16, 1024)
        );
        // 52 GiB of KV at 128 KiB per token, in blocks of 16.
        assert_eq!(52usize * 1024 * 1024 / 128 / 16, 26_624);
        // 50 GiB per GPU at 40 KiB per token per GPU.
        assert_eq!(50usize * 1024 * 1024 / 40 / 16, 81_920);
        let big = parse("--kv-blocks 100 --preset llama3-70b-8xh100")
            .unwrap()
            .unwrap();
        assert_eq!(
            (big.kv_blocks, big.max_num_seqs, big.kv_bytes_per_token),
            (100, 1024, 327_680.0),
            "--kv-blocks given before --preset still wins"
        );
        let old = parse("--preset=legacy").unwrap().unwrap();
        assert_eq!((old.kv_blocks, old.max_num_seqs), (16_384, 256));
        assert!(parse("--preset nope").is_err());
        assert!(!d.orca_on_stream && !d.enable_prompt_tokens_details && !d.cache_at_pass_end);
        assert!(d.context_attention);
        let flags = parse("--orca-on-stream --enable-prompt-tokens-details --no-context-attention --cache-at-pass-end")
            .unwrap()
            .unwrap();
        assert!(flags.orca_on_stream && flags.enable_prompt_tokens_details);
        assert!(!flags.context_attention && flags.cache_at_pass_end);
    }
}
