//! Command line of the `kvroute-relay` binary.

use crate::hub::{EngineSpec, Limits};

pub const USAGE: &str = "\
kvroute-relay: subscribes to inference engines' KV cache events (vLLM's ZMQ format) and serves
them, re-keyed to kvroute's block hashes, as a gRPC stream (kvroute.relay.v1.Relay/Watch).

USAGE:
  kvroute-relay --engine NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL]... [OPTIONS]

ENGINES (at least one --engine or --engines-dns, unless --nats only shares decisions):
  --engine SPEC          An engine's KV event publisher (vLLM --kv-events-config endpoint).
                         NAME is the worker's name in the filter's `workers[].name`;
                         replay= its replay (ROUTER) endpoint, used to repair gaps;
                         model= the model name requests use (default: --model);
                         kv_blocks= the engine's KV cache capacity in blocks (default:
                         --kv-blocks). Repeatable.
  --engines-dns HOST:PORT[,replay_port=PORT]
                         Resolve HOST every 10 s; every address becomes an engine named IP:PORT
                         publishing on tcp://IP:PORT (replay on tcp://IP:replay_port).
OPTIONS:
  --model NAME           Model name the engines serve (the `model` of requests); the chain
                         seed of every re-keyed block. Required unless every engine has model=.
  --block-size N         Tokens per block; must equal the engines' and the filter's (default 16).
  --listen ADDR          gRPC listen address (default 127.0.0.1:7000).
  --metrics ADDR         HTTP address for GET /metrics and GET /health (default 127.0.0.1:7001).
