use kvroute_relay::auth::TOKEN_ENV;
use kvroute_relay::cli::{loopback, parse, read_secret, Config, Dns, USAGE};
use kvroute_relay::engine::{self, EngineOpts};
use kvroute_relay::hub::{EngineSpec, Hub};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let cfg = match parse(std::env::args().skip(1)) {
        Ok(Some(c)) => c,
        Ok(None) => {
            print!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("kvroute-relay: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-relay: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(run(cfg)) {
        eprintln!("kvroute-relay: {e}");
        std::process::exit(1);
    }
}

async fn run(cfg: Config) -> Result<(), String> {
    let hub = Hub::with_limits(cfg.block_size, 1024, cfg.limits.clone());
    // Secrets are read before anything listens, so a bad one stops the start.
    let token_from = cfg.token_file.as_deref().unwrap_or(TOKEN_ENV);
    match read_secret(cfg.token_file.as_deref(), TOKEN_ENV)? {
        Some(t) => {
            hub.auth.require(&t).map_err(|e| format!("{token_from}: {e}"))?;
            eprintln!("kvroute-relay: gRPC clients must send the relay token (from {token_from})");
        }
        None if cfg.no_auth || loopback(&cfg.listen) => eprintln!(
            "kvroute-relay: warning: no relay token (--token-file or {TOKEN_ENV}): whoever reaches {} reads every engine's holdings and can steer the gateways",
            cfg.listen
        ),
        None => {
            return Err(format!(
                "--listen {} is not a loopback address and no relay token is set: give --token-file PATH or {TOKEN_ENV} (or --no-auth to serve anyone)",
                cfg.listen
            ))
        }
    }
    let nats_creds = match &cfg.nats_user {
        Some(user) => {
            let from = cfg
                .nats_password_file
                .as_deref()
                .unwrap_or("KVROUTE_NATS_PASSWORD");
            let password = read_secret(cfg.nats_password_file.as_deref(), "KVROUTE_NATS_PASSWORD")?
                .ok_or_else(|| format!("--nats-user {user}: no password (--nats-password-file PATH or KVROUTE_NATS_PASSWORD)"))?;
            eprintln!("kvroute-relay: NATS user {user:?}, password from {from}");
            Some(kvroute_relay::nats::NatsCreds {
                user: user.clone(),
                password,
            })
        }
        None => None,
    };
    let grpc = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", cfg.listen))?;
    let http = tokio::net::TcpListener::bind(&cfg.metrics)
        .await
        .map_err(|e| format!("--metrics {}: {e}", cfg.metrics))?;
    eprintln!(
        "kvroute-relay: gRPC on {}, metrics on http://{}/metrics, block size {}, epoch {:016x}",
        cfg.listen, cfg.metrics, cfg.block_size, hub.epoch
    );
    if cfg!(panic = "abort") {
        eprintln!(
            "kvroute-relay: built with panic = \"abort\": a panic in an engine's task (the zeromq crate has todo!()s on some socket errors) ends the relay; build with `cargo build --profile relay -p kvroute-relay` (target/relay/kvroute-relay) to restart the task instead"
        );
    }
    if let Some(url) = cfg.nats.clone() {
        let opts = kvroute_relay::nats::NatsOpts {
            url,
            prefix: cfg.nats_prefix.clone(),
            peer_timeout: Duration::from_millis(cfg.peer_timeout_ms),
        };
        if nats_creds.is_none() {
            eprintln!("kvroute-relay: warning: NATS without credentials (--nats-user): whoever reaches the server reads and forges the gateways' decisions");
        }
        kvroute_relay::nats::start_nats_as(hub.share.clone(), opts, nats_creds).await?;
    } else {
        eprintln!(
            "kvroute-relay: no --nats: decisions are shared only between this relay's streams"
        );
    }
    let opts = EngineOpts {
        probe_interval: Duration::from_millis(cfg.probe_ms),
        ..EngineOpts::default()
    };
    for spec in cfg.engines.clone() {
        tokio::spawn(engine::supervise(hub.clone(), spec, opts.clone()));
    }
    if let Some(dns) = cfg.dns.clone() {
        tokio::spawn(discover(hub.clone(), dns, cfg.model.clone(), opts));
    }
    tokio::spawn(kvroute_relay::metrics::serve(hub.clone(), http));
    kvroute_relay::grpc::serve(hub, grpc).await
}

/// Resolves `--engines-dns` every 10 s; each new address becomes an engine.
async fn discover(hub: Arc<Hub>, dns: Dns, model: String, opts: EngineOpts) {
    let mut known = HashSet::new();
    let mut logged_error = false;
    loop {
        match tokio::net::lookup_host((dns.host.as_str(), dns.port)).await {
            Ok(addrs) => {
                logged_error = false;
                for a in addrs {
                    if known.insert(a) {
                        let ip = a.ip();
                        let host = if ip.is_ipv6() {
                            format!("[{ip}]")
                        } else {
                            ip.to_string()
                        };
                        let spec = EngineSpec {
                            name: format!("{host}:{}", a.port()),
                            endpoint: format!("tcp://{host}:{}", a.port()),
                            replay: dns.replay_port.map(|p| format!("tcp://{host}:{p}")),
                            model: model.clone(),
                            kv_blocks: None,
                        };
                        eprintln!(
                            "kvroute-relay: discovered engine {} via {}",
                            spec.name, dns.host
                        );
                        tokio::spawn(engine::supervise(hub.clone(), spec, opts.clone()));
                    }
                }
            }
            Err(e) => {
                if !logged_error {
                    eprintln!("kvroute-relay: --engines-dns {}: {e}", dns.host);
                    logged_error = true;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}