AUTHENTICATION (README, Authentication):
  --token-file PATH      The shared token every gRPC client (each gateway's Envoy) must send as
                         `authorization: Bearer <token>`; without this flag it is read from env
                         KVROUTE_RELAY_TOKEN. At least 16 printable ASCII bytes. Calls without it
                         or with another are refused with UNAUTHENTICATED (counted in
                         kvroute_relay_unauthenticated_total); the token is never logged.
  --no-auth              Serve gRPC without a token on a non-loopback --listen address (anyone who
                         reaches the port reads every engine's holdings and can steer gateways).
                         Without a token a loopback --listen only warns.
  --probe-ms N           Probe every engine's replay socket every N ms (default 50; 0: off):
                         a restarted engine is announced cleared within about N ms of it
                         listening again; 3 failed probes in a row mark it stale.
SHARING (gateways' routing decisions, see README, Sharing decisions):
  --nats URL             Share decisions with other relays over NATS (nats://HOST:PORT; the
                         relay starts and reconnects by itself when NATS is down). Without it,
                         decisions are shared only between streams of this relay.
  --nats-user NAME       Connect to NATS as this user; its password is read from
                         --nats-password-file PATH, or else env KVROUTE_NATS_PASSWORD. The user
                         needs publish and subscribe permission on <prefix>.> only.
  --nats-subject-prefix P
                         Subjects are P.<16-hex fingerprint of the group> (default
                         kvroute.decisions).
  --peer-timeout-ms N    A peer gateway not heard from (decisions or heartbeat) for N ms is
                         announced gone to local streams (default 3000).
LIMITS (see README, Limits; every refusal and eviction is counted in /metrics):
  --kv-blocks N          KV cache capacity in blocks of engines without kv_blocks= (default
                         131072).
  --index-factor F       An engine's index holds at most kv_blocks x F blocks; past that the
                         least recently used chains are evicted and announced removed
                         (default 2).
  --max-streams N        Watch streams open at once (default 256).
  --max-streams-per-client N
                         Watch streams open at once from one IP address (default 16).
  --max-snapshot-blocks N
                         Hashes in one snapshot, over all engines (default 4194304); a cut
                         keeps every engine's shallowest blocks.
  -h, --help             This help.
";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dns {
    pub host: String,
    pub port: u16,
    pub replay_port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub engines: Vec<EngineSpec>,
    pub dns: Option<Dns>,
    pub model: String,
    pub block_size: u32,
    pub listen: String,
    pub metrics: String,
    /// `--probe-ms`.
    pub probe_ms: u64,
    /// `--nats`.
    pub nats: Option<String>,
    /// `--nats-subject-prefix`.
    pub nats_prefix: String,
    /// `--peer-timeout-ms`.
    pub peer_timeout_ms: u64,
    /// `--token-file` (None: env KVROUTE_RELAY_TOKEN, if set).
    pub token_file: Option<String>,
    /// `--no-auth`.
    pub no_auth: bool,
    /// `--nats-user` and `--nats-password-file`.
    pub nats_user: Option<String>,
    pub nats_password_file: Option<String>,
    /// `--kv-blocks`, `--index-factor`, `--max-streams*`, `--max-snapshot-blocks`.
    pub limits: Limits,
}

/// `Ok(None)` means --help.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Option<Config>, String> {
    let mut raw_engines = Vec::new();
    let mut dns = None;
    let mut model = None;
    let mut block_size = 16u32;
    let mut listen = "127.0.0.1:7000".to_owned();
    let mut metrics = "127.0.0.1:7001".to_owned();
    let mut probe_ms = 50u64;
    let mut nats = None;
    let mut nats_prefix = crate::nats::SUBJECT_PREFIX.to_owned();
    let mut peer_timeout_ms = crate::share::PEER_TIMEOUT_MS;
    let mut limits = Limits::default();
    let (mut token_file, mut no_auth, mut nats_user, mut nats_password_file) =
        (None, false, None, None);
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            return Ok(None);
        }
        if flag == "--no-auth" {
            no_auth = true;
            continue;
        }
        let mut value = || -> Result<String, String> {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{flag} needs a value (see --help)"))
        };
        match flag.as_str() {
            "--engine" => raw_engines.push(value()?),
            "--engines-dns" => dns = Some(parse_dns(&value()?)?),
            "--model" => model = Some(value()?),
            "--block-size" => {
                let v = value()?;
                block_size =
                    v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        format!("--block-size {v:?}: expected a positive integer")
                    })?;
            }
            "--listen" => listen = check_addr("--listen", &value()?)?,
            "--metrics" => metrics = check_addr("--metrics", &value()?)?,
            "--probe-ms" => {
                let v = value()?;
                probe_ms = v
                    .parse()
                    .ok()
                    .filter(|n| *n <= 60_000)
                    .ok_or_else(|| format!("--probe-ms {v:?}: expected 0..=60000"))?;
            }
            "--nats" => {
                let v = value()?;
                if v.is_empty() || v.contains(char::is_whitespace) {
                    return Err(format!("--nats {v:?}: expected nats://HOST:PORT"));
                }
                nats = Some(v);
            }
            "--nats-subject-prefix" => {
                let v = value()?;
                let ok = !v.is_empty()
                    && v.split('.').all(|t| !t.is_empty())
                    && !v.contains(|c: char| c.is_whitespace() || c == '*' || c == '>');
                if !ok {
                    return Err(format!(
                        "--nats-subject-prefix {v:?}: expected dot-separated tokens without wildcards or spaces"
                    ));
                }
                nats_prefix = v;
            }
            "--token-file" => token_file = Some(value()?),
            "--nats-user" => {
                let v = value()?;
                if v.is_empty() || v.contains(char::is_whitespace) {
                    return Err(format!("--nats-user {v:?}: expected a user name"));
                }
                nats_user = Some(v);
            }
            "--nats-password-file" => nats_password_file = Some(value()?),
            "--peer-timeout-ms" => {
                let v = value()?;
                peer_timeout_ms = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=3_600_000).contains(n))
                    .ok_or_else(|| format!("--peer-timeout-ms {v:?}: expected 1..=3600000"))?;
            }
            // Limits (README, "Limits").
            "--kv-blocks" => limits.kv_blocks = number(&flag, &value()?, 1, 1 << 32)?,
            "--index-factor" => limits.index_factor = number(&flag, &value()?, 1, 64)?,
            "--max-streams" => limits.max_streams = number(&flag, &value()?, 1, 65_536)? as usize,
            "--max-streams-per-client" => {
                limits.max_streams_per_client = number(&flag, &value()?, 1, 65_536)? as usize
            }
            "--max-snapshot-blocks" => {
                limits.max_snapshot_blocks = number(&flag, &value()?, 1, 1 << 32)? as usize
            }
            _ => return Err(format!("unknown argument {arg:?} (see --help)")),
        }
    }
    if (nats_user.is_some() || nats_password_file.is_some()) && nats.is_none() {
        return Err("--nats-user and --nats-password-file need --nats".to_owned());
    }
    if nats_password_file.is_some() && nats_user.is_none() {
        return Err("--nats-password-file needs --nats-user".to_owned());
    }
    let mut engines = Vec::new();
    for e in &raw_engines {
        let spec = parse_engine(e, model.as_deref())?;
        if engines.iter().any(|x: &EngineSpec| x.name == spec.name) {
            return Err(format!(
                "--engine {e:?}: the name {:?} is used twice",
                spec.name
            ));
        }
        engines.push(spec);
    }
    // Without engines the relay still shares gateways' decisions (predicted mode replicas).
    if engines.is_empty() && dns.is_none() && nats.is_none() {
        return Err("no engines and no --nats: give --engine NAME=tcp://HOST:PORT, --engines-dns HOST:PORT or --nats URL (see --help)".to_owned());
    }
    let model = match model {
        Some(m) => m,
        None if dns.is_none() => String::new(),
        None => return Err("--engines-dns needs --model (the model name requests use)".to_owned()),
    };
    Ok(Some(Config {
        engines,
        dns,
        model,
        block_size,
        listen,
        metrics,
        probe_ms,
        nats,
        nats_prefix,
        peer_timeout_ms,
        token_file,
        no_auth,
        nats_user,
        nats_password_file,
        limits,
    }))
}

fn number(flag: &str, v: &str, min: u64, max: u64) -> Result<u64, String> {
    v.parse()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| format!("{flag} {v:?}: expected {min}..={max}"))
}

/// A secret from `file` (trailing newline and spaces dropped, as `echo x > file` and
/// Kubernetes Secrets leave them), or else from env `var`; None when neither is given.
pub fn read_secret(file: Option<&str>, var: &str) -> Result<Option<String>, String> {
    match file {
        Some(path) => std::fs::read_to_string(path)
            .map(|t| Some(t.trim_end().to_owned()))
            .map_err(|e| format!("cannot read {path}: {e}")),
        None => Ok(std::env::var(var).ok().filter(|t| !t.is_empty())),
    }
}

/// Whether `--listen` only accepts this machine's connections.
pub fn loopback(listen: &str) -> bool {
    listen
        .parse::<std::net::SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback())
}

fn check_addr(flag: &str, v: &str) -> Result<String, String> {
    v.parse::<std::net::SocketAddr>()
        .map(|_| v.to_owned())
        .map_err(|_| format!("{flag} {v:?}: expected IP:PORT, e.g. 127.0.0.1:7000"))
}

fn check_endpoint(what: &str, ep: &str) -> Result<(), String> {
    let rest = ep
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{what} {ep:?}: expected tcp://HOST:PORT"))?;
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(format!("{what} {ep:?}: expected tcp://HOST:PORT")),
    }
}

pub fn parse_engine(s: &str, default_model: Option<&str>) -> Result<EngineSpec, String> {
    let what = format!("--engine {s:?}");
    let (name, rest) = s
        .split_once('=')
        .filter(|(n, _)| !n.is_empty())
        .ok_or_else(|| format!("{what}: expected NAME=tcp://HOST:PORT[,replay=...][,model=...]"))?;
    let mut parts = rest.split(',');
    let endpoint = parts.next().unwrap_or_default().to_owned();
    check_endpoint(&what, &endpoint)?;
    let mut replay = None;
    let mut model = default_model.map(str::to_owned);
    let mut kv_blocks = None;
    for p in parts {
        match p.split_once('=') {
            Some(("replay", v)) => {
                check_endpoint(&what, v)?;
                replay = Some(v.to_owned());
            }
            Some(("model", v)) if !v.is_empty() => model = Some(v.to_owned()),
            Some(("kv_blocks", v)) => kv_blocks = Some(number(&what, v, 1, 1 << 32)?),
            _ => {
                return Err(format!(
                    "{what}: unknown option {p:?} (replay=, model= or kv_blocks=)"
                ))
            }
        }
    }
    let model = model.ok_or_else(|| format!("{what}: no model (give --model or model=NAME)"))?;
    Ok(EngineSpec {
        name: name.to_owned(),
        endpoint,
        replay,
        model,
        kv_blocks,
    })
}

fn parse_dns(s: &str) -> Result<Dns, String> {
    let what = format!("--engines-dns {s:?}");
    let mut parts = s.split(',');
    let hp = parts.next().unwrap_or_default();
    let (host, port) = hp
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        .filter(|(h, _)| !h.is_empty())
        .ok_or_else(|| format!("{what}: expected HOST:PORT"))?;
    let mut replay_port = None;
    for p in parts {
        match p.split_once('=') {
            Some(("replay_port", v)) => {
                replay_port = Some(
                    v.parse()
                        .map_err(|_| format!("{what}: bad replay_port {v:?}"))?,
                )
            }
            _ => return Err(format!("{what}: unknown option {p:?} (replay_port=PORT)")),
        }
    }
    Ok(Dns {
        host: host.to_owned(),
        port,
        replay_port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn parses_engines_and_defaults() {
        let c = parse(args("--model m --engine w1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5657 --engine=w2=tcp://h:1,model=x --block-size 32"))
            .unwrap()
            .unwrap();
        assert_eq!(c.engines.len(), 2);
        assert_eq!(c.engines[0].replay.as_deref(), Some("tcp://127.0.0.1:5657"));
        assert_eq!(c.engines[0].model, "m");
        assert_eq!(c.engines[1].model, "x");
        assert_eq!(c.block_size, 32);
        assert_eq!(c.listen, "127.0.0.1:7000");
        assert_eq!(c.metrics, "127.0.0.1:7001");
        assert_eq!(c.probe_ms, 50);
        let c = parse(args("--model m --engine w=tcp://h:1 --probe-ms 0"))
            .unwrap()
            .unwrap();
        assert_eq!(c.probe_ms, 0);
        assert_eq!(c.nats, None);
        assert_eq!(c.nats_prefix, "kvroute.decisions");
        assert_eq!(c.peer_timeout_ms, 3000);
        let c = parse(args(
            "--model m --engine w=tcp://h:1 --nats nats://127.0.0.1:4222 --nats-subject-prefix a.b --peer-timeout-ms 500",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(c.nats.as_deref(), Some("nats://127.0.0.1:4222"));
        assert_eq!(c.nats_prefix, "a.b");
        assert_eq!(c.peer_timeout_ms, 500);
        assert_eq!((c.token_file, c.no_auth, c.nats_user), (None, false, None));
        let c = parse(args(
            "--nats nats://n:4222 --nats-user relay --nats-password-file /p --token-file /t --no-auth --listen 0.0.0.0:7000",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(c.token_file.as_deref(), Some("/t"));
        assert_eq!(c.nats_user.as_deref(), Some("relay"));
        assert_eq!(c.nats_password_file.as_deref(), Some("/p"));
        assert!(c.no_auth);
        assert!(loopback("127.0.0.1:7000") && loopback("[::1]:7000"));
        assert!(!loopback("0.0.0.0:7000"));
    }

    #[test]
    fn parses_limits() {
        let c = parse(args("--model m --engine w=tcp://h:1"))
            .unwrap()
            .unwrap();
        assert_eq!(c.limits, Limits::default());
        let c = parse(args(
            "--model m --engine w=tcp://h:1,kv_blocks=1000 --kv-blocks 50 --index-factor 3 --max-streams 9 --max-streams-per-client 2 --max-snapshot-blocks 77",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(c.engines[0].kv_blocks, Some(1000));
        let l = &c.limits;
        assert_eq!(
            (
                l.kv_blocks,
                l.index_factor,
                l.max_streams,
                l.max_streams_per_client
            ),
            (50, 3, 9, 2)
        );
        assert_eq!(l.max_snapshot_blocks, 77);
        assert_eq!(l.max_blocks(&c.engines[0]), 3000);
        for bad in [
            "--model m --engine w=tcp://h:1,kv_blocks=0",
            "--model m --engine w=tcp://h:1 --index-factor 0",
            "--model m --engine w=tcp://h:1 --max-streams-per-client x",
            "--model m --engine w=tcp://h:1 --max-snapshot-blocks",
        ] {
            assert!(parse(args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn secrets_from_file_or_env() {
        let path =
            std::env::temp_dir().join(format!("kvroute-relay-secret-{}", std::process::id()));
        std::fs::write(&path, "s3cret-token-0123456789\n").unwrap();
        let p = path.to_str().unwrap();
        assert_eq!(
            read_secret(Some(p), "KVROUTE_TEST_UNSET_VAR"),
            Ok(Some("s3cret-token-0123456789".to_owned()))
        );
        std::fs::remove_file(&path).unwrap();
        assert!(read_secret(Some(p), "X").is_err());
        assert_eq!(read_secret(None, "KVROUTE_TEST_UNSET_VAR"), Ok(None));
    }

    #[test]
    fn rejects_bad_flags() {
        for bad in [
            "",
            "--engine w=tcp://h:1",
            "--model m --engine w=http://h:1",
            "--model m --engine w=tcp://h:1,bogus=1",
            "--model m --engine w=tcp://h:1 --engine w=tcp://h:2",
            "--model m --engine w=tcp://h:1 --block-size 0",
            "--model m --engine w=tcp://h:1 --listen nope",
            "--model m --engine w=tcp://h:1 --frob",
            "--model m --engine",
            "--engines-dns h:1",
            "--model m --engine w=tcp://h:1 --probe-ms x",
            "--model m --engine w=tcp://h:1 --nats-subject-prefix a.*",
            "--model m --engine w=tcp://h:1 --nats-subject-prefix a..b",
            "--model m --engine w=tcp://h:1 --peer-timeout-ms 0",
            "--model m --engine w=tcp://h:1 --nats",
            "--model m --engine w=tcp://h:1 --nats-user relay",
            "--nats nats://n:1 --nats-password-file /p",
            "--nats nats://n:1 --nats-user",
            "--model m --engine w=tcp://h:1 --token-file",
        ] {
            assert!(parse(args(bad)).is_err(), "{bad}");
        }
        assert_eq!(parse(args("--help")), Ok(None));
        let c = parse(args("--model m --engines-dns pool:5557,replay_port=5558"))
            .unwrap()
            .unwrap();
        assert_eq!(c.dns.unwrap().replay_port, Some(5558));
    }
}
